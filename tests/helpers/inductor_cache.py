"""One inductor cache for every test process of a pytest run, so a compiled test loads the
AOTInductor packages another test (or the other xdist worker) built instead of building its own:
building one costs 20-35 s of a core here (export, lowering, gcc), loading one a few ms.

It lives in pytest's base temporary directory (under xdist, the one the workers' own are in),
and conftest.py's `pytest_sessionfinish` removes it when the run ends. Processes build a shared
package once and wait for each other meanwhile (precompiled.build_lock), so sharing is safe;
tests that need a cold build (test_precompiled_graphs.py) keep a cache of their own.
"""

from __future__ import annotations

import os
from pathlib import Path

FOLDER = "shared_inductor_cache"


def shared_cache_dir(tmp_path_factory) -> Path:
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / FOLDER
