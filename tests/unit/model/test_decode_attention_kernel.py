"""The decode-step attention kernel (kernels/decode_attention.py, kernels/decode_attention.cpp).

It writes each token's K/V to its slot and attends to the token's first seq_len keys; checked
against torch's SDPA on the same gathered keys (decode_attention.reference) and against
paged_attention's torch path, on both of its code paths (the AVX-512 one for head dims 64 and
128, the plain one for the rest), grouped and plain heads, keys across blocks, one key; a
token's bits do not depend on the batch; bad slots or lengths are errors, not reads outside the
cache; the choice of path follows SPMD_ENGINE_CPU_DECODE_ATTENTION. The kernel's tests skip
where there is no g++; one test fails if g++ is there and the kernel is still not used.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from spmd_engine import envs
from spmd_engine.config import ConfigError
from spmd_engine.kernels import decode_attention as kernel
from spmd_engine.model.layers.attention import AttentionMetadata, paged_attention

REASON = kernel.unavailable()
needs_kernel = pytest.mark.skipif(REASON is not None, reason=f"the kernel is unavailable here: {REASON}")


def _step(lens, bs, blocks, gen):
    """Block tables (each token its own blocks, in no order), slots of the last key, lengths."""
    nb = max(-(-L // bs) for L in lens)
    tables = torch.randperm(blocks, generator=gen)[:len(lens) * nb].view(len(lens), nb)
    slots = torch.stack([tables[n, (L - 1) // bs] * bs + (L - 1) % bs for n, L in enumerate(lens)])
    return slots, tables, torch.tensor(lens)


@needs_kernel
@pytest.mark.parametrize("D", [64, 128, 24])  # the AVX-512 path's two head dims, and the plain path
@pytest.mark.parametrize("heads,kv", [(8, 2), (4, 4), (7, 1), (10, 2)])  # groups of 4, 1, 7 and 5 heads
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_equals_sdpa_and_writes_the_slots(D, heads, kv, dtype):
    gen = torch.Generator().manual_seed(D + heads * 10 + kv)
    bs, blocks, lens = 16, 64, [1, 16, 17, 40, 100, 33]
    caches = [torch.randn(blocks, bs, kv, D, generator=gen).to(dtype) for _ in range(2)]
    step = _step(lens, bs, blocks, gen)
    q, k, v = (torch.randn(len(lens), h, D, generator=gen).to(dtype) for h in (heads, kv, kv))
    want_caches = [c.clone() for c in caches]
    want = kernel.reference(q, k, v, *want_caches, step, D ** -0.5)
    got = kernel.decode(q, k, v, *caches, step, D ** -0.5)
    assert got.dtype == dtype and got.shape == (len(lens), heads * D)
    assert all(torch.equal(a, b) for a, b in zip(caches, want_caches))  # the same slots written
    tol = 2e-6 if dtype == torch.float32 else 1e-2  # float32 sums in another order; bf16: one rounding
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@needs_kernel
@pytest.mark.parametrize("D", [64, 24])
def test_q_k_v_read_in_place_from_the_steps_qkv_rows_give_the_same_bits(D):
    """Inside a compiled layer q, k and v are slices of one [N, (H + 2 KV) * D] row per token: the
    kernel reads them there (no copy); other layouts (heads not one after another, int32
    metadata) are copied first. Every way gives the contiguous call's bits and slots."""
    gen = torch.Generator().manual_seed(5)
    bs, blocks, lens, H, KV = 16, 64, [5, 70, 33, 1, 48], 8, 2
    caches = [torch.randn(blocks, bs, KV, D, generator=gen).bfloat16() for _ in range(2)]
    step = _step(lens, bs, blocks, gen)
    qkv = torch.randn(len(lens), (H + 2 * KV) * D, generator=gen).bfloat16()
    q, k, v = (part.view(len(lens), -1, D) for part in qkv.split([H * D, KV * D, KV * D], dim=-1))
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    want_caches = [c.clone() for c in caches]
    want = kernel.decode(q.contiguous(), k.contiguous(), v.contiguous(), *want_caches, step, 0.125)
    for args in ((q, k, v), (q.transpose(0, 1).contiguous().transpose(0, 1), k, v)):
        got_caches = [c.clone() for c in caches]
        got = kernel.decode(*args, *got_caches, tuple(t.int() for t in step), 0.125)
        assert torch.equal(got, want)
        assert all(torch.equal(a, b) for a, b in zip(got_caches, want_caches))


@needs_kernel
@pytest.mark.parametrize("D", [64, 24])
def test_a_tokens_bits_do_not_depend_on_the_batch(D):
    gen = torch.Generator().manual_seed(3)
    bs, blocks, lens = 16, 64, [5, 70, 33, 1, 48]
    caches = [torch.randn(blocks, bs, 2, D, generator=gen).bfloat16() for _ in range(2)]
    slots, tables, seq = _step(lens, bs, blocks, gen)
    q, k, v = (torch.randn(len(lens), h, D, generator=gen).bfloat16() for h in (8, 2, 2))
    batch = kernel.decode(q, k, v, *caches, (slots, tables, seq), 0.125)
    for n in range(len(lens)):
        alone = kernel.decode(q[n:n + 1], k[n:n + 1], v[n:n + 1], *caches,
                              (slots[n:n + 1], tables[n:n + 1], seq[n:n + 1]), 0.125)
        assert torch.equal(alone[0], batch[n]), n


@needs_kernel
def test_paged_attention_sends_decode_steps_to_the_kernel_and_agrees_with_its_torch_path(monkeypatch):
    gen = torch.Generator().manual_seed(4)
    bs, D, contexts = 4, 64, [1, 3, 4, 9, 17, 2]
    tables, at = [], 0
    for c in contexts:
        n = c // bs + 1
        tables.append([(7 * (at + i)) % 40 for i in range(n)])
        at += n
    attn = AttentionMetadata.build(contexts, [1] * len(contexts), tables, bs, "cpu")
    q = torch.randn(len(contexts), 8, D, generator=gen).bfloat16()
    k, v = (torch.randn(len(contexts), 2, D, generator=gen).bfloat16() for _ in range(2))
    caches = [torch.randn(40, bs, 2, D, generator=gen).bfloat16() for _ in range(2)]
    torch_caches = [c.clone() for c in caches]
    got = paged_attention(q, k, v, *caches, attn, D ** -0.5)
    assert torch.equal(got, kernel.decode(q, k, v, *[c.clone() for c in caches], attn.decode_step(), D ** -0.5))
    monkeypatch.setenv(envs.CPU_DECODE_ATTENTION, "torch")
    want = paged_attention(q, k, v, *torch_caches, attn, D ** -0.5)  # SDPA on gathered blocks
    assert all(torch.equal(a, b) for a, b in zip(caches, torch_caches))
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)


@needs_kernel
def test_slots_blocks_and_lengths_outside_the_cache_are_errors():
    gen = torch.Generator().manual_seed(5)
    caches = [torch.zeros(8, 4, 1, 8) for _ in range(2)]
    q, k, v = torch.randn(1, 2, 8, generator=gen), torch.randn(1, 1, 8, generator=gen), torch.randn(1, 1, 8, generator=gen)
    table = torch.tensor([[1, 2]])
    with pytest.raises(RuntimeError, match="slot 32 outside the cache"):
        kernel.decode(q, k, v, *caches, (torch.tensor([32]), table, torch.tensor([5])), 1.0)
    with pytest.raises(RuntimeError, match="9 keys for a table of 2 blocks"):
        kernel.decode(q, k, v, *caches, (torch.tensor([5]), table, torch.tensor([9])), 1.0)
    with pytest.raises(RuntimeError, match="block 8 outside the cache"):
        kernel.decode(q, k, v, *caches, (torch.tensor([5]), torch.tensor([[1, 8]]), torch.tensor([6])), 1.0)
    assert not any(c.any() for c in caches)  # nothing written before the checks passed


def test_the_choice_of_path_and_its_errors(monkeypatch):
    monkeypatch.setenv(envs.CPU_DECODE_ATTENTION, "torch")
    assert not kernel.usable("cpu")
    monkeypatch.setenv(envs.CPU_DECODE_ATTENTION, "flash")
    with pytest.raises(ConfigError, match="SPMD_ENGINE_CPU_DECODE_ATTENTION='flash': expected 'auto', 'torch' or 'kernel'"):
        kernel.usable("cpu")
    monkeypatch.setenv(envs.CPU_DECODE_ATTENTION, "kernel")
    assert not kernel.usable("meta")  # CPU only
    monkeypatch.setattr(kernel, "unavailable", lambda: "no g++ on PATH to build it with")
    with pytest.raises(ConfigError, match="=kernel, but the kernel is unavailable: no g\\+\\+ on PATH"):
        kernel.usable("cpu")
    monkeypatch.setenv(envs.CPU_DECODE_ATTENTION, "auto")
    assert not kernel.usable("cpu")  # auto: torch code, quietly


def test_the_kernel_is_used_wherever_g_plus_plus_is_there(monkeypatch):
    """Else a kernel broken so that its trial fails would only skip the tests above."""
    if shutil.which("g++") is None:
        pytest.skip("no g++ here: the kernel is not expected")
    monkeypatch.delenv(envs.CPU_DECODE_ATTENTION, raising=False)
    assert REASON is None and kernel.usable("cpu")
