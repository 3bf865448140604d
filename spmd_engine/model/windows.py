"""Which layers attend over a sliding window, and how wide, read from config.json as transformers 5
reads it for each family (issue 53).

The families disagree, and transformers' modeling code is what decides:
- Mistral, Mixtral and Qwen3-MoE: `sliding_window` on every layer (Mistral ignores `layer_types`);
  Qwen3-MoE only with `use_sliding_window`.
- Qwen2 and Qwen3: `layer_types`, by default sliding from layer `max_window_layers` (28) on,
  the window `sliding_window` only with `use_sliding_window` (a "sliding_attention" layer
  without it attends to everything).
- Qwen2-MoE: `layer_types`, by default every odd-numbered layer (1st, 3rd, ...) below
  `max_window_layers` with `use_sliding_window`.
- Llama: no windows (its attention has none, whatever the config says).
- Any other family (Gemma 3, gpt-oss, ...): the generic `layer_types` list of "sliding_attention"
  and "full_attention" with `sliding_window`; without a list, `sliding_window` on every layer.
"""

from __future__ import annotations

from typing import Any, Mapping

from spmd_engine.config import ConfigError

LAYER_TYPES = ("sliding_attention", "full_attention")
EVERY_LAYER = ("MistralForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM")
GATED = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


def layer_windows(family: str, cfg: Mapping[str, Any], num_layers: int,
                  source: str = "config.json") -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention), for a model of `family`."""
    if family == "LlamaForCausalLM":
        return (None,) * num_layers
    window = cfg.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
        raise ConfigError(f"{source}: 'sliding_window' must be a positive integer or null, got {window!r}")
    if family in GATED and not cfg.get("use_sliding_window", False):
        window = None
    window = window or None  # 0: none (Qwen2-MoE's reading of a window turned off)
    if family in EVERY_LAYER or (family not in GATED and cfg.get("layer_types") is None):
        return (window,) * num_layers
    return tuple(window if kind == "sliding_attention" else None
                 for kind in _layer_types(family, cfg, num_layers, window, source))


def _layer_types(family: str, cfg: Mapping[str, Any], num_layers: int, window: int | None,
                 source: str) -> list[str]:
    types = cfg.get("layer_types")
    if types is None:
        most = cfg.get("max_window_layers", 28)
        if family == "Qwen2MoeForCausalLM":
            return ["sliding_attention" if i % 2 == 0 and i < most and window else "full_attention"
                    for i in range(num_layers)]
        return ["sliding_attention" if window and i >= most else "full_attention" for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers:
        raise ConfigError(f"{source}: 'layer_types' must list one type for each of the {num_layers} layers")
    unknown = sorted({t for t in types if t not in LAYER_TYPES}, key=str)
    if unknown:
        raise ConfigError(f"{source}: 'layer_types' {unknown} are not supported (only {', '.join(LAYER_TYPES)})")
    return types


def kv_freeing_window(windows: tuple[int | None, ...], model_config=None) -> int | None:
    """The window the KV cache manager may free blocks behind: the one every layer shares, else
    None (layers of different windows: a table per group, core/kv_groups.py). None too
    under routing replay (`model_config.enable_return_routed_experts`): it reads a cached
    prefix's expert rows back by KV slot (worker/routing_replay.py), which a freed block lost."""
    if model_config is not None and model_config.enable_return_routed_experts:
        return None
    kinds = set(windows)
    return kinds.pop() if len(kinds) == 1 else None
