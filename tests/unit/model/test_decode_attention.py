"""Decode-shaped steps' traced attention (attention.decode_attention, issue 23).

The compiled forward sends decode-shaped steps (one new token per request, every request with a
cache) through decode_attention instead of the opaque paged_attention op. The two must agree:
the same cache writes, bit for bit, and the same outputs to float rounding. Reference here:
paged_attention (itself checked against attention without a cache in test_layers.py).
"""

from __future__ import annotations

import pytest
import torch

from spmd_engine.model.layers.attention import AttentionMetadata, decode_attention, paged_attention


def _caches(num_blocks, block_size, kv, D, dtype, gen):
    shape = (num_blocks, block_size, kv, D)
    return (torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))


@pytest.mark.parametrize("heads,kv", [(8, 2), (4, 4), (6, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_equals_paged_attention(heads, kv, dtype):
    gen = torch.Generator().manual_seed(heads * 10 + kv)
    D, bs = 16, 4
    contexts = [1, 3, 4, 9, 17, 2]  # one block, a full block, several, a partial last one
    tables, at = [], 0
    for c in contexts:  # each request its own blocks, in no particular order
        n = c // bs + 1
        tables.append([(7 * (at + i)) % 40 for i in range(n)])
        at += n
    attn = AttentionMetadata.build(contexts, [1] * len(contexts), tables, bs, "cpu")
    step = attn.decode_step()
    assert step is not None and step.block_tables.shape[1] >= 2
    q = torch.randn(len(contexts), heads, D, generator=gen).to(dtype)
    k, v = (torch.randn(len(contexts), kv, D, generator=gen).to(dtype) for _ in range(2))
    ref_k, ref_v = _caches(40, bs, kv, D, dtype, torch.Generator().manual_seed(1))
    got_k, got_v = ref_k.clone(), ref_v.clone()
    want = paged_attention(q, k, v, ref_k, ref_v, attn, D ** -0.5)
    got = decode_attention(q, k, v, got_k, got_v, step, D ** -0.5)
    assert torch.equal(got_k, ref_k) and torch.equal(got_v, ref_v)  # the same slots written
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_only_decode_shaped_steps_have_a_decode_step():
    bs = 4
    assert AttentionMetadata.build([0], [3], [[0]], bs, "cpu").decode_step() is None  # a fresh prompt
    assert AttentionMetadata.build([5, 2], [1, 3], [[0, 1], [2]], bs, "cpu").decode_step() is None  # a chunk
    assert AttentionMetadata.build([5, 0], [1, 2], [[0, 1], [2]], bs, "cpu").decode_step() is None  # mixed
    invariant = AttentionMetadata.build([5], [1], [[0, 1]], bs, "cpu", invariant=True)
    assert invariant.decode_step() is None  # batch-invariant mode keeps its own kernels
    dummy = AttentionMetadata.build([2], [1], [[0]], bs, "cpu")
    dummy.slot_mapping = None  # a DP wave's dummy step writes nothing
    assert dummy.decode_step() is None
    step = AttentionMetadata.build([2, 6], [1, 1], [[3], [4, 5]], bs, "cpu").decode_step()
    assert step.slots.tolist() == [3 * bs + 2, 5 * bs + 2]
    assert step.block_tables.tolist() == [[3, 0], [4, 5]] and step.seq_lens.tolist() == [3, 7]
    one_block = AttentionMetadata.build([2], [1], [[3]], bs, "cpu").decode_step()
    assert one_block.block_tables.tolist() == [[3, 0]]  # padded: a width of 1 would be a graph of its own


def test_decode_shaped_metadata_is_the_general_builds():
    """build's short path for decode-shaped steps gives what the general path does, field by field
    (random batches, block sizes, contexts and tables with spare blocks), and the DecodeStep the
    general path's group implies: its tables padded to two blocks, sequence lengths position + 1."""
    import random
    rng = random.Random(0)
    for _ in range(300):
        B, bs = rng.randint(1, 9), rng.choice([1, 2, 4, 16])
        ctx = [rng.randint(1, 70) for _ in range(B)]
        tables = [[rng.randint(0, 50) for _ in range(-(-(c + 1) // bs) + rng.randint(0, 2))] for c in ctx]
        fast = AttentionMetadata.build(ctx, [1] * B, tables, bs, "cpu")
        slow = AttentionMetadata._general(ctx, [1] * B, tables, bs, "cpu", False)
        for name in ("num_tokens", "row_order", "row_start", "query_lens"):
            assert getattr(fast, name) == getattr(slow, name), name
        assert torch.equal(fast.slot_mapping, slow.slot_mapping) and torch.equal(fast.positions, slow.positions)
        (f,), (s,) = fast.groups, slow.groups
        assert (f.start, f.end, f.num_rows, f.width, f.pad_index) == (s.start, s.end, s.num_rows, s.width, None)
        assert f._mask is None  # made when first read: the compiled graph and the kernel never read it
        assert torch.equal(f.block_tables, s.block_tables) and torch.equal(f.mask, s.mask)
        step, tables_2 = fast.decode_step(), s.block_tables
        if tables_2.shape[1] < 2:
            tables_2 = torch.cat([tables_2, torch.zeros_like(tables_2)], dim=1)
        assert torch.equal(step.block_tables, tables_2) and torch.equal(step.slots, slow.slot_mapping)
        assert torch.equal(step.seq_lens, slow.positions + 1)


def test_paged_attention_takes_sdpa_output_in_any_layout(monkeypatch):
    """SDPA's output strides are its backend's choice: CUDA's kernels hand back [G, T, heads, D]
    memory seen as [G, heads, T, D], where a view of the folded GQA heads failed (an engine on one
    H200 died at its first decode step). Here SDPA is made to answer in that layout on CPU."""
    from spmd_engine import envs
    from spmd_engine.model.layers import attention
    monkeypatch.setenv(envs.CPU_DECODE_ATTENTION, "torch")  # the SDPA path, not the kernel
    gen = torch.Generator().manual_seed(6)
    bs, D, contexts = 4, 16, [3, 9, 5]
    tables = [[0, 1, 2], [3, 4, 5], [6, 7]]
    attn = AttentionMetadata.build(contexts, [1] * len(contexts), tables, bs, "cpu")
    q = torch.randn(len(contexts), 8, D, generator=gen)
    k, v = (torch.randn(len(contexts), 2, D, generator=gen) for _ in range(2))
    caches = _caches(10, bs, 2, D, torch.float32, gen)
    want = paged_attention(q, k, v, *(c.clone() for c in caches), attn, D ** -0.5)
    sdpa = attention.F.scaled_dot_product_attention

    def cuda_like(*args, **kwargs):
        out = sdpa(*args, **kwargs)
        return out.transpose(1, 2).contiguous().transpose(1, 2)  # same values, [B, T, H, D] memory

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", cuda_like)
    got = paged_attention(q, k, v, *caches, attn, D ** -0.5)
    assert torch.equal(got, want)

