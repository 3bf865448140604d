"""Workers and EngineCore_DP processes belong to the process that owns the LLM, not a thread.

PR_SET_PDEATHSIG fires when the creating *thread* exits: before issue 15 an LLM
built in a worker thread (a web server's startup hook, a trainer's helper thread)
lost every worker process as soon as that thread ended.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from launch import REPO, base_env, pid_alive, tagged_pids

from spmd_engine import LLM, SamplingParams


def build_in_a_thread(**kwargs) -> LLM:
    box: dict = {}

    def build():
        box["llm"] = LLM(**kwargs)

    thread = threading.Thread(target=build)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive()
    return box["llm"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(data_parallel_size=2)], ids=["mp", "dp"])
def test_an_llm_built_in_a_thread_keeps_its_processes(layout):
    llm = build_in_a_thread(**layout)  # the building thread has exited now
    try:
        time.sleep(0.5)  # a parent-death signal, if any, has been delivered by now
        out = llm.generate(["Beautiful is", "Errors should"], SamplingParams(temperature=0.0, max_tokens=16))
        assert out[0].outputs[0].text.startswith(" better than")
        assert out[1].outputs[0].text.startswith(" never pass")
    finally:
        llm.shutdown()


OWNER_SCRIPT = """
import os, sys, threading
from spmd_engine import LLM
if __name__ == "__main__":
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("llm", LLM(tensor_parallel_size=2)))
    t.start(); t.join()
    print(*box["llm"].collective_rpc(lambda w: os.getpid()), flush=True)
    threading.Event().wait()
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_workers_still_end_when_the_owning_process_dies(tmp_path):
    """The other half: with no thread-bound signal, the process's own death still ends them."""
    script = tmp_path / "owner.py"
    script.write_text(OWNER_SCRIPT)
    tag = f"threadowner{os.getpid()}"
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env=base_env(tag), cwd=REPO, start_new_session=True)
    try:
        workers = [int(p) for p in proc.stdout.readline().split()]
        assert len(workers) == 2 and all(pid_alive(p) for p in workers)
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 5
        while any(pid_alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(pid_alive(p) for p in workers), "orphaned workers"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in tagged_pids(tag):
            os.kill(pid, signal.SIGKILL)
