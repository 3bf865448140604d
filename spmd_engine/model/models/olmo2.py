"""OLMo 2 (`Olmo2ForCausalLM`): Llama's layers rearranged, with whole-projection q/k norms.

Two differences from Llama. Norms come after each sublayer instead of before it: the
sublayer reads the residual stream itself and its output is normalised before the add
(post_attention_layernorm, post_feedforward_layernorm; no input norm). And q and k are
RMS-normalised over the whole projection (num_heads x head_dim), not per head, which under TP
spans ranks: layers/sharded_norm.py. Every RMSNorm scales in float32 before the cast back, and
RoPE turns q and k in float32 by cos / sin in the activations' dtype (transformers' Olmo2
arithmetic; the same as Llama's in float32).

The decoder layer keeps the (hidden, residual) pair every family hands on (pipeline stages,
the compiled path): the stream is hidden + residual, so the final norm is unchanged.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from spmd_engine.model.layers import batch_invariant as bi
from spmd_engine.model.layers.norm import RMSNorm
from spmd_engine.model.layers.sharded_norm import ShardedRMSNorm, norm_together
from spmd_engine.model.models.llama import CausalLM, LlamaAttention, LlamaDecoderLayer, LlamaModel
from spmd_engine.model.spec import ModelSpec


def read_config(cfg: Mapping[str, Any], source: str) -> tuple[Mapping[str, Any], dict]:
    """ModelSpec's family hook: `attention_bias` puts a bias on q, k, v and o."""
    bias = bool(cfg.get("attention_bias", False))
    return cfg, dict(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=True, qk_norm_over="projection",
                     post_norm=True)


class Olmo2RMSNorm(RMSNorm):
    """Scaled by the weight in float32, then cast (Llama's casts first)."""

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        mean = (bi.row_sum(x32 * x32).unsqueeze(-1) if self.batch_invariant
                else x32.pow(2).sum(-1, keepdim=True)) / x.shape[-1]
        rsqrt = bi.pointwise(torch.rsqrt, mean + self.eps) if self.batch_invariant else torch.rsqrt(mean + self.eps)
        return (self.weight * (x32 * rsqrt)).to(x.dtype)


class Olmo2Attention(LlamaAttention):
    def __init__(self, spec: ModelSpec, tp_group, dtype: torch.dtype, sliding_window: int | None = None):
        super().__init__(spec, tp_group, dtype, sliding_window)
        qkv, d = self.qkv_proj, spec.head_dim
        self.q_norm = ShardedRMSNorm(spec.num_heads * d, qkv.q_size, qkv.tp_rank * qkv.q_size, d, tp_group,
                                     spec.rms_norm_eps, dtype=dtype)
        self.k_norm = ShardedRMSNorm(spec.num_kv_heads * d, qkv.kv_size, qkv.kv_head_start * d, d, tp_group,
                                     spec.rms_norm_eps, dtype=dtype)

    def norm_qk(self, qk: torch.Tensor) -> torch.Tensor:
        q, k = qk.split([self.qkv_proj.q_size, self.qkv_proj.kv_size], dim=-1)
        return torch.cat(norm_together([(self.q_norm, q), (self.k_norm, k)]), dim=-1).float()


class Olmo2DecoderLayer(LlamaDecoderLayer):
    attention_class = Olmo2Attention
    norm_class = Olmo2RMSNorm

    def __init__(self, spec: ModelSpec, tp_group, dtype: torch.dtype, layer: int = 0, moe: dict | None = None):
        super().__init__(spec, tp_group, dtype, layer, moe)
        del self.input_layernorm  # OLMo 2 norms sublayer outputs only
        self.post_feedforward_layernorm = Olmo2RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype=dtype)

    def forward(self, rope, hidden, residual, attn):
        stream = hidden if residual is None else hidden + residual
        stream = stream + self.post_attention_layernorm(self.self_attn(rope, stream, attn))
        return self.post_feedforward_layernorm(self.mlp(stream)), stream


class Olmo2Model(LlamaModel):
    decoder_layer = Olmo2DecoderLayer
    norm_class = Olmo2RMSNorm


class Olmo2ForCausalLM(CausalLM):
    hf_config_architecture = "Olmo2ForCausalLM"
    model_class = Olmo2Model
