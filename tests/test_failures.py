"""What happens when a process dies, as the seed's last section traces it for mp,
and as torchrun users expect for external_launcher. Nothing may hang."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from launch import REPO, base_env, run_torchrun, tagged_pids
from spmd_engine import LLM, SamplingParams
from spmd_engine.engine.core import EngineDeadError

LONG = SamplingParams(max_tokens=800)


def our_shm() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("spmd_*")} if Path("/dev/shm").is_dir() else set()


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill_later(pid: int, delay: float, record: dict) -> threading.Thread:
    def run():
        time.sleep(delay)
        record["killed_at"] = time.monotonic()
        os.kill(pid, signal.SIGKILL)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(120)
def test_sigkill_of_one_mp_worker_fails_the_call_fast():
    llm = LLM(tensor_parallel_size=2)
    try:
        executor = llm._engine.executor
        segments = [mq.handle().shm_name.lstrip("/") for mq in [executor.rpc_broadcast_mq, *executor.response_mqs]]
        pids = llm.collective_rpc(lambda worker: os.getpid())
        record: dict = {}
        kill_later(pids[1], 1.0, record)
        with pytest.raises(EngineDeadError, match="cancelled|Executor failed.") as err:
            llm.generate(["Beautiful is"] * 4, LONG)
        assert time.monotonic() - record["killed_at"] < 2.0
        assert err.value.partial_outputs == [None] * 4
        # A new call is refused before anything is enqueued.
        with pytest.raises(EngineDeadError, match="Executor failed."):
            llm.generate(["Simple is"], LONG)
        # The surviving worker was terminated deliberately, not left behind.
        deadline = time.monotonic() + 5
        while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(pid_alive(p) for p in pids)
    finally:
        llm.shutdown()
    assert not our_shm() & set(segments)  # this executor's queues are gone from /dev/shm


@pytest.mark.timeout(180)
def test_other_dp_replicas_finish_when_one_loses_a_worker():
    llm = LLM(data_parallel_size=2, tensor_parallel_size=2)
    try:
        pids = llm.collective_rpc(lambda worker: os.getpid())  # replica 0's workers, then replica 1's
        assert len(set(pids)) == 4
        prompts = ["Beautiful is", "Explicit is", "Simple is", "Complex is"]  # replica i gets prompts i::2
        record: dict = {}
        kill_later(pids[2], 1.0, record)
        with pytest.raises(EngineDeadError, match="EngineCore_DP1") as err:
            llm.generate(prompts, LONG)
        # Issue 15: the healthy replica is stopped too (fail fast, tests/test_dp_fail_fast.py);
        # what it had finished before the fault is kept, whole.
        partial = err.value.partial_outputs
        assert partial[1] is None and partial[3] is None
        assert all(p is None or p.outputs[0].finish_reason is not None for p in partial)
    finally:
        llm.shutdown()
    assert not any(pid_alive(p) for p in pids)


ENGINE_SCRIPT = """
import os, sys
from spmd_engine import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(tensor_parallel_size=2)
    print(*llm.collective_rpc(lambda w: os.getpid()), flush=True)
    while True:
        llm.generate(["Beautiful is"], SamplingParams(max_tokens=800))
"""


@pytest.mark.timeout(120)
def test_workers_exit_when_the_engine_is_sigkilled(tmp_path):
    script = tmp_path / "engine.py"
    script.write_text(ENGINE_SCRIPT)
    env = base_env("engine-death")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env,
                            cwd=REPO, start_new_session=True)
    try:
        workers = [int(p) for p in proc.stdout.readline().split()]
        assert len(workers) == 2
        time.sleep(1.0)
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
        for pid in tagged_pids("engine-death"):
            os.kill(pid, signal.SIGKILL)


def pids_with_env(marker: str) -> dict[int, int]:
    """rank -> pid of live processes carrying the marker in their environment and a RANK."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = dict(kv.split(b"=", 1) for kv in (entry / "environ").read_bytes().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if env.get(b"SPMD_TEST_MARKER") == marker.encode() and b"RANK" in env and pid_alive(int(entry.name)):
            found[int(env[b"RANK"])] = int(entry.name)
    return found


@pytest.mark.timeout(120)
def test_sigkill_of_one_torchrun_rank_ends_the_job(tmp_path):
    out = tmp_path / "out.jsonl"
    marker = f"rankdeath{os.getpid()}"
    result: dict = {}

    def killer():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ranks = pids_with_env(marker)
            if len(ranks) == 4:
                time.sleep(5.0)  # past start-up, into generation
                result["killed_at"] = time.monotonic()
                os.kill(ranks[2], signal.SIGKILL)
                return
            time.sleep(0.1)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    launch = run_torchrun(4, ["-m", "spmd_engine.run", "-tp", 2, "-pp", 2, "--prompt", "Beautiful is",
                              "--output", out, "--quiet"], timeout=100, env_extra={"SPMD_TEST_MARKER": marker})
    ended_at = time.monotonic()
    thread.join(timeout=1)
    assert "killed_at" in result, launch.describe()
    assert launch.returncode != 0 and not launch.timed_out, launch.describe()
    assert ended_at - result["killed_at"] < 10
    assert not launch.leftover_pids
    assert not out.exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGINT, 130)],
                         ids=["SIGTERM", "SIGINT"])
def test_signal_stops_cleanly_with_no_partial_output(tmp_path, signum, code):
    out = tmp_path / "out.jsonl"
    tag = f"signal{int(signum)}"
    env = base_env(tag)
    proc = subprocess.Popen([sys.executable, "-m", "spmd_engine.run", "-tp", "2", "--prompt", "Beautiful is",
                             "--output", str(out)], stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        line = ""
        while "engine ready" not in line and time.monotonic() < deadline:  # workers are up
            line = proc.stderr.readline()
        time.sleep(1.0)
        proc.send_signal(signum)
        assert proc.wait(timeout=20) == code
        deadline = time.monotonic() + 5
        while tagged_pids(tag) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not tagged_pids(tag)
        # Neither the file nor a temporary; the streamed part file stays for --resume (issue 15).
        assert [p for p in tmp_path.iterdir() if ".part-" not in p.name] == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def launch_ranks_by_hand(args_per_rank: list[list[str]], tag: str) -> list[subprocess.Popen]:
    """torchrun's environment, set by hand, so each rank can get different flags."""
    from launch import free_port
    port, world = free_port(), len(args_per_rank)
    procs = []
    for rank, args in enumerate(args_per_rank):
        env = base_env(tag, {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                             "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                             "MASTER_PORT": str(port)})
        procs.append(subprocess.Popen([sys.executable, "-m", "spmd_engine.run", *args], env=env, cwd=REPO,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


@pytest.mark.timeout(120)
def test_ranks_started_with_different_flags_all_exit_2():
    procs = launch_ranks_by_hand([["-tp", "2", "--max-tokens", "5"], ["-tp", "2", "--max-tokens", "6"]], "flags")
    try:
        results = [(p.wait(timeout=60), p.stderr.read()) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [code for code, _ in results] == [2, 2]
    assert "error: ranks [1] were started with different flags or prompts than rank 0" in results[0][1]


@pytest.mark.timeout(180)
def test_two_jobs_on_one_machine_at_once(tmp_path):
    """No fixed port or shared-memory name: two launches side by side both succeed."""
    outs = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    jobs = [threading.Thread(target=lambda o=o: run_torchrun(
        2, ["-m", "spmd_engine.run", "-tp", 2, "--prompt", "Errors should", "--max-tokens", 30, "--output", o,
            "--quiet"], timeout=150)) for o in outs]
    mp_job = subprocess.Popen([sys.executable, "-m", "spmd_engine.run", "-tp", "2", "--prompt", "Errors should",
                               "--max-tokens", "30", "--output", str(tmp_path / "c.jsonl"), "--quiet"],
                              env=base_env("twojobs"), cwd=REPO)
    for job in jobs:
        job.start()
    for job in jobs:
        job.join()
    assert mp_job.wait(timeout=150) == 0
    texts = {json_text(p) for p in (*outs, tmp_path / "c.jsonl")}
    assert texts == {" never pass silently.\nUnless e"}


def json_text(path: Path) -> str:
    import json
    return json.loads(path.read_text())["text"]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def shm_mappings(pids) -> int:
    """Shared-memory segments mapped by these processes (names, unlinked or not)."""
    count = 0
    for pid in pids:
        with open(f"/proc/{pid}/maps") as f:
            count += len({line.split()[-1] for line in f if "/dev/shm/" in line or "/spmd_" in line})
    return count


def children() -> set[int]:
    import multiprocessing
    return {p.pid for p in multiprocessing.active_children()}


@pytest.mark.timeout(300)
def test_soak_hundreds_of_generate_calls_leak_nothing():
    with LLM(tensor_parallel_size=2) as llm:
        params = SamplingParams(max_tokens=3)
        for _ in range(10):  # warm up: lazy shared-memory set-up, caches
            llm.generate(["Now is"], params)
        workers = llm.collective_rpc(lambda worker: os.getpid())
        pids = [os.getpid(), *workers]
        fds, procs, shm = open_fds(), children(), shm_mappings(pids)
        for i in range(300):
            out = llm.generate(["Now is", "Flat is"][: 1 + i % 2], params)
            assert out[0].outputs[0].text == " be"
        assert open_fds() == fds and children() == procs and shm_mappings(pids) == shm
        assert shm > 0  # the queues and the all-reduce segment are really there
