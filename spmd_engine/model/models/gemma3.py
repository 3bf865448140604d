"""Gemma 3 (text): `Gemma3ForCausalLM` as transformers defines it, on the Llama machinery.

What Gemma 3 changes, and how each change meets the shared code:
- config.json (`gemma3_spec`, the family's reader that spec.py hands Gemma's configs to): the
  sizes Llama also has are read and checked by ModelSpec's own reading; Gemma's keys here.
- Interleaved local (sliding-window) and global layers (`layer_types`, or the older
  `sliding_window_pattern`), each kind with its own rope: global `rope_theta` with its scaling
  (linear, factor 8 in the 4B-27B models), local `rope_local_base_freq` (or both as
  `rope_parameters` keyed by layer type). The model's rope input carries both tables side by
  side along the last dim, so every layer keeps the signature layer(rope, hidden, residual,
  attn) that the compiled path calls, and takes its own half.
- Four norms per layer: the attention's and the MLP's outputs are normed before they join the
  residual stream (HF's post_attention and post_feedforward norms), so a layer carries the
  residual as Llama's does, with one norm more on each branch.
- Norms scale by 1 + weight in float32 (RMSNorm's `unit_offset`), q and k get per-head norms,
  the softmax scale is query_pre_attn_scalar ** -0.5, the MLP gates with gelu (tanh).
- The embedding is scaled by sqrt(hidden_size), that factor rounded to the model's dtype first
  (as HF does: in bf16 sqrt(3072) is 55.5); the LM head is the embedding (tied).
- final_logit_softcapping squashes the logits (ParallelLMHead's `softcap`).

Refused, naming the field: attn_logit_softcapping (Gemma 2's; every Gemma 3 config has it
null), use_bidirectional_attention, an activation other than gelu_pytorch_tanh. Only the text
model: Gemma3ForConditionalGeneration (image and text) is not registered.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Any, Mapping

import torch
from torch import nn

from spmd_engine.config import ConfigError
from spmd_engine.model.layers.embedding import VocabParallelEmbedding
from spmd_engine.model.layers.mlp import SwiGLUMLP
from spmd_engine.model.layers.norm import RMSNorm
from spmd_engine.model.layers.rotary import RotaryEmbedding
from spmd_engine.model.models.llama import CausalLM, LlamaAttention, LlamaModel
from spmd_engine.model.spec import ModelSpec, _rope

SLIDING, FULL = "sliding_attention", "full_attention"
# Gemma3TextConfig's defaults for the keys a config.json may leave out (hub configs do).
DEFAULTS = {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
            "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6,
            "max_position_embeddings": 131_072, "tie_word_embeddings": True, "query_pre_attn_scalar": 256,
            "sliding_window": 4096}
DEFAULT_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}

GemmaNorm = functools.partial(RMSNorm, unit_offset=True)


@dataclass(frozen=True)
class Gemma3Spec(ModelSpec):
    """ModelSpec's fields (rope_theta / rope_scaling: the global layers') and Gemma's own."""

    layer_types: tuple[str, ...] = ()
    local_rope_theta: float = DEFAULT_THETA[SLIDING]
    local_rope_scaling: Mapping[str, Any] | None = None
    query_pre_attn_scalar: float = 256.0
    final_logit_softcapping: float | None = None

    def layer_norm_names(self) -> tuple[str, ...]:
        return ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm")


def gemma3_spec(cfg: Mapping[str, Any], source: str, architecture: str) -> Gemma3Spec:
    """config.json as Gemma3TextConfig reads it; a one-line ConfigError for what we do not run."""
    cfg = {**DEFAULTS, **cfg}
    act = cfg.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ConfigError(f"{source}: hidden_activation {act!r} is not supported (only 'gelu_pytorch_tanh')")
    for key in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if cfg.get(key):
            raise ConfigError(f"{source}: {key} {cfg[key]!r} is not supported (only null / false)")
    window, layers = cfg.get("sliding_window"), cfg.get("num_hidden_layers")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ConfigError(f"{source}: 'sliding_window' must be a positive integer, got {window!r}")
    scalar = _positive(cfg, "query_pre_attn_scalar", source)
    softcap = None if cfg.get("final_logit_softcapping") is None else _positive(cfg, "final_logit_softcapping", source)
    rope = _rope_by_kind(cfg, source)
    # The sizes Llama has too, read (and checked) by ModelSpec as for a Llama with Gemma's rope
    # for global layers; q/k/v/o biases follow `attention_bias` there as here.
    llama = ModelSpec.from_hf_config({**cfg, "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
                                      "rope_parameters": None, "rope_theta": rope[FULL][0],
                                      "rope_scaling": rope[FULL][1], "mlp_bias": False,
                                      "sliding_window": None}, source)
    shared = {f.name: getattr(llama, f.name) for f in fields(ModelSpec)}
    types = _layer_types(cfg, layers, source)
    shared.update(architecture=architecture, qk_norm=True, sliding_window=window,
                  layer_windows=tuple(window if kind == SLIDING else None for kind in types))
    return Gemma3Spec(**shared, layer_types=types, local_rope_theta=rope[SLIDING][0],
                      local_rope_scaling=rope[SLIDING][1], query_pre_attn_scalar=scalar,
                      final_logit_softcapping=softcap)


def _positive(cfg: Mapping[str, Any], key: str, source: str) -> float:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ConfigError(f"{source}: '{key}' must be a positive number, got {value!r}")
    return float(value)


def _layer_types(cfg: Mapping[str, Any], layers: int, source: str) -> tuple[str, ...]:
    """`layer_types`, or as older configs say it: every `sliding_window_pattern`-th layer global."""
    types = cfg.get("layer_types")
    if types is None:
        pattern = cfg.get("sliding_window_pattern", 6)
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise ConfigError(f"{source}: 'sliding_window_pattern' must be a positive integer, got {pattern!r}")
        return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(layers))
    if not isinstance(types, list) or len(types) != layers or not set(types) <= {SLIDING, FULL}:
        raise ConfigError(f"{source}: 'layer_types' must list {layers} entries of {SLIDING!r} or {FULL!r}, "
                          f"got {types!r}")
    return tuple(types)


def _rope_by_kind(cfg: Mapping[str, Any], source: str) -> dict[str, tuple[float, Mapping[str, Any] | None]]:
    """(theta, scaling) of each layer kind, as Gemma3TextConfig fills `rope_parameters`: given per
    kind, or from the older keys (rope_theta and rope_scaling for global layers,
    rope_local_base_freq for local ones)."""
    given = cfg.get("rope_parameters")
    if given is not None and (not isinstance(given, dict) or not set(given) <= {SLIDING, FULL}):
        raise ConfigError(f"{source}: 'rope_parameters' must map {SLIDING!r} and {FULL!r} to their rope "
                          f"parameters, got {given!r}")
    params = {kind: dict((given or {}).get(kind) or {"rope_type": "default"}) for kind in (FULL, SLIDING)}
    if cfg.get("rope_scaling"):
        params[FULL].update(cfg["rope_scaling"])
    params[FULL].setdefault("rope_theta", cfg.get("rope_theta", DEFAULT_THETA[FULL]))
    params[SLIDING].setdefault("rope_theta", cfg.get("rope_local_base_freq", DEFAULT_THETA[SLIDING]))
    return {kind: _rope({"rope_parameters": p}, f"{source} (rope_parameters.{kind})") for kind, p in params.items()}


class ScaledEmbedding(VocabParallelEmbedding):
    """Rows times sqrt(hidden_size), the factor rounded to the rows' dtype as HF rounds it."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = super().forward(input_ids)
        return rows * _rounded(self.hidden_size ** 0.5, rows.dtype)


@functools.lru_cache(maxsize=None)
def _rounded(value: float, dtype: torch.dtype) -> float:
    return float(torch.tensor(value, dtype=dtype))


class Gemma3Rotary(nn.Module):
    """Both rope tables in one (cos, sin) pair, global then local along the last dim."""

    def __init__(self, spec: Gemma3Spec):
        super().__init__()
        self.full = RotaryEmbedding(spec.head_dim, spec.rope_theta, spec.rope_scaling)
        self.sliding = RotaryEmbedding(spec.head_dim, spec.local_rope_theta, spec.local_rope_scaling)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, attn=None) -> tuple[torch.Tensor, torch.Tensor]:
        (cos_full, sin_full), (cos_local, sin_local) = (r.cos_sin(positions, dtype, attn)
                                                        for r in (self.full, self.sliding))
        return torch.cat([cos_full, cos_local], dim=-1), torch.cat([sin_full, sin_local], dim=-1)


class Gemma3DecoderLayer(nn.Module):
    """HF's Gemma3DecoderLayer with the residual carried beside the hidden state (LlamaDecoderLayer's
    form, which the PP hand-off and the compiled path rely on): each branch's output is normed
    before the next norm adds it to the residual."""

    def __init__(self, spec: Gemma3Spec, tp_group, dtype: torch.dtype, layer: int = 0, moe: dict | None = None):
        super().__init__()
        # Local layers take the local rope; the compiled path keys its graphs by each layer's window
        # (compilation/chunk_program.py's `windows`), so a graph never serves a layer of the other kind.
        self.local = spec.layer_types[layer] == SLIDING
        self.self_attn = LlamaAttention(spec, tp_group, dtype, spec.window(layer), norm=GemmaNorm,
                                        scale=spec.query_pre_attn_scalar ** -0.5)
        self.mlp = SwiGLUMLP(spec.hidden_size, spec.intermediate_size, tp_group, dtype=dtype,
                             activation="gelu_pytorch_tanh")
        for name in spec.layer_norm_names():
            setattr(self, name, GemmaNorm(spec.hidden_size, spec.rms_norm_eps, dtype=dtype))

    def forward(self, rope, hidden, residual, attn):
        cos, sin = rope  # Gemma3Rotary's: [..., global | local]
        half = cos.shape[-1] // 2
        own = slice(half, None) if self.local else slice(0, half)
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn((cos[..., own], sin[..., own]), hidden, attn))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3Model(LlamaModel):
    embedding = ScaledEmbedding
    decoder_layer = Gemma3DecoderLayer
    norm_class = GemmaNorm
    rotary = staticmethod(Gemma3Rotary)


class Gemma3ForCausalLM(CausalLM):
    """CausalLM with Gemma3Model inside and the LM head's logits soft-capped where configured."""

    model_class = Gemma3Model

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.lm_head is not None:
            self.lm_head.softcap = self.spec.final_logit_softcapping
