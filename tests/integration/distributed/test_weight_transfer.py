"""Weight transfer between two jobs (vLLM 0.34's four phases; docs/weight-transfer.md).

A trainer job (torchrun, 2 ranks, its rank 0 sending) and a generator job (torchrun,
external_launcher, batch-invariant) run at the same time on this host: after
finish_weight_update("v3") every generator rank's greedy tokens and logprobs must equal, bit
for bit, a fresh engine loaded from the checkpoint the trainer wrote of exactly what it sent
(batch-invariant mode makes TP2 / PP2 / DP2 equal to uni). Layouts: TP2 x DP2 ("nccl", gloo on
CPU), TP2 x PP2 ("ipc", shared memory), two torchrun agents standing for two nodes, and a TP2
generator whose mp executor spawns its workers.

Faults, one uni generator: a trainer SIGKILLed mid-stream, a trainer hanging past timeout_s, a
second trainer on a taken endpoint, an init while connected, a wrong shape and a wrong dtype
(refused, named, on both sides); generate refused after each until a complete update; a
restarted trainer completes one; a request in flight across an update is kept and finishes
under the new version. Nothing is left in /dev/shm.
"""

from __future__ import annotations

import json
import uuid

import pytest
from launch import PYTHON, REPO, SHM_DIR, Launch, base_env, free_port

SCRIPTS = REPO / "tests" / "helpers" / "dist_scripts"


def torchrun(nproc: int, args: list, nnodes: int = 1, node: int = 0, port: int = 0, tag: str = "") -> list[str]:
    cmd = [PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--nnodes", str(nnodes),
           "--monitor-interval", "0.2"]
    if nnodes == 1:
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--rdzv-id", tag]
    else:
        cmd += ["--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port)]
    return cmd + [str(a) for a in args]


def transfer_segments() -> set[str]:
    return {p.name for p in SHM_DIR.glob("spmd_wt_*")} if SHM_DIR.is_dir() else set()


def reference(ckpt) -> list[dict]:
    """A fresh uni engine on what the trainer sent, batch-invariant (its outputs are every layout's)."""
    import sys
    sys.path.insert(0, str(SCRIPTS))
    from wt_generator import GREEDY, PROMPTS, records

    from spmd_engine import LLM
    with LLM(model=str(ckpt), distributed_executor_backend="uni", batch_invariant=True, seed=0,
             max_model_len=128) as llm:
        return records(llm.generate(PROMPTS, GREEDY))


def run_pair(tmp_path, backend: str, tp: int, pp: int, dp: int, nnodes: int = 1, mp: bool = False) -> Launch:
    """`mp`: the generator is one process whose mp executor spawns its ranks (its driver reports)."""
    port, ckpt, out = free_port(), tmp_path / "pushed", tmp_path / "out"
    out.mkdir()
    engine_world = tp * pp * dp * (2 if nnodes == 2 else 1)
    world = 1 + engine_world
    tag = uuid.uuid4().hex[:12]
    cmds = [torchrun(2, [SCRIPTS / "wt_trainer.py", "push", port, world, backend, ckpt], tag=tag + "t")]
    gen = [SCRIPTS / "wt_generator.py", "push", tp, pp, dp, backend, port, world, out]
    if mp:
        cmds.append([PYTHON] + [str(a) for a in gen + ["mp"]])
    elif nnodes == 1:
        cmds.append(torchrun(engine_world, gen, tag=tag + "g"))
    else:
        agents_port = free_port()
        cmds += [torchrun(engine_world // 2, gen, nnodes=2, node=n, port=agents_port) for n in range(2)]
    before = transfer_segments()
    launch = Launch(cmds, [base_env(tag)] * len(cmds), tag, timeout=150)
    assert launch.returncode == 0 and not launch.leftover_pids, launch.describe()
    assert transfer_segments() <= before, transfer_segments() - before
    expected = [{k: v for k, v in o.items() if k != "version"} for o in reference(ckpt)]
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(1 if mp else engine_world)]
    for r in results:
        assert r["version"] == "v3", r["rank"]
        assert [o["version"] for o in r["outs"]] == ["v3"] * len(expected)
        got = [{k: v for k, v in o.items() if k != "version"} for o in r["outs"]]
        assert got == expected, f"rank {r['rank']} differs from a fresh engine on the pushed weights"
    return launch


@pytest.mark.timeout(200)
def test_tp2_dp2_generator_equals_a_fresh_engine_on_the_trainers_weights(tmp_path):
    run_pair(tmp_path, "nccl", tp=2, pp=1, dp=2)


@pytest.mark.timeout(200)
def test_tp2_pp2_generator_over_shared_memory(tmp_path):
    run_pair(tmp_path, "ipc", tp=2, pp=2, dp=1)


@pytest.mark.timeout(200)
def test_replicas_on_two_agents_stand_for_two_nodes(tmp_path):
    """Two torchrun agents of 2 ranks each, TP2: two external-DP replicas, both receive."""
    run_pair(tmp_path, "nccl", tp=2, pp=1, dp=1, nnodes=2)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_an_mp_executor_generator_receives_in_the_workers_it_spawned(tmp_path):
    """One generator process, TP2 through the mp executor: the push reaches its spawned workers
    (collective RPCs into each), and the driver serves the pushed weights under the new version."""
    run_pair(tmp_path, "nccl", tp=2, pp=1, dp=1, mp=True)


@pytest.mark.timeout(200)
def test_faults_never_serve_a_mix_and_never_hang(tmp_path):
    port, out = free_port(), tmp_path / "faults.json"
    tag = uuid.uuid4().hex[:12]
    killed = []

    def kill_the_stalled_trainer(launch: Launch) -> None:
        if not killed and "STALLED" in launch.output_so_far():
            import os
            import signal
            os.kill(launch.procs[0].pid, signal.SIGKILL)
            killed.append(True)
    cmds = [[PYTHON, SCRIPTS / "wt_trainer.py", "stall", port, 2, "nccl", tmp_path / "unused"],
            [PYTHON, SCRIPTS / "wt_generator.py", "faults", port, out]]
    launch = Launch([[str(c) for c in cmd] for cmd in cmds], [base_env(tag)] * 2, tag, timeout=150,
                    on_poll=kill_the_stalled_trainer)
    assert killed and launch.returncodes[1] == 0 and not launch.leftover_pids, launch.describe()
    assert not transfer_segments()
    r = json.loads(out.read_text())
    refused = "did not complete"
    # SIGKILL mid-stream: the update fails at once, finish fails, generate refuses
    assert r["killed_update"][0] == "RuntimeError" and "Connection closed" in r["killed_update"][1], r["killed_update"]
    assert r["killed_update"][2] < 20
    assert refused in r["killed_finish"][1] and refused in r["killed_generate"][1]
    # a hung trainer: the engine gives up at timeout_s (6 s), the trainer when it wakes
    assert "timed out" in r["hung_update"][1] and 5.5 < r["hung_update"][2] < 20, r["hung_update"]
    assert refused in r["hung_finish"][1] and r["hung_trainer"][0] == "TransferError", r["hung_trainer"]
    # one sender per endpoint, one trainer per engine
    assert r["second_trainer"][0] == "TransferError" and "in use" in r["second_trainer"][1]
    assert "a trainer is connected" in r["init_while_connected"][1]
    # refused and named on both sides; the update fails
    assert r["bad_shape"][0] == "ValueError" and "model.norm.weight has shape [7], expected [128]" in r["bad_shape"][1]
    assert r["bad_dtype"][0] == "ValueError" and "model.norm.weight has dtype int32" in r["bad_dtype"][1]
    assert refused in r["bad_shape_finish"][1] and refused in r["bad_dtype_finish"][1]
    for key in ("bad_shape", "bad_dtype"):
        assert r["trainer"][key][0] == "WeightTransferRefused" and "model.norm.weight" in r["trainer"][key][1]
    # a restarted trainer completes an update: the original weights serve the original tokens
    assert r["update_original"][0] == "ok" and r["finish_v4"][0] == "ok"
    assert r["after_restart"] == [[ids, "v4"] for ids in r["reference"]]
    # in flight across an update: stepping refused in between, then finished under the new version
    assert "in progress" in r["step_during_update"][1]
    assert r["update_new"][0] == "ok" and r["inflight"]["version"] == "v5" and len(r["inflight"]["token_ids"]) == 12
    assert r["trainer"]["original"][0] == "ok" and r["trainer"]["new"][0] == "ok"
