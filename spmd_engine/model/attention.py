"""Attention over a slot-addressed KV cache, with torch SDPA.

The cache of one layer is two tensors [num_slots, kv_heads, max_model_len,
head_dim]; a sequence owns one slot for its lifetime and its token at position
p lives at [slot, :, p]. One step's batch is right-padded to T tokens and
described by `AttentionMetadata`; mixed batches (some rows prefilling many
tokens, others decoding one) go through the same vectorised path, with no
Python loop over sequences: scatter the valid new K/V, gather each row's
cached prefix, attend under a position mask. A step of new prompts only
(every row from position 0) needs neither: each row attends causally to its
own new tokens, and right padding cannot reach a real token (measured: same
bits, 1.3-2.7x faster, and no [B, T, L] mask for long prompts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class CachePlan:
    """Index tensors derived once per step and shared by every layer."""

    valid: torch.Tensor  # [B, T] bool: token t of row b is real (t < query_len)
    # `valid` as indices, computed once, so layers gather without a device sync
    rows: torch.Tensor  # [N] batch row of each real token
    cols: torch.Tensor  # [N] its column
    write_slots: torch.Tensor  # [N] slot of each real token
    write_positions: torch.Tensor  # [N] its position in the cache
    positions: torch.Tensor  # [B, T] position of each token of the step
    kv_len: int  # L: longest cached prefix after this step's writes
    slot_prefix: int | None = None  # B when slots are exactly 0..B-1: read the cache by slicing, no gather
    # Every row starts at position 0 (a prefill step of new prompts): each row attends
    # only to its own new tokens, causally, and right padding cannot reach a real token.
    fresh: bool = False
    _masks: dict = field(default_factory=dict, repr=False)

    def grouped_mask(self, group: int) -> torch.Tensor:
        """Query t may attend cached key j (j <= its position), with `group` query heads
        per KV head folded into the token axis: [B, 1, group * T, L]; built once per
        step, not once per layer, and only when a layer needs it."""
        if group not in self._masks:
            B, T = self.positions.shape
            keys = torch.arange(self.kv_len, device=self.positions.device)
            mask = keys.view(1, 1, -1) <= self.positions.unsqueeze(-1)  # [B, T, L]; padded rows see >= key 0
            self._masks[group] = mask.unsqueeze(1).unsqueeze(1).expand(B, 1, group, T, self.kv_len).reshape(
                B, 1, group * T, self.kv_len)
        return self._masks[group]


@dataclass
class AttentionMetadata:
    """What the model needs to know about the cache for one forward step.

    slots[b]: the KV cache slot of row b; context_lens[b]: tokens of that
    sequence already cached before this step; query_lens[b]: its new tokens this
    step (<= T; the input is right-padded). New K/V go to
    cache[slot, :, context_len : context_len + query_len], and the query at
    position p attends its own sequence's cached keys at positions <= p.
    """

    slots: torch.Tensor
    context_lens: torch.Tensor
    query_lens: torch.Tensor
    _plan: CachePlan | None = field(default=None, init=False, repr=False, compare=False)

    def plan(self, num_tokens: int) -> CachePlan:
        if self._plan is None or self._plan.valid.shape[1] != num_tokens:
            self._plan = _build_plan(self.slots, self.context_lens, self.query_lens, num_tokens)
        return self._plan


def _build_plan(slots: torch.Tensor, context_lens: torch.Tensor, query_lens: torch.Tensor, T: int) -> CachePlan:
    device = slots.device
    steps = torch.arange(T, device=device)
    valid = steps.unsqueeze(0) < query_lens.unsqueeze(1)
    positions = context_lens.unsqueeze(1) + steps.unsqueeze(0)  # [B, T]
    kv_len = int((context_lens + query_lens).max()) if slots.numel() else 0
    rows, cols = valid.nonzero(as_tuple=True)
    B = slots.numel()
    prefix = B if B and bool((slots == torch.arange(B, device=device)).all()) else None
    return CachePlan(
        valid=valid,
        rows=rows,
        cols=cols,
        write_slots=slots[rows],
        write_positions=positions[rows, cols],
        positions=positions,
        kv_len=kv_len,
        slot_prefix=prefix,
        fresh=B > 0 and bool((context_lens == 0).all()),
    )


class Attention(nn.Module):
    """Multi-head / grouped-query attention for this rank's heads, owning its cache.

    q: [B, T, num_heads, D], k and v: [B, T, num_kv_heads, D] (after RoPE).
    With `attn=None` there is no cache: plain causal attention within each row
    (training, references). Returns [B, T, num_heads * D].
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads evenly")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def allocate_kv_cache(self, num_slots: int, max_model_len: int, dtype: torch.dtype, device) -> None:
        shape = (num_slots, self.num_kv_heads, max_model_len, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn: AttentionMetadata | None):
        B, T = q.shape[:2]
        if attn is None:
            out = self._causal(q, k, v)
        else:
            out = self._cached(q, k, v, attn.plan(T), attn.slots)
        return out.reshape(B, T, self.num_heads * self.head_dim)

    def _causal(self, q, k, v) -> torch.Tensor:
        group = self.num_heads // self.num_kv_heads
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [B, heads, T, D]
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return out.transpose(1, 2)

    def _cached(self, q, k, v, plan: CachePlan, slots: torch.Tensor) -> torch.Tensor:
        if self.k_cache is None:
            raise RuntimeError("KV cache not allocated: call model.allocate_kv_cache(num_slots, max_model_len)")
        self.k_cache[plan.write_slots, :, plan.write_positions] = k[plan.rows, plan.cols]
        self.v_cache[plan.write_slots, :, plan.write_positions] = v[plan.rows, plan.cols]
        if plan.fresh:  # no cached prefix to read and no [B, T, L] mask to build
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True, scale=self.scale, enable_gqa=True)
            return out.transpose(1, 2)
        if plan.slot_prefix is not None:  # views, no copy of every row's cached prefix
            keys = self.k_cache[: plan.slot_prefix, :, : plan.kv_len]  # [B, kv_heads, L, D]
            values = self.v_cache[: plan.slot_prefix, :, : plan.kv_len]
        else:
            keys = self.k_cache[slots, :, : plan.kv_len]  # [B, kv_heads, L, D]
            values = self.v_cache[slots, :, : plan.kv_len]
        # Grouped-query attention without copying K/V per query head: fold the
        # query heads sharing a KV head into the token axis, [B, kv, group*T, D].
        B, T = q.shape[:2]
        group = self.num_heads // self.num_kv_heads
        q = q.permute(0, 2, 1, 3).reshape(B, self.num_kv_heads, group * T, self.head_dim)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=plan.grouped_mask(group), scale=self.scale)
        return out.reshape(B, self.num_heads, T, self.head_dim).transpose(1, 2)
