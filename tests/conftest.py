"""Suite-wide settings: tests never inherit a launcher's environment by accident, and
optional reference packages are a failure (not a skip) under CI."""

import importlib
import os
import shutil
import sys
from pathlib import Path

import pytest

# The suite's helpers (tests/helpers: launches, fixtures, stand-ins) and the repo's scripts/
# (checkpoint makers) import by name from every test folder.
_TESTS = Path(__file__).resolve().parent
sys.path[:0] = [str(_TESTS / "helpers"), str(_TESTS.parent / "scripts")]

# One intra-op thread in each pytest process unless asked otherwise (torch reads this when it
# loads): with `-n 2` two test processes and the launches they start share the cores, and an
# OpenMP team spinning for cores it cannot have slowed in-process tests many times over.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Engines run eager unless a test asks for the compiled forward (enforce_eager=False, or
# compilation_config): compiling in each of the suite's hundreds of engines would cost minutes.
# tests/integration/engine/test_compiled_forward.py runs it compiled; SPMD_ENGINE_ENFORCE_EAGER=0
# runs the whole suite compiled.
os.environ.setdefault("SPMD_ENGINE_ENFORCE_EAGER", "1")

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_JOB_ID")


def require_reference(module: str):
    """Import an independent reference package (transformers, tokenizers).

    Locally a missing package skips the test; when the `CI` variable is set it fails it,
    because `.ci/run` installs `.[test]`, which pins them: a skip there would hide that the
    comparison never ran.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        message = f"reference package {module!r} is not installed ({exc}); pip install -e '.[test]'"
        if os.environ.get("CI"):
            pytest.fail(f"CI is set: {message}", pytrace=False)
        pytest.skip(message)


@pytest.hookimpl(trylast=True)  # after pytest's tmpdir plugin has made its factory
def pytest_configure(config):
    """Every compile cache of the run (inductor's, and the bf16 decode GEMM that
    kernels/vnni_gemm.py builds into it on AVX512-BF16 CPUs) in the run's shared folder,
    which pytest_sessionfinish removes (inductor still writes its precompiled headers to
    /tmp/torchinductor_<user>, whatever the variable says). Set
    before collection (test modules ask whether the kernel is available when imported), so
    launched ranks and mp workers inherit it; a test with a cache of its own still sets its own."""
    factory = getattr(config, "_tmp_path_factory", None)
    if factory is not None:
        from inductor_cache import shared_cache_dir
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(shared_cache_dir(factory)))


# Folders whose every test launches processes (torchrun, srun stand-ins, the CLIs, a fresh
# install): the slow suite, run by the README's second command (`-m slow`). Elsewhere a test
# that costs as much carries @pytest.mark.slow itself.
SLOW_FOLDERS = (("e2e",), ("integration", "distributed"))


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = Path(str(item.path)).resolve().relative_to(_TESTS).parts
        if any(parts[:len(folder)] == folder for folder in SLOW_FOLDERS):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _clean_launcher_env(monkeypatch):
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))


def pytest_sessionfinish(session):
    """The run's shared inductor cache (tests/helpers/inductor_cache.py) goes when the run ends:
    by the controller under xdist (it finishes after its workers), else by the one process."""
    factory = getattr(session.config, "_tmp_path_factory", None)
    if factory is None or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    from inductor_cache import shared_cache_dir
    shutil.rmtree(shared_cache_dir(factory), ignore_errors=True)
