"""Attention sinks (gpt-oss) on every path of the Attention layer, against transformers' own
gpt-oss eager attention (its `sinks` column in the softmax) on the same q, k, v.

Paths: no cache (eager and batch-invariant), the paged step in prompts, chunks after a cache
and decode-shaped steps (where the decode kernel would otherwise run), the compiled forward's
opaque op, the traced decode step, and batch-invariant tiles. Negative control: the same
layer without its sinks must disagree.
"""

from __future__ import annotations

import types

import pytest
import torch
from conftest import require_reference

from spmd_engine import forward_context
from spmd_engine.forward_context import COMPILED
from spmd_engine.model.layers.attention import Attention, AttentionMetadata
from spmd_engine.model.layers.sink_attention import AttentionSinks

HEADS, KV, D, BS = 4, 2, 8, 4
SCALE = D ** -0.5


class _Solo:
    world_size, rank_in_group = 1, 0


def _layer(sinks: torch.Tensor | None, invariant: bool = False, window: int | None = None) -> Attention:
    module = None
    if sinks is not None:
        module = AttentionSinks(HEADS, _Solo())
        module.weight_loader(module.weight, sinks)
    attn = Attention(HEADS, KV, D, SCALE, sliding_window=window, sinks=module)
    attn.batch_invariant = invariant
    attn.allocate_kv_cache(num_blocks=40, block_size=BS, dtype=torch.float32, device="cpu")
    return attn


def _transformers(q, k, v, sinks, window=None) -> torch.Tensor:
    """transformers' gpt-oss eager attention, causal (within `window`), on one sequence [T, heads,
    D] -> [T, heads * D]."""
    gpt_oss = require_reference("transformers.models.gpt_oss.modeling_gpt_oss")
    module = types.SimpleNamespace(sinks=sinks, num_key_value_groups=HEADS // KV, training=False)
    T = q.shape[0]
    mask = torch.full((T, T), float("-inf")).triu(1)
    if window is not None:
        mask = mask + torch.full((T, T), float("-inf")).tril(-window)
    mask = mask.view(1, 1, T, T)
    out, _ = gpt_oss.eager_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], mask, SCALE)
    return out[0].reshape(T, HEADS * D)


def _sequences(lens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(n, h, D, generator=gen) for h in (HEADS, KV, KV)) for n in lens]


SINKS = torch.tensor([2.0, -1.0, 0.5, 3.0])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("window", [None, 4])
def test_no_cache_rows_match_transformers(invariant, window):
    (q, k, v), = _sequences([9])
    out = _layer(SINKS, invariant, window)(q[None], k[None], v[None], None)[0]
    assert torch.allclose(out, _transformers(q, k, v, SINKS, window), atol=1e-5)


def _paged_run(attn: Attention, seqs, split, call=None):
    """Each sequence's first `split` tokens as a prompt step, then the rest one token at a time
    (decode-shaped steps); returns each sequence's outputs [T, heads * D]."""
    call = call or attn
    tables = [[i, i + 10, i + 20, i + 30] for i in range(len(seqs))]
    outs = [[] for _ in seqs]
    md = AttentionMetadata.build([0] * len(seqs), [split] * len(seqs), tables, BS, "cpu",
                                 invariant=attn.batch_invariant)
    got = md.to_row_order(call(*(md.pack([s[j][:split] for s in seqs]) for j in range(3)), md))
    for i in range(len(seqs)):
        outs[i].append(got[i * split:(i + 1) * split])
    for t in range(split, seqs[0][0].shape[0]):
        md = AttentionMetadata.build([t] * len(seqs), [1] * len(seqs), tables, BS, "cpu",
                                     invariant=attn.batch_invariant)
        got = md.to_row_order(call(*(md.pack([s[j][t:t + 1] for s in seqs]) for j in range(3)), md))
        for i in range(len(seqs)):
            outs[i].append(got[i:i + 1])
    return [torch.cat(o) for o in outs]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("window", [None, 3])
def test_paged_prompt_then_decode_matches_transformers(invariant, window):
    """window 3: shorter than the prompt step (5) and the sequences (11)."""
    seqs = _sequences([11, 11, 11], seed=1)
    outs = _paged_run(_layer(SINKS, invariant, window), seqs, split=5)
    for (q, k, v), out in zip(seqs, outs):
        assert torch.allclose(out, _transformers(q, k, v, SINKS, window), atol=1e-5)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("window", [None, 4])
def test_compiled_op_and_traced_decode_step_match_transformers(window):
    """The compiled forward's two forms of the layer: the opaque op reading forward_context,
    and (decode-shaped steps) the DecodeStep's tensors themselves."""
    seqs = _sequences([10, 10], seed=2)
    attn = _layer(SINKS, window=window)

    def call(q, k, v, md):
        step = md.decode_step()
        if step is not None:
            return attn(q, k, v, tuple(step))
        with forward_context.set_forward_context(md):
            return attn(q, k, v, COMPILED)
    outs = _paged_run(attn, seqs, split=6, call=call)
    for (q, k, v), out in zip(seqs, outs):
        assert torch.allclose(out, _transformers(q, k, v, SINKS, window), atol=1e-5)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("window", [None, 4])
def test_chunk_after_cache_matches_transformers(window):
    """A prompt in two chunks: the second attends to the cached first under the group's mask."""
    (q, k, v), = _sequences([13], seed=3)
    attn = _layer(SINKS, window=window)
    table = [[3, 7, 1, 9]]
    md = AttentionMetadata.build([0], [6], table, BS, "cpu")
    first = attn(q[:6], k[:6], v[:6], md)
    md = AttentionMetadata.build([6], [7], table, BS, "cpu")
    second = attn(q[6:], k[6:], v[6:], md)
    assert torch.allclose(torch.cat([first, second]), _transformers(q, k, v, SINKS, window), atol=1e-5)


@pytest.mark.timeout(60)
def test_without_sinks_disagrees():
    """Negative control: the comparison sees the sinks (a layer without them differs)."""
    seqs = _sequences([7], seed=4)
    out = _paged_run(_layer(None), seqs, split=4)[0]
    q, k, v = seqs[0]
    assert not torch.allclose(out, _transformers(q, k, v, SINKS), atol=1e-3)
