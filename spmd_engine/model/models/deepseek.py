"""DeepSeek-V2 and V3 (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM): Llama's CausalLM with
multi-head latent attention (MLA) in every layer and DeepSeek's MoE (models/moe_block.py with
the grouped router of layers/grouped_routing.py, shared experts, the first dense layers).

MLA compresses a token's keys and values into one latent vector (`kv_lora_rank` wide, after
kv_a_layernorm) plus one rotary key shared by all heads (`qk_rope_head_dim`); kv_b_proj
expands the latent into each head's key (no position) and value. Expanding it for every
cached token at every step would cost a cache of per-head K/V. Instead (as vLLM does) the
expansion is folded into the two ends: each head's query is multiplied by its slice of
kv_b_proj's key half, so it scores the latent directly, and the attention output (a mix of
latents) by the value half before o_proj. Attention is then multi-query with one KV head
whose key is [latent, rotary key] and whose value is the latent, the key's first channels:
the shared Attention layer and paged cache serve it with one cache tensor per layer
(Attention's head_dim_v), and that cache is the same on every TP rank (each rank holds its
heads' slices of the projections). Parameter names are transformers' own.

In batch-invariant mode (batch_invariant.py) the two per-head products go through
`batch_invariant.linear` a head at a time: a batched einsum lets the GEMM pick its kernel (and
its order of sums) from the token count, and a head's product is the same whichever TP rank
holds it, so TP sizes agree too.
"""

from __future__ import annotations

import torch
from torch import nn

from spmd_engine.config import ConfigError
from spmd_engine.model.layers import batch_invariant as bi
from spmd_engine.model.layers.attention import Attention, AttentionMetadata
from spmd_engine.model.layers.linear import ColumnParallelLinear, RowParallelLinear
from spmd_engine.model.layers.norm import RMSNorm
from spmd_engine.model.layers.rotary import apply_rotary, rope_type_of, yarn_factor, yarn_mscale
from spmd_engine.model.models.llama import CausalLM, LlamaDecoderLayer, LlamaModel
from spmd_engine.model.models.moe_block import ReplicatedLinear
from spmd_engine.model.spec import ModelSpec

LATENT_NORM_EPS = 1e-6  # transformers' q_a_layernorm / kv_a_layernorm keep RMSNorm's default


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on (even, odd) channel pairs (DeepSeek's layout), the result de-interleaved (evens'
    rotations, then odds'), as transformers writes it: q and k alike, so their product is the
    pairwise rotation's. cos/sin are RotaryEmbedding's, each frequency twice over."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)


def softmax_scale(spec: ModelSpec) -> float:
    """1 / sqrt(qk_head_dim), times YaRN's mscale(factor, mscale_all_dim) squared: DeepSeek scales
    every dimension's scores, not only the rotary ones the rope's attention factor reaches."""
    scale, scaling = spec.mla.qk_head_dim ** -0.5, spec.rope_scaling
    if scaling and rope_type_of(scaling) == "yarn" and scaling.get("mscale_all_dim"):
        mscale = yarn_mscale(yarn_factor(scaling, spec.max_position_embeddings), float(scaling["mscale_all_dim"]))
        scale *= mscale * mscale
    return scale


class LatentUpProjection(ColumnParallelLinear):
    """kv_b_proj, this rank's heads: [heads x (qk_nope_head_dim + v_head_dim), kv_lora_rank]. Never
    applied to the latents; read as a weight by MLAttention, so it is left unpacked."""

    packable_weight = False


class MLAttention(nn.Module):
    """One layer's multi-head latent attention, this rank's heads (see the module docstring)."""

    batch_invariant = False  # the per-head products through batch_invariant.linear

    def __init__(self, spec: ModelSpec, tp_group, dtype: torch.dtype, sliding_window: int | None = None):
        super().__init__()
        if sliding_window is not None:
            raise ConfigError("multi-head latent attention (DeepSeek) has no sliding-window form")
        m, h = spec.mla, spec.hidden_size
        self.mla = m
        self.q_proj = self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        if m.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(h, spec.num_heads * m.qk_head_dim, tp_group, dtype=dtype)
        else:
            self.q_a_proj = ReplicatedLinear(h, m.q_lora_rank, dtype=dtype)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS, dtype=dtype)
            self.q_b_proj = ColumnParallelLinear(m.q_lora_rank, spec.num_heads * m.qk_head_dim, tp_group,
                                                 dtype=dtype)
        self.kv_a_proj_with_mqa = ReplicatedLinear(h, m.cache_width, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS, dtype=dtype)
        self.kv_b_proj = LatentUpProjection(m.kv_lora_rank, spec.num_heads * (m.qk_nope_head_dim + m.v_head_dim),
                                            tp_group, dtype=dtype)
        self.o_proj = RowParallelLinear(spec.num_heads * m.v_head_dim, h, tp_group, dtype=dtype)
        self.heads = spec.num_heads // tp_group.world_size
        self.attn = Attention(self.heads, 1, m.cache_width, softmax_scale(spec),
                              head_dim_v=m.kv_lora_rank)
        self.rotate = rotate_interleaved if m.rope_interleave else apply_rotary

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor,
                attn: AttentionMetadata | None):
        """`hidden` [N, H] packed tokens with `attn`, or [B, T, H] rows without (no cache)."""
        m, lead = self.mla, hidden.shape[:-1]
        q = self.q_proj(hidden) if self.q_proj is not None else \
            self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q_nope, q_rope = q.view(*lead, self.heads, m.qk_head_dim).split([m.qk_nope_head_dim, m.qk_rope_head_dim],
                                                                          dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(hidden).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        k_rope = self.rotate(k_rope.unsqueeze(-2), *rope)  # one key head shared by all heads
        w_key, w_value = self.kv_b_proj.weight.view(self.heads, -1, m.kv_lora_rank).split(
            [m.qk_nope_head_dim, m.v_head_dim], dim=1)
        # Each head's query scores latents: q_nope . (W_key latent) == (W_key^T q_nope) . latent.
        query = torch.cat([self.per_head(q_nope, w_key.transpose(1, 2)), self.rotate(q_rope, *rope)], dim=-1)
        key = torch.cat([self.kv_a_layernorm(latent).unsqueeze(-2), k_rope], dim=-1)
        mixed = self.attn(query, key, key[..., :m.kv_lora_rank], attn).view(*lead, self.heads, m.kv_lora_rank)
        values = self.per_head(mixed, w_value)  # each head's values from its latent mix
        return self.o_proj(values.reshape(*lead, self.heads * m.v_head_dim))

    def per_head(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [..., heads, K], weights [heads, N, K] -> [..., heads, N]: head h's rows times W_h^T."""
        if not self.batch_invariant:
            return torch.einsum("...hk,hnk->...hn", x, weights)
        return torch.stack([bi.linear(x[..., h, :], weights[h]) for h in range(self.heads)], dim=-2)


class DeepseekDecoderLayer(LlamaDecoderLayer):
    attention_class = MLAttention


class DeepseekModel(LlamaModel):
    decoder_layer = DeepseekDecoderLayer


class DeepseekForCausalLM(CausalLM):
    """CausalLM with MLAttention layers and a latent KV cache: per token and layer one
    `kv_lora_rank + qk_rope_head_dim` vector, whatever the heads or the TP size."""

    model_class = DeepseekModel

    def kv_bytes_per_token(self) -> int:
        """The latent and the rotary key of one token in every layer of this stage."""
        return self.spec.mla.cache_width * len(self.model.layers) * self.dtype.itemsize

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        return (num_blocks, block_size, 1, self.spec.mla.cache_width)

    def allocate_kv_cache(self, num_blocks: int, block_size: int, zeros=torch.zeros) -> None:
        """One zeroed latent cache per layer, bound as both its K and its V cache (the values
        are the keys' first kv_lora_rank channels)."""
        shape = self.kv_cache_shape(num_blocks, block_size)
        caches = [zeros(shape, dtype=self.dtype, device=self.device) for _ in self._attention_layers()]
        self.bind_kv_cache([(cache, cache) for cache in caches])
