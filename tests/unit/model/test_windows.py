"""Per-layer sliding windows read from config.json (model/windows.py, issue 53), against what
transformers 5's own config and attention classes make of the same config: each HF layer's
`self_attn.sliding_window` (Mistral, Mixtral, Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE) is the window
ModelSpec gives that layer."""

from __future__ import annotations

import pytest

from spmd_engine.config import ConfigError
from spmd_engine.model.spec import ModelSpec

pytestmark = pytest.mark.timeout(120)

SMALL = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=6, num_attention_heads=2,
             num_key_value_heads=1, head_dim=8)


def _hf_windows(arch: str, **extra) -> tuple[ModelSpec, list]:
    import transformers
    if "Moe" in arch or "Mixtral" in arch:
        extra = {**extra, "moe_intermediate_size": 16, "num_experts": 2, "num_local_experts": 2,
                 "num_experts_per_tok": 1}
    config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**SMALL, **extra)
    module = getattr(transformers, arch).__module__
    attention = next(getattr(__import__(module, fromlist=["x"]), name) for name in dir(__import__(module, fromlist=["x"]))
                     if name.endswith("Attention") and "Flash" not in name and "Sdpa" not in name)
    # Mistral's and Mixtral's attention pass config.sliding_window at forward (no attribute).
    fallback = config.sliding_window if arch in ("MistralForCausalLM", "MixtralForCausalLM") else None
    windows = [getattr(attention(config, i), "sliding_window", fallback) or None
               for i in range(SMALL["num_hidden_layers"])]
    cfg = config.to_dict()
    cfg["architectures"] = [arch]
    cfg.setdefault("num_experts", cfg.get("num_local_experts"))  # Qwen3-MoE's to_dict names it so
    return ModelSpec.from_hf_config(cfg), windows


CASES = [
    ("MistralForCausalLM", {"sliding_window": 5}),
    ("MistralForCausalLM", {"sliding_window": None}),
    ("MixtralForCausalLM", {"sliding_window": 7}),
    ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 2}),
    ("Qwen2ForCausalLM", {"use_sliding_window": False, "sliding_window": 5, "max_window_layers": 2}),
    ("Qwen3ForCausalLM", {"use_sliding_window": True, "sliding_window": 9, "max_window_layers": 4}),
    ("Qwen3ForCausalLM", {"use_sliding_window": True, "sliding_window": 3,
                          "layer_types": ["sliding_attention", "full_attention"] * 3}),
    ("Qwen2MoeForCausalLM", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 5}),
    ("Qwen3MoeForCausalLM", {"use_sliding_window": True, "sliding_window": 6}),
    ("LlamaForCausalLM", {}),
]


@pytest.mark.parametrize("arch,extra", CASES)
def test_layer_windows_are_transformers_reading(arch, extra):
    spec, want = _hf_windows(arch, **extra)
    assert [spec.window(i) for i in range(spec.num_layers)] == want


def test_mixed_qwen2_has_both_kinds():
    spec, _ = _hf_windows("Qwen2ForCausalLM", use_sliding_window=True, sliding_window=5, max_window_layers=2)
    assert spec.layer_windows == (None, None, 5, 5, 5, 5)


def test_generic_layer_types_for_other_families():
    """A family this file does not name (Gemma 3, gpt-oss) gets the generic `layer_types` reading."""
    from spmd_engine.model.windows import layer_windows
    cfg = {"sliding_window": 16, "layer_types": ["sliding_attention"] * 2 + ["full_attention"]}
    assert layer_windows("Gemma3ForCausalLM", cfg, 3) == (16, 16, None)
    assert layer_windows("Gemma3ForCausalLM", {"sliding_window": 16}, 2) == (16, 16)


@pytest.mark.parametrize("bad,match", [({"layer_types": ["full_attention"]}, "one type for each"),
                                       ({"layer_types": ["chunked_attention"] * 6}, "chunked_attention"),
                                       ({"sliding_window": "big", "use_sliding_window": True}, "sliding_window")])
def test_bad_window_configs_are_one_line_errors(bad, match):
    cfg = {**SMALL, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 4, **bad}
    with pytest.raises(ConfigError, match=match):
        ModelSpec.from_hf_config(cfg)


def test_the_kv_cache_frees_behind_one_shared_window_only():
    from types import SimpleNamespace

    from spmd_engine.model.windows import kv_freeing_window
    assert kv_freeing_window((8, 8)) == 8
    assert kv_freeing_window((8, None)) is None and kv_freeing_window((8, 4)) is None
    assert kv_freeing_window(()) is None and kv_freeing_window((None,)) is None
    # Routing replay reads a cached prefix's rows back by KV slot: every block is kept.
    assert kv_freeing_window((8, 8), SimpleNamespace(enable_return_routed_experts=True)) is None
    assert kv_freeing_window((8, 8), SimpleNamespace(enable_return_routed_experts=False)) == 8
