"""A HF `config.json` dict read once into the sizes the model code needs.

Everything a user's checkpoint can get wrong (an architecture we do not run,
a missing size, an activation or RoPE variant we do not implement) is reported
here as a one-line ConfigError naming the file, before any tensor or
collective exists.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Mapping

from spmd_engine.config import ConfigError
from spmd_engine.model.layers.grouped_routing import GroupedTopK
from spmd_engine.model.layers.longrope import longrope_scaling
from spmd_engine.model.layers.rotary import SUPPORTED_ROPE_TYPES, rope_type_of
from spmd_engine.model.mla_spec import MLA_ARCHITECTURES, MlaSpec, deepseek_moe_fields
from spmd_engine.model.registry import BUILTIN_MODELS, ModelRegistry
from spmd_engine.model.windows import layer_windows

# The built-in architectures (model/registry.py maps every architecture to its class).
SUPPORTED_ARCHITECTURES = tuple(BUILTIN_MODELS)
# Architectures whose attention RMS-normalises q and k per head before RoPE.
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
GPT_OSS = "GptOssForCausalLM"
# Families whose config.json says more than the Llama family's keys: their family file reads it
# ("module:function" taking (config dict, source), returning the config to read on and the
# ModelSpec fields it decides).
FAMILY_READERS = {"Phi3ForCausalLM": "spmd_engine.model.models.phi3:read_config",
                  "Olmo2ForCausalLM": "spmd_engine.model.models.olmo2:read_config"}
# Widths past this are a typo, not a model (the largest released are near 2**14 hidden and
# 2**16 intermediate): refused here, naming the field, instead of failing later as a KV budget
# or an allocation nobody can read back to config.json.
MAX_WIDTH = 1 << 20
MAX_VOCAB = 1 << 24
# The weight dtypes a config may declare (HF's names; "torch." prefixes allowed).
CONFIG_DTYPES = ("float32", "float", "bfloat16", "float16", "half")
# Families that read their own config.json, in their model file: "module:function", called as
# function(cfg, source, architecture) -> a ModelSpec (or a subclass of it with the family's fields).
FAMILY_SPECS = {
    "Gemma3ForCausalLM": "spmd_engine.model.models.gemma3:gemma3_spec",
}


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
    qk_norm: bool = False
    moe: MoeSpec | None = None  # None: a dense model
    # Each layer's sliding window, None for full attention (model/windows.py); () : none anywhere.
    layer_windows: tuple[int | None, ...] = ()
    attention_sinks: bool = False  # gpt-oss: a learned logit per head in every softmax (sink_attention.py)
    mla: MlaSpec | None = None  # DeepSeek's latent attention (then num_kv_heads 1, head_dim the rotary width)
    qk_norm_over: str = "head"  # "head" (Qwen3) or "projection": all heads of q / k at once (OLMo 2)
    post_norm: bool = False  # OLMo 2: sublayer outputs normed before the residual add, no input norm
    fused_checkpoint: bool = False  # Phi-3: the checkpoint holds qkv_proj and gate_up_proj whole
    partial_rotary_factor: float = 1.0  # the share of each head's features RoPE turns (Phi-3)

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (None: it attends to every earlier token)."""
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and self.moe.is_sparse(layer)

    def layer_norm_names(self) -> tuple[str, ...]:
        """The RMSNorms of every decoder layer, by their checkpoint names."""
        if self.post_norm:  # OLMo 2: no input norm
            return ("post_attention_layernorm", "post_feedforward_layernorm")
        return ("input_layernorm", "post_attention_layernorm")

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any], source: str = "config.json") -> "ModelSpec":
        arch = architecture_of(cfg, source)
        # A class registered under a new name reads config.json as the built-in it names.
        family = ModelRegistry.config_architecture(arch)
        if family in FAMILY_SPECS:
            module, _, reader = FAMILY_SPECS[family].partition(":")
            return getattr(importlib.import_module(module), reader)(cfg, source, arch)
        cfg, family_fields = _family_reading(family, cfg, source)

        def need(key: str, most: int | None = None) -> int:
            value = cfg.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{source}: '{key}' must be a positive integer, got {value!r}")
            if most is not None and value > most:
                raise ConfigError(f"{source}: '{key}' {value} is absurd (more than {most})")
            return value

        def positive(key: str, default: float) -> float:
            value = cfg.get(key, default)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ConfigError(f"{source}: '{key}' must be a positive number, got {value!r}")
            return value

        hidden, heads = need("hidden_size", MAX_WIDTH), need("num_attention_heads")
        _check_dtype(cfg, source)
        if cfg.get("quantization_config"):
            raise ConfigError(f"{source}: quantization_config "
                              f"({dict(cfg['quantization_config']).get('quant_method', '?')}) is not supported: "
                              f"only unquantised (float) checkpoints load")
        mla = MlaSpec.from_hf_config(family, cfg, source)
        kv_heads = 1 if mla else cfg.get("num_key_value_heads") or heads
        head_dim = mla.qk_rope_head_dim if mla else cfg.get("head_dim") or hidden // heads
        if hidden % heads and not cfg.get("head_dim") and not mla:
            raise ConfigError(f"{source}: hidden_size {hidden} is not divisible by num_attention_heads {heads}")
        if heads % kv_heads:
            raise ConfigError(
                f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
            )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
        theta, scaling = _rope(cfg, source)
        qwen = family in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
        # Llama, Qwen3 and Qwen3-MoE: `attention_bias` puts a bias on q, k, v and o;
        # Qwen2 always has q/k/v biases, Qwen2-MoE per `qkv_bias` (default on).
        all_bias = bool(cfg.get("attention_bias", False)) and family in (
            "LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", GPT_OSS)
        qkv_bias = (all_bias or family == "Qwen2ForCausalLM"
                    or (family == "Qwen2MoeForCausalLM" and bool(cfg.get("qkv_bias", True))))
        windows = layer_windows(family, cfg, need("num_hidden_layers"), source)
        window = cfg.get("sliding_window")
        if qwen and not cfg.get("use_sliding_window", False):
            window = None
        max_positions = int(positive("max_position_embeddings", 2048))
        rotary = _rotary_factor(cfg, source, arch, family_fields)
        rotary_dim = int(int(head_dim) * rotary)
        if rotary_dim % 2 or rotary_dim < 2:
            raise ConfigError(f"{source}: partial_rotary_factor {rotary} turns {rotary_dim} of head_dim "
                              f"{head_dim} features: RoPE needs an even number of them")
        if rope_type_of(scaling) == "longrope":
            try:
                scaling = longrope_scaling(scaling, rotary_dim, max_positions,
                                           cfg.get("original_max_position_embeddings"))
            except ValueError as exc:
                raise ConfigError(f"{source}: {exc}") from None
        fields = dict(
            architecture=arch,
            vocab_size=need("vocab_size", MAX_VOCAB),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size", MAX_WIDTH),
            num_layers=need("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=int(kv_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(positive("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=all_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)) and family == "LlamaForCausalLM",
            sliding_window=int(window) if window else None,
            qk_norm=family in QK_NORM_ARCHITECTURES,
            moe=MoeSpec.from_hf_config(family, cfg, source),
            layer_windows=windows,
            attention_sinks=family == GPT_OSS,
            mla=mla,
        )
        return cls(**{**fields, **family_fields})


@dataclass(frozen=True)
class MoeSpec:
    """The mixture-of-experts part of a config, as each HF model reads it.

    Mixtral: every layer sparse, `num_local_experts`, expert width
    `intermediate_size`, top-k weights always renormalised and kept in float32.
    Qwen2-MoE / Qwen3-MoE: `num_experts`, `moe_intermediate_size`,
    `norm_topk_prob`, sparse layers chosen by `decoder_sparse_step` and
    `mlp_only_layers`, top-k weights cast to the activation dtype; Qwen2-MoE adds
    a shared expert behind a sigmoid gate.
    gpt-oss: `num_local_experts`, width `intermediate_size`, a router with a bias whose
    top-k logits are softmaxed (`softmax_after_topk`), experts with biases and the clamped
    SwiGLU (`swiglu_limit`, `swiglu_alpha`), every layer sparse.
    """

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    renormalize: bool
    weights_in_activation_dtype: bool
    shared_expert_intermediate_size: int  # 0: none
    sparse_step: int
    mlp_only_layers: tuple[int, ...]
    checkpoint_style: str  # "mixtral" (block_sparse_moe.experts.E.w1/w2/w3), "qwen", "gpt_oss" or "deepseek"
    router_bias: bool = False
    softmax_after_topk: bool = False  # softmax over the k chosen logits (else top-k of the softmax)
    expert_bias: bool = False
    swiglu_limit: float | None = None  # the clamped SwiGLU (gpt-oss); None: silu(gate) * up
    swiglu_alpha: float = 1.0
    grouped: GroupedTopK | None = None  # DeepSeek's router (grouped_routing.py) instead of softmax top-k
    shared_expert_gated: bool = True  # Qwen2-MoE's sigmoid gate; DeepSeek's shared experts are always on

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.sparse_step == 0

    @classmethod
    def from_hf_config(cls, arch: str, cfg: Mapping[str, Any], source: str) -> "MoeSpec | None":
        if arch in MLA_ARCHITECTURES:
            return cls(**deepseek_moe_fields(arch, cfg, source))
        if arch not in ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", GPT_OSS):
            return None
        mixtral = arch in ("MixtralForCausalLM", GPT_OSS)  # the same config keys
        experts = cfg.get("num_local_experts" if mixtral else "num_experts", 8 if mixtral else None)
        top_k = cfg.get("num_experts_per_tok", 2 if mixtral else None)
        width = cfg.get("intermediate_size" if mixtral else "moe_intermediate_size")
        for key, value in (("num_experts", experts), ("num_experts_per_tok", top_k),
                           ("moe_intermediate_size", width)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{source}: {key} must be a positive integer, got {value!r}")
        if top_k > experts:
            raise ConfigError(f"{source}: num_experts_per_tok {top_k} exceeds the number of experts {experts}")
        step = 1 if mixtral else cfg.get("decoder_sparse_step", 1)
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ConfigError(f"{source}: decoder_sparse_step must be a positive integer, got {step!r}")
        shared = int(cfg.get("shared_expert_intermediate_size") or 0) if arch == "Qwen2MoeForCausalLM" else 0
        if arch == GPT_OSS:
            limit, alpha = cfg.get("swiglu_limit", 7.0), cfg.get("swiglu_alpha", 1.702)
            for key, value in (("swiglu_limit", limit), ("swiglu_alpha", alpha)):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                    raise ConfigError(f"{source}: '{key}' must be a positive number, got {value!r}")
            return cls(num_experts=experts, top_k=top_k, expert_intermediate_size=width, renormalize=False,
                       weights_in_activation_dtype=True, shared_expert_intermediate_size=0, sparse_step=1,
                       mlp_only_layers=(), checkpoint_style="gpt_oss", router_bias=True, softmax_after_topk=True,
                       expert_bias=True, swiglu_limit=float(limit), swiglu_alpha=float(alpha))
        return cls(num_experts=experts, top_k=top_k, expert_intermediate_size=width,
                   renormalize=mixtral or bool(cfg.get("norm_topk_prob", False)),
                   weights_in_activation_dtype=not mixtral, shared_expert_intermediate_size=shared,
                   sparse_step=step, mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
                   checkpoint_style="mixtral" if mixtral else "qwen")


def architecture_of(cfg: Mapping[str, Any], source: str = "config.json") -> str:
    """The first of config.json's `architectures` that ModelRegistry knows (vLLM tries each)."""
    archs = cfg.get("architectures") or []
    arch = ModelRegistry.supported_architecture(archs) if isinstance(archs, list) else None
    if arch is None:
        named = archs[0] if isinstance(archs, list) and archs else None
        raise ConfigError(
            f"unsupported architecture {named} in {source}; supported: {', '.join(ModelRegistry.get_supported_archs())}"
        )
    return arch


def _rope(cfg: Mapping[str, Any], source: str) -> tuple[float, Mapping[str, Any] | None]:
    """(theta, scaling) from either the classic keys (`rope_theta`, `rope_scaling`)
    or the newer `rope_parameters` dict that recent transformers writes."""
    params = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < float("inf"):
        raise ConfigError(f"{source}: 'rope_theta' must be a positive number, got {theta!r}")
    scaling = cfg.get("rope_scaling") or (params if rope_type_of(params) != "default" else None)
    kind = rope_type_of(scaling)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"{source}: rope_scaling type {kind!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if kind == "yarn" and "original_max_position_embeddings" not in scaling:
        # transformers' default: the top-level key where a config has one (Phi-3), else the
        # model's own context (so a stretch of `factor` over it).
        original = cfg.get("original_max_position_embeddings") or cfg.get("max_position_embeddings", 2048)
        scaling = {**scaling, "original_max_position_embeddings": original}
    required = {"linear": ("factor",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                "yarn": ("factor",),
                "longrope": ("short_factor", "long_factor")}
    for key in required.get(kind, ()):
        if key not in scaling:
            raise ConfigError(f"{source}: rope_scaling of type {kind!r} needs '{key}'")
    return float(theta), scaling


def _family_reading(family: str, cfg: Mapping[str, Any], source: str) -> tuple[Mapping[str, Any], dict]:
    """(config to read on, ModelSpec fields) from the family's own reader, if it has one."""
    reader = FAMILY_READERS.get(family)
    if reader is None:
        return cfg, {}
    module, _, name = reader.partition(":")
    return getattr(importlib.import_module(module), name)(cfg, source)


def _rotary_factor(cfg: Mapping[str, Any], source: str, arch: str, family_fields: Mapping[str, Any]) -> float:
    """The family's partial_rotary_factor; elsewhere transformers turns every feature, so a
    config asking for less is refused rather than read two ways."""
    if "partial_rotary_factor" in family_fields:
        return family_fields["partial_rotary_factor"]
    asked = partial_rotary_factor(cfg, source)
    if asked != 1.0:
        raise ConfigError(f"{source}: partial_rotary_factor {asked} is not supported for {arch}")
    return 1.0


def partial_rotary_factor(cfg: Mapping[str, Any], source: str) -> float:
    """From `rope_parameters` (transformers 5) or the top level (older configs); 1.0 if neither."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    value = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ConfigError(f"{source}: partial_rotary_factor must be a number in (0, 1], got {value!r}")
    return float(value)


def _check_dtype(cfg: Mapping[str, Any], source: str) -> None:
    """`torch_dtype` (or the newer `dtype`) names the weights' float type; anything else (an
    int type, a typo) would silently load as float32."""
    key = "torch_dtype" if "torch_dtype" in cfg else "dtype"
    value = cfg.get(key)
    if value is not None and str(value).removeprefix("torch.") not in CONFIG_DTYPES:
        raise ConfigError(f"{source}: '{key}' {value!r} is not a float dtype ({', '.join(CONFIG_DTYPES)})")
