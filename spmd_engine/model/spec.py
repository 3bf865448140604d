"""A HF `config.json` dict read once into the sizes the model code needs.

Everything a user's checkpoint can get wrong (an architecture we do not run,
a missing size, an activation or RoPE variant we do not implement) is reported
here as a one-line ConfigError naming the file, before any tensor or
collective exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from spmd_engine.config import ConfigError
from spmd_engine.model.rotary import SUPPORTED_ROPE_TYPES, rope_type_of

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Mapping[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any], source: str = "config.json") -> "ModelSpec":
        arch = architecture_of(cfg, source)

        def need(key: str) -> int:
            value = cfg.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{source}: '{key}' must be a positive integer, got {value!r}")
            return value

        hidden, heads = need("hidden_size"), need("num_attention_heads")
        kv_heads = cfg.get("num_key_value_heads") or heads
        head_dim = cfg.get("head_dim") or hidden // heads
        if hidden % heads and not cfg.get("head_dim"):
            raise ConfigError(f"{source}: hidden_size {hidden} is not divisible by num_attention_heads {heads}")
        if heads % kv_heads:
            raise ConfigError(
                f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
            )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
        theta, scaling = _rope(cfg, source)
        qwen = arch == "Qwen2ForCausalLM"
        llama_bias = bool(cfg.get("attention_bias", False)) and arch == "LlamaForCausalLM"
        window = cfg.get("sliding_window")
        if qwen and not cfg.get("use_sliding_window", False):
            window = None
        return cls(
            architecture=arch,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=int(kv_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qwen or llama_bias,
            o_bias=llama_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)) and arch == "LlamaForCausalLM",
            sliding_window=int(window) if window else None,
        )


def architecture_of(cfg: Mapping[str, Any], source: str = "config.json") -> str:
    archs = cfg.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"unsupported architecture {arch} in {source}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _rope(cfg: Mapping[str, Any], source: str) -> tuple[float, Mapping[str, Any] | None]:
    """(theta, scaling) from either the classic keys (`rope_theta`, `rope_scaling`)
    or the newer `rope_parameters` dict that recent transformers writes."""
    params = cfg.get("rope_parameters") or {}
    theta = float(cfg.get("rope_theta", params.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or (params if rope_type_of(params) != "default" else None)
    kind = rope_type_of(scaling)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"{source}: rope_scaling type {kind!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    required = {"linear": ("factor",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    for key in required.get(kind, ()):
        if key not in scaling:
            raise ConfigError(f"{source}: rope_scaling of type {kind!r} needs '{key}'")
    return theta, scaling
