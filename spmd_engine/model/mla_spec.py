"""DeepSeek-V2 / V3's config.json read the way transformers' models read it.

Two parts differ from the Llama family: the attention (multi-head latent attention, MlaSpec)
and the router (GroupedTopK, with every layer after the `first_k_dense_replace` dense ones
sparse, and always-on shared experts without a gate). spec.py calls
`MlaSpec.from_hf_config` and `deepseek_moe_fields` for these architectures only; every value
we would read otherwise than transformers (or cannot run) is a one-line ConfigError naming
the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from spmd_engine.config import ConfigError
from spmd_engine.model.layers.grouped_routing import GroupedTopK

MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


def _positive_int(cfg: Mapping[str, Any], key: str, source: str, default: Any = None, minimum: int = 1) -> int:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{source}: '{key}' must be an integer >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True)
class MlaSpec:
    """The latent attention's sizes. The KV cache holds, per token and layer, the normalised
    latent (`kv_lora_rank`) and the rotated shared key (`qk_rope_head_dim`): `cache_width`."""

    q_lora_rank: int | None  # None: a plain q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # the rotary dims as (even, odd) pairs (V2 always, V3 by default)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_hf_config(cls, arch: str, cfg: Mapping[str, Any], source: str) -> "MlaSpec | None":
        if arch not in MLA_ARCHITECTURES:
            return None
        if cfg.get("quantization_config"):  # DeepSeek-V3's FP8 release: its blocks and scales unread
            raise ConfigError(f"{source}: 'quantization_config' is not supported for {arch} (convert the "
                              f"checkpoint to bfloat16)")
        if cfg.get("attention_bias", False):
            raise ConfigError(f"{source}: 'attention_bias' true is not supported for {arch}")
        q_lora = cfg.get("q_lora_rank")
        rope = _positive_int(cfg, "qk_rope_head_dim", source)
        if rope % 2:
            raise ConfigError(f"{source}: 'qk_rope_head_dim' must be even, got {rope}")
        return cls(q_lora_rank=None if q_lora is None else _positive_int(cfg, "q_lora_rank", source),
                   kv_lora_rank=_positive_int(cfg, "kv_lora_rank", source),
                   qk_nope_head_dim=_positive_int(cfg, "qk_nope_head_dim", source),
                   qk_rope_head_dim=rope, v_head_dim=_positive_int(cfg, "v_head_dim", source),
                   rope_interleave=arch == "DeepseekV2ForCausalLM" or bool(cfg.get("rope_interleave", True)))

    def tensor_shapes(self, prefix: str, hidden: int, heads: int) -> dict[str, tuple[int, ...]]:
        """Full HF shapes of one layer's attention tensors (`prefix`: "model.layers.i.")."""
        p = prefix + "self_attn."
        shapes = {p + "kv_a_proj_with_mqa.weight": (self.cache_width, hidden),
                  p + "kv_a_layernorm.weight": (self.kv_lora_rank,),
                  p + "kv_b_proj.weight": (heads * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank),
                  p + "o_proj.weight": (hidden, heads * self.v_head_dim)}
        if self.q_lora_rank is None:
            shapes[p + "q_proj.weight"] = (heads * self.qk_head_dim, hidden)
        else:
            shapes.update({p + "q_a_proj.weight": (self.q_lora_rank, hidden),
                           p + "q_a_layernorm.weight": (self.q_lora_rank,),
                           p + "q_b_proj.weight": (heads * self.qk_head_dim, self.q_lora_rank)})
        return shapes


def deepseek_moe_fields(arch: str, cfg: Mapping[str, Any], source: str) -> dict[str, Any]:
    """MoeSpec's fields for a DeepSeek config (transformers: V3's sigmoid router with the
    correction bias and grouped top-2-sum choice; V2's softmax with `topk_method` greedy or
    group_limited_greedy, which never renormalises whatever `norm_topk_prob` says)."""
    experts = _positive_int(cfg, "n_routed_experts", source)
    top_k = _positive_int(cfg, "num_experts_per_tok", source)
    width = _positive_int(cfg, "moe_intermediate_size", source)
    shared = 0 if cfg.get("n_shared_experts") is None else _positive_int(cfg, "n_shared_experts", source, minimum=0)
    v3 = arch == "DeepseekV3ForCausalLM"
    expected = {"scoring_func": "sigmoid" if v3 else "softmax"}
    if v3:
        expected["topk_method"] = "noaux_tc"
    for key, value in expected.items():
        if cfg.get(key, value) != value:
            raise ConfigError(f"{source}: '{key}' {cfg[key]!r} is not supported for {arch} (only {value!r})")
    method = "noaux_tc" if v3 else cfg.get("topk_method", "greedy")
    if method not in (("noaux_tc",) if v3 else ("greedy", "group_limited_greedy")):
        raise ConfigError(f"{source}: 'topk_method' {method!r} is not supported for {arch} "
                          f"(greedy, group_limited_greedy)")
    groups, kept = 1, 1
    if method != "greedy":
        groups = _positive_int(cfg, "n_group", source)
        kept = _positive_int(cfg, "topk_group", source)
        if experts % groups:
            raise ConfigError(f"{source}: 'n_group' {groups} must divide n_routed_experts {experts}")
        if kept > groups:
            raise ConfigError(f"{source}: 'topk_group' {kept} exceeds n_group {groups}")
        if v3 and experts // groups < 2:
            raise ConfigError(f"{source}: 'n_group' {groups} leaves fewer than 2 experts per group (V3 rates a "
                              f"group by its best two)")
        if top_k > kept * (experts // groups):
            raise ConfigError(f"{source}: 'num_experts_per_tok' {top_k} exceeds the experts of topk_group {kept} "
                              f"groups")
    if top_k > experts:
        raise ConfigError(f"{source}: 'num_experts_per_tok' {top_k} exceeds n_routed_experts {experts}")
    if not v3 and cfg.get("mlp_bias", False):
        raise ConfigError(f"{source}: 'mlp_bias' true is not supported for {arch}")
    scaling = cfg.get("routed_scaling_factor", 2.5 if v3 else 1.0)
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not 0 < scaling < float("inf"):
        raise ConfigError(f"{source}: 'routed_scaling_factor' must be a positive number, got {scaling!r}")
    first_dense = _positive_int(cfg, "first_k_dense_replace", source, default=3 if v3 else 0, minimum=0)
    if _positive_int(cfg, "moe_layer_freq", source, default=1) != 1:
        # transformers makes every layer after the dense ones sparse; DeepSeek's own code and
        # vLLM only every moe_layer_freq-th: the two agree only at 1 (every released config).
        raise ConfigError(f"{source}: 'moe_layer_freq' {cfg['moe_layer_freq']!r} is not supported (only 1)")
    layers = cfg.get("num_hidden_layers") if isinstance(cfg.get("num_hidden_layers"), int) else 0
    grouped = GroupedTopK(scoring="sigmoid" if v3 else "softmax", num_groups=groups, topk_groups=kept,
                          group_score="top2_sum" if v3 else "max", masked_score=float("-inf") if v3 else 0.0,
                          correction_bias=v3, renormalize=v3 and bool(cfg.get("norm_topk_prob", True)),
                          scaling_factor=float(scaling))
    return dict(num_experts=experts, top_k=top_k, expert_intermediate_size=width, renormalize=grouped.renormalize,
                weights_in_activation_dtype=False, shared_expert_intermediate_size=shared * width, sparse_step=1,
                mlp_only_layers=tuple(range(min(first_dense, layers))),
                checkpoint_style="deepseek", grouped=grouped, shared_expert_gated=False)
