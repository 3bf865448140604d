"""Versioned, all-or-nothing weight updates (issue 26): start_weight_update() ... load_weights
... finish_weight_update(v), RequestOutput.weight_version, and no half-applied policy served.

Three tiny random checkpoints stand for three policies. After a complete update the engine's
greedy tokens equal a no-cache reference decode of the pushed checkpoint; between start and
finish, and after an update that failed anywhere in the replica, generate refuses on every
rank until an update that writes every tensor completes.
"""

from __future__ import annotations

import json

import pytest
import torch
from engine_helpers import make_tiny_checkpoint, reference_greedy
from safetensors.torch import load_file

from spmd_engine import LLM, SamplingParams
from spmd_engine.config import ConfigError

PROMPTS = [list(range(1, 40)), [4, 5, 6, 7, 8]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return [make_tiny_checkpoint(tmp_path_factory.mktemp(f"policy{i}"), seed=10 + i) for i in range(3)]


@pytest.fixture(scope="module")
def expected(ckpts):
    return [[reference_greedy(c, p, 8) for p in PROMPTS] for c in ckpts]


def pairs(ckpt) -> list[tuple[str, torch.Tensor]]:
    return list(load_file(str(ckpt / "model.safetensors")).items())


def generate(llm):
    outs = llm.generate(PROMPTS, GREEDY)
    versions = {o.weight_version for o in outs}
    assert len(versions) == 1
    return [o.outputs[0].token_ids for o in outs], versions.pop()


def protocol(llm, ckpts, expected, push):
    """The whole protocol on one engine; `push(pairs)` loads a batch the way the caller does."""
    assert generate(llm) == (expected[0], None) and llm.weight_version is None
    llm.start_weight_update()
    with pytest.raises(RuntimeError, match="a weight update is in progress"):
        llm.generate(PROMPTS, GREEDY)
    for pair in pairs(ckpts[1]):  # one tensor at a time, as TRL pushes them
        push([pair])
    llm.finish_weight_update(1)
    llm.reset_prefix_cache()
    assert generate(llm) == (expected[1], 1) and llm.weight_version == 1
    # A failure half-way: nothing of it is served, anywhere, until a complete update.
    llm.start_weight_update()
    batch = pairs(ckpts[2])
    push(batch[: len(batch) // 2])
    name, tensor = batch[len(batch) // 2]
    with pytest.raises(ValueError, match=f"{name} has shape"):
        push([(name, tensor[:1])])
    with pytest.raises(RuntimeError, match="weight update 'v2' did not complete .*ValueError"):
        llm.finish_weight_update("v2")
    with pytest.raises(RuntimeError, match="'v2' did not complete.*mix of two policies"):
        llm.generate(PROMPTS, GREEDY)
    # Writing only the rest is not enough: the first half was of a failed update.
    llm.start_weight_update()
    push(batch[len(batch) // 2:])
    with pytest.raises(RuntimeError, match="weight update 3 did not complete .*tensors not loaded"):
        llm.finish_weight_update(3)
    llm.start_weight_update()
    push(batch)
    llm.finish_weight_update(4)
    llm.reset_prefix_cache()
    assert generate(llm) == (expected[2], 4)


@pytest.mark.timeout(120)
def test_uni_update_protocol_through_collective_rpc(ckpts, expected):
    with LLM(model=str(ckpts[0]), max_model_len=64) as llm:
        protocol(llm, ckpts, expected, lambda batch: llm.collective_rpc("load_weights", args=(batch,)))


@pytest.mark.timeout(120)
def test_uni_update_protocol_through_the_model_trainers_reach(ckpts, expected):
    with LLM(model=str(ckpts[0]), max_model_len=64) as llm:
        model = llm.llm_engine.model_executor.driver_worker.model_runner.model
        protocol(llm, ckpts, expected, model.load_weights)


@pytest.mark.timeout(180)
def test_mp_tp2_update_protocol(ckpts, expected):
    with LLM(model=str(ckpts[0]), max_model_len=64, tensor_parallel_size=2,
             distributed_executor_backend="mp") as llm:
        protocol(llm, ckpts, expected, lambda batch: llm.collective_rpc("load_weights", args=(batch,)))


@pytest.mark.timeout(120)
def test_bad_protocol_calls_are_named_and_change_nothing(ckpts, expected):
    with LLM(model=str(ckpts[0]), max_model_len=64, enable_sleep_mode=True) as llm:
        with pytest.raises(RuntimeError, match="finish_weight_update\\(\\) without start_weight_update"):
            llm.finish_weight_update()
        llm.start_weight_update()
        with pytest.raises(RuntimeError, match="a weight update is in progress: finish_weight_update"):
            llm.start_weight_update()
        for bad in (1.5, True, [1]):  # refused, and the update stays open
            with pytest.raises(ConfigError, match="version must be an int or a str"):
                llm.finish_weight_update(bad)
        llm.finish_weight_update(7)  # nothing loaded: the old weights, complete
        assert generate(llm) == (expected[0], 7)
        # After sleep(2) the update must bring every tensor back (the same rule as generate's).
        llm.sleep(level=2)
        llm.wake_up()
        llm.start_weight_update()
        llm.collective_rpc("load_weights", args=(pairs(ckpts[1])[:3],))
        with pytest.raises(RuntimeError, match="weight update 9 did not complete .*tensors not loaded"):
            llm.finish_weight_update(9)
        with pytest.raises(RuntimeError, match="mix of two policies"):
            llm.generate(PROMPTS, GREEDY)
        llm.start_weight_update()
        llm.collective_rpc("load_weights", args=(pairs(ckpts[1]),))
        llm.finish_weight_update(10)
        assert generate(llm) == (expected[1], 10)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_torchrun_tp2_dp2_a_failure_on_one_rank_is_refused_on_every_rank(ckpts, expected):
    from launch import REPO, run_torchrun
    script = REPO / "tests" / "helpers" / "dist_scripts" / "versioned_update.py"
    launch = run_torchrun(4, [str(script), *map(str, ckpts)], timeout=200)
    assert launch.returncode == 0, launch.describe()
    reports = {r["rank"]: r for r in (json.loads(line.split("REPORT ", 1)[1]) for line in launch.stdout.splitlines()
                                      if line.startswith("REPORT "))}
    assert sorted(reports) == [0, 1, 2, 3], launch.describe()
    for rank, r in reports.items():
        assert r["during"][0] == "RuntimeError" and "a weight update is in progress" in r["during"][1], r
        assert r["finish_failed"][0] == "RuntimeError" and "did not complete" in r["finish_failed"][1], r
        assert "has shape" in r["finish_failed"][1], r  # the failing rank's reason, on every rank
        assert r["after_failure"][0] == "RuntimeError" and "mix of two policies" in r["after_failure"][1], r
        assert r["finish_ok"] == ["ok", None], r
        assert r["after"] == ["ok", [[tokens, "v2"] for tokens in expected[2]]], r
    assert reports[1]["bad_load"][0] == "ValueError"
    assert not launch.leftover_pids
