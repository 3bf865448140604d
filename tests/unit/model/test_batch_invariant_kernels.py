"""batch_invariant.py's kernels, one at a time: a row's (a query's) bits do not depend on its
neighbours in the call, on how the call is tiled or padded, or on the thread count.

The shapes are chosen to meet the hazards the module names: K=1024 makes MKL split a lone
GEMM's reduction between two threads on the machines we measured, and sequences long
enough to span several key blocks, tiles and key lengths.
"""

from __future__ import annotations

import random

import pytest
import torch

from spmd_engine.kernels.packed_weights import packing_applies
from spmd_engine.model.layers import batch_invariant as bi


@pytest.fixture
def threads():
    """Run a body at several thread counts; restore the process's count afterwards."""
    before = torch.get_num_threads()
    yield (1, 2, 3)
    torch.set_num_threads(before)


FP32_SHAPES = [(torch.float32, 512, 1024), (torch.float32, 768, 1024), (torch.float32, 256, 1024),
               (torch.float32, 300, 1024)]
BF16_SHAPES = [(torch.bfloat16, 256, 1024), (torch.bfloat16, 1536, 512)]  # oneDNN: 48+ rows sum otherwise at 512 x 1536


@pytest.mark.parametrize("kernel,dtype,width,depth", [("linear", *c) for c in FP32_SHAPES + BF16_SHAPES]
                         + [("mkl_linear", *c) for c in FP32_SHAPES])  # mkl_linear: fp32's row-parallel slices
def test_linear_rows_ignore_neighbours_and_threads(kernel, dtype, width, depth, threads):
    """mkl_linear: width 512 cuts a decode's columns between 2 threads, 768 between 2 and 3;
    256 (too narrow) and 300 never."""
    fn = getattr(bi, kernel)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(width, depth, generator=gen).to(dtype)
    x = torch.randn(300, depth, generator=gen).to(dtype)
    torch.set_num_threads(1)
    want = torch.cat([fn(x[i:i + 1], weight) for i in range(len(x))])
    rng = random.Random(0)
    for n in threads:
        torch.set_num_threads(n)
        for count in (1, 2, 7, 16, 17, 33, 80, 300):
            start = rng.randrange(len(x) - count + 1)
            assert torch.equal(fn(x[start:start + count], weight), want[start:start + count]), (n, count)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_parallel_subtree_rows_ignore_neighbours_and_threads(dtype, threads):
    """A decode's slices go to one bmm, a prompt's through `linear`: the same bits."""
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(512, 2048, generator=gen).to(dtype)
    x = torch.randn(40, 2048, generator=gen).to(dtype)
    torch.set_num_threads(1)
    want = torch.cat([bi.partial_tree(x[i:i + 1], weight, 1) for i in range(len(x))])
    for n in threads:
        torch.set_num_threads(n)
        for count in (1, 5, 16, 17, 40):
            assert torch.equal(bi.partial_tree(x[:count], weight, 1), want[:count]), (n, count)
        halves = [bi.partial_tree(xc, wc, 2) for xc, wc in zip(x[:3].chunk(2, dim=-1), weight.chunk(2, dim=-1))]
        assert torch.equal(halves[0] + halves[1], want[:3])  # TP=2's two subtrees, summed by the tree


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hint", [8, 256])
def test_packed_tiles_equal_dense_ones_with_gradients(dtype, hint, threads):
    """What lets the engine pack weights in this mode while a trainer's stay dense (and learn)."""
    if not packing_applies(dtype, torch.device("cpu"), batch_invariant=True):
        pytest.skip(f"this CPU or torch has no oneDNN {dtype} kernels: such weights are never packed here")
    gen = torch.Generator().manual_seed(3)
    for depth, width in ((512, 768), (1536, 512), (512, 32000)):
        weight = torch.randn(width, depth, generator=gen).to(dtype)
        x = torch.randn(300, depth, generator=gen).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, hint)
        for n in threads:
            torch.set_num_threads(n)
            for count in (1, 2, 8, 32, 70, 300):
                assert torch.equal(bi.linear(x[:count], packed), bi.linear(x[:count], weight)), (depth, n, count)
    trained = weight[:64, :48].clone().requires_grad_(True)
    rows = x[:40, :48].clone().requires_grad_(True)
    y = bi.linear(rows, trained)
    assert torch.equal(y, bi.linear(rows.detach(), trained.detach()))
    y.square().sum().backward()
    g = (2 * y.detach()).float()  # d(sum y^2)/dy: the gradients of y = x W^T (tile by tile: close, not equal)
    for got, want in ((trained.grad, g.t() @ rows.detach().float()), (rows.grad, g @ trained.detach().float())):
        scale = want.abs().max().item()
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want, rtol=0, atol=tol * scale)


@pytest.mark.parametrize("fn", [torch.exp, torch.nn.functional.silu, torch.sigmoid])
def test_pointwise_ignores_size_and_threads(threads, fn):
    """(torch's own silu and sigmoid give other bits in a tensor's scalar tail on x86.)"""
    x = torch.randn(150_001, generator=torch.Generator().manual_seed(1)) * 4
    torch.set_num_threads(1)
    want = bi.pointwise(fn, x)
    for n in threads:
        torch.set_num_threads(n)
        for size in (1, 7, 63, 64, 40_000, 70_001, 150_001):
            assert torch.equal(bi.pointwise(fn, x[:size]), want[:size]), (n, size)


def sequences(lengths, kv=2, heads=8, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(t, heads, d, generator=gen), torch.randn(t, kv, d, generator=gen),
             torch.randn(t, kv, d, generator=gen)) for t in lengths]


def attend_chunks(seqs, chunks):
    """Each sequence's queries in chunks of `chunks[b]` (its keys before a chunk cached, as
    the engine's chunked prefill does), all sequences' chunks of a round in one call."""
    heads, kv = seqs[0][0].shape[1], seqs[0][1].shape[1]
    keys = torch.cat([k for _, k, _ in seqs])
    values = torch.cat([v for _, _, v in seqs])
    base = [sum(len(s[0]) for s in seqs[:b]) for b in range(len(seqs))]
    out = [[] for _ in seqs]
    done = [0] * len(seqs)
    while any(d < len(s[0]) for d, s in zip(done, seqs)):
        live = [b for b, s in enumerate(seqs) if done[b] < len(s[0])]
        lens = [min(chunks[b], len(seqs[b][0]) - done[b]) for b in live]
        q = torch.cat([seqs[b][0][done[b]:done[b] + n] for b, n in zip(live, lens)])
        starts = [sum(lens[:i]) for i in range(len(live))]
        ctx = [done[b] for b in live]
        plan = bi.plan_tiles(ctx, lens, starts, lambda seq, pos, live=live: torch.tensor(
            [base[b] for b in live])[seq].view(-1, 1) + pos.view(1, -1), heads // kv, "cpu")
        got = bi.attend(q, keys, values, plan, 0.25)
        for i, (b, n) in enumerate(zip(live, lens)):
            out[b].append(got[starts[i]:starts[i] + n])
            done[b] += n
    return [torch.cat(o) for o in out]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv,d", [(8, 2, 16), (4, 1, 128), (4, 1, 8)])
def test_attention_queries_ignore_batch_chunks_heads_and_threads(threads, heads, kv, d, dtype):
    """Head dim 8 (the tests' tiny models) meets MKL's small kernels unless padded; bf16 goes
    through torch's SDPA where the probe finds it invariant."""
    seqs = [tuple(x.to(dtype) for x in s) for s in sequences([300, 1, 45, 130, 64], kv=kv, heads=heads, d=d)]
    torch.set_num_threads(1)
    want = [attend_chunks([s], [len(s[0])])[0] for s in seqs]  # each alone, whole
    for n in threads:
        torch.set_num_threads(n)
        for chunks in ([10_000] * 5, [16] * 5, [1, 7, 33, 64, 5], [1] * 5):
            got = attend_chunks(seqs, chunks)
            assert all(torch.equal(g, w) for g, w in zip(got, want)), (n, chunks)
        # a decode tile beside a long prompt's, the decode's key length padded differently
        assert torch.equal(attend_chunks(seqs[:2], [300, 1])[1], want[1])
    # a TP rank holds some of a KV head's query heads: one alone, the same bits
    for chunks in ([10_000] * 5, [1] * 5):
        alone = attend_chunks([(q[:, :1], k[:, :1], v[:, :1]) for q, k, v in seqs], chunks)
        assert all(torch.equal(a, w[:, :1]) for a, w in zip(alone, want)), chunks


def test_sdpa_serves_only_where_the_probe_finds_it_invariant():
    """The negative control of the bf16 path: in float32 SDPA's products (MKL's) move a
    query's bits with its call, and the probe sees it."""
    assert not bi._sdpa_invariant("cpu", 64, torch.float32)


def test_attention_matches_softmax_attention():
    """The recipe is attention: close to SDPA (not equal: other sums)."""
    (q, k, v), = sequences([77], kv=2, heads=4)
    got = bi.causal_attention(q[None], k[None], v[None], 0.25)[0]
    kr, vr = (x.repeat_interleave(2, dim=1).transpose(0, 1) for x in (k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), kr, vr, is_causal=True, scale=0.25)
    torch.testing.assert_close(got, ref.transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_tiles_cover_every_query_once_within_the_score_cap():
    for ctx, q, group in ((0, 1, 4), (0, 512, 4), (37, 200, 1), (5000, 3, 8), (0, 9000, 2)):
        tiles = bi.sequence_tiles(ctx, q, group)
        covered = []
        for first, size, length in tiles:
            real = [j for j in range(first, first + size) if j < q and ctx + j < length]
            assert real and real[0] == first
            assert all(ctx + j < length for j in real) and length % bi.KEY_BLOCK == 0
            assert size * group * length <= bi.MAX_SCORES or size <= bi.LONG_TILE
            if q * group <= bi.MIN_ROWS:  # a decode reads only the key blocks it needs
                assert len(tiles) == 1 and length == -(-(ctx + q) // bi.KEY_BLOCK) * bi.KEY_BLOCK
            covered += real
        assert covered == list(range(q)), (ctx, q, group)
