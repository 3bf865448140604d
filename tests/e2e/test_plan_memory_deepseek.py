"""`plan`'s memory numbers for DeepSeek (latent attention, grouped MoE) against a real launch.

As tests/e2e/test_plan_memory.py: one torchrun launch of 4 gloo ranks builds the engine at
each layout (dist_scripts/rank_memory.py), and `plan --json` must give every rank's weight
bytes (q_a/kv_a projections replicated, kv_b/q_b/o split by heads, experts whole over EP or
split by width) and KV block count (one latent + rotary key per token and layer, on every
rank) exactly.
"""

import json

import pytest
from deepseek_checkpoint import make_deepseek_checkpoint
from launch import REPO, run_torchrun
from test_plan_memory import KV, plan_memory

CASES = [
    ("v3-tp2-pp2", "v3", dict(tensor_parallel_size=2, pipeline_parallel_size=2)),
    ("v3-tp2-dp2-ep", "v3", dict(tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True)),
    ("v2-tp4", "v2", dict(tensor_parallel_size=4)),
]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_plan_per_rank_weights_and_latent_kv_blocks_equal_a_real_launch(tmp_path, monkeypatch):
    models = {name: make_deepseek_checkpoint(tmp_path / name, name, seed=i) for i, name in enumerate(("v3", "v2"))}
    cases = [{"name": name, "model": str(models[model]), "llm": {**kwargs, **KV}} for name, model, kwargs in CASES]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    launch = run_torchrun(4, [REPO / "tests" / "helpers" / "dist_scripts" / "rank_memory.py",
                              tmp_path / "cases.json", tmp_path], timeout=260, env_extra={"OMP_NUM_THREADS": "1"})
    assert launch.returncode == 0 and not launch.leftover_pids, launch.describe()
    assert not launch.stale_segments()
    measured = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for name, model, kwargs in CASES:
        memory = plan_memory(models[model], kwargs, monkeypatch, {})
        planned = [(r["weight_bytes"], r["kv_blocks"]) for r in memory["per_rank"]]
        real = [(m[name]["weight_bytes"], m[name]["kv_blocks"]) for m in measured]
        assert planned == real, name
    # Not vacuous: stages differ, and the latent cache is the same size on every TP rank.
    assert len({m["v3-tp2-pp2"]["weight_bytes"] for m in measured}) == 2
    assert len({m["v2-tp4"]["kv_blocks"] for m in measured}) == 1
