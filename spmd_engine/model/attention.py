"""Attention over a paged KV cache, with plain torch SDPA (CPU and CUDA alike).

A layer's cache is two tensors [num_blocks, block_size, kv_heads, head_dim].
A step's tokens arrive packed, [N, heads, head_dim], with no padding: each
request contributes the tokens it computes this step (a whole prompt, a chunk
of one, or one decode token). Each token's K/V goes to its slot
(`slot_mapping`: block * block_size + offset) before any row reads the
cache, so a request may share blocks another request fills in the same step.

SDPA wants rectangular batches, so the step's requests are grouped
(`RowGroup`): requests with nothing cached yet (fresh prompts) attend causally
to their own new tokens, no cache read and no mask; the others (decodes,
later chunks, prefix-cache hits) gather their blocks and attend under a
position mask. Within each kind, requests of similar query length share a
group, padded to its longest, so one long prompt does not pad every decode
to its length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

PAD_LIMIT = 1.25  # a group's padded queries may exceed its real ones by at most this factor


@dataclass
class RowGroup:
    """Some of a step's requests, attended in one SDPA call with queries padded to T."""

    token_index: torch.Tensor  # [n] packed index of each real query token of the group
    pad_index: torch.Tensor  # [n] where it sits in the group's padded [G * T] layout
    num_rows: int  # G
    width: int  # T
    in_order: bool  # token_index == pad_index == 0..n-1: no gather or scatter needed
    block_tables: torch.Tensor | None = None  # [G, nb] (cached groups): the blocks to read
    mask: torch.Tensor | None = None  # [G, 1, T, nb * block_size]: query t may see key j


@dataclass
class AttentionMetadata:
    """What every layer needs to write and read the cache in one step; built once per step."""

    slot_mapping: torch.Tensor  # [N] cache slot of each new token
    groups: list[RowGroup]
    num_tokens: int
    positions: torch.Tensor | None = None  # [N] position of each new token in its sequence

    @classmethod
    def build(cls, context_lens: Sequence[int], query_lens: Sequence[int],
              block_tables: Sequence[Sequence[int]], block_size: int, device) -> "AttentionMetadata":
        """From each request's cached length, new-token count and block table."""
        B = len(query_lens)
        starts = [0] * B
        for b in range(1, B):
            starts[b] = starts[b - 1] + query_lens[b - 1]
        n = starts[-1] + query_lens[-1] if B else 0
        width = max((len(t) for t in block_tables), default=1) or 1
        table = torch.tensor([list(t) + [0] * (width - len(t)) for t in block_tables], dtype=torch.long)
        row = torch.repeat_interleave(torch.arange(B), torch.tensor(query_lens))
        pos = torch.arange(n) - torch.tensor(starts)[row] + torch.tensor(context_lens)[row]
        slots = table[row, pos // block_size] * block_size + pos % block_size
        fresh = [b for b in range(B) if context_lens[b] == 0]
        cached = [b for b in range(B) if context_lens[b] > 0]
        groups = [_group(rows, starts, context_lens, query_lens, None, block_size, n, device)
                  for rows in _bucket(fresh, query_lens)]
        groups += [_group(rows, starts, context_lens, query_lens, table, block_size, n, device)
                   for rows in _bucket(cached, query_lens)]
        return cls(slot_mapping=slots.to(device), groups=groups, num_tokens=n, positions=pos.to(device))


def _bucket(rows: list[int], query_lens: Sequence[int]) -> list[list[int]]:
    """Rows by query length, longest first, cut so padding stays within PAD_LIMIT."""
    order = sorted(rows, key=lambda b: (-query_lens[b], b))
    buckets: list[list[int]] = []
    real = 0
    for b in order:
        if buckets and (len(buckets[-1]) + 1) * query_lens[buckets[-1][0]] <= PAD_LIMIT * (real + query_lens[b]):
            buckets[-1].append(b)
            real += query_lens[b]
        else:
            buckets.append([b])
            real = query_lens[b]
    return buckets


def _group(rows, starts, context_lens, query_lens, table, block_size, n, device) -> RowGroup:
    T = max(query_lens[b] for b in rows)
    token_index = torch.cat([torch.arange(starts[b], starts[b] + query_lens[b]) for b in rows])
    pad_index = torch.cat([torch.arange(g * T, g * T + query_lens[b]) for g, b in enumerate(rows)])
    # Every row full width and the rows back to back: the packed tokens are the padded layout.
    in_order = len(rows) * T == n == len(token_index) and bool((token_index == torch.arange(n)).all())
    group = RowGroup(token_index.to(device), pad_index.to(device), len(rows), T, in_order)
    if table is not None:
        ctx = torch.tensor([context_lens[b] for b in rows])
        seq_lens = ctx + torch.tensor([query_lens[b] for b in rows])
        nb = -(-int(seq_lens.max()) // block_size)
        group.block_tables = table[rows, :nb].to(device)
        keys = torch.arange(nb * block_size)
        # Query t of a row sits at position ctx + t and sees keys 0..ctx + t. Padded queries
        # see key 0 at least (no all-masked row, no NaN); their outputs are dropped.
        group.mask = (keys.view(1, 1, -1) <= (ctx.view(-1, 1, 1) + torch.arange(T).view(1, -1, 1))).unsqueeze(1)
        group.mask = group.mask.to(device)
    return group


class Attention(nn.Module):
    """Multi-head / grouped-query attention for this rank's heads, owning its cache.

    With metadata: q [N, num_heads, D], k and v [N, num_kv_heads, D] packed
    tokens (after RoPE); returns [N, num_heads * D]. With `attn=None` there
    is no cache: batched [B, T, heads, D] inputs attend causally within each
    row (training, references); returns [B, T, num_heads * D].
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

    def allocate_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype, device) -> None:
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        self.set_kv_cache(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    def set_kv_cache(self, k_cache: torch.Tensor | None, v_cache: torch.Tensor | None) -> None:
        """[num_blocks, block_size, num_kv_heads, head_dim] each, or None to drop the cache."""
        self.k_cache, self.v_cache = k_cache, v_cache

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn: AttentionMetadata | None):
        if attn is None:
            B, T = q.shape[:2]
            return self._causal(q, k, v).reshape(B, T, self.num_heads * self.head_dim)
        if self.k_cache is None:
            raise RuntimeError("KV cache not allocated: the model runner allocates it before the first step")
        D = self.head_dim
        self.k_cache.view(-1, self.num_kv_heads, D).index_copy_(0, attn.slot_mapping, k)
        self.v_cache.view(-1, self.num_kv_heads, D).index_copy_(0, attn.slot_mapping, v)
        if len(attn.groups) == 1 and attn.groups[0].in_order:
            return self._attend(q, k, v, attn.groups[0]).reshape(attn.num_tokens, -1)
        out = q.new_empty(attn.num_tokens, self.num_heads, D)
        for group in attn.groups:
            out[group.token_index] = self._attend(q, k, v, group)
        return out.reshape(attn.num_tokens, -1)

    def _causal(self, q, k, v) -> torch.Tensor:
        group = self.num_heads // self.num_kv_heads
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [B, heads, T, D]
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return out.transpose(1, 2)

    def _attend(self, q, k, v, g: RowGroup) -> torch.Tensor:
        """The group's real query tokens' outputs, [n, heads, D], in token_index order."""
        G, T, D = g.num_rows, g.width, self.head_dim
        qg = self._padded(q, g)
        if g.block_tables is None:  # fresh prompts: causal over their own new tokens
            out = F.scaled_dot_product_attention(qg, self._padded(k, g), self._padded(v, g),
                                                 is_causal=True, scale=self.scale, enable_gqa=True)
        else:
            L = g.mask.shape[-1]
            keys = self.k_cache[g.block_tables].view(G, L, self.num_kv_heads, D).transpose(1, 2)
            values = self.v_cache[g.block_tables].view(G, L, self.num_kv_heads, D).transpose(1, 2)
            out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=g.mask, scale=self.scale,
                                                 enable_gqa=True)
        out = out.transpose(1, 2).reshape(G * T, self.num_heads, D)
        return out if g.in_order else out[g.pad_index]

    @staticmethod
    def _padded(x: torch.Tensor, g: RowGroup) -> torch.Tensor:
        """x [N, heads, D] -> the group's [G, heads, T, D], zeros where a row is shorter."""
        if g.in_order:
            return x.view(g.num_rows, g.width, *x.shape[1:]).transpose(1, 2)
        padded = x.new_zeros(g.num_rows * g.width, *x.shape[1:])
        padded[g.pad_index] = x[g.token_index]
        return padded.view(g.num_rows, g.width, *x.shape[1:]).transpose(1, 2)
