"""DeepSeek-V3 / V2 (models/deepseek.py) one module at a time against transformers' own.

The grouped router against transformers' router modules; the whole model over a paged cache
(a prefill split in chunks, a decode, a fresh prompt in one step) against transformers'
logits at fp32 tolerance; the KV cache holding only the latent and the rotary key (its size,
the one tensor bound as K and V, the front end's and plan's counts); config values we cannot
run refused naming the key.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import require_reference
from deepseek_checkpoint import CONFIGS, make_deepseek_checkpoint
from fake_groups import SoloGroup
from model_helpers import _TOKENS, SCHEDULE, SEQ_NAMES, run_schedule

from spmd_engine.config import ConfigError
from spmd_engine.model import load_model
from spmd_engine.model.layers.grouped_routing import grouped_route
from spmd_engine.model.models.llama import CausalLM
from spmd_engine.model.spec import ModelSpec
from spmd_engine.plan.rank_weights import RankModels


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek")
    return {name: make_deepseek_checkpoint(root / name, name, seed=i) for i, name in enumerate(("v3", "v2", "v2-greedy"))}


def hf_config(path) -> dict:
    return json.loads((path / "config.json").read_text())


# ---- the router -----------------------------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["v3", "v3-plainrope", "v2", "v2-greedy"])
def test_grouped_route_equals_transformers_router(name):
    transformers = require_reference("transformers")
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    v2 = name.startswith("v2")
    config = (transformers.DeepseekV2Config if v2 else transformers.DeepseekV3Config)(**CONFIGS[name])
    router = (DeepseekV2TopkRouter if v2 else DeepseekV3TopkRouter)(config)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
        if not v2:
            router.e_score_correction_bias.copy_(torch.randn(8, generator=gen))
    x = torch.randn(64, CONFIGS[name]["hidden_size"], generator=gen)
    _, ref_weights, ref_ids = router(x)
    spec = ModelSpec.from_hf_config({**config.to_dict(), "architectures": [type(router).__name__.replace(
        "TopkRouter", "ForCausalLM")]})
    weights, ids = grouped_route(x @ router.weight.T, spec.moe.top_k, spec.moe.grouped,
                                 None if v2 else router.e_score_correction_bias)
    # transformers' top-k is unsorted: compare each token's experts as a set, weights by expert
    order, ref_order = ids.argsort(dim=1), ref_ids.argsort(dim=1)
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    torch.testing.assert_close(weights.gather(1, order), ref_weights.gather(1, ref_order), rtol=1e-6, atol=1e-7)
    if spec.moe.grouped.num_groups == 1:
        return
    # The groups decide: without them (one group) some token picks other experts.
    loose = grouped_route(x @ router.weight.T, spec.moe.top_k,
                          type(spec.moe.grouped)(**{**spec.moe.grouped.__dict__, "num_groups": 1}),
                          None if v2 else router.e_score_correction_bias)[1]
    assert not torch.equal(loose.sort(dim=1).values, ids.sort(dim=1).values)


# ---- the model over a paged cache ----------------------------------------------------------------

@torch.no_grad()
def hf_schedule_logits(path) -> list[np.ndarray]:
    """transformers' logits for the tokens each SCHEDULE step computes, in its row order."""
    transformers = require_reference("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    full = {name: hf(torch.tensor([tokens])).logits[0].numpy() for name, tokens in _TOKENS.items()}
    return [np.concatenate([full[SEQ_NAMES[seq]][cached:cached + len(tokens)] for seq, tokens, cached in step])
            for step in SCHEDULE]


def relative_error(ours: list[np.ndarray], ref: list[np.ndarray]) -> float:
    scale = max(np.abs(r).max() for r in ref)
    return max(np.abs(a - b).max() for a, b in zip(ours, ref, strict=True)) / scale


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["v3", "v2", "v2-greedy"])
def test_paged_forward_matches_transformers_logits(checkpoints, name, tmp_path):
    solo = SoloGroup()
    with torch.no_grad():
        ours = run_schedule(load_model(checkpoints[name], solo, solo))
    ref = hf_schedule_logits(checkpoints[name])
    assert relative_error(ours, ref) < 1e-5
    # Negative control: our model reading the rotary dims in the other layout is caught.
    if name == "v3":
        flipped = tmp_path / "flipped"
        flipped.mkdir()
        for f in checkpoints[name].iterdir():
            (flipped / f.name).symlink_to(f)
        (flipped / "config.json").unlink()
        (flipped / "config.json").write_text(json.dumps({**hf_config(checkpoints[name]), "rope_interleave": False}))
        with torch.no_grad():
            wrong = run_schedule(load_model(flipped, solo, solo))
        assert relative_error(wrong, ref) > 1e-3


# ---- the latent KV cache ---------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_kv_cache_holds_only_the_latent_and_the_rotary_key(checkpoints):
    cfg = hf_config(checkpoints["v3"])
    latent = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    solo = SoloGroup()
    model = load_model(checkpoints["v3"], solo, solo)
    assert model.kv_bytes_per_token() == cfg["num_hidden_layers"] * latent * 4
    # Negative control: per-head K and V (Llama's count) on the same model is another number.
    assert CausalLM.kv_bytes_per_token(model) != model.kv_bytes_per_token()
    model.allocate_kv_cache(5, 4)
    layers = model._attention_layers()
    assert all(a.k_cache is a.v_cache and a.k_cache.shape == (5, 4, 1, latent) for a in layers)
    held = {id(a.k_cache): a.k_cache for a in layers}.values()
    assert sum(t.numel() * t.element_size() for t in held) == 5 * 4 * model.kv_bytes_per_token()
    # The same on every TP rank (each holds its heads, not a share of the cache), in the plan too.
    for tp in (2, 4):
        rank_models = RankModels(cfg, torch.bfloat16, True)._build(tp, tp - 1, 2, 1, None, None)
        assert rank_models.kv_bytes_per_token == 2 * latent * 2  # layers 2..3 of 4 on the last stage
    from spmd_engine.core.kv_sizing import plan_kv
    from spmd_engine.engine.arg_utils import EngineArgs
    config = EngineArgs(model=str(checkpoints["v3"]), tensor_parallel_size=2,
                        kv_cache_memory_bytes=1 << 20).create_engine_config().config
    spec = ModelSpec.from_hf_config(cfg)
    assert plan_kv(config, spec, 2, 1 << 30, 1, 4).bytes_per_token == 4 * latent * 2


# ---- configs refused ------------------------------------------------------------------------------

@pytest.mark.timeout(30)
@pytest.mark.parametrize("change, key", [
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"topk_method": "greedy"}, "topk_method"),
    ({"n_group": 3}, "n_group"),
    ({"topk_group": 3}, "topk_group"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"attention_bias": True}, "attention_bias"),
    ({"kv_lora_rank": 0}, "kv_lora_rank"),
    ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
    ({"routed_scaling_factor": -1.0}, "routed_scaling_factor"),
    ({"moe_layer_freq": 0}, "moe_layer_freq"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, "quantization_config"),  # transformers ignores it, vLLM does not
])
def test_unsupported_config_values_are_one_line_errors_naming_the_key(checkpoints, change, key):
    cfg = {**hf_config(checkpoints["v3"]), **change}
    with pytest.raises(ConfigError) as err:
        ModelSpec.from_hf_config(cfg)
    assert key in str(err.value) and "\n" not in str(err.value)


@pytest.mark.timeout(30)
def test_v2_topk_methods_and_sparse_layers(checkpoints):
    cfg = hf_config(checkpoints["v2"])
    with pytest.raises(ConfigError, match="topk_method"):
        ModelSpec.from_hf_config({**cfg, "topk_method": "noaux_tc"})
    greedy = ModelSpec.from_hf_config({**cfg, "topk_method": "greedy"}).moe.grouped
    assert greedy.num_groups == 1 and not greedy.renormalize
    spec = ModelSpec.from_hf_config({**cfg, "num_hidden_layers": 8, "first_k_dense_replace": 3})
    assert [i for i in range(8) if spec.is_moe_layer(i)] == [3, 4, 5, 6, 7]  # transformers': i >= k


@pytest.mark.timeout(30)
def test_lora_refused(checkpoints):
    from spmd_engine.engine.arg_utils import EngineArgs
    with pytest.raises(ConfigError, match="does not support multi-head latent attention"):
        EngineArgs(model=str(checkpoints["v2"]), enable_lora=True).create_engine_config()
