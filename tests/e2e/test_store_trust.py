"""What crosses the launcher's store is data, never code (issue 25).

Before: under torchrun every replica head handed its records to rank 0 through the
launcher's TCP store as `pickle.dumps`, and rank 0 `pickle.loads`-ed them, so anyone who
could reach MASTER_ADDR:MASTER_PORT could run code in rank 0 by writing that key. Here a
real torchrun job is attacked the way such a person would: replica 1 is stopped while it
generates, a crafted pickle (it creates a file when unpickled) is written under replica
1's results key, and rank 0 must refuse it with one clear line, the file never created.
"""

from __future__ import annotations

import datetime
import os
import pickle
import signal

import pytest
from launch import pid_alive, run_torchrun, tagged_pids


class _CreatesAFile:
    """Unpickling this calls open(path, "w"): the file appears only if a pickle is loaded."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def _rank_env(pid: int) -> dict[str, str]:
    try:
        raw = open(f"/proc/{pid}/environ", "rb").read()
    except OSError:
        return {}
    return dict(kv.decode(errors="replace").split("=", 1) for kv in raw.split(b"\0") if b"=" in kv)


def _plant(env: dict[str, str], payload: bytes) -> str:
    """Write `payload` under replica 1's results key in the job's store, as an outsider
    who can reach the store would: find the job's prefix from a key rank 1 wrote."""
    import torch.distributed as dist
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=20))
    (mine,) = [k for k in store.list_keys() if k.endswith("spmd_engine/invocation/1")]
    key = mine.removesuffix("invocation/1") + "results/1"
    store.set(key, payload)
    return key


@pytest.mark.timeout(240)
def test_a_crafted_pickle_under_the_results_key_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_CreatesAFile(str(marker)))
    state: dict = {}

    def on_poll(launch):
        pids = {int(_rank_env(p).get("RANK", -1)): p for p in tagged_pids(launch.tag) if "RANK" in _rank_env(p)}
        if "stopped" not in state and "[rank1] launch:" in launch.output_so_far() and 1 in pids:
            os.kill(pids[1], signal.SIGSTOP)  # replica 1 cannot write its own records now
            state["stopped"], state["rank0"] = pids[1], pids.get(0)
            state["key"] = _plant(_rank_env(pids[1]), payload)
        elif "stopped" in state and "resumed" not in state and not pid_alive(state["rank0"] or -1):
            os.kill(state["stopped"], signal.SIGCONT)  # rank 0 is done: let torchrun end rank 1
            state["resumed"] = True

    launch = run_torchrun(2, ["-m", "spmd_engine.run", "--prompt", "Beautiful is", "--prompt", "Explicit is",
                              "--max-tokens", 400, "--max-num-seqs", 1], timeout=200, on_poll=on_poll)
    if "resumed" not in state and "stopped" in state:
        os.kill(state["stopped"], signal.SIGCONT)
    assert "key" in state, f"replica 1 was never caught generating\n{launch.describe()}"
    assert not marker.exists(), "rank 0 executed the pickle planted in the launcher's store"
    assert launch.returncode != 0 and not launch.timed_out, launch.describe()
    refusals = [line for line in launch.stderr.splitlines() if "[rank 0]" in line and "refused" in line]
    assert len(refusals) == 1 and "rank 1" in refusals[0] and "not JSON" in refusals[0], launch.describe()
    assert not launch.leftover_pids
