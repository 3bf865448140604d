"""TRL's colocate mode replayed call for call (tests/helpers/dist_scripts/trl_colocate.py), and vLLM's
own torchrun example (tests/helpers/dist_scripts/torchrun_example.py).

The trainer perturbs every weight each step and pushes them one tensor at a time; TRL then
calls collective_rpc("reload_weights") before generating. The tokens of each step must equal a
fresh engine's on that step's checkpoint and differ from the original's (negative control seen
failing: a reload_weights that always reads the checkpoint gives the original's tokens at
every step). The fresh engines are built in the same processes after the first one is shut
down: without a fresh store prefix per world, the second engine under torchrun hangs in its
rendezvous.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from engine_helpers import make_tiny_checkpoint
from launch import REPO, run_ranks_on_free_port, run_torchrun
from safetensors.torch import load_file, save_file

SCRIPT = str(REPO / "tests" / "helpers" / "dist_scripts" / "trl_colocate.py")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> list[str]:
    """The original random checkpoint and two training steps, every tensor perturbed."""
    root = tmp_path_factory.mktemp("trl")
    orig = make_tiny_checkpoint(root / "orig", seed=3)
    paths = [str(orig)]
    weights = load_file(orig / "model.safetensors")
    for step in (1, 2):
        out = root / f"step{step}"
        out.mkdir()
        shutil.copy(orig / "config.json", out / "config.json")
        g = torch.Generator().manual_seed(step)
        weights = {n: t + 0.5 * t.float().std() * torch.randn(t.shape, generator=g) for n, t in weights.items()}
        save_file(weights, out / "model.safetensors")
        paths.append(str(out))
    return paths


@pytest.fixture(scope="module")
def bf16_checkpoints(checkpoints, tmp_path_factory) -> list[str]:
    """The same three checkpoints in bf16: `--dtype auto` then runs bf16 (on a CPU without bf16
    instructions too, with SPMD_ENGINE_CPU_BF16=1), where the forward compiles by default."""
    root = tmp_path_factory.mktemp("trl_bf16")
    paths = []
    for path in map(Path, checkpoints):
        out = root / path.name
        out.mkdir()
        config = json.loads((path / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
        save_file({n: t.to(torch.bfloat16) for n, t in load_file(path / "model.safetensors").items()},
                  out / "model.safetensors")
        paths.append(str(out))
    return paths


def _reports(launch, ranks: int) -> list[dict]:
    assert launch.returncode == 0 and not launch.timed_out, launch.describe()
    assert not launch.leftover_pids and not launch.stale_segments(), launch.describe()
    reports = [json.loads(line[len("REPORT "):]) for line in launch.stdout.splitlines() if line.startswith("REPORT ")]
    assert sorted(r["rank"] for r in reports) == list(range(ranks)), launch.describe()
    return sorted(reports, key=lambda r: r["rank"])


def _check_steps(report: dict, checkpoints: list[str]) -> None:
    """Step k's tokens are the k-th call of a fresh engine on step k's weights, not the original's."""
    orig, steps = checkpoints[0], checkpoints[1:len(report["steps"]) + 1]
    fresh = report["fresh"]
    for k, (step, path) in enumerate(zip(report["steps"], steps)):
        assert step["tokens"] == fresh[path][k], (k, step["tokens"], fresh[path][k])
        assert step["tokens"] != fresh[orig][k], f"step {k} generated from the original weights"
        for seq, lps in zip(step["tokens"], step["logprobs"]):
            assert len(lps) == len(seq) and 1 <= len(seq) <= 8  # logprobs=0: the sampled token's, per position
            assert all(len(entry) == 1 and entry[0] is not None and not math.isnan(entry[0]) and entry[0] <= 0
                       for entry in lps)
    n4 = report["n4"]
    prompts = len(report["steps"][0]["tokens"])  # TP 2 in the trainer's world: the group's 2 x 2
    assert len(n4["tokens"]) == 4 * prompts and all(1 <= len(t) <= 8 for t in n4["tokens"])
    assert len({tuple(t) for t in n4["tokens"]}) > prompts  # the four samples of a prompt differ
    assert all(e[0] is not None for seq in n4["logprobs"] for e in seq)


@pytest.mark.timeout(150)
def test_trl_sequence_at_tp1_with_the_environment_set_by_hand(checkpoints):
    """TP 1, external_launcher, RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set by
    hand and no world made before the engine (TRL on one GPU)."""
    def env(rank, port):
        return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port)}
    launch = run_ranks_on_free_port(1, [SCRIPT, "bare", "1", *checkpoints], env, timeout=140)
    (report,) = _reports(launch, 1)
    _check_steps(report, checkpoints)
    assert "max_num_seqs" not in launch.stderr  # None means the default, as in vLLM


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trl_sequence_at_tp1_compiled_with_graphs_built_in_the_rank(bf16_checkpoints, tmp_path):
    """The same in bf16, where the forward compiles by default (as vLLM's does), with an empty
    inductor cache (a job's first start): the rank exports and builds its graphs itself, then
    takes TRL's pushes. A compiled engine that had built its graphs in its own process once
    served the original weights' tokens after every push (the program read copies of the
    parameter dicts that torch.export left behind: tests/unit/model/test_chunk_program.py); the
    fresh engines load the graphs the first one saved."""
    def env(rank, port):
        return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port), "SPMD_ENGINE_ENFORCE_EAGER": "0", "SPMD_ENGINE_CPU_BF16": "1",
                "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    launch = run_ranks_on_free_port(1, [SCRIPT, "bare", "1", *bf16_checkpoints], env, timeout=290)
    (report,) = _reports(launch, 1)
    _check_steps(report, bf16_checkpoints)
    assert report["compiled"] == {"built": 3, "loaded": 0}, report["compiled"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_trl_sequence_under_torchrun_tp2_dp2_in_the_trainers_world(checkpoints):
    """TRL's layout: the trainer's world of 4 first (accelerate), TP subgroups of 2 made by
    TRL, seed = rank // 2, prompts gathered within each TP group."""
    launch = run_torchrun(4, [SCRIPT, "world", "2", *checkpoints], timeout=230)
    reports = _reports(launch, 4)
    for report in reports:
        _check_steps(report, checkpoints)
    assert reports[0]["steps"] == reports[1]["steps"] and reports[2]["steps"] == reports[3]["steps"]
    assert reports[0]["steps"][0]["tokens"] != reports[2]["steps"][0]["tokens"]  # other prompts, other seed
    assert len({tuple(r["blocks"]) for r in reports}) == 1


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_engines_built_one_after_another_under_torchrun_tp2_dp2(checkpoints):
    """No trainer world: each engine makes the world itself. The first engine and two fresh
    ones (the same processes, one after another) all start, and the fresh engine on the
    pushed checkpoint generates what the first one did after the push."""
    launch = run_torchrun(4, [SCRIPT, "bare", "2", *checkpoints[:2]], timeout=230)
    reports = _reports(launch, 4)
    for report in reports:
        _check_steps(report, checkpoints)
    assert reports[0]["steps"] == reports[1]["steps"] and reports[2]["steps"] == reports[3]["steps"]


@pytest.mark.timeout(120)
def test_vllm_torchrun_example_ranks_with_different_memory_settings_agree():
    """vLLM's test_torchrun_example: per-rank gpu_memory_utilization / swap_space /
    kv_cache_memory_bytes, no seed; the script itself checks every rank against rank 0."""
    launch = run_torchrun(2, [str(REPO / "tests" / "helpers" / "dist_scripts" / "torchrun_example.py")], timeout=110)
    assert launch.returncode == 0 and not launch.timed_out, launch.describe()
    assert not launch.leftover_pids, launch.describe()
    blocks = sorted(line for line in launch.stdout.splitlines() if " blocks " in line)
    assert len(blocks) == 2 and blocks[0].split()[2:] == blocks[1].split()[2:], blocks
    texts = [line.split(", ", 1)[1] for line in launch.stdout.splitlines() if line.startswith("Rank ") and "Prompt" in line]
    assert len(texts) == 8 and len(set(texts)) == 4, texts  # each prompt: one text on both ranks


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_mp_engines_one_after_another_and_a_callable_that_does_not_pickle():
    """Three mp TP 2 engines in turn in one process, equal outputs; collective_rpc sends lambdas
    (cloudpickle, a runtime dependency as in vLLM); a callable or arguments that do not pickle
    are one TypeError naming the problem, and the executor stays usable (no worker dies)."""
    import threading

    from spmd_engine import LLM, SamplingParams
    lock = threading.Lock()
    texts = []
    for _ in range(3):
        with LLM(tensor_parallel_size=2, seed=0) as llm:
            texts.append(llm.generate(["Beautiful is"], SamplingParams(temperature=0.0, max_tokens=12))[0].outputs[0].text)
            assert llm.collective_rpc(lambda worker: worker.tp_group.rank_in_group) == [0, 1]
            with pytest.raises(TypeError, match="cannot send .*lambda.* it does not pickle .*_thread.lock"):
                llm.collective_rpc(lambda worker: lock)
            with pytest.raises(TypeError, match="'get_runner_stats': its arguments do not pickle"):
                llm.collective_rpc("get_runner_stats", args=(lock,))
            assert llm.collective_rpc(lambda worker, k: worker.rank + k, args=(10,)) == [10, 11]
            assert llm.llm_engine.vllm_config.cache_config.num_gpu_blocks == llm.get_stats()[0]["num_blocks"]
    assert texts == [" better than"] * 3
