"""DP waves (issue 14): replicas of a mixture of experts step in lockstep; an idle one runs
dummy forwards, counted in get_stats; a dense model under DP runs none.

Until a MoE model exists here, the lockstep is forced on a dense model with
SPMD_ENGINE_DP_WAVES=1: the counters, the end of a wave and the outputs are the
same machinery (what would hang without it needs the expert layers' collectives).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine_helpers import make_tiny_checkpoint, reference_greedy
from launch import run_torchrun
from spmd_engine import LLM, SamplingParams
from spmd_engine.config import ConfigError, ParallelConfig
from spmd_engine.engine.dp_waves import WAVES_ENV, needs_dp_coordinator

SCRIPT = Path(__file__).resolve().parent / "dist_scripts" / "dp_waves.py"
LONG = (list(range(1, 31)), 10)  # 30-token prompt, 10 new tokens
SHORT = ([7], 2)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def test_needs_dp_coordinator_is_moe_under_dp_only():
    dp2, dp1 = ParallelConfig(data_parallel_size=2), ParallelConfig()
    env = {}
    assert needs_dp_coordinator(dp2, {"num_local_experts": 8}, env)  # Mixtral
    assert needs_dp_coordinator(dp2, {"num_experts": 4}, env)  # Qwen2/3-MoE
    assert not needs_dp_coordinator(dp1, {"num_experts": 4}, env)
    assert not needs_dp_coordinator(dp2, {"hidden_size": 64}, env)  # dense
    assert needs_dp_coordinator(dp2, {"hidden_size": 64}, {WAVES_ENV: "1"})
    with pytest.raises(ConfigError, match=WAVES_ENV):
        needs_dp_coordinator(dp2, {}, {WAVES_ENV: "yes"})


def _mp_run(ckpt, jobs):
    with LLM(model=str(ckpt), data_parallel_size=2) as llm:
        outs = llm.generate([ids for ids, _ in jobs], [SamplingParams(max_tokens=n, ignore_eos=True)
                                                       for _, n in jobs])
        return [o.outputs[0].token_ids for o in outs], llm.get_stats(), llm.runs_dp_waves


@pytest.mark.timeout(120)
def test_dense_model_under_dp_runs_no_waves(ckpt, monkeypatch):
    monkeypatch.delenv(WAVES_ENV, raising=False)
    tokens, stats, waves = _mp_run(ckpt, [LONG, SHORT])
    assert not waves
    for s in stats:
        assert (s["dp_waves"], s["waves"], s["wave_steps"], s["dummy_steps"]) == (False, 0, 0, 0)
        assert s["runner"]["dummy_steps"] == 0
    assert stats[0]["steps"] != stats[1]["steps"]  # uneven, and nobody waited for anybody


@pytest.mark.timeout(120)
@pytest.mark.parametrize("jobs", [[LONG], [LONG, SHORT]], ids=["one-prompt", "uneven"])
def test_mp_waves_idle_replica_runs_counted_dummy_steps(ckpt, monkeypatch, jobs):
    monkeypatch.setenv(WAVES_ENV, "1")
    tokens, stats, waves = _mp_run(ckpt, jobs)
    assert waves
    assert tokens == [reference_greedy(ckpt, ids, n) for ids, n in jobs]
    longest = max(s["steps"] for s in stats)
    for s in stats:  # every replica took every step of the wave, idle ones as dummies
        assert s["dp_waves"] and s["waves"] == 1 and s["wave_steps"] == longest
        assert s["dummy_steps"] == longest - s["steps"] == s["runner"]["dummy_steps"]
    assert stats[1]["dummy_steps"] > 0
    if len(jobs) == 1:
        assert stats[1]["steps"] == 0 and stats[1]["dummy_steps"] == stats[0]["steps"]


def _torchrun(ckpt, out_dir, tp, jobs, extra=None, env=None) -> list[dict]:
    """Run the script at TP x DP 2 under torchrun; every rank's result."""
    args = [SCRIPT, out_dir, ckpt, tp, json.dumps(jobs)] + ([json.dumps(extra)] if extra else [])
    launch = run_torchrun(2 * tp, args, timeout=150, env_extra={"OMP_NUM_THREADS": "1", **(env or {WAVES_ENV: "1"})})
    assert launch.returncode == 0 and not launch.timed_out, launch.describe()
    assert not launch.leftover_pids
    results = [json.loads(p.read_text()) for p in sorted(out_dir.glob("rank*.json"))]
    assert len(results) == 2 * tp
    return results


@pytest.mark.timeout(180)
@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "tp2xdp2"])
def test_torchrun_waves_one_prompt_and_uneven(ckpt, tmp_path, tp):
    jobs = [LONG, SHORT, LONG]  # replica 0: two long; replica 1: one short
    results = _torchrun(ckpt, tmp_path, tp, jobs)
    expected = [reference_greedy(ckpt, ids, n) for ids, n in jobs]
    by_replica = {r["replica"]: r for r in results}
    assert by_replica[0]["tokens"] == expected[0::2] and by_replica[1]["tokens"] == expected[1::2]
    longest = max(r["stats"]["steps"] for r in results)
    for r in results:
        s = r["stats"]
        assert s["dp_waves"] and s["wave_steps"] == longest
        assert s["dummy_steps"] == longest - s["steps"] == r["runner_dummy"]
    assert by_replica[1]["stats"]["dummy_steps"] > 0


@pytest.mark.timeout(180)
def test_torchrun_waves_with_an_idle_replica(ckpt, tmp_path):
    results = {r["replica"]: r for r in _torchrun(ckpt, tmp_path, 1, [LONG])}
    assert results[0]["tokens"] == [reference_greedy(ckpt, *LONG)] and results[1]["tokens"] == []
    assert results[1]["stats"]["dummy_steps"] == results[0]["stats"]["steps"] > 0
