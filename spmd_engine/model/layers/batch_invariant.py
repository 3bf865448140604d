"""Batch-invariant kernels: a row's result depends on that row alone, whatever shares the call.

The default kernels are free to pick their algorithm from the whole call's shape: MKL's
fp32 GEMM uses one kernel for 1 row, another for 2-15 and a third from 16 (each summing K in
its own order), oneDNN's blocking changes with the row count too, SDPA splits keys and
queries by the sequence lengths, and a row-parallel layer's all-reduce adds partial products
in a different order than one rank's matmul. Each is right to 1e-6, and each makes a
request's logprobs depend on its batch. These do not, by construction:

- `linear`: rows go through one kernel in tiles of TILE_ROWS (padded), so every call the
  kernel sees has the same shape and a row's sums run in the same order wherever it sits.
- `row_parallel_linear`: the reduction dimension is cut into REDUCE_CHUNKS (the largest
  supported TP) products summed in one fixed pairwise tree; a TP rank computes its subtree
  and the ranks' subtrees are all-gathered and summed by the same tree, so TP 1, 2, 4 and 8
  give the same bits.
- `attention`: every query attends to its keys in blocks of KEY_BLOCK from position 0, one
  fixed-shape product per (query tile, key block), a max over all keys, block sums added in
  order (`cumsum`: sequential), so neither the number of queries, nor cached blocks, nor
  padding to a longer neighbour changes a query's output.
- `row_sum`, `rms_norm`, `log_softmax`: a row's sum in fixed chunks of SUM_CHUNK added in
  order, never split by thread count.
- `pointwise`: torch's elementwise kernels compute exp, silu, rsqrt, cos... with SIMD for
  whole vectors and with the scalar libm function (other bits) for the tail of the tensor,
  so an element's value depends on the tensor's size. Padding the last dim to a multiple of
  SUM_CHUNK (contiguous) sends every element through the vector path.

Everything is torch ops with autograd: a trainer calls the same functions (model/trainer.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

TILE_ROWS = 32
REDUCE_CHUNKS = 8  # the largest TP size whose results equal TP=1's
KEY_BLOCK = 32
QUERY_TILE = 16  # query tokens per attention tile
SUM_CHUNK = 64
MAX_SCORES = 1 << 22  # score elements per attention call (tiles are independent: any split)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b, each row computed by the same [TILE_ROWS, K] x [K, N] product."""
    lead, (n, k) = x.shape[:-1], weight.shape
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    if m % TILE_ROWS:
        rows = F.pad(rows, (0, 0, 0, TILE_ROWS - m % TILE_ROWS))
    tiles = rows.view(-1, TILE_ROWS, k)
    if tiles.dtype == torch.float32:  # one batched call, the weight broadcast (not copied)
        y = torch.bmm(tiles, weight.t().expand(tiles.shape[0], k, n))
    else:  # CPU bmm has no fast half-precision path: one product per tile
        y = torch.stack([tile @ weight.t() for tile in tiles.unbind(0)])
    y = y.reshape(-1, n)[:m]
    if bias is not None:
        y = y + bias
    return y.view(*lead, n)


def tree_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """((p0 + p1) + (p2 + p3)) + ...: neighbours added level by level (len a power of two)."""
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]


def chunks_per_rank(tp_size: int) -> int:
    if tp_size > REDUCE_CHUNKS or REDUCE_CHUNKS % tp_size:
        raise ValueError(f"batch-invariant mode supports TP sizes dividing {REDUCE_CHUNKS}, got {tp_size}")
    return REDUCE_CHUNKS // tp_size


def partial_tree(x: torch.Tensor, weight: torch.Tensor, tp_size: int) -> torch.Tensor:
    """This rank's subtree: its REDUCE_CHUNKS / tp_size slices of K, each a `linear`, summed."""
    n = chunks_per_rank(tp_size)
    return tree_sum([linear(xc, wc) for xc, wc in zip(x.chunk(n, dim=-1), weight.chunk(n, dim=-1))])


def gather_tree(partial: torch.Tensor, group) -> torch.Tensor:
    """The ranks' subtrees summed by the top of the tree: an all-gather, not an all-reduce."""
    if group.world_size == 1:
        return partial
    return tree_sum(list(group.all_gather(partial.unsqueeze(0), dim=0).unbind(0)))


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, group) -> torch.Tensor:
    """sum over the group of x_r W_r^T, the same bits at every TP size dividing REDUCE_CHUNKS."""
    return gather_tree(partial_tree(x, weight, group.world_size), group)


def pointwise(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an elementwise fn, every element through the same (vector) code path."""
    d = x.shape[-1]
    if d % SUM_CHUNK == 0 and x.is_contiguous():
        return fn(x)
    return fn(F.pad(x, (0, -d % SUM_CHUNK)))[..., :d]


def silu(x: torch.Tensor) -> torch.Tensor:
    return pointwise(F.silu, x)


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim: fixed chunks of SUM_CHUNK, then the chunks in order."""
    d = x.shape[-1]
    if d % SUM_CHUNK:
        x = F.pad(x, (0, SUM_CHUNK - d % SUM_CHUNK))
    return x.unflatten(-1, (-1, SUM_CHUNK)).sum(-1).cumsum(-1)[..., -1]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Llama's RMSNorm (float32, cast back, then scale) with `row_sum`'s mean."""
    x32 = x.float()
    x32 = x32 * pointwise(torch.rsqrt, row_sum(x32 * x32).unsqueeze(-1) / x.shape[-1] + eps)
    return weight * x32.to(x.dtype)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dim, float32, with `row_sum`'s normaliser."""
    x = x.float()
    m = x.amax(dim=-1, keepdim=True)
    return x - m - pointwise(torch.log, row_sum(pointwise(torch.exp, x - m)).unsqueeze(-1))


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_pos: torch.Tensor,
              scale: float) -> torch.Tensor:
    """Tiles of queries over their sequences' keys, laid out by position.

    q [n, QUERY_TILE, heads, D]; keys, values [n, L, kv_heads, D], key j at position j of
    the tile's sequence, L a multiple of KEY_BLOCK; q_pos [n, QUERY_TILE]: a query sees keys
    0..q_pos (padding queries: 0). Returns [n, QUERY_TILE, heads, D] in q's dtype. Keys past
    a query's position add exact zeros, so any L gives the same bits.
    """
    outs = []
    per_tile = q.shape[1] * q.shape[2] * keys.shape[1]
    step = max(1, MAX_SCORES // per_tile)
    for start in range(0, q.shape[0], step):
        sl = slice(start, start + step)
        outs.append(_attend_tiles(q[sl], keys[sl], values[sl], q_pos[sl], scale))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _attend_tiles(q, keys, values, q_pos, scale):
    n, t, heads, d = q.shape
    kv, length = keys.shape[2], keys.shape[1]
    nb = length // KEY_BLOCK
    # One product per (tile, query head, key block), [t, d] x [d, KEY_BLOCK]: the same shape at
    # any TP size (folding the query heads that share a KV head into the rows would not be).
    qf = q.float().permute(0, 2, 1, 3).unsqueeze(2)  # [n, heads, 1, t, d]
    def blocks(x):  # [n, L, kv, d] -> [n, heads, nb, KEY_BLOCK, d], each query head its KV head's keys
        x = x.float().view(n, nb, KEY_BLOCK, kv, 1, d).expand(n, nb, KEY_BLOCK, kv, heads // kv, d)
        return x.reshape(n, nb, KEY_BLOCK, heads, d).permute(0, 3, 1, 2, 4)
    kf, vf = blocks(keys), blocks(values)
    s = torch.matmul(qf.expand(n, heads, nb, t, d), kf.transpose(-1, -2)) * scale  # [n, heads, nb, t, KB]
    key_pos = torch.arange(length, device=q.device).view(1, 1, nb, 1, KEY_BLOCK)
    s = s.masked_fill(key_pos > q_pos.view(n, 1, 1, t, 1), float("-inf"))
    p = pointwise(torch.exp, s - s.amax(dim=(2, 4), keepdim=True))  # last dim KEY_BLOCK
    denom = p.sum(-1).cumsum(2)[:, :, -1]  # [n, heads, t]
    acc = torch.matmul(p, vf).cumsum(2)[:, :, -1]  # [n, heads, t, d]
    return (acc / denom.unsqueeze(-1)).permute(0, 2, 1, 3).to(q.dtype)


def padded_keys(length: int) -> int:
    return -(-length // KEY_BLOCK) * KEY_BLOCK


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Whole rows [B, T, heads, D] (no cache), through `attention`: what a trainer runs."""
    b, t = q.shape[:2]
    tiles = -(-t // QUERY_TILE)
    tq, length = tiles * QUERY_TILE, padded_keys(t)
    qp = F.pad(q, (0, 0, 0, 0, 0, tq - t)).view(b * tiles, QUERY_TILE, *q.shape[2:])
    keys = F.pad(k, (0, 0, 0, 0, 0, length - t)).repeat_interleave(tiles, dim=0)
    values = F.pad(v, (0, 0, 0, 0, 0, length - t)).repeat_interleave(tiles, dim=0)
    pos = torch.arange(tq, device=q.device).clamp(max=t - 1).view(1, tiles, QUERY_TILE).expand(b, -1, -1)
    out = attention(qp, keys, values, pos.reshape(b * tiles, QUERY_TILE), scale)
    return out.reshape(b, tq, *out.shape[2:])[:, :t]
