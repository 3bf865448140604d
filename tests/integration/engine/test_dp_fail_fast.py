"""An mp worker death in one DP replica fails the whole generate at once.

Before issue 15 the healthy replicas ran their whole share first (seconds to
minutes) and the dead replica's EngineCore process lingered until shutdown.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from launch import pid_alive

from spmd_engine import LLM, SamplingParams
from spmd_engine.engine.core_client import EngineDeadError


def shm_names_of(pids) -> set[str]:
    """/dev/shm entries whose name carries one of these pids (the all-reduce segments)."""
    root = Path("/dev/shm")
    if not root.is_dir():
        return set()
    return {p.name for p in root.iterdir() if any(f"_{pid}_" in p.name for pid in pids)}


@pytest.mark.timeout(180)
def test_a_worker_death_in_one_replica_fails_generate_within_2s():
    short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    long = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
    # Replica i gets prompts i::2. Replica 0: two short prompts, then long ones; replica 1: long
    # ones. One sequence at a time, so the healthy replica has several seconds of work left.
    prompts = ["Beautiful is", "Explicit is", "Simple is", "Complex is", "Flat is", "Sparse is",
               "Readability", "Special cases", "Errors should", "In the face"]
    params = [short, long, short, long] + [long] * 6
    llm = LLM(data_parallel_size=2, tensor_parallel_size=2, max_num_seqs=1)
    try:
        workers = llm.collective_rpc(lambda w: os.getpid())  # replica 0's workers, then replica 1's
        cores = [p.pid for p in llm.llm_engine.engine_core.procs]
        record: dict = {}

        def progress(n, tokens):
            # Event-triggered: the first finished requests (replica 0's short ones) kill a worker
            # of replica 1 while both replicas still have long work.
            record.setdefault("finished_before", 0)
            if "killed_at" not in record:
                record["finished_before"] += n
                record["killed_at"] = time.monotonic()
                os.kill(workers[3], signal.SIGKILL)

        # The death shows either through the executor's monitor (cancelled / Executor failed.) or
        # first as the surviving TP rank's all-reduce naming its dead peer, whichever the engine
        # reads first (a race under load; multiproc.DEATH_GRACE_S): both must name replica 1.
        dead = rf"rank 1 in group \(pid {workers[3]}\) died"
        with pytest.raises(EngineDeadError, match=rf"EngineCore_DP1.*(cancelled|Executor failed\.|{dead})") as err:
            llm.generate(prompts, params, progress=progress)
        raised_at = time.monotonic()
        assert raised_at - record["killed_at"] < 2.0, raised_at - record["killed_at"]
        partial = err.value.partial_outputs
        done = [i for i, o in enumerate(partial) if o is not None]
        assert len(done) >= record["finished_before"] >= 1
        assert set(done) <= {0, 2}  # only what had finished before the fault, and it is whole
        for i in done:
            assert len(partial[i].outputs[0].token_ids) == 2
        deadline = record["killed_at"] + 10
        while any(pid_alive(p) for p in cores + workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in cores + workers if pid_alive(p)], "replica processes outlived the fault by 10 s"
        assert not shm_names_of(cores + workers)
        # A dead engine refuses new work at once.
        with pytest.raises(EngineDeadError, match="Executor failed."):
            llm.generate(["Beautiful is"], short)
    finally:
        llm.shutdown()
