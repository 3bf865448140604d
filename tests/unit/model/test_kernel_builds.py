"""The hand-written kernels' builds (kernels/native.py): started ahead on threads of their own
at a first start, so that they overlap each other and the checkpoint's load, and `load` (through
`built`) waits for such a build rather than starting a second g++."""

from __future__ import annotations

import shutil
import threading

import pytest

from spmd_engine.kernels import native

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to build with")

SOURCE = """#include <torch/library.h>
int64_t spmd_build_test_answer() { return 42; }
"""


def test_a_kernel_builds_ahead_on_its_own_thread_and_the_loader_waits_for_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "answer.cpp"
    source.write_text(SOURCE)
    builds, compile_, started = [], native._compile, threading.Event()

    def counted(src, path):
        builds.append(threading.current_thread().name)
        started.set()
        compile_(src, path)
    monkeypatch.setattr(native, "_compile", counted)
    native.start_building(source)
    assert started.wait(timeout=60)
    path = native.built(source)  # the thread holds the lock: this waits for its library, no second g++
    assert path.exists() and builds == ["build answer.cpp"]
    for thread in threading.enumerate():
        if thread.name == "build answer.cpp":
            thread.join(timeout=120)
    native.start_building(source)  # in the cache now: no thread, no build
    assert not any(t.name == "build answer.cpp" for t in threading.enumerate())
    assert native.built(source) == path and builds == ["build answer.cpp"]
