"""Sliding-window attention on every path of model/layers/attention.py (issue 53).

A query at position p of a layer with window W sees keys p - W < j <= p: the mask is built
here from transformers' own masking_utils (causal_mask_function and sliding_window_overlay),
and each request's attention computed densely over its whole sequence, the independent
reference. The engine's paths: fresh prompts (causal SDPA, a window mask once a row outgrows
it), cached rows (chunks, prefix hits, decodes) under position masks, the decode-shaped torch
path the compiled graph traces, the decode kernel, the compiled graph's opaque op, and the
batch-invariant tiles. Each also with the window off, which must then differ (the test sees
the window). Freed blocks (block 0 in the table) out of the window must not matter.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spmd_engine import forward_context
from spmd_engine.kernels import decode_attention as kernel
from spmd_engine.model.layers.attention import Attention, AttentionMetadata, decode_attention, paged_attention

pytestmark = pytest.mark.timeout(120)

BS, BLOCKS, KV, HEADS, D = 4, 64, 2, 4, 16


def _hf_mask(positions: torch.Tensor, length: int, window: int | None) -> torch.Tensor:
    from transformers.masking_utils import and_masks, causal_mask_function, sliding_window_overlay
    fn = causal_mask_function if window is None else and_masks(causal_mask_function, sliding_window_overlay(window))
    zero = torch.zeros((), dtype=torch.long)
    return fn(zero, zero, positions.view(-1, 1), torch.arange(length).view(1, -1))


def _case(contexts, queries, seed, freed_before=None):
    """Caches holding each request's context keys at its blocks (block 0 never used: freed
    blocks are block 0 in a table), the requests' full keys and values, and new q, k, v."""
    gen = torch.Generator().manual_seed(seed)
    caches = [torch.randn(BLOCKS, BS, KV, D, generator=gen) for _ in range(2)]
    order = (torch.randperm(BLOCKS - 1, generator=gen) + 1).tolist()
    tables, full = [], []
    for c, qn in zip(contexts, queries):
        n = -(-(c + qn) // BS)
        tables.append([order.pop() for _ in range(n)])
        keys = [torch.randn(c + qn, KV, D, generator=gen) for _ in range(2)]
        for cache, x in zip(caches, keys):
            for p in range(c):
                cache[tables[-1][p // BS], p % BS] = x[p]
        full.append(keys)
    if freed_before is not None:  # blocks wholly before every query's window: given back
        for t, c in zip(tables, contexts):
            for b in range(max(0, c - freed_before + 1) // BS):
                t[b] = 0
    q = [torch.randn(qn, HEADS, D, generator=gen) for qn in queries]
    return caches, tables, full, q


def _reference(contexts, queries, full, q, window):
    outs = []
    for c, qn, (keys, values), qr in zip(contexts, queries, full, q):
        mask = _hf_mask(torch.arange(c, c + qn), c + qn, window)
        out = F.scaled_dot_product_attention(qr.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                             attn_mask=mask, scale=D ** -0.5, enable_gqa=True)
        outs.append(out.transpose(0, 1).reshape(qn, HEADS * D))
    return torch.cat(outs)


def _run(contexts, queries, window, seed=0, invariant=False, path="paged"):
    caches, tables, full, q = _case(contexts, queries, seed, freed_before=window)
    attn = AttentionMetadata.build(contexts, queries, tables, BS, "cpu", invariant=invariant)
    new_k = [keys[c:] for (keys, _), c in zip(full, contexts)]
    new_v = [values[c:] for (_, values), c in zip(full, contexts)]
    qp, kp, vp = attn.pack(q), attn.pack(new_k), attn.pack(new_v)
    if path == "paged":
        out = paged_attention(qp, kp, vp, *caches, attn, D ** -0.5, window)
    elif path == "op":  # the compiled graph's opaque op, metadata through forward_context
        with forward_context.set_forward_context(attn):
            out = torch.ops.spmd_engine.attention(qp, kp, vp, *caches, D ** -0.5, window or 0)
    elif path == "traced":
        out = decode_attention(qp, kp, vp, *caches, tuple(attn.decode_step()), D ** -0.5, window)
    else:
        out = kernel.decode(qp, kp, vp, *caches, attn.decode_step(), D ** -0.5, window)
    return attn.to_row_order(out), _reference(contexts, queries, full, q, window)


# Fresh prompts longer and shorter than the window, chunks and prefix hits, decodes.
MIXED = ([0, 0, 0, 9, 13, 2, 30], [11, 3, 6, 5, 1, 4, 1])
DECODES = ([1, 5, 6, 13, 30, 7], [1] * 6)


@pytest.mark.parametrize("window", [1, 3, 6, 64])
@pytest.mark.parametrize("invariant", [False, True])
def test_paged_attention_honours_the_window(window, invariant):
    got, want = _run(*MIXED, window, invariant=invariant)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("path", ["paged", "op", "traced", "kernel"])
@pytest.mark.parametrize("window", [1, 5, 8])
def test_decode_paths_honour_the_window(path, window):
    if path == "kernel" and kernel.unavailable() is not None:
        pytest.skip(f"the decode kernel is unavailable here: {kernel.unavailable()}")
    got, want = _run(*DECODES, window, seed=1, path=path)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("invariant", [False, True])
def test_without_the_window_the_reference_differs(invariant):
    """Negative control: the window-5 reference is not what full attention gives, so the tests
    above would fail on a path that ignored the window."""
    got, _ = _run(*MIXED, None, invariant=invariant)
    _, want = _run(*MIXED, 5, invariant=invariant)
    assert not torch.allclose(got, want, atol=1e-3)


@pytest.mark.parametrize("invariant", [False, True])
def test_no_cache_forward_honours_the_window(invariant, monkeypatch):
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 23, h, D, generator=gen) for h in (HEADS, KV, KV))
    layer = Attention(HEADS, KV, D, D ** -0.5, sliding_window=7)
    monkeypatch.setattr(Attention, "batch_invariant", invariant)
    got = layer(q, k, v, None)
    mask = _hf_mask(torch.arange(23), 23, 7)
    want = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                          scale=D ** -0.5, enable_gqa=True).transpose(1, 2).reshape(2, 23, -1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_window_below_one_is_refused():
    with pytest.raises(ValueError, match="sliding_window"):
        Attention(HEADS, KV, D, 1.0, sliding_window=0)
