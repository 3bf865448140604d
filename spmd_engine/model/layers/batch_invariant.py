"""Batch-invariant kernels: a row's result depends on that row alone, whatever shares the call.

The default kernels are free to pick their algorithm from the whole call's shape: MKL's
fp32 GEMM uses one kernel for 1 row, another for 2-15 and a third from 16 (each summing K in
its own order), and when a GEMM runs alone on several threads it may split K between them;
oneDNN's blocking changes with the row count too; SDPA splits keys and queries by the
sequence lengths; a row-parallel layer's all-reduce adds partial products in a different
order than one rank's matmul. Each is right to 1e-6, and each makes a request's logprobs
depend on its batch (or on the process's thread count). These do not, by construction:

- `linear` (a whole weight): on CPU oneDNN in calls of up to ONEDNN_ROWS rows; oneDNN gives
  a row the same bits in any call of 2 to 256 rows in fp32 (32 in bf16), at any thread count, with a packed
  weight or a dense one (measured and tested; one row meets a matrix-vector kernel, so a
  lone row is padded to two). `mkl_linear` (the row-parallel slices, sliced weights have no
  packed form): rows in tiles of MKL_ROWS through one batched fp32 GEMM of at least as
  many products as threads (and two): then MKL runs each product on one thread,
  sequentially; given fewer, it splits a product's K between threads (measured), and a
  row's bits would follow the thread count.
- `row_parallel_linear`: the reduction dimension is cut into REDUCE_CHUNKS (the largest
  supported TP) products summed in one fixed pairwise tree; a TP rank computes its subtree
  and the ranks' subtrees are all-gathered and summed by the same tree, so TP 1, 2, 4 and 8
  give the same bits. In bf16 each slice is a oneDNN product like `linear`'s, on the
  engine's packed copies of the slices (RowParallelLinear.pack_slices) or a trainer's dense
  weight.
- `attention` (`plan_tiles`, `attend`): float32 computes every product with the keys' rows
  (or a value block's head dims, no fewer than MIN_ROWS) as M and a tile's query rows as N:
  a query's scores and sums then do not depend on how many rows share the product, in whole
  blocks of MIN_ROWS columns (measured: AMD EPYC's MKL sums a part-filled block otherwise), so
  a decode computes its own rows padded to one block. The softmax's sums and the value
  products run in fixed key blocks of KEY_BLOCK from position 0, combined by one pairwise
  tree as if padded to a power of two, where blocks past the query add exact zeros: neither
  the number of queries, nor cached blocks, nor the key length a tile is padded to changes a
  query's output. bf16 goes through torch's SDPA (its CPU flash kernel: keys in fixed
  blocks from 0, oneDNN products, a query's rows padded to MIN_ROWS) wherever a probe at
  first use finds it invariant (`_sdpa_invariant`; in float32 it is not).
- `row_sum`, `rms_norm`, `log_softmax`: a row's sum in fixed chunks of SUM_CHUNK added in
  order, never split by thread count.
- `pointwise`: torch's elementwise kernels compute exp, silu, rsqrt, cos... with SIMD for
  whole vectors and with the scalar libm function (other bits) for the tail of each
  thread's share, so an element's value depends on the tensor's size and the thread count.
  Padding the flattened tensor so every share is a multiple of SUM_CHUNK sends every
  element through the vector path.

Everything is torch ops with autograd: a trainer calls the same functions (model/trainer.py).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

REDUCE_CHUNKS = 8  # the largest TP size whose results equal TP=1's
KEY_BLOCK = 32
MIN_ROWS = 16  # rows of every attention product: fewer meet MKL's small-M kernels
LONG_TILE = 32  # queries per attention tile of a prompt (or chunk) longer than a short tile
SUM_CHUNK = 64
ONEDNN_ROWS = {torch.float32: 256, torch.bfloat16: 32}  # rows per oneDNN call: a row gets the same
# bits in any call of 2 to this many rows (bf16: 48 and more sum otherwise; measured and tested)
MKL_ROWS = 16  # rows per MKL product: its smallest full kernel
COLUMN_BLOCK = 64  # a decode's output columns are cut between threads in multiples of this,
MIN_COLUMNS = 256  # and no narrower (MKL's narrow products sum in another order: measured)
GRAIN = 32768  # torch's elementwise kernels split work between threads from this many elements
MAX_SCORES = 1 << 22  # score elements per attention call (tiles are independent: any split)
PAD_LIMIT = 1.25  # keys a call reads for its tiles, at most this many times those they need
EXP_FLOOR = -87.0  # exp of less is subnormal or 0, where torch's exp is far slower (docs/performance.md)


def uses_onednn(x: torch.Tensor) -> bool:
    """Whole weights go to oneDNN on CPU (fp32, and bf16 where it has bf16 kernels)."""
    return x.device.type == "cpu" and (x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and _onednn_bf16()))


@functools.lru_cache(maxsize=None)
def _onednn_bf16() -> bool:
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b for a whole weight (column-parallel, LM head, router, an expert): on CPU
    oneDNN in calls of up to ONEDNN_ROWS rows, with the engine's packed weight or a
    trainer's dense one alike; elsewhere `mkl_linear`'s fixed tiles."""
    lead, (n, k) = x.shape[:-1], weight.shape
    rows = x.reshape(-1, k)
    if uses_onednn(rows):
        y = _in_calls(rows, ONEDNN_ROWS[rows.dtype], lambda tile: _onednn(tile, weight))
    else:
        y = mkl_linear(rows, weight)
    if bias is not None:
        y = y + bias
    return y.view(*lead, n)


def _in_calls(rows: torch.Tensor, most: int, product) -> torch.Tensor:
    """product(tile) over calls of up to `most` rows, stacked back (one call: no copy)."""
    if rows.shape[0] <= most:
        return product(rows)
    return torch.cat([product(tile) for tile in rows.split(most)])


def _onednn(tile: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    m = tile.shape[0]
    if m == 1:  # one row meets a matrix-vector kernel: other bits (measured)
        tile = F.pad(tile, (0, 0, 0, 1))
    if not weight.is_mkldnn and not weight.is_contiguous():
        weight = weight.contiguous()  # oneDNN reorders a strided dense weight very slowly
    if weight.is_mkldnn or not (torch.is_grad_enabled() and (tile.requires_grad or weight.requires_grad)):
        y = torch.ops.mkldnn._linear_pointwise(tile, weight, None, "none", [], "")
    else:
        y = _OneDNNLinear.apply(tile, weight)
    return y[:m]


class _OneDNNLinear(torch.autograd.Function):
    """oneDNN's forward (the bits the engine computes), plain matmuls for the gradients."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return grad @ weight, grad.t() @ x


def mkl_linear(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """rows [m, K] W^T in fixed tiles: fp32 through MKL's batched GEMM (`_batched_tiles`), other
    dtypes a product a tile (CPU bmm has no fast half-precision path, nor a thread-invariant one)."""
    m = rows.shape[0]
    if rows.dtype == torch.float32:
        return _batched_tiles(rows, weight, m, MKL_ROWS)
    return torch.cat([tile @ weight.t() for tile in F.pad(rows, (0, 0, 0, -m % 32)).split(32)])[:m]


def _batched_tiles(rows: torch.Tensor, weight: torch.Tensor, m: int, t: int) -> torch.Tensor:
    """fp32: one bmm of at least as many products as threads, each run sequentially (see
    above). One tile (a decode) is cut by output columns instead, a block a thread: a
    column's sums do not depend on its neighbours when blocks are multiples of COLUMN_BLOCK,
    at least MIN_COLUMNS wide (measured: an odd width meets an edge kernel, a narrow product
    another algorithm), and each thread reads only its block of W."""
    (n, k), want = weight.shape, max(2, torch.get_num_threads())
    if m <= t and n % (COLUMN_BLOCK * want) == 0 and n // want >= MIN_COLUMNS:
        tile = F.pad(rows, (0, 0, 0, t - m)).unsqueeze(0).expand(want, t, k)
        y = torch.bmm(tile, weight.unflatten(0, (want, -1)).transpose(1, 2))  # [want, t, n / want]
        return y.transpose(0, 1).reshape(t, n)[:m]
    tiles = F.pad(rows, (0, 0, 0, max(-(-m // t), want) * t - m)).view(-1, t, k)
    return torch.bmm(tiles, weight.t().expand(tiles.shape[0], k, n)).reshape(-1, n)[:m]


def tree_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """((p0 + p1) + (p2 + p3)) + ...: neighbours added level by level (len a power of two)."""
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]


def chunks_per_rank(tp_size: int) -> int:
    if tp_size > REDUCE_CHUNKS or REDUCE_CHUNKS % tp_size:
        raise ValueError(f"batch-invariant mode supports TP sizes dividing {REDUCE_CHUNKS}, got {tp_size}")
    return REDUCE_CHUNKS // tp_size


def partial_tree(x: torch.Tensor, weight: torch.Tensor, tp_size: int,
                 slices: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """This rank's subtree: its REDUCE_CHUNKS / tp_size slices of K, each a product, summed.
    fp32 slices go to `mkl_linear` (sliced weights have no packed form), a decode's in one
    bmm, a slice a product (the same sequential product `mkl_linear` runs for a tile), when
    there are enough of them for the threads; bf16 slices to oneDNN like `linear`, through
    the engine's packed copies of them (`slices`) or the dense weight's (the same bits)."""
    n = chunks_per_rank(tp_size)
    rows, t = x.reshape(-1, x.shape[-1]), MKL_ROWS
    if x.dtype != torch.float32:
        parts = slices if slices is not None else weight.chunk(n, dim=-1)
        return tree_sum([linear(xc, wc) for xc, wc in zip(x.chunk(n, dim=-1), parts)])
    if rows.shape[0] <= t and n >= max(2, torch.get_num_threads()):
        m, (out, k) = rows.shape[0], weight.shape
        tiles = F.pad(rows, (0, 0, 0, t - m)).view(t, n, k // n).transpose(0, 1)  # [n, t, K / n]
        parts = torch.bmm(tiles, weight.unflatten(1, (n, -1)).permute(1, 2, 0))[:, :m]  # [n, m, N]
        return tree_sum(list(parts.unbind(0))).view(*x.shape[:-1], out)
    parts = [mkl_linear(xc, wc) for xc, wc in zip(rows.chunk(n, dim=-1), weight.chunk(n, dim=-1))]
    return tree_sum(parts).view(*x.shape[:-1], weight.shape[0])


def gather_tree(partial: torch.Tensor, group) -> torch.Tensor:
    """The ranks' subtrees summed by the top of the tree: an all-gather, not an all-reduce."""
    if group.world_size == 1:
        return partial
    return tree_sum(list(group.all_gather(partial.unsqueeze(0), dim=0).unbind(0)))


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, group,
                        slices: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """sum over the group of x_r W_r^T, the same bits at every TP size dividing REDUCE_CHUNKS."""
    return gather_tree(partial_tree(x, weight, group.world_size, slices), group)


def pointwise(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an elementwise fn, every element through the same (vector) code path: the
    flattened tensor padded so that each thread's share is a multiple of SUM_CHUNK."""
    n = x.numel()
    shares = 1
    while True:  # torch's split: min(threads, ceil(size / GRAIN)) shares of ceil(size / shares)
        size = -(-n // (SUM_CHUNK * shares)) * SUM_CHUNK * shares
        fit = max(1, min(torch.get_num_threads(), -(-size // GRAIN)))
        if fit == shares:
            break
        shares = fit
    flat = x.reshape(-1)
    if size == n:
        return fn(flat).view(x.shape)
    return fn(F.pad(flat, (0, size - n)))[:n].view(x.shape)


def silu(x: torch.Tensor) -> torch.Tensor:
    return pointwise(F.silu, x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return pointwise(functools.partial(F.gelu, approximate="tanh"), x)


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim: fixed chunks of SUM_CHUNK, then the chunks in order."""
    d = x.shape[-1]
    if d % SUM_CHUNK:
        x = F.pad(x, (0, SUM_CHUNK - d % SUM_CHUNK))
    return x.unflatten(-1, (-1, SUM_CHUNK)).sum(-1).cumsum(-1)[..., -1]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """HF Llama's RMSNorm (float32, cast back, then scale) with `row_sum`'s mean; with
    `unit_offset` Gemma's (scaled by 1 + weight in float32, then cast)."""
    x32 = x.float()
    x32 = x32 * pointwise(torch.rsqrt, row_sum(x32 * x32).unsqueeze(-1) / x.shape[-1] + eps)
    if unit_offset:
        return (x32 * (1.0 + weight.float())).to(x.dtype)
    return weight * x32.to(x.dtype)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dim, float32, with `row_sum`'s normaliser."""
    x = x.float()
    m = x.amax(dim=-1, keepdim=True)
    return x - m - pointwise(torch.log, row_sum(pointwise(torch.exp, x - m)).unsqueeze(-1))


def pairwise_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """`tree_sum` along `dim` as if padded with zeros to a power of two, one add a level: an
    odd level's last element moves up unchanged (the zero it would meet adds nothing)."""
    dim %= x.dim()
    while x.shape[dim] > 1:
        size = x.shape[dim]
        pairs = x.narrow(dim, 0, size - size % 2).unflatten(dim, (-1, 2))
        total = pairs.select(dim + 1, 0) + pairs.select(dim + 1, 1)
        x = torch.cat([total, x.narrow(dim, size - 1, 1)], dim) if size % 2 else total
    return x.squeeze(dim)


def key_length(last_position: int) -> int:
    """Keys a prompt's tile reads: a power-of-two number of KEY_BLOCKs covering 0..last_position."""
    return KEY_BLOCK << (-(-(last_position + 1) // KEY_BLOCK) - 1).bit_length()


def sequence_tiles(context: int, queries: int, group: int) -> list[tuple[int, int, int]]:
    """(first query, tile size, key length) of each tile of a sequence with `context` keys
    cached and `queries` new ones. Neither a tile's size nor its key length changes a query's
    bits, so both are chosen for speed: a decode (or a few queries) gets one tile reading the
    KEY_BLOCKs it needs; a prompt one tile per run of queries that read the same power-of-two
    key length (keys gathered once a run, at most twice the causal work), each a power of two,
    at most MAX_SCORES scores a tile."""
    if queries * group <= MIN_ROWS:
        return [(0, 1 << (queries - 1).bit_length(), _blocks(context + queries))]
    tiles, j = [], 0
    while j < queries:
        length = key_length(context + j)
        run = min(queries, length - context) - j  # the queries up to the key length's end
        cap = max(LONG_TILE, 1 << max(0, (MAX_SCORES // (group * length)).bit_length() - 1))
        size = min(cap, max(LONG_TILE, 1 << (run - 1).bit_length()))
        tiles.append((j, size, length))
        j += min(size, run)
    return tiles


def bucket_lengths(lengths: Sequence[int]) -> dict[int, int]:
    """Tiles of one size share a call (and a key length, the longest) while the keys they
    read padded stay within PAD_LIMIT of those they need: length -> the call's length."""
    out, longest, tiles, need = {}, 0, 0, 0
    for length in sorted(set(lengths), reverse=True):
        count = lengths.count(length)
        if tiles and (tiles + count) * longest > PAD_LIMIT * (need + count * length):
            tiles, need = 0, 0
        if not tiles:
            longest = length
        tiles, need = tiles + count, need + count * length
        out[length] = longest
    return out


@dataclass
class TileBucket:
    """Tiles of one shape, attended in one call."""

    index: torch.Tensor  # [n, q] packed query of each tile slot; N (a zero row) for padding
    q_pos: torch.Tensor  # [n, q] its position (padding: 0)
    keys: torch.Tensor  # [n, L] row of the flat keys at each position (past the sequence: 0)


@dataclass
class TilePlan:
    buckets: list[TileBucket]
    unpack: torch.Tensor  # [N] where each packed query sits in the buckets' tiles, flattened in order


def plan_tiles(context_lens: Sequence[int], query_lens: Sequence[int], row_start: Sequence[int],
               key_rows: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], group: int, device) -> TilePlan:
    """The step's (or a training batch's) queries as tiles of one sequence each, bucketed by
    (key length, tile size). Sequence b has context_lens[b] keys already and query_lens[b]
    new queries at packed rows row_start[b]..; key_rows(seqs [n], positions [L]) gives the
    rows of the flat key tensor holding those sequences' keys at those positions."""
    tiles = [(b, j, qt, length) for b, (ctx, q) in enumerate(zip(context_lens, query_lens))
             for j, qt, length in sequence_tiles(ctx, q, group)]
    padded = {qt: bucket_lengths([t[3] for t in tiles if t[2] == qt]) for qt in {t[2] for t in tiles}}
    shapes: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for b, j, qt, length in tiles:
        shapes.setdefault((padded[qt][length], qt), []).append((b, j))
    ctx_t, qlen_t = torch.tensor(list(context_lens)), torch.tensor(list(query_lens))
    start_t, total = torch.tensor(list(row_start)), sum(query_lens)
    buckets, flat, at = [], [], 0
    for (length, qt), tiles in sorted(shapes.items()):
        seq, first = (torch.tensor(c, dtype=torch.long) for c in zip(*tiles))
        offset = first.view(-1, 1) + torch.arange(qt).view(1, -1)
        real = (offset < qlen_t[seq].view(-1, 1)) & (ctx_t[seq].view(-1, 1) + offset < length)
        index = torch.where(real, start_t[seq].view(-1, 1) + offset, total)
        q_pos = torch.where(real, ctx_t[seq].view(-1, 1) + offset, 0)
        pos = torch.arange(length)
        keys = torch.where(pos.view(1, -1) < (ctx_t + qlen_t)[seq].view(-1, 1), key_rows(seq, pos), 0)
        buckets.append(TileBucket(index.to(device), q_pos.to(device), keys.to(device)))
        flat.append((index[real], at + torch.arange(index.numel()).view(index.shape)[real]))
        at += index.numel()
    unpack = torch.empty(total, dtype=torch.long)
    for rows, where in flat:
        unpack[rows] = where
    return TilePlan(buckets, unpack.to(device))


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plan: TilePlan, scale: float,
           window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Packed queries [N, heads, D] over flat keys [S, kv_heads, D] and values [S, kv_heads, Dv]
    -> [N, heads, Dv], each over its last `window` keys (None: all).
    Each bucket's tiles are gathered and attended MAX_SCORES scores at a time (tiles are
    independent: any split), so a long context's keys are never all copied at once. `sinks`
    [heads]: attention sinks' logits (sink_attention.py) in every denominator."""
    qx = torch.cat([q, q.new_zeros(1, *q.shape[1:])])
    outs = []
    for b in plan.buckets:
        step = max(2, MAX_SCORES // (b.index.shape[1] * q.shape[1] * b.keys.shape[1]))
        for i in range(0, b.index.shape[0], step):
            rows = b.keys[i:i + step]
            flat = rows.reshape(-1)
            k, v = (torch.index_select(x, 0, flat).view(*rows.shape, *x.shape[1:]) for x in (keys, values))
            outs.append(attention(qx[b.index[i:i + step]], k, v, b.q_pos[i:i + step], scale, window,
                                  sinks).flatten(0, 1))
    return (outs[0] if len(outs) == 1 else torch.cat(outs))[plan.unpack]


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_pos: torch.Tensor,
              scale: float, window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Tiles of queries over their sequences' keys, laid out by position.

    q [n, t, heads, D]; keys [n, L, kv_heads, D], values [.., Dv], key j at position j of the tile's
    sequence, L a power-of-two number of KEY_BLOCKs; q_pos [n, t]: a query sees keys
    0..q_pos (padding queries: 0), with a sliding `window` only q_pos - window < j. A key's
    bits do not depend on which others are hidden (a hidden key adds an exact zero), so the
    window keeps the recipe batch-invariant. Returns [n, t, heads, Dv] in q's dtype.
    """
    n, t, heads, d = q.shape
    kv, length, dv = keys.shape[2], keys.shape[1], values.shape[-1]
    group, nb = heads // kv, length // KEY_BLOCK
    if nb * KEY_BLOCK != length:
        raise ValueError(f"key length {length} is not a whole number of {KEY_BLOCK}-key blocks")
    if q.dtype == torch.bfloat16 and sinks is None and dv == d and _sdpa_invariant(q.device.type, d, q.dtype):
        return _flash_tiles(q, keys, values, q_pos, scale, window)  # (the probe checks a lone sequence too)
    if n < 2:  # no product alone in its call (a lone bmm may split its sums between threads)
        pad = (0, 0, 0, 0, 0, 0, 0, 2 - n)
        return attention(F.pad(q, pad), F.pad(keys, pad), F.pad(values, pad), F.pad(q_pos, (0, 0, 0, 2 - n)),
                         scale, window, sinks)[:n]
    step = MIN_ROWS // math.gcd(group, MIN_ROWS)  # queries whose heads fill whole MIN_ROWS columns
    if t % step:  # fewer columns meet other kernels on some CPUs (AMD EPYC's MKL: below 16)
        extra = step - t % step
        return attention(F.pad(q, (0, 0, 0, 0, 0, extra)), keys, values, F.pad(q_pos, (0, extra)), scale,
                         window, sinks)[:, :t]
    f32, rows = torch.float32, t * group
    keys, values = keys.to(f32), values.to(f32)  # no copy in fp32
    if min(d, dv) < MIN_ROWS:  # a head this narrow meets MKL's small kernels (other sums): zeros pad it
        q, keys = (F.pad(x, (0, max(0, MIN_ROWS - d))) for x in (q, keys))
        values = F.pad(values, (0, max(0, MIN_ROWS - dv)))
        return attention(q, keys, values, q_pos, scale, window, sinks)[..., :dv]
    # [n, kv, D, rows]: a KV head's query heads folded into the columns; each product has the
    # keys' (or a value block's dims') rows, so a decode's few columns cost what they compute
    qf = (q.to(f32) * scale).view(n, t, kv, group, d).permute(0, 2, 4, 1, 3).reshape(n, kv, d, rows)
    hidden = _hidden(length, q_pos, window).transpose(1, 2).unsqueeze(-1)  # [n, L, t, 1]
    outs = []
    for h in range(kv):
        s = torch.bmm(keys[:, :, h], qf[:, h])  # [n, L, rows], on a strided view of the keys
        s = s.view(n, length, t, group).masked_fill(hidden, float("-inf")).view(n, length, rows)
        top = s.amax(dim=1, keepdim=True)
        if sinks is not None:  # a sink per query head: column t * group + j is head h * group + j
            sink = sinks[h * group:(h + 1) * group].float().repeat(t).view(1, 1, rows)
            top = torch.maximum(top, sink)
        p = pointwise(torch.exp, (s - top).clamp(min=EXP_FLOOR))
        p = p.view(n, length, t, group).masked_fill(hidden, 0).view(n * nb, KEY_BLOCK, rows)
        sums = p.transpose(1, 2).contiguous().sum(-1)  # [n * nb, rows]: a block's keys innermost
        denom = pairwise_sum(sums.view(n, nb, rows), dim=1)  # [n, rows]
        if sinks is not None:
            denom = denom + pointwise(torch.exp, (sink - top).clamp(min=EXP_FLOOR)).view(n, rows)
        vb = values[:, :, h].reshape(n * nb, KEY_BLOCK, dv).transpose(1, 2)  # [n * nb, Dv, KEY_BLOCK]
        acc = pairwise_sum(torch.bmm(vb, p).view(n, nb, dv, rows), dim=1)  # [n, Dv, rows]
        outs.append((acc / denom.unsqueeze(1)).view(n, dv, t, group).permute(0, 2, 3, 1))
    return torch.stack(outs, dim=2).reshape(n, t, heads, dv).to(q.dtype)


def _hidden(length: int, q_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[n, t, L]: which of a tile's `length` keys each query (at q_pos [n, t]) may not see."""
    keys = torch.arange(length, device=q_pos.device).view(1, 1, length)
    pos = q_pos.unsqueeze(-1)
    hidden = keys > pos
    return hidden if window is None else hidden | (keys <= pos - window)


def _flash_tiles(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_pos: torch.Tensor,
                 scale: float, window: int | None = None) -> torch.Tensor:
    """`attention` through torch's bf16 SDPA (`_sdpa_invariant`): a tile's queries, a KV head's
    query heads folded into its rows, under an explicit mask of the keys each may see."""
    n, t, heads, d = q.shape
    kv, length = keys.shape[2], keys.shape[1]
    group = heads // kv
    rows = t * group
    qf = q.view(n, t, kv, group, d).transpose(1, 2).reshape(n, kv, rows, d)
    visible = ~_hidden(length, q_pos, window).unsqueeze(2)  # [n, t, 1, L]
    mask = visible.expand(n, t, group, length).reshape(n, 1, rows, length)
    if rows % MIN_ROWS:  # a lone row (a decode at TP 8), or a ragged last block of rows, meets another
        # kernel (AMD EPYC: any part-filled block of 16): padded to whole blocks, as the products are
        extra = MIN_ROWS - rows % MIN_ROWS
        qf, mask = F.pad(qf, (0, 0, 0, extra)), F.pad(mask, (0, 0, 0, extra), value=True)
    out = F.scaled_dot_product_attention(qf, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask,
                                         scale=scale)[:, :, :rows]  # [n, kv, t * group, D]
    return out.reshape(n, kv, t, group, d).transpose(1, 2).reshape(n, t, heads, d)


@functools.lru_cache(maxsize=None)
def _sdpa_invariant(device_type: str, d: int, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether bf16 SDPA gives a query the same bits whatever shares its call: torch's CPU
    flash kernel runs a query's keys in fixed blocks from position 0, with oneDNN products
    whose rows do not depend on their neighbours, one thread per block of queries; measured
    (any number of queries, sequences, padded keys and threads) on AVX512-BF16/AMX with
    torch 2.13, and tested (tests/unit/model/test_batch_invariant_kernels.py). This probe
    keeps the float32 recipe wherever a query's output moves with its call, as it does in
    float32 (MKL's products) and may on another CPU or build. Only with AMX: on an AMD EPYC with
    AVX512-BF16 but no AMX, the probe passed while one query in 300 of a prompt decoded alone
    differed by a bit from the same query in the whole prompt's tile (the test above caught it)."""
    if device_type != "cpu" or not _onednn_bf16() or not torch.cpu._is_amx_tile_supported():
        return False
    threads = torch.get_num_threads()
    try:
        return all(_sdpa_probe(seed, d, dtype, n_threads) for seed in (0, 1, 2)
                   for n_threads in sorted({1, threads, threads + 1}))
    finally:
        torch.set_num_threads(threads)


def _sdpa_probe(seed: int, d: int, dtype: torch.dtype, threads: int) -> bool:
    """Sixteen queries within, then past, the kernel's first 512-key block: each alone (a
    decode), then in a tile of 16 and of 256 queries among other sequences with padded keys,
    and as a TP rank's share of the query heads (one head alone, two)."""
    gen = torch.Generator().manual_seed(seed)
    kv, group, count, before = 2, 4, 16, 200
    q = torch.randn(3, before + 56, kv * group, d, generator=gen).to(dtype)
    k, v = (torch.randn(3, 1100, kv, d, generator=gen).to(dtype) for _ in range(2))
    torch.set_num_threads(threads)
    for first in (280, 590):
        pos = torch.arange(first - before, first + 56).view(1, -1).expand(3, -1)
        probe = slice(before, before + count)
        alone = torch.cat([_flash_tiles(q[:1, j:j + 1], k[:1, :_blocks(p + 1)], v[:1, :_blocks(p + 1)],
                                        pos[:1, j:j + 1], 0.125) for j, p in zip(range(before, before + count),
                                                                                  range(first, first + count))], dim=1)
        end = _blocks(first + 56) + 64
        tiles = (_flash_tiles(q[:, probe], k[:, :end], v[:, :end], pos[:, probe], 0.125)[:1],
                 _flash_tiles(q[:2], k[:2, :end], v[:2, :end], pos[:2], 0.125)[:1, probe])
        if not all(torch.equal(tile, alone) for tile in tiles):
            return False
        for heads in (1, 2):  # of the first KV head
            length = _blocks(first + count)
            part = torch.cat([_flash_tiles(q[:2, j:j + 1, :heads], k[:2, :length, :1], v[:2, :length, :1],
                                           pos[:2, j:j + 1], 0.125) for j in range(before, before + count)], dim=1)
            if not torch.equal(part[:1], alone[:, :, :heads]):
                return False
    return True


def _blocks(keys: int) -> int:
    """The fewest keys, in whole KEY_BLOCKs, covering `keys`."""
    return -(-keys // KEY_BLOCK) * KEY_BLOCK


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Whole rows [B, T, heads, D] (no cache; values' Dv may be narrower), through `attend`: what a
    trainer runs."""
    b, t, heads, d = q.shape
    kv, dv = k.shape[2], v.shape[-1]
    plan = plan_tiles([0] * b, [t] * b, [i * t for i in range(b)],
                      lambda seq, pos: seq.view(-1, 1) * t + pos.clamp(max=t - 1).view(1, -1), heads // kv, q.device)
    out = attend(q.reshape(b * t, heads, d), k.reshape(b * t, kv, d), v.reshape(b * t, kv, dv), plan, scale, window,
                 sinks)
    return out.view(b, t, heads, dv)
