"""The online engine API across processes (issue 21): mp TP 2 x PP 2 (the batch queue: steps
in flight while requests arrive, abort and pause with steps in flight), mp DP 2 (replicas in
their own processes), and torchrun TP 2 x PP 2 x DP 2 with both admission modes and a rank
that adds a different request. Reference: `generate` on the same engine, and the
no-cache decode of the other engine tests.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from engine_helpers import make_tiny_checkpoint, reference_greedy
from launch import run_torchrun

from spmd_engine import LLM, SamplingParams

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "tests" / "helpers" / "dist_scripts" / "online_engine.py"
PROMPTS = [list(range(1, 30)), [4, 5, 6, 7, 8], [9, 10, 11]]
N = 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("online"), seed=0)


def params(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": N, "ignore_eos": True, **kw})


def drive(llm, starts, abort_at=None):
    """Add PROMPTS[i] at step starts[i]; abort "q0" at step `abort_at`; pause (keep) and resume
    at step 2. Final outputs per id."""
    engine, final, step = llm.llm_engine, {}, 0
    while step <= max(starts) or engine.has_unfinished_requests():
        for i, s in enumerate(starts):
            if s == step:
                engine.add_request(f"q{i}", PROMPTS[i], params(seed=i, temperature=1.0) if i == 2 else params())
        if step == abort_at:
            engine.abort_request("q0")
        if step == 2:
            final.update({o.request_id: o for o in llm.pause_generation(mode="keep") if o.finished})
            llm.resume_generation()
        final.update({o.request_id: o for o in engine.step() if o.finished})
        step += 1
    return final


@pytest.mark.timeout(150)
@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2, pipeline_parallel_size=2), dict(data_parallel_size=2)],
                         ids=["mp-tp2xpp2", "mp-dp2"])
@pytest.mark.slow
def test_mp_steps_equal_generate(ckpt, layout):
    with LLM(model=str(ckpt), seed=0, timeout_s=60, **layout) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, [params(), params(), params(seed=2, temperature=1.0)])]
        got = drive(llm, [0, 1, 3])
        aborted = drive(llm, [0, 0, 0], abort_at=4)
        blocks = llm.get_stats()
    assert want[:2] == [reference_greedy(ckpt, p, N) for p in PROMPTS[:2]]
    assert [got[f"q{i}"].outputs[0].token_ids for i in range(3)] == want
    part = aborted["q0"].outputs[0]
    assert part.finish_reason == "abort" and 0 < len(part.token_ids) < N and part.token_ids == want[0][:len(part.token_ids)]
    assert [aborted[f"q{i}"].outputs[0].token_ids for i in (1, 2)] == want[1:]
    assert all(s["free_blocks"] == s["num_blocks"] for s in blocks)  # every block back after the abort


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.xdist_group("world8")
def test_torchrun_tp2xpp2xdp2_admission_modes(ckpt, tmp_path):
    launch = run_torchrun(8, [SCRIPT, tmp_path, ckpt], timeout=220,
                          env_extra={"OMP_NUM_THREADS": "1", "SPMD_ENGINE_TIMEOUT_S": "60"})
    assert launch.returncode == 0 and not launch.timed_out, launch.describe()
    assert not launch.leftover_pids
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert len(results) == 8
    for replica in (0, 1):
        ranks = [r for r in results if r["replica"] == replica]
        want = ranks[0]["generate"]
        assert [r["lead"] for r in ranks].count(True) == 1
        for r in ranks:  # every rank of the replica saw the same outputs, in both modes
            assert r["generate"] == r["identical"] == r["rank0"] == r["rank0_generate"] == want
            assert "different prompts" in r["mismatch"] and r["mismatch_s"] < 1.0
            assert r["unfinished_after_mismatch"] == 0
