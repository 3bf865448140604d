"""`plan`'s per-rank weight bytes and KV blocks for gpt-oss against a real launch
(test_plan_memory.py's check): its attention sinks (split over TP), q/k/v/o, router and
expert biases and the fused expert tensors, at TP 4 (widths split), TP 2 x PP 2, and
TP 2 x DP 2 with expert parallelism (whole experts).
"""

import json

import pytest
from gpt_oss_checkpoint import make_gpt_oss_checkpoint
from launch import REPO, run_torchrun
from test_plan_memory import KV, plan_memory

CASES = [
    ("gpt-oss-tp4", dict(tensor_parallel_size=4)),
    ("gpt-oss-tp2-pp2", dict(tensor_parallel_size=2, pipeline_parallel_size=2)),
    ("gpt-oss-tp2-dp2-ep", dict(tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True)),
]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_plan_per_rank_weights_and_kv_blocks_equal_a_real_launch(tmp_path, monkeypatch):
    # 8 experts: whole ones over an EP group of 4 (2 each), widths of 24 over TP 4
    model = make_gpt_oss_checkpoint(tmp_path / "gpt-oss", seed=5, num_local_experts=8,
                                    num_attention_heads=8, num_key_value_heads=4)
    cases = [{"name": name, "model": str(model), "llm": {**kwargs, **KV}, "env": {}} for name, kwargs in CASES]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    launch = run_torchrun(4, [REPO / "tests" / "helpers" / "dist_scripts" / "rank_memory.py",
                              tmp_path / "cases.json", tmp_path], timeout=280)
    assert launch.returncode == 0 and not launch.leftover_pids, launch.describe()
    assert not launch.stale_segments()
    measured = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for name, kwargs in CASES:
        memory = plan_memory(model, kwargs, monkeypatch, {})
        planned = [(r["weight_bytes"], r["kv_blocks"]) for r in memory["per_rank"]]
        real = [(m[name]["weight_bytes"], m[name]["kv_blocks"]) for m in measured]
        assert planned == real, name
    weights = {name: tuple(m[name]["weight_bytes"] for m in measured) for name, _ in CASES}
    assert len(set(weights.values())) == len(CASES)  # not vacuous: the layouts differ
