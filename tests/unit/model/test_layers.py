"""Every parallel primitive against an unsharded reference, at TP 1, 2 and 4.

TP 1 runs in this process; TP 2 and 4 run in real gloo processes, each rank
building its shard, loading it through the layer's own weight_loader, and
comparing its output with plain torch ops on the full weights. One spawn per
TP size runs all primitives (process start-up dominates the cost).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import require_reference
from fake_groups import DistGroup, ShardOnlyGroup, SoloGroup, run_distributed

from spmd_engine.model.layers import (
    Attention,
    AttentionMetadata,
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SwiGLUMLP,
    VocabParallelEmbedding,
    padded_vocab_size,
)

TOL = 1e-5


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference, relative to the reference's scale when that exceeds 1
    (random unscaled weights make some outputs large)."""
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item() / max(1.0, b.abs().max().item())


def _reference_attention(q, k, v, scale):
    """Causal GQA attention written out: q [T, H, D], k/v [T, KV, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) * scale
    T = q.shape[0]
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v)


def _rope_reference(x, positions, theta):
    """RoPE on [T, H, D] in the half-split layout, via complex rotation (independent of rotate_half)."""
    D = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, D, 2).float() / D)
    rot = torch.polar(torch.ones(len(positions), D // 2), positions.float()[:, None] * inv)
    z = torch.complex(x[..., : D // 2], x[..., D // 2 :]) * rot[:, None, :]
    return torch.cat([z.real, z.imag], dim=-1)


def primitive_errors(group) -> dict:
    """Max abs error of each primitive on this rank vs the unsharded reference."""
    tp, rank = group.world_size, group.rank_in_group
    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    errors = {}
    x = randn(3, 5, 32)

    # Column-parallel: local slice without gather, full output with gather.
    W, b = randn(48, 32), randn(48)
    n = 48 // tp
    for gather in (False, True):
        layer = ColumnParallelLinear(32, 48, group, bias=True, gather_output=gather)
        layer.weight_loader(layer.weight, W)
        layer.weight_loader(layer.bias, b)
        ref = F.linear(x, W, b)
        errors[f"column(gather={gather})"] = _max_err(layer(x), ref if gather else ref[..., rank * n : (rank + 1) * n])

    # Merged gate/up: each rank holds matching slices of both.
    Wg, Wu = randn(64, 32), randn(64, 32)
    merged = MergedColumnParallelLinear(32, [64, 64], group)
    merged.weight_loader(merged.weight, Wg, 0)
    merged.weight_loader(merged.weight, Wu, 1)
    gate, up = merged(x).chunk(2, dim=-1)
    n = 64 // tp
    errors["merged(gate)"] = _max_err(gate, F.linear(x, Wg)[..., rank * n : (rank + 1) * n])
    errors["merged(up)"] = _max_err(up, F.linear(x, Wu)[..., rank * n : (rank + 1) * n])

    # QKV: query heads split; KV heads split or, when tp > kv heads, replicated.
    for heads, kv in ((8, 2), (4, 1)):
        D = 32 // heads
        Wq, Wk, Wv = randn(heads * D, 32), randn(kv * D, 32), randn(kv * D, 32)
        bq, bk, bv = randn(heads * D), randn(kv * D), randn(kv * D)
        qkv = QKVParallelLinear(32, D, heads, kv, group, bias=True)
        for sid, w, bias in (("q", Wq, bq), ("k", Wk, bk), ("v", Wv, bv)):
            qkv.weight_loader(qkv.weight, w, sid)
            qkv.weight_loader(qkv.bias, bias, sid)
        q, k, v = qkv.split(qkv(x))
        hq = heads // tp
        kv_local = max(1, kv // tp)
        # The KV heads this rank must hold are those its query heads attend with.
        first_kv = (rank * hq) // (heads // kv)
        errors[f"qkv{heads}/{kv}(q)"] = _max_err(q, F.linear(x, Wq, bq)[..., rank * hq * D : (rank + 1) * hq * D])
        kv_cols = slice(first_kv * D, (first_kv + kv_local) * D)
        errors[f"qkv{heads}/{kv}(k)"] = _max_err(k, F.linear(x, Wk, bk)[..., kv_cols])
        errors[f"qkv{heads}/{kv}(v)"] = _max_err(v, F.linear(x, Wv, bv)[..., kv_cols])

    # Row-parallel: split input, all-reduce, bias once.
    W, b = randn(32, 48), randn(32)
    x_full = randn(3, 5, 48)
    row = RowParallelLinear(48, 32, group, bias=True)
    row.weight_loader(row.weight, W)
    row.weight_loader(row.bias, b)
    n = 48 // tp
    errors["row"] = _max_err(row(x_full[..., rank * n : (rank + 1) * n]), F.linear(x_full, W, b))

    # Vocab-parallel embedding and LM head, vocab not a multiple of 64.
    E = randn(100, 16)
    ids = torch.tensor([[0, 99, 63, 64, 5], [31, 32, 47, 48, 95]])
    emb = VocabParallelEmbedding(100, 16, group)
    emb.weight_loader(emb.weight, E)
    errors["embedding"] = _max_err(emb(ids), F.embedding(ids, E))
    head = ParallelLMHead(100, 16, group)
    head.weight_loader(head.weight, E)
    hidden = randn(6, 16)
    logits = head.compute_logits(hidden)
    errors["lm_head"] = _max_err(logits, F.linear(hidden, E))

    # SwiGLU MLP.
    Wg, Wu, Wd = randn(64, 32), randn(64, 32), randn(32, 64)
    mlp = SwiGLUMLP(32, 64, group)
    mlp.gate_up_proj.weight_loader(mlp.gate_up_proj.weight, Wg, 0)
    mlp.gate_up_proj.weight_loader(mlp.gate_up_proj.weight, Wu, 1)
    mlp.down_proj.weight_loader(mlp.down_proj.weight, Wd)
    errors["swiglu_mlp"] = _max_err(mlp(x), F.linear(F.silu(F.linear(x, Wg)) * F.linear(x, Wu), Wd))

    # A whole attention block: QKV -> RoPE -> cached attention -> o_proj.
    errors.update(_attention_block_errors(group, randn))
    return {"errors": errors, "logits": logits.numpy(), "tp": tp}


def _attention_block_errors(group, randn) -> dict:
    heads, kv, D, H = 8, 2, 4, 32
    Wq, Wk, Wv, Wo = randn(heads * D, H), randn(kv * D, H), randn(kv * D, H), randn(H, heads * D)
    qkv = QKVParallelLinear(H, D, heads, kv, group)
    for sid, w in (("q", Wq), ("k", Wk), ("v", Wv)):
        qkv.weight_loader(qkv.weight, w, sid)
    o = RowParallelLinear(heads * D, H, group)
    o.weight_loader(o.weight, Wo)
    rope = RotaryEmbedding(D, 10000.0)
    attn = Attention(qkv.num_heads_per_rank, qkv.num_kv_heads_per_rank, D, D ** -0.5)
    attn.allocate_kv_cache(num_blocks=12, block_size=4, dtype=torch.float32, device="cpu")

    def block(x, positions, md):
        lead = x.shape[:-1]
        q, k, v = (t.view(*lead, -1, D) for t in qkv.split(qkv(x)))
        q, k = rope(positions, q, k)
        return o(attn(q, k, v, md))

    def reference(x_seq):  # [T, H] whole sequence from position 0
        pos = torch.arange(len(x_seq))
        q = _rope_reference(F.linear(x_seq, Wq).view(-1, heads, D), pos, 10000.0)
        k = _rope_reference(F.linear(x_seq, Wk).view(-1, kv, D), pos, 10000.0)
        v = F.linear(x_seq, Wv).view(-1, kv, D)
        return F.linear(_reference_attention(q, k, v, D ** -0.5).reshape(len(x_seq), -1), Wo)

    seq_a, seq_b = randn(5, H), randn(6, H)
    ref_a, ref_b = reference(seq_a), reference(seq_b)
    errors = {}
    # no cache: two full rows
    x = torch.stack([seq_a, seq_b[:5]])
    out = block(x, torch.arange(5).expand(2, 5), None)
    errors["attention(no cache)"] = max(_max_err(out[0], ref_a), _max_err(out[1], reference(seq_b[:5])))
    # Packed tokens over a paged cache (4-token blocks; A owns blocks 8.., B owns blocks 0..).
    # step 1: A prefills 3 tokens, B prefills 4
    md = AttentionMetadata.build([0, 0], [3, 4], [[8, 9], [0, 1]], 4, "cpu")
    out = md.to_row_order(block(md.pack([seq_a[:3], seq_b[:4]]), md.positions, md))
    err = max(_max_err(out[:3], ref_a[:3]), _max_err(out[3:], ref_b[:4]))
    # step 2 (mixed): A prefills its last 2 tokens, B decodes 1 (into its second block)
    md = AttentionMetadata.build([3, 4], [2, 1], [[8, 9], [0, 1]], 4, "cpu")
    out = md.to_row_order(block(md.pack([seq_a[3:5], seq_b[4:5]]), md.positions, md))
    err = max(err, _max_err(out[:2], ref_a[3:5]), _max_err(out[2:], ref_b[4:5]))
    # step 3: pure decode of B
    md = AttentionMetadata.build([5], [1], [[0, 1]], 4, "cpu")
    out = block(seq_b[5:6], md.positions, md)
    errors["attention(kv cache, mixed batch)"] = max(err, _max_err(out, ref_b[5:6]))
    return errors


def _worker(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    return primitive_errors(DistGroup(list(range(world_size)), dist.group.WORLD))


def _assert_small(errors: dict, where: str) -> None:
    bad = {k: v for k, v in errors.items() if not v <= TOL}
    assert not bad, f"{where}: primitives off the reference by more than {TOL}: {bad}"


@pytest.mark.timeout(30)
def test_primitives_tp1():
    _assert_small(primitive_errors(SoloGroup())["errors"], "tp=1")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("tp", [2, 4])
def test_primitives_match_reference(tp):
    results = run_distributed(_worker, tp, timeout=80)
    for rank, result in enumerate(results):
        _assert_small(result["errors"], f"tp={tp} rank {rank}")
    # compute_logits gives every rank the identical full logits
    for result in results[1:]:
        assert np.array_equal(result["logits"], results[0]["logits"])
    assert results[0]["logits"].shape == (6, 100)


@pytest.mark.parametrize("tp,expected", [(1, [0]), (2, [0, 1]), (4, [0, 0, 1, 1]), (8, [0, 0, 0, 0, 1, 1, 1, 1])])
def test_kv_heads_replicated_when_tp_exceeds_them(tp, expected):
    """8 query heads, 2 KV heads: at TP 4 and 8 each KV head lives on tp/2 ranks."""
    starts, local = [], []
    for rank in range(tp):
        layer = QKVParallelLinear(32, 4, 8, 2, ShardOnlyGroup(tp, rank))
        starts.append(layer.kv_head_start)
        local.append(layer.num_kv_heads_per_rank)
    if tp <= 2:
        expected = [r * (2 // tp) for r in range(tp)]
    assert starts == expected
    assert local == [max(1, 2 // tp)] * tp


def test_qkv_replicated_shards_hold_the_right_kv_head_at_tp8():
    """No collective is involved in QKV, so all 8 ranks can be checked in one process."""
    gen = torch.Generator().manual_seed(1)
    Wq, Wk, Wv = (torch.randn(n, 32, generator=gen) for n in (32, 8, 8))
    x = torch.randn(2, 32, generator=gen)
    for rank in range(8):
        layer = QKVParallelLinear(32, 4, 8, 2, ShardOnlyGroup(8, rank))
        for sid, w in (("q", Wq), ("k", Wk), ("v", Wv)):
            layer.weight_loader(layer.weight, w, sid)
        q, k, v = layer.split(layer(x))
        kv_head = rank // 4  # query head `rank` belongs to KV group rank // (8 / 2)
        assert torch.equal(q, F.linear(x, Wq)[:, rank * 4 : rank * 4 + 4])
        assert torch.equal(k, F.linear(x, Wk)[:, kv_head * 4 : kv_head * 4 + 4])
        assert torch.equal(v, F.linear(x, Wv)[:, kv_head * 4 : kv_head * 4 + 4])


@pytest.mark.parametrize("vocab,tp,padded", [(258, 1, 320), (258, 8, 320), (320, 2, 320), (100, 3, 192), (1, 1, 64)])
def test_vocab_padding(vocab, tp, padded):
    assert padded_vocab_size(vocab, tp) == padded


def test_embedding_padding_rows_are_zero_and_unread():
    E = torch.randn(100, 8)
    for rank in range(2):
        emb = VocabParallelEmbedding(100, 8, ShardOnlyGroup(2, rank))
        emb.weight_loader(emb.weight, E)
        if rank == 1:  # rows 64..127: 36 real, 28 padding
            assert torch.equal(emb.weight[:36], E[64:])
            assert not emb.weight[36:].any()


def test_rmsnorm_plain_and_fused_residual():
    x, res, w = torch.randn(4, 16), torch.randn(4, 16), torch.randn(16)
    norm = RMSNorm(16, eps=1e-6)
    norm.weight_loader(norm.weight, w)
    ref = lambda t: w * t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6)  # noqa: E731
    assert _max_err(norm(x), ref(x)) < TOL
    out, new_res = norm(x, res)
    assert torch.equal(new_res, x + res)
    assert _max_err(out, ref(x + res)) < TOL


def test_rotary_matches_complex_rotation():
    q, k = torch.randn(1, 7, 3, 8), torch.randn(1, 7, 2, 8)
    positions = torch.tensor([[0, 1, 2, 10, 100, 1000, 4095]])
    rq, rk = RotaryEmbedding(8, 500000.0)(positions, q, k)
    assert _max_err(rq[0], _rope_reference(q[0], positions[0], 500000.0)) < 1e-4
    assert _max_err(rk[0], _rope_reference(k[0], positions[0], 500000.0)) < 1e-4


def test_rope_scaling_linear_divides_frequencies():
    from spmd_engine.model.layers.rotary import inv_frequencies

    base = inv_frequencies(16, 10000.0)
    assert torch.allclose(inv_frequencies(16, 10000.0, {"type": "linear", "factor": 4.0}), base / 4)


def test_rope_scaling_llama3_bands():
    """High frequencies kept, low ones divided by factor, the middle band between."""
    from spmd_engine.model.layers.rotary import inv_frequencies

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    base = inv_frequencies(128, 500000.0)
    scaled = inv_frequencies(128, 500000.0, scaling)
    wavelen = 2 * math.pi / base
    high, low = wavelen < 8192 / 4, wavelen > 8192 / 1
    assert torch.equal(scaled[high], base[high])
    assert torch.allclose(scaled[low], base[low] / 8)
    mid = ~high & ~low
    assert mid.any() and bool(((scaled[mid] < base[mid]) & (scaled[mid] > base[mid] / 8)).all())


def test_rope_scaling_llama3_matches_transformers():
    rope_utils = require_reference("transformers.modeling_rope_utils")
    from transformers import LlamaConfig

    from spmd_engine.model.layers.rotary import inv_frequencies

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    config = LlamaConfig(hidden_size=1024, num_attention_heads=8, rope_theta=500000.0, rope_scaling=scaling)
    hf_inv, _ = rope_utils.ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    assert torch.allclose(inv_frequencies(128, 500000.0, scaling), hf_inv.float(), rtol=1e-6, atol=0)


def test_unsupported_rope_type_is_refused():
    from spmd_engine.model.layers.rotary import inv_frequencies

    with pytest.raises(ValueError, match="dynamic"):
        inv_frequencies(16, 10000.0, {"rope_type": "dynamic", "factor": 2.0})


def test_attention_pure_decode_batch_matches_no_cache():
    """Eight sequences of different lengths decoding one token each, in one call."""
    torch.manual_seed(0)
    attn = Attention(4, 2, 8, 8 ** -0.5)
    attn.allocate_kv_cache(num_blocks=40, block_size=4, dtype=torch.float32, device="cpu")
    lens = [1, 3, 5, 2, 7, 4, 6, 11]
    # Scattered block tables: sequence i owns blocks i, i + 8, i + 16 (not contiguous).
    tables = [[i, i + 8, i + 16] for i in range(8)]
    qs = [torch.randn(n, 4, 8) for n in lens]
    ks = [torch.randn(n, 2, 8) for n in lens]
    vs = [torch.randn(n, 2, 8) for n in lens]
    # prefill all but the last token of each (the one-token sequence has nothing to prefill)
    pre = [i for i in range(8) if lens[i] > 1]
    md = AttentionMetadata.build([0] * len(pre), [lens[i] - 1 for i in pre], [tables[i] for i in pre], 4, "cpu")
    attn(md.pack([qs[i][:-1] for i in pre]), md.pack([ks[i][:-1] for i in pre]), md.pack([vs[i][:-1] for i in pre]), md)
    md = AttentionMetadata.build([n - 1 for n in lens], [1] * 8, tables, 4, "cpu")
    out = md.to_row_order(attn(md.pack([q[-1:] for q in qs]), md.pack([k[-1:] for k in ks]),
                               md.pack([v[-1:] for v in vs]), md))
    for i in range(8):
        ref = _reference_attention(qs[i], ks[i], vs[i], 8 ** -0.5)[-1].reshape(-1)
        assert _max_err(out[i], ref) < TOL
