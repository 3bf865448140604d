"""Building the hand-written CPU kernels (*.cpp beside it) for this machine.

Each source is compiled with g++ for this CPU (`-march=native`) the first time a process needs
it and kept in the compile cache folder, named by a hash of everything that decides the binary
(the source, torch, Python, the compiler, the CPU's flags), under a lock, so the processes of
one job build it once and later processes only load it (loading is cheap, building is not).
"""

from __future__ import annotations

import contextlib
import fcntl
import getpass
import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from spmd_engine import platform

logger = logging.getLogger("spmd_engine")

FOLDER = "spmd_engine_kernels"


def unavailable(load_and_try: Callable[[], str | None]) -> str | None:
    """Why a kernel cannot be used here, or None: no g++, or `load_and_try` (which loads the
    library and runs its trial) failing to build, load or run it, or saying why not."""
    if shutil.which("g++") is None:
        return "no g++ on PATH to build it with"
    try:
        return load_and_try()
    except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        return f"building, loading or trying it failed ({type(exc).__name__}: {first})"


def load(source: Path, fakes: dict[str, Callable]) -> None:
    """Load `source`'s library (built first if need be) and give its ops their shape functions,
    for compiled graphs that call them (once per process)."""
    torch.ops.load_library(str(built(source)))
    for name, fake in fakes.items():
        if not torch._C._dispatch_has_kernel_for_dispatch_key(name, "Meta"):
            torch.library.register_fake(name, fake)


def start_building(source: Path) -> None:
    """Build `source`'s library on a thread of its own, now, unless it is in the cache already:
    a fresh machine's first start then compiles the kernels side by side (g++ runs outside the
    GIL) and beside the checkpoint's load, instead of one after the other when each is first
    needed. The thread only builds: `load` (through `built`) waits for its lock, and builds
    again, reporting why, if the thread failed. Not a daemon, so an exiting process waits for
    its g++ rather than leaving it behind."""
    if shutil.which("g++") is None:
        return
    try:
        if _library_path(source).exists():
            return
    except (OSError, subprocess.CalledProcessError):
        return
    threading.Thread(target=_build_quietly, args=(source,), name=f"build {source.name}").start()


def _build_quietly(source: Path) -> None:
    try:
        built(source)
    except Exception as exc:  # load() builds again and says why
        logger.debug("building kernels/%s ahead failed: %s", source.name, exc)


def built(source: Path) -> Path:
    """The shared library for `source`: built unless already in the cache folder (another
    process of the job may be building it: wait for its lock)."""
    path = _library_path(source)
    if path.exists():
        return path
    with build_lock(path):
        if not path.exists():
            _compile(source, path)
    return path


def _library_path(source: Path) -> Path:
    """Where `source`'s library for this machine is kept: named by everything that decides it."""
    compiler = subprocess.run(["g++", "--version"], capture_output=True, text=True, check=True).stdout
    facts = (source.read_bytes(), torch.__version__, sys.version, compiler, sorted(platform.cpu_flags()),
             torch._C._GLIBCXX_USE_CXX11_ABI)
    return cache_dir() / FOLDER / f"{source.stem}_{hashlib.sha256(repr(facts).encode()).hexdigest()[:24]}.so"


# Instruction sets a source may test for (#if defined(__AVX512BF16__)): torch's cpuinfo name,
# the macro g++ defines when it targets the set, and the option that turns it off.
_OPTIONAL = (("avx512_bf16", "__AVX512BF16__", "-mno-avx512bf16"), ("amx_tile", "__AMX_TILE__", "-mno-amx-tile"),
             ("amx_bf16", "__AMX_BF16__", "-mno-amx-bf16"))


def _not_on_this_cpu() -> list[str]:
    """-mno-X for each optional instruction set that -march=native targets but the engine finds
    no flag for: the build then has what the engine will expect (and a test can build the
    library of a CPU without them). Usually none: -march=native leaves out what the CPU lacks,
    and a g++ too old to know a set neither defines its macro nor takes its option."""
    flags = platform.cpu_flags()
    wanted = [(macro, option) for flag, macro, option in _OPTIONAL if flag not in flags]
    if not wanted:
        return []
    native = subprocess.run(["g++", "-march=native", "-dM", "-E", "-x", "c++", "-"], input="",
                            capture_output=True, text=True, check=True).stdout
    return [option for macro, option in wanted if f"#define {macro} " in native]


def _compile(source: Path, path: Path) -> None:
    from torch.utils import cpp_extension
    torch_lib = Path(torch.__file__).parent / "lib"
    partial = path.with_name(f"{path.stem}.{os.getpid()}.partial.so")
    cmd = ["g++", "-O3", "-march=native", *_not_on_this_cpu(), "-fopenmp", "-shared", "-fPIC", "-std=c++20",
           *[f"-I{p}" for p in cpp_extension.include_paths()], f"-I{sysconfig.get_paths()['include']}",
           str(source), "-o", str(partial), f"-L{torch_lib}", "-ltorch", "-ltorch_cpu", "-lc10",
           f"-Wl,-rpath,{torch_lib}", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    logger.info("building the CPU kernel kernels/%s into %s (once per machine and torch version)",
                source.name, path.parent)
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            errors = [line for line in proc.stderr.splitlines() if "error" in line] or proc.stderr.splitlines() or [""]
            raise RuntimeError(f"g++ exited with {proc.returncode}: {errors[0].strip()}")
        os.replace(partial, path)  # whole or not at all: a reader never loads half a library
        logger.info("built kernels/%s in %.1f s", source.name, time.perf_counter() - started)
    finally:
        partial.unlink(missing_ok=True)


def cache_dir() -> Path:
    """Inductor's cache directory, found as inductor finds it (TORCHINDUCTOR_CACHE_DIR, else
    `torchinductor_<user>` in the temporary directory) without importing inductor, which
    imports dynamo (tests/unit/model/test_precompiled_packages.py holds the two equal)."""
    path = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if path is None:
        try:
            user = getpass.getuser()
        except (KeyError, ModuleNotFoundError, OSError):
            user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
        path = os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))
    return Path(os.path.abspath(path))


@contextlib.contextmanager
def build_lock(path: Path):
    """Hold the lock on building `path`; yields whether another process held it first (then
    it has probably saved what it built: load before building). An flock, so a builder that dies
    releases it; without a writable cache folder there is nothing to share and no lock."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            waited = False
        except BlockingIOError:
            start = time.monotonic()
            logger.info("another process is building %s; waiting for it", path.name)
            fcntl.flock(fd, fcntl.LOCK_EX)
            waited = True
            logger.info("waited %.1f s for %s to be built", time.monotonic() - start, path.name)
        yield waited
    finally:
        os.close(fd)  # releases the lock
