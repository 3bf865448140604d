"""`plan`'s memory numbers against a real launch: the bytes each rank loads, the KV blocks it gets.

One torchrun launch of 4 gloo ranks builds the engine at eight layouts in turn
(dist_scripts/rank_memory.py); for each, `plan --json` (no process, no weights read)
must give every rank's weight bytes and the KV block count exactly.
"""

import contextlib
import io
import json

import pytest
from family_checkpoints import olmo2_config, phi3_config, save_random
from launch import REPO, run_torchrun
from model_helpers import LLAMA, QWEN_TIED, make_random_checkpoint

from spmd_engine.plan.main import main as plan_main

QWEN3_MOE = dict(architecture="Qwen3MoeForCausalLM", hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                 intermediate_size=96, vocab_size=190, num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=32)
MODELS = {"llama": LLAMA, "qwen2-tied": QWEN_TIED, "qwen3-moe": QWEN3_MOE}
FAMILIES = {"phi3": phi3_config, "olmo2": olmo2_config}  # written by transformers (family_checkpoints.py)
KV = dict(kv_cache_memory_bytes=60000, max_model_len=48)
# name, model, LLM kwargs, environment: TP with KV heads replicated (2 < 4), PP with a remainder
# (5 layers: 3 + 2), a partition from the environment, bf16, tied embeddings on one stage and
# across two, experts whole over EP (DP x TP), split by width over TP, and over DP x TP (DP waves).
CASES = [
    ("llama-tp4", "llama", dict(tensor_parallel_size=4), {}),
    ("llama-tp2-pp2", "llama", dict(tensor_parallel_size=2, pipeline_parallel_size=2), {}),
    ("llama-pp4-env-bf16", "llama", dict(pipeline_parallel_size=4, dtype="bfloat16"),
     {"SPMD_ENGINE_PP_PARTITION": "1,2,1,1"}),
    ("qwen2-tied-tp2-pp2", "qwen2-tied", dict(tensor_parallel_size=2, pipeline_parallel_size=2), {}),
    ("qwen2-tied-tp2-dp2", "qwen2-tied", dict(tensor_parallel_size=2, data_parallel_size=2), {}),
    ("moe-tp2-dp2-ep", "qwen3-moe", dict(tensor_parallel_size=2, data_parallel_size=2,
                                         enable_expert_parallel=True), {}),
    ("moe-tp4", "qwen3-moe", dict(tensor_parallel_size=4), {}),
    ("moe-pp2-dp2", "qwen3-moe", dict(pipeline_parallel_size=2, data_parallel_size=2), {}),
    # Phi-3's fused tensors; OLMo 2's q/k norms cut with the heads (k's replicated at TP 4 > 2 KV heads)
    ("phi3-tp2-pp2", "phi3", dict(tensor_parallel_size=2, pipeline_parallel_size=2), {}),
    ("phi3-tp2-dp2", "phi3", dict(tensor_parallel_size=2, data_parallel_size=2), {}),
    ("olmo2-tp4", "olmo2", dict(tensor_parallel_size=4), {}),
    ("olmo2-tp2-pp2", "olmo2", dict(tensor_parallel_size=2, pipeline_parallel_size=2), {}),
]


def plan_memory(model, llm_kwargs: dict, monkeypatch, env: dict) -> dict:
    """`plan --json` in this process (it starts none), with the LLM kwargs as flags."""
    flags = []
    for key, value in {**llm_kwargs, **KV}.items():
        flag = "--" + key.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = plan_main(["--model", str(model), "--json", *flags])
    for key in env:
        monkeypatch.delenv(key)
    assert rc == 0
    return json.loads(out.getvalue())["memory"]


@pytest.mark.timeout(360)
def test_plan_per_rank_weights_and_kv_blocks_equal_a_real_launch(tmp_path, monkeypatch):
    models = {name: make_random_checkpoint(tmp_path / name, seed=i, **cfg) for i, (name, cfg) in
              enumerate(MODELS.items())}
    models.update({name: save_random(config(), tmp_path / name) for name, config in FAMILIES.items()})
    cases = [{"name": name, "model": str(models[model]), "llm": {**kwargs, **KV}, "env": env}
             for name, model, kwargs, env in CASES]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    launch = run_torchrun(4, [REPO / "tests" / "helpers" / "dist_scripts" / "rank_memory.py",
                              tmp_path / "cases.json", tmp_path], timeout=300)
    assert launch.returncode == 0 and not launch.leftover_pids, launch.describe()
    assert not launch.stale_segments()
    measured = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for name, model, kwargs, env in CASES:
        memory = plan_memory(models[model], kwargs, monkeypatch, env)
        planned = [(r["weight_bytes"], r["kv_blocks"]) for r in memory["per_rank"]]
        real = [(m[name]["weight_bytes"], m[name]["kv_blocks"]) for m in measured]
        assert planned == real, name
        assert memory["fits"]
    # Not vacuous: the layouts differ per rank and from one another.
    weights = {name: [m[name]["weight_bytes"] for m in measured] for name, *_ in CASES}
    assert len(set(weights["llama-tp2-pp2"])) == 2 and len(set(weights["qwen2-tied-tp2-pp2"])) == 2
    assert len(set(map(tuple, weights.values()))) == len(CASES)
