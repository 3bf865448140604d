"""Attention sinks (gpt-oss): a learned logit per query head that joins every query's softmax
denominator and contributes no value, so a head can attend to "nothing".

    p_j = exp(s_j) / (sum_i exp(s_i) + exp(sink_h)),   out = sum_j p_j v_j

No fused SDPA or the decode kernel takes such a term, so an Attention layer with sinks routes
every path here: the eager paged step (each RowGroup's masked scores, written out), the
compiled forward's opaque op (`spmd_engine::sink_attention`, its metadata read from
forward_context as the plain op's is), a decode-shaped step traced into a compiled graph (the
same written-out scores over its DecodeStep) and batch-invariant tiles (batch_invariant.attend
with the sinks in its denominator). The scores are float32 whatever the model's dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from spmd_engine import forward_context
from spmd_engine.model.layers import batch_invariant as bi
from spmd_engine.model.shard import Loaded, check_shape, copy_into, divide, read_range


class AttentionSinks(nn.Module):
    """This rank's heads' sink logits, [num_heads / TP]: query heads split evenly over TP in
    order (QKVParallelLinear's), so rank r holds heads [r * n, (r + 1) * n) of the checkpoint's."""

    def __init__(self, num_heads: int, tp_group, dtype: torch.dtype | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.per_rank = divide(num_heads, tp_group.world_size, "num_attention_heads")
        self.tp_rank = tp_group.rank_in_group
        self.weight = nn.Parameter(torch.empty(self.per_rank, dtype=dtype), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id=None) -> None:
        check_shape(loaded, (self.num_heads,), "attention sinks")
        n = self.per_rank
        copy_into(param.data, read_range(loaded, 0, self.tp_rank * n, (self.tp_rank + 1) * n))


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
           sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """q [G, heads, T, D]; keys, values [G, kv, L, D]; visible: bool, broadcastable to
    [G, heads, T, L]; sinks [heads]. Returns [G, heads, T, D] in q's dtype. Query head h reads
    KV head h // (heads / kv), as transformers' repeat_kv pairs them."""
    G, heads, T, D = q.shape
    kv, L = keys.shape[1], keys.shape[2]
    folded = q.float().reshape(G, kv, (heads // kv) * T, D)
    scores = (folded @ keys.float().transpose(-1, -2) * scale).view(G, heads, T, L)
    scores = scores.masked_fill(~visible, float("-inf"))
    sink = sinks.float().view(1, heads, 1, 1).expand(G, heads, T, 1)
    p = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :L]
    out = p.reshape(G, kv, (heads // kv) * T, L) @ values.float()
    return out.view(G, heads, T, D).to(q.dtype)


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, scale: float,
           window: int | None = None) -> torch.Tensor:
    """No cache: rows [B, T, heads, D] attend causally (within `window`) to themselves -> [B, T, heads, D]."""
    visible = _causal_mask(q.shape[1], window, q.device)
    return attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), visible, sinks, scale).transpose(1, 2)


def _causal_mask(T: int, window: int | None, device) -> torch.Tensor:
    """[T, T]: query t sees keys t - window < j <= t (window None: all j <= t)."""
    t = torch.arange(T, device=device)
    diff = t.view(-1, 1) - t.view(1, -1)
    return (diff >= 0) if window is None else (diff >= 0) & (diff < window)


def paged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
          attn, sinks: torch.Tensor, scale: float, window: int | None = None) -> torch.Tensor:
    """attention.paged_attention's contract with sinks: write the step's K/V, then attend; q [N,
    heads, D], k and v [N, kv, D]; `attn` AttentionMetadata or a DecodeStep's tuple (a traced
    decode graph); `window` the layer's sliding window. Returns [N, heads * D]."""
    from spmd_engine.model.layers.attention import _padded
    heads, kv, D = q.shape[1], k.shape[1], q.shape[2]
    if isinstance(attn, tuple):
        return _decode(q, k, v, k_cache, v_cache, attn, sinks, scale, window)
    if attn.slot_mapping is not None:  # None: a dummy step (DP waves) writes nothing
        k_cache.view(-1, kv, D).index_copy_(0, attn.slot_mapping, k)
        v_cache.view(-1, kv, D).index_copy_(0, attn.slot_mapping, v)
    if attn.tiles is not None:
        out = bi.attend(q, k_cache.view(-1, kv, D), v_cache.view(-1, kv, D), attn.tiles.plan(heads // kv), scale,
                        window, sinks)
        return out.reshape(attn.num_tokens, heads * D)
    outs = []
    for g in attn.groups:
        G, T = g.num_rows, g.width
        qg = _padded(q[g.start:g.end], g)  # [G, heads, T, D]
        if g.block_tables is None:  # fresh prompts: their own new tokens, causally
            keys, values = _padded(k[g.start:g.end], g), _padded(v[g.start:g.end], g)
            visible = _causal_mask(T, window, q.device)
        else:
            L = g.block_tables.shape[1] * k_cache.shape[1]
            blocks = g.block_tables.reshape(-1)
            keys = k_cache.index_select(0, blocks).view(G, L, kv, D).transpose(1, 2)
            values = v_cache.index_select(0, blocks).view(G, L, kv, D).transpose(1, 2)
            visible = g.window_mask(window)  # [G, 1, T, L]
        out = attend(qg, keys, values, visible, sinks, scale).transpose(1, 2).reshape(G * T, heads, D)
        outs.append(out if g.pad_index is None else out[g.pad_index])
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.reshape(attn.num_tokens, heads * D)


def _decode(q, k, v, k_cache, v_cache, step, sinks, scale, window) -> torch.Tensor:
    """A decode-shaped step from its tensors alone (traceable): each token over its block
    table's keys before its sequence length."""
    slots, block_tables, seq_lens = step
    N, heads, D = q.shape
    kv, block_size, nb = k.shape[1], k_cache.shape[1], block_tables.shape[1]
    k_cache.view(-1, kv, D).index_copy_(0, slots, k)
    v_cache.view(-1, kv, D).index_copy_(0, slots, v)
    L = nb * block_size
    keys = k_cache[block_tables].view(N, L, kv, D).transpose(1, 2)
    values = v_cache[block_tables].view(N, L, kv, D).transpose(1, 2)
    keys_at = torch.arange(L, device=q.device).view(1, L)
    visible = keys_at < seq_lens.view(N, 1)
    if window is not None:
        visible = visible & (keys_at >= seq_lens.view(N, 1) - window)
    visible = visible.view(N, 1, 1, L)
    return attend(q.unsqueeze(2), keys, values, visible, sinks, scale).reshape(N, heads * D)


# The compiled forward's opaque op for a layer with sinks (attention.py's `attention` op, plus
# the sinks): its metadata comes from forward_context, the cache is written in place.
_lib = torch.library.Library("spmd_engine", "FRAGMENT")
_lib.define("sink_attention(Tensor q, Tensor k, Tensor v, Tensor k_cache, Tensor v_cache, Tensor sinks, "
            "float scale, int window=0) -> Tensor")  # window: the layer's sliding window, 0 for none


def _sink_attention_op(q, k, v, k_cache, v_cache, sinks, scale, window=0):
    return paged(q, k, v, k_cache, v_cache, forward_context.attn_metadata().for_window(window or None), sinks, scale, window or None).contiguous()


_lib.impl("sink_attention", _sink_attention_op, "CompositeExplicitAutograd")


@torch.library.register_fake("spmd_engine::sink_attention")
def _sink_attention_fake(q, k, v, k_cache, v_cache, sinks, scale, window=0):
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
