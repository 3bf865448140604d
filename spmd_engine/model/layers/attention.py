"""Attention over a paged KV cache, with plain torch SDPA (CPU and CUDA alike).

A layer's cache is two tensors [num_blocks, block_size, kv_heads, head_dim].
A step's tokens arrive packed, [N, heads, head_dim], with no padding: each
request contributes the tokens it computes this step (a whole prompt, a chunk
of one, or one decode token), in the order AttentionMetadata chose. Each token's K/V goes to its slot
(`slot_mapping`: block * block_size + offset) before any row reads the
cache, so a request may share blocks another request fills in the same step.

SDPA wants rectangular batches, so the step's requests are grouped
(`RowGroup`): requests with nothing cached yet (fresh prompts) attend causally
to their own new tokens, no cache read and no mask; the others (decodes,
later chunks, prefix-cache hits) gather their blocks and attend under a
position mask. Within each kind, requests of similar query length share a
group, padded to its longest, so one long prompt does not pad every decode
to its length.

A sliding-window layer (`Attention(sliding_window=W)`, Mistral, Gemma 3, gpt-oss) lets a
query at position p see keys p - W < j <= p only (transformers' sliding_window_overlay).
Layers of one model differ in window while the step's metadata is shared, so the window is
the layer's argument to every path, and masks for it are made once per step and window
(`RowGroup.window_mask`). Keys out of a query's window are masked, never read as values,
so a freed block (block 0 in its place in the table) there is harmless.

In batch-invariant mode (`invariant=True`) every query instead reads its keys from the cache
(its own new ones included, written first) in tiles that batch_invariant.attention computes
the same way whatever else is in the step: a prompt whole, in chunks, or after a prefix hit,
and a decode token, all meet one recipe.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from spmd_engine import forward_context
from spmd_engine.forward_context import COMPILED
from spmd_engine.kernels import decode_attention as decode_kernel
from spmd_engine.model.layers import batch_invariant as bi
from spmd_engine.model.layers import sink_attention

PAD_LIMIT = 1.25  # a group's padded queries may exceed its real ones by at most this factor


@dataclass
class RowGroup:
    """Requests attended in one SDPA call: their tokens are packed[start:end], rows padded to T."""

    start: int
    end: int
    num_rows: int  # G
    width: int  # T
    pad_index: torch.Tensor | None  # [end - start] slot of each token in [G * T]; None: rows are full width
    block_tables: torch.Tensor | None = None  # [G, nb] (cached groups): the blocks to read
    query_pos: torch.Tensor | None = None  # [G, T] (cached groups): each query's position
    # How to make `mask` when first read: a decode step that the compiled graph (or the kernel)
    # runs never reads it, and its three small tensor ops cost tens of us cold.
    make_mask: Callable[[], torch.Tensor] | None = field(default=None, repr=False, compare=False)
    _mask: torch.Tensor | None = field(default=None, repr=False, compare=False)
    _folded: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def mask(self) -> torch.Tensor | None:
        """[G, 1, T, nb * block_size] (cached groups): query t may see key j; None for fresh ones."""
        if self._mask is None and self.make_mask is not None:
            self._mask = self.make_mask()
        return self._mask

    @mask.setter
    def mask(self, value: torch.Tensor | None) -> None:
        self._mask = value

    def window_mask(self, window: int | None, device=None) -> torch.Tensor | None:
        """`mask` for a layer of sliding window `window` (None: `mask` itself): built once per step
        and window. A fresh group's is [1, 1, T, T] (causal within the window), None while its
        rows are no longer than the window (causal alone is the same)."""
        if window is None:
            return self.mask
        key = ("window", window)
        if key not in self._folded:
            if self.block_tables is None:
                t = torch.arange(self.width, device=device)
                diff = t.view(-1, 1) - t.view(1, -1)  # query - key
                self._folded[key] = None if self.width <= window else ((diff >= 0) & (diff < window)).view(
                    1, 1, self.width, self.width)
            else:
                keys = torch.arange(self.mask.shape[-1], device=self.mask.device)
                pos = self.query_pos.unsqueeze(-1)  # [G, T, 1]
                self._folded[key] = self.mask & (keys.view(1, 1, -1) > pos - window).unsqueeze(1)
        return self._folded[key]

    def folded_mask(self, group: int, window: int | None = None) -> torch.Tensor:
        """The mask for `group` query heads per KV head folded into the query axis,
        [G, 1, group * T, L]; built once per step and window (every layer has the same group)."""
        mask = self.window_mask(window)
        if self.width == 1:
            return mask  # [G, 1, 1, L] broadcasts over the folded heads
        if (group, window) not in self._folded:
            G, _, T, L = mask.shape
            self._folded[(group, window)] = mask.unsqueeze(2).expand(G, 1, group, T, L).reshape(G, 1, group * T, L)
        return self._folded[(group, window)]


@dataclass
class InvariantTiles:
    """Batch-invariant mode: the step's queries as batch_invariant tiles over the cache, planned
    once per step for each number of query heads per KV head (every layer has the same)."""

    context_lens: Sequence[int]
    query_lens: Sequence[int]
    row_start: Sequence[int]
    table: torch.Tensor  # [B, width] block table
    block_size: int
    device: object
    _plans: dict = field(default_factory=dict, repr=False, compare=False)

    def plan(self, group: int) -> bi.TilePlan:
        if group not in self._plans:
            table, bs = self.table, self.block_size
            def slots(seq, pos):  # cache slot of each sequence's key at each position
                return table[seq][:, (pos // bs).clamp(max=table.shape[1] - 1)] * bs + pos % bs
            self._plans[group] = bi.plan_tiles(self.context_lens, self.query_lens, self.row_start, slots,
                                               group, self.device)
        return self._plans[group]


class DecodeStep(NamedTuple):
    """A decode-shaped step's metadata as tensors, for the compiled forward to trace attention
    (decode_attention) instead of calling the opaque op: every request has one new token and a
    cache to read. Tensors, not Python numbers, so one graph serves any batch and context."""

    slots: torch.Tensor  # [N] cache slot of each token's K/V
    block_tables: torch.Tensor  # [N, nb] blocks each token reads, nb >= 2 (padding: block 0, masked)
    seq_lens: torch.Tensor  # [N] keys each token sees (its position + 1)


@dataclass
class AttentionMetadata:
    """What every layer needs to write and read the cache in one step; built once per step.

    The step's tokens are packed group by group (`row_order`), so each group is one
    contiguous slice: a group of equal-length rows (all decodes, `n` copies of a prompt)
    is a view, with no gather or scatter.
    """

    slot_mapping: torch.Tensor | None  # [N] cache slot of each new token; None: write nothing
    groups: list[RowGroup]
    num_tokens: int
    positions: torch.Tensor  # [N] position of each new token in its sequence
    row_order: list[int]  # the requests (scheduler rows) in packed order
    row_start: list[int]  # where each request's tokens start in the packed step, by scheduler row
    query_lens: list[int]
    tiles: InvariantTiles | None = None  # batch-invariant mode: the one attention recipe
    known_lens: list[int] | None = None  # by scheduler row, a request's tokens before the step (longrope.py)
    # A KV cache of several groups (core/kv_groups.py): each group's own metadata (its block
    # tables and slots) by the window of its layers; each layer takes its group's (`for_window`).
    by_window: dict | None = None
    _decode: list = field(default_factory=list, repr=False, compare=False)

    def decode_step(self) -> DecodeStep | None:
        """This step as a DecodeStep if it is decode-shaped (one new token for each request, every
        one with a cache, writing its K/V: `build` made it), else None. None for a step of several
        KV groups: a DecodeStep carries one block table, and the decode graphs and compiled
        decode layers that take it whole would give every layer the same."""
        if self.slot_mapping is None or not self._decode or self.by_window is not None:
            return None
        return self._decode[0]

    def for_window(self, window: int | None) -> "AttentionMetadata":
        """The metadata of the KV group whose layers have sliding window `window`."""
        return self if self.by_window is None else self.by_window[window]

    @classmethod
    def build(cls, context_lens: Sequence[int], query_lens: Sequence[int],
              block_tables: Sequence[Sequence[int]], block_size: int, device,
              invariant: bool = False) -> "AttentionMetadata":
        """From each request's cached length, new-token count and block table (scheduler order)."""
        if not invariant and query_lens and all(q == 1 for q in query_lens) and all(context_lens):
            return cls._decode_shaped(context_lens, block_tables, block_size, device)
        return cls._general(context_lens, query_lens, block_tables, block_size, device, invariant)

    @classmethod
    def _general(cls, context_lens, query_lens, block_tables, block_size, device, invariant) -> "AttentionMetadata":
        B = len(query_lens)
        fresh = [b for b in range(B) if context_lens[b] == 0]
        cached = [b for b in range(B) if context_lens[b] > 0]
        buckets = [(rows, False) for rows in _bucket(fresh, query_lens)]
        buckets += [(rows, True) for rows in _bucket(cached, query_lens)]
        order = [b for rows, _ in buckets for b in rows]
        row_start, at = [0] * B, 0
        for b in order:
            row_start[b] = at
            at += query_lens[b]
        n = at
        width = max((len(t) for t in block_tables), default=1) or 1
        table = torch.tensor([list(t) + [0] * (width - len(t)) for t in block_tables], dtype=torch.long)
        row = torch.repeat_interleave(torch.tensor(order, dtype=torch.long),
                                      torch.tensor([query_lens[b] for b in order], dtype=torch.long))
        pos = torch.arange(n) - torch.tensor(row_start)[row] + torch.tensor(context_lens, dtype=torch.long)[row]
        slots = table[row, pos // block_size] * block_size + pos % block_size
        tiles = InvariantTiles(list(context_lens), list(query_lens), row_start, table, block_size, device) \
            if invariant else None
        groups = [] if invariant else [
            _group(rows, row_start, context_lens, query_lens, table if is_cached else None, block_size, device)
            for rows, is_cached in buckets]
        return cls(slot_mapping=slots.to(device), groups=groups, num_tokens=n, positions=pos.to(device),
                   row_order=order, row_start=row_start, query_lens=list(query_lens), tiles=tiles)

    @classmethod
    def _decode_shaped(cls, context_lens: Sequence[int], block_tables: Sequence[Sequence[int]], block_size: int,
                       device) -> "AttentionMetadata":
        """`build` for a step of one new token per cached request (most steps of a generation), from
        Python lists in two tensor constructions: the general path's dozen small tensor ops cost
        more than the decode graph's attention (docs/performance.md). The same metadata: one
        cached group in scheduler order, block tables [B, nb] cut to the blocks any token reads,
        and the DecodeStep (its tables padded to 2 blocks at least) built with it."""
        B = len(context_lens)
        nb = -(-(max(context_lens) + 1) // block_size)
        width = max(nb, 2)
        rows = [list(table[:nb]) + [0] * (width - min(nb, len(table))) for table in block_tables]
        slots = [rows[b][c // block_size] * block_size + c % block_size for b, c in enumerate(context_lens)]
        per_token = torch.tensor([slots, list(context_lens), [c + 1 for c in context_lens]], dtype=torch.long)
        table = torch.tensor(rows, dtype=torch.long)
        if torch.device(device).type != "cpu":
            per_token, table = per_token.to(device), table.to(device)
        slots_t, positions, seq_lens = per_token.unbind(0)

        def make_mask():  # each token sees the keys up to its own position
            keys = torch.arange(nb * block_size, device=positions.device)
            return (keys.view(1, -1) <= positions.view(-1, 1)).view(B, 1, 1, -1)
        group = RowGroup(0, B, B, 1, None, block_tables=table[:, :nb], query_pos=positions.view(B, 1),
                         make_mask=make_mask)
        meta = cls(slot_mapping=slots_t, groups=[group], num_tokens=B, positions=positions,
                   row_order=list(range(B)), row_start=list(range(B)), query_lens=[1] * B)
        meta._decode.append(DecodeStep(slots_t, table, seq_lens))
        return meta

    def pack(self, per_row: Sequence):
        """Per-request sequences (lists or tensors, scheduler order) -> one packed list/tensor."""
        parts = [per_row[b] for b in self.row_order]
        if parts and isinstance(parts[0], torch.Tensor):
            return torch.cat(parts)
        return [x for part in parts for x in part]

    def to_row_order(self, packed: torch.Tensor) -> torch.Tensor:
        """Packed per-token rows back in scheduler order (for references and tests)."""
        index = [i for b in range(len(self.query_lens)) for i in range(self.row_start[b],
                                                                        self.row_start[b] + self.query_lens[b])]
        return packed[torch.tensor(index, dtype=torch.long, device=packed.device)]


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


def _group(rows, row_start, context_lens, query_lens, table, block_size, device) -> RowGroup:
    lens = [query_lens[b] for b in rows]
    T = max(lens)
    start = row_start[rows[0]]
    pad_index = None
    if any(q != T for q in lens):
        pad_index = torch.cat([torch.arange(g * T, g * T + q) for g, q in enumerate(lens)]).to(device)
    group = RowGroup(start, start + sum(lens), len(rows), T, pad_index)
    if table is not None:
        ctx = torch.tensor([context_lens[b] for b in rows], dtype=torch.long)
        nb = -(-int((ctx + torch.tensor(lens)).max()) // block_size)
        group.block_tables = table[rows, :nb].to(device)
        keys = torch.arange(nb * block_size)
        # Query t of a row sits at position ctx + t and sees keys 0..ctx + t. Padded queries
        # see key 0 at least (no all-masked row, no NaN); their outputs are dropped.
        pos = ctx.view(-1, 1) + torch.arange(T).view(1, -1)  # [G, T]
        mask = keys.view(1, 1, -1) <= pos.unsqueeze(-1)
        group.mask = mask.unsqueeze(1).to(device)
        group.query_pos = pos.to(device)
    return group


class Attention(nn.Module):
    """Multi-head / grouped-query attention for this rank's heads, owning its cache.

    With metadata: q [N, num_heads, D], k and v [N, num_kv_heads, D] packed
    tokens (after RoPE); returns [N, num_heads * D]. With `attn=None` there
    is no cache: batched [B, T, heads, D] inputs attend causally within each
    row (training, references); returns [B, T, num_heads * D]. `sliding_window`
    W: each query sees its last W keys (itself included) only; None: all. `sinks` (gpt-oss):
    an AttentionSinks module, its per-head logits in every softmax (sink_attention.py, which
    every path then goes through).

    With `head_dim_v` < head_dim the values are the first head_dim_v channels of the keys
    (DeepSeek's latent attention: the key is [latent, rotary key], the value the latent): one
    cache tensor is bound as both K and V cache, only the keys are written, and outputs are
    [..., num_heads * head_dim_v].
    """

    batch_invariant = False  # without a cache: batch_invariant.causal_attention

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, sinks: nn.Module | None = None,
                 head_dim_v: int | None = None):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads evenly")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window {sliding_window} must be at least 1")
        self.sliding_window = sliding_window
        self.sinks = sinks
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v or head_dim
        self.scale = scale
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.uses_decode_kernel = False  # decode_attention's kernel for traced decode steps (set_kv_cache)

    def allocate_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype, device) -> None:
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        self.set_kv_cache(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    def set_kv_cache(self, k_cache: torch.Tensor | None, v_cache: torch.Tensor | None) -> None:
        """[num_blocks, block_size, num_kv_heads, head_dim] each, or None to drop the cache."""
        self.k_cache, self.v_cache = k_cache, v_cache
        # Asked here, outside any trace: through dynamo (a backend other than inductor's
        # packages) the first ask, which builds and tries the kernel, broke the graph.
        self.uses_decode_kernel = (k_cache is not None and self.head_dim_v == self.head_dim
                                   and decode_kernel.usable(k_cache.device))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn: AttentionMetadata | None):
        if isinstance(attn, AttentionMetadata):
            attn = attn.for_window(self.sliding_window)
        if self.sinks is not None:
            return self._with_sinks(q, k, v, attn)
        if attn is None:
            B, T = q.shape[:2]
            if self.batch_invariant:
                out = bi.causal_attention(q, k, v, self.scale, self.sliding_window)
                return out.reshape(B, T, self.num_heads * self.head_dim_v)
            return self._causal(q, k, v).reshape(B, T, self.num_heads * self.head_dim_v)
        if self.k_cache is None:
            raise RuntimeError("KV cache not allocated: the model runner allocates it before the first step")
        if isinstance(attn, tuple):  # a DecodeStep's tensors, traced into the compiled graph
            if self.uses_decode_kernel:
                return decode_kernel.decode(q, k, v, self.k_cache, self.v_cache, attn, self.scale, self.sliding_window)
            return decode_attention(q, k, v, self.k_cache, self.v_cache, attn, self.scale, self.sliding_window)
        if attn is COMPILED:  # traced: the metadata comes through forward_context
            return torch.ops.spmd_engine.attention(q, k, v, self.k_cache, self.v_cache, self.scale,
                                                   self.sliding_window or 0)
        return paged_attention(q, k, v, self.k_cache, self.v_cache, attn, self.scale, self.sliding_window)

    def _with_sinks(self, q, k, v, attn) -> torch.Tensor:
        sinks, window = self.sinks.weight, self.sliding_window
        if attn is None:
            B, T = q.shape[:2]
            out = (bi.causal_attention(q, k, v, self.scale, window, sinks) if self.batch_invariant
                   else sink_attention.causal(q, k, v, sinks, self.scale, window))
            return out.reshape(B, T, self.num_heads * self.head_dim)
        if self.k_cache is None:
            raise RuntimeError("KV cache not allocated: the model runner allocates it before the first step")
        if isinstance(attn, AttentionMetadata):
            attn = attn.for_window(self.sliding_window)
        if attn is COMPILED:
            return torch.ops.spmd_engine.sink_attention(q, k, v, self.k_cache, self.v_cache, sinks, self.scale,
                                                        window or 0)
        return sink_attention.paged(q, k, v, self.k_cache, self.v_cache, attn, sinks, self.scale, window)

    def _causal(self, q, k, v) -> torch.Tensor:
        group = self.num_heads // self.num_kv_heads
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [B, heads, T, D]
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        T, W = q.shape[2], self.sliding_window
        if W is None or T <= W:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:
            t = torch.arange(T, device=q.device)
            diff = t.view(-1, 1) - t.view(1, -1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=(diff >= 0) & (diff < W), scale=self.scale)
        return out.transpose(1, 2)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, attn: AttentionMetadata, scale: float,
                    window: int | None = None) -> torch.Tensor:
    """Write the step's K/V to their slots, then attend: q [N, heads, D], k and v [N, kv_heads, D]
    packed tokens, each query over its last `window` keys (None: all); returns [N, heads * Dv].
    Heads and sizes are read from the shapes: v narrower than k is the keys' first Dv channels
    (Attention's head_dim_v), not written. A decode-shaped step goes to the decode attention
    kernel where it is usable (CPU)."""
    heads, kv, D, Dv = q.shape[1], k.shape[1], q.shape[2], v.shape[2]
    if Dv == D and decode_kernel.usable(q.device) and (step := attn.decode_step()) is not None:
        return decode_kernel.decode(q, k, v, k_cache, v_cache, step, scale, window)  # writes the K/V too
    if attn.slot_mapping is not None:  # None: a dummy step (DP waves) writes nothing
        k_cache.view(-1, kv, D).index_copy_(0, attn.slot_mapping, k)
        if Dv == D:
            v_cache.view(-1, kv, D).index_copy_(0, attn.slot_mapping, v)
    if attn.tiles is not None:
        out = bi.attend(q, k_cache.view(-1, kv, D), v_cache.view(-1, kv, D)[..., :Dv], attn.tiles.plan(heads // kv),
                        scale, window)
        return out.reshape(attn.num_tokens, heads * Dv)
    outs = [_attend(q[g.start:g.end], k[g.start:g.end], v[g.start:g.end], g, k_cache, v_cache, scale, window)
            for g in attn.groups]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.reshape(attn.num_tokens, heads * Dv)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, step: tuple, scale: float, window: int | None = None) -> torch.Tensor:
    """paged_attention for a decode-shaped step, written for inductor to trace: the cache write,
    then per token a dot product with each key it sees, a softmax and a weighted sum of values,
    all in float32, the gather from the cache folded into the loads (no copy of the keys).
    Eager this is slower than SDPA; compiled it is a few fused loops where the opaque op's
    Python, dispatch and SDPA's fixed work cost more than the attention (docs/performance.md).
    q [N, heads, D], k and v [N, kv_heads, D], `step` a DecodeStep or its tuple of tensors,
    `window` the layer's sliding window (None: all keys); returns [N, heads * D]."""
    slots, block_tables, seq_lens = step
    N, heads, D = q.shape
    kv, block_size, nb, Dv = k.shape[1], k_cache.shape[1], block_tables.shape[1], v.shape[2]
    k_cache.view(-1, kv, D).index_copy_(0, slots, k)
    if Dv == D:  # else the values are the keys' first Dv channels (Attention's head_dim_v)
        v_cache.view(-1, kv, D).index_copy_(0, slots, v)
    L = nb * block_size
    keys = k_cache[block_tables].view(N, L, kv, D).permute(0, 2, 1, 3).unsqueeze(2)  # [N, kv, 1, L, D]
    values = v_cache[block_tables].view(N, L, kv, D).permute(0, 2, 1, 3).unsqueeze(2)[..., :Dv]
    # The query heads sharing a KV head side by side (the order SDPA's enable_gqa uses).
    scores = (q.view(N, kv, heads // kv, 1, D).float() * keys.float()).sum(-1) * scale  # [N, kv, group, L]
    keys_at = torch.arange(L, device=q.device).view(1, 1, 1, L)
    seen = keys_at < seq_lens.view(N, 1, 1, 1)
    if window is not None:
        seen = seen & (keys_at >= seq_lens.view(N, 1, 1, 1) - window)
    p = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
    out = (p.unsqueeze(-1) * values.float()).sum(-2)  # [N, kv, group, Dv]
    return out.reshape(N, heads * Dv).to(q.dtype)


def _attend(q, k, v, g: RowGroup, k_cache, v_cache, scale, window=None) -> torch.Tensor:
    """The group's outputs [n, heads, D] for its packed q [n, heads, D] (k, v: its new tokens)."""
    G, T, heads, D, kv, Dv = g.num_rows, g.width, q.shape[1], q.shape[2], k.shape[1], v.shape[2]
    qg = _padded(q, g)  # [G, heads, T, D]
    if g.block_tables is None:  # fresh prompts: causal over their own new tokens
        mask = g.window_mask(window, q.device) if window is not None else None
        out = F.scaled_dot_product_attention(qg, _padded(k, g), _padded(v, g), attn_mask=mask,
                                             is_causal=mask is None, scale=scale, enable_gqa=True)
    else:
        L = g.block_tables.shape[1] * k_cache.shape[1]
        # index_select of whole blocks copies rows with memcpy; advanced indexing with the
        # 2-D table gathers element by element (the profile's largest non-matmul cost).
        blocks = g.block_tables.reshape(-1)
        keys = k_cache.index_select(0, blocks).view(G, L, kv, D).transpose(1, 2)  # [G, kv, L, D]
        values = (v_cache.index_select(0, blocks).view(G, L, kv, D).transpose(1, 2) if Dv == D
                  else keys[..., :Dv])  # the values are the keys' first Dv channels
        # The query heads sharing a KV head folded into the query axis, [G, kv, group * T, D]:
        # grouped-query attention without copying K/V per head (enable_gqa expands them).
        group = heads // kv
        out = F.scaled_dot_product_attention(qg.reshape(G, kv, group * T, D), keys, values,
                                             attn_mask=g.folded_mask(group, window), scale=scale)
        out = out.reshape(G, heads, T, Dv)  # a view fails on CUDA, whose SDPA may lay its output out otherwise
    out = out.transpose(1, 2).reshape(G * T, heads, Dv)
    return out if g.pad_index is None else out[g.pad_index]


def _padded(x: torch.Tensor, g: RowGroup) -> torch.Tensor:
    """The group's packed x [n, heads, D] -> [G, heads, T, D], zeros where a row is shorter."""
    if g.pad_index is None:
        return x.view(g.num_rows, g.width, *x.shape[1:]).transpose(1, 2)
    padded = x.new_zeros(g.num_rows * g.width, *x.shape[1:])
    padded[g.pad_index] = x
    return padded.view(g.num_rows, g.width, *x.shape[1:]).transpose(1, 2)


# The paged attention as one op a compiled graph calls without tracing it (compilation/): its
# metadata is read from forward_context, never passed. The cache is written in place: it is no
# tensor the graph reads again, so the schema says nothing of it (vLLM's attention op hides its
# cache behind a layer name alike).
_lib = torch.library.Library("spmd_engine", "FRAGMENT")  # the op lives as long as the process
_lib.define("attention(Tensor q, Tensor k, Tensor v, Tensor k_cache, Tensor v_cache, float scale, int window=0) "
            "-> Tensor")  # window: the layer's sliding window, 0 for none


def _attention_op(q, k, v, k_cache, v_cache, scale, window=0):
    attn = forward_context.attn_metadata().for_window(window or None)
    return paged_attention(q, k, v, k_cache, v_cache, attn, scale, window or None).contiguous()


_lib.impl("attention", _attention_op, "CompositeExplicitAutograd")


@torch.library.register_fake("spmd_engine::attention")
def _attention_fake(q, k, v, k_cache, v_cache, scale, window=0):
    return q.new_empty(q.shape[0], q.shape[1] * v.shape[2])
