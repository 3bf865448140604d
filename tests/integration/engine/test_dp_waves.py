"""DP waves (issue 14): replicas of a mixture of experts step in lockstep; an idle one runs
dummy forwards, counted in get_stats; a dense model under DP runs none.

The MoE cases use expert parallelism across the DP replicas: every MoE layer gathers the
replicas' tokens over the DP group, so without waves a replica that runs out of work first
leaves the others blocked in that collective (until the hang timeout). Outputs must equal
the one-process reference decode.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from engine_helpers import make_random_checkpoint, make_tiny_checkpoint, reference_greedy
from launch import REPO, pid_alive, run_torchrun

from spmd_engine import LLM, SamplingParams
from spmd_engine.config import ConfigError, ParallelConfig
from spmd_engine.engine.core_client import EngineDeadError
from spmd_engine.engine.dp_waves import WAVES_ENV, needs_dp_waves

SCRIPT = REPO / "tests" / "helpers" / "dist_scripts" / "dp_waves.py"
LONG = (list(range(1, 31)), 10)  # 30-token prompt, 10 new tokens
SHORT = ([7], 2)
QWEN3_MOE = dict(architecture="Qwen3MoeForCausalLM", hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                 head_dim=32, intermediate_size=96, vocab_size=139, num_experts=8, num_experts_per_tok=3,
                 moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=2)
EP = {"enable_expert_parallel": True}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return make_random_checkpoint(tmp_path_factory.mktemp("moe"), seed=3, **QWEN3_MOE)


def check_wave_stats(stats: list[dict], runner_dummy: list[int]) -> None:
    """Every replica took every step of the wave, the idle ones as dummy forwards."""
    longest = max(s["steps"] for s in stats)
    for s, dummy in zip(stats, runner_dummy):
        assert s["dp_waves"] and s["wave_steps"] == longest
        assert s["dummy_steps"] == longest - s["steps"] == dummy


def test_needs_dp_waves_is_moe_under_dp_only():
    dp2, dp1 = ParallelConfig(data_parallel_size=2), ParallelConfig()
    env = {}
    assert needs_dp_waves(dp2, {"num_local_experts": 8}, env)  # Mixtral
    assert needs_dp_waves(dp2, {"num_experts": 4}, env)  # Qwen2/3-MoE
    assert not needs_dp_waves(dp1, {"num_experts": 4}, env)
    assert not needs_dp_waves(dp2, {"hidden_size": 64}, env)  # dense
    assert needs_dp_waves(dp2, {"hidden_size": 64}, {WAVES_ENV: "1"})
    with pytest.raises(ConfigError, match=WAVES_ENV):
        needs_dp_waves(dp2, {}, {WAVES_ENV: "yes"})


def _mp_run(ckpt, jobs):
    with LLM(model=str(ckpt), data_parallel_size=2) as llm:
        outs = llm.generate([ids for ids, _ in jobs], [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                                                       for _, n in jobs])
        return [o.outputs[0].token_ids for o in outs], llm.get_stats(), llm.dp_waves


@pytest.mark.timeout(120)
def test_dense_model_under_dp_runs_no_waves(ckpt, monkeypatch):
    monkeypatch.delenv(WAVES_ENV, raising=False)
    tokens, stats, waves = _mp_run(ckpt, [LONG, SHORT])
    assert not waves
    for s in stats:
        assert (s["dp_waves"], s["waves"], s["wave_steps"], s["dummy_steps"]) == (False, 0, 0, 0)
        assert s["runner"]["dummy_steps"] == 0
    assert stats[0]["steps"] != stats[1]["steps"]  # uneven, and nobody waited for anybody


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_mp_moe_dp2_ep_uneven_then_one_prompt(moe):
    jobs = [LONG, SHORT]  # replica 0: the long one, replica 1: the short one
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in jobs]
    with LLM(model=str(moe), data_parallel_size=2, timeout_s=60, **EP) as llm:
        assert llm.dp_waves
        tokens = [o.outputs[0].token_ids for o in llm.generate([ids for ids, _ in jobs], params)]
        uneven = llm.get_stats()
        one = llm.generate([LONG[0]], params[0])[0].outputs[0].token_ids  # replica 1 idle from the start
        after = llm.get_stats()
    assert tokens == [reference_greedy(moe, ids, n) for ids, n in jobs]
    assert one == tokens[0]
    check_wave_stats(uneven, [s["runner"]["dummy_steps"] for s in uneven])
    assert uneven[1]["dummy_steps"] == LONG[1] - SHORT[1]
    assert after[1]["steps"] == uneven[1]["steps"]  # no real step on the idle replica...
    assert after[1]["dummy_steps"] - uneven[1]["dummy_steps"] == after[0]["steps"] - uneven[0]["steps"]  # ...only dummies
    assert [s["waves"] for s in after] == [2, 2]


def _torchrun(ckpt, out_dir, tp, jobs, extra=None) -> list[dict]:
    """Run the script at TP x DP 2 under torchrun; every rank's result."""
    args = [SCRIPT, out_dir, ckpt, tp, json.dumps(jobs)] + ([json.dumps(extra)] if extra else [])
    launch = run_torchrun(2 * tp, args, timeout=150, env_extra={"OMP_NUM_THREADS": "1", "SPMD_ENGINE_TIMEOUT_S": "60"})
    assert launch.returncode == 0 and not launch.timed_out, launch.describe()
    assert not launch.leftover_pids
    results = [json.loads(p.read_text()) for p in sorted(out_dir.glob("rank*.json"))]
    assert len(results) == 2 * tp
    return results


@pytest.mark.timeout(150)
def test_mp_moe_dp2_without_ep_splits_each_expert_over_dp_x_tp(moe):
    # vLLM's sharding without EP under DP: every expert's width over the flattened DP x TP
    # ranks (the EP-shaped group), tokens gathered over DP; replicas step in waves.
    jobs = [LONG, SHORT]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in jobs]
    with LLM(model=str(moe), data_parallel_size=2, timeout_s=60) as llm:
        assert llm.dp_waves
        tokens = [o.outputs[0].token_ids for o in llm.generate([ids for ids, _ in jobs], params)]
        shards = llm.collective_rpc(lambda w: sorted({(m.width, m.width_start, m.group.world_size)
                                                      for m in w.model_runner.model.modules()
                                                      if type(m).__name__ == "FusedMoE"}))
    assert tokens == [reference_greedy(moe, ids, n) for ids, n in jobs]
    half = QWEN3_MOE["moe_intermediate_size"] // 2
    assert shards == [[(half, 0, 2)], [(half, half, 2)]]  # replica 0's worker, then replica 1's


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("tp,extra", [(1, EP), (2, EP), (2, {})], ids=["dp2-ep", "tp2xdp2-ep", "tp2xdp2-no-ep"])
def test_torchrun_moe_ep_uneven_prompts(moe, tmp_path, tp, extra):
    jobs = [LONG, SHORT, LONG]  # replica 0: two long; replica 1: one short
    results = _torchrun(moe, tmp_path, tp, jobs, extra)
    expected = [reference_greedy(moe, ids, n) for ids, n in jobs]
    by_replica = {r["replica"]: r for r in results}
    assert by_replica[0]["tokens"] == expected[0::2] and by_replica[1]["tokens"] == expected[1::2]
    check_wave_stats([r["stats"] for r in results], [r["runner_dummy"] for r in results])
    assert by_replica[1]["stats"]["dummy_steps"] > 0


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_torchrun_moe_ep_with_an_idle_replica(moe, tmp_path):
    results = {r["replica"]: r for r in _torchrun(moe, tmp_path, 1, [LONG], EP)}
    assert results[0]["tokens"] == [reference_greedy(moe, *LONG)] and results[1]["tokens"] == []
    assert results[1]["stats"]["dummy_steps"] == results[0]["stats"]["steps"] > 0


@pytest.mark.timeout(150)
def test_mp_moe_worker_death_in_one_replica_ends_both_promptly(moe):
    """The replicas share one world and every MoE layer's collectives: a worker killed in
    replica 1 leaves replica 0's workers in a collective with a dead peer. The whole generate
    must still fail at once (not after the 60 s hang timeout) and every process must go."""
    long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    llm = LLM(model=str(moe), data_parallel_size=2, max_model_len=128, timeout_s=60, **EP)
    try:
        workers = llm.collective_rpc(lambda w: os.getpid())  # replica 0's worker, then replica 1's
        cores = [p.pid for p in llm.llm_engine.engine_core.procs]
        record: dict = {}

        def progress(n, tokens):  # replica 1's short request finished: both still mid-wave
            if "killed_at" not in record:
                record["killed_at"] = time.monotonic()
                os.kill(workers[1], signal.SIGKILL)

        jobs = [[1, 2, 3], [4, 5], [6, 7, 8], [9, 10]]  # replica 0: two long; replica 1: short, long
        with pytest.raises(EngineDeadError):
            llm.generate(jobs, [long, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), long, long],
                         progress=progress)
        assert time.monotonic() - record["killed_at"] < 10
        deadline = time.monotonic() + 10
        while any(pid_alive(p) for p in cores + workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in cores + workers if pid_alive(p)]
    finally:
        llm.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_run_cli_under_torchrun_with_fewer_prompts_than_replicas(moe, tmp_path):
    """`spmd_engine.run` under torchrun, DP 2 + EP, one prompt: the replica with no share must
    still step with the other (it calls generate with no prompts), or rank 0 fails."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": LONG[0]}) + "\n")
    out = tmp_path / "out.jsonl"
    launch = run_torchrun(2, ["-m", "spmd_engine.run", "--model", moe, "-dp", 2, "--enable-expert-parallel",
                              "--prompts-file", prompts, "--max-tokens", LONG[1], "--output", out,
                              "--timeout", 60], timeout=150, env_extra={"OMP_NUM_THREADS": "1"})
    assert launch.returncode == 0 and not launch.timed_out, launch.describe()
    assert not launch.leftover_pids
    records = [json.loads(line) for line in out.read_text().splitlines()]
    eos = json.loads((moe / "config.json").read_text()).get("eos_token_id")
    assert [r["token_ids"] for r in records] == [reference_greedy(moe, *LONG, eos=eos)]


def test_moe_width_that_does_not_split_over_dp_x_tp_is_a_config_error(moe):
    with pytest.raises(ConfigError, match=r"the 3 ranks of DP x TP .* must divide the expert intermediate size 32"):
        LLM(model=str(moe), data_parallel_size=3)
    LLM_ep = dict(data_parallel_size=3, enable_expert_parallel=True)  # EP: whole experts, 8 over 3 ranks
    with pytest.raises(ConfigError, match="num_experts 8 of this model is not divisible by the expert parallel size 3"):
        LLM(model=str(moe), **LLM_ep)
