"""The decode-step attention of kernels/decode_attention.cpp: built once per machine, loaded, checked.

A decode-shaped step (one new token per request, each with a cache) is most of a generation's
steps. Its attention, as torch code, was SDPA behind two gathers eager and a few inductor loops
compiled, either way most of the step's time outside the matmuls (docs/performance.md). The kernel writes the step's K/V to their slots and attends,
every token on its own keys only (its bits do not depend on the batch), in float32.

It serves every CPU dtype, needs only g++ (no particular instruction set), and where it cannot
be built or its trial disagrees with torch's attention, steps keep the torch code
(`SPMD_ENGINE_CPU_DECODE_ATTENTION=kernel` makes that an error instead, `torch` never uses it).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from spmd_engine import envs
from spmd_engine.config import ConfigError
from spmd_engine.kernels import native

SOURCE = Path(__file__).resolve().with_name("decode_attention.cpp")


def usable(device) -> bool:
    """Whether decode-shaped steps on `device` go to the kernel (the choice is made once per
    process, and is part of a compiled graph's package name). Never call it in traced code: the
    first call builds and tries the kernel, a graph break for dynamo (Attention asks when its
    cache is bound)."""
    if torch.device(device).type != "cpu":
        return False
    choice = envs.cpu_decode_attention()
    if choice == "torch":
        return False
    reason = unavailable()
    if reason is not None and choice == "kernel":
        raise ConfigError(f"{envs.CPU_DECODE_ATTENTION}=kernel, but the kernel is unavailable: {reason}")
    return reason is None


def start_building(device) -> None:
    """Start building the library now (native.start_building) where `usable` will ask for it."""
    if torch.device(device).type == "cpu" and envs.cpu_decode_attention() != "torch":
        native.start_building(SOURCE)


def decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           step: tuple, scale: float, window: int | None = None) -> torch.Tensor:
    """attention.decode_attention's contract: q [N, heads, D], k and v [N, kv_heads, D], `step`
    a DecodeStep (slots, block tables, sequence lengths), `window` a sliding-window layer's
    width (None: every key); returns [N, heads * D]."""
    slots, block_tables, seq_lens = step
    return torch.ops.spmd_decode_attention.decode(q, k, v, k_cache, v_cache, slots, block_tables, seq_lens, scale,
                                                  window or 0)


@functools.lru_cache(maxsize=None)
def unavailable() -> str | None:
    """Why the kernel cannot be used here, or None once it is loaded and its trial agrees."""
    return native.unavailable(_load_and_try)


def _load_and_try() -> str | None:
    native.load(SOURCE, {"spmd_decode_attention::decode": _fake})
    return _trial_disagrees()


def _fake(q, k, v, k_cache, v_cache, slots, block_tables, seq_lens, scale, window=0):
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


def reference(q, k, v, k_cache, v_cache, step, scale, window: int | None = None) -> torch.Tensor:
    """The same step through torch's SDPA on gathered keys, float32 (the trial's and tests' yardstick):
    writes the caches as the kernel does."""
    slots, block_tables, seq_lens = step
    N, heads, D = q.shape
    kv, bs = k.shape[1], k_cache.shape[1]
    k_cache.view(-1, kv, D)[slots] = k.to(k_cache.dtype)
    v_cache.view(-1, kv, D)[slots] = v.to(v_cache.dtype)
    outs = []
    for n in range(N):
        L = int(seq_lens[n])
        seen = torch.arange(max(0, L - window) if window else 0, L)
        rows = block_tables[n][seen // bs] * bs + seen % bs
        keys = k_cache.view(-1, kv, D)[rows].float().transpose(0, 1)  # [kv, L, D]
        values = v_cache.view(-1, kv, D)[rows].float().transpose(0, 1)
        out = F.scaled_dot_product_attention(q[n].float().view(heads, 1, D), keys, values, scale=scale,
                                             enable_gqa=True)
        outs.append(out.reshape(heads * D))
    return torch.stack(outs).to(q.dtype)


def _trial_disagrees() -> str | None:
    """Grouped and plain heads, keys across blocks, a token seeing one key, fp32 and bf16, both
    code paths (head dims 64 and 128 take the AVX-512 one where the CPU has it), with and
    without a sliding window (shorter and longer than the keys, starting mid-block)."""
    gen = torch.Generator().manual_seed(0)
    for dtype, heads, kv, D, lens in ((torch.float32, 4, 2, 16, (1, 5, 19)), (torch.bfloat16, 3, 3, 8, (7, 16, 33)),
                                      (torch.bfloat16, 8, 2, 64, (1, 21, 40)), (torch.float32, 6, 2, 128, (2, 17))):
        bs, blocks = 4, 40
        caches = [torch.randn(blocks, bs, kv, D, generator=gen).to(dtype) for _ in range(2)]
        N, nb = len(lens), max(-(-L // bs) for L in lens)
        tables = torch.randperm(blocks, generator=gen)[:N * nb].view(N, nb)
        seq_lens = torch.tensor(lens)
        slots = torch.stack([tables[n, (L - 1) // bs] * bs + (L - 1) % bs for n, L in enumerate(lens)])
        q, k, v = (torch.randn(N, h, D, generator=gen).to(dtype) for h in (heads, kv, kv))
        for window in (None, 6, 21):
            want = reference(q, k, v, *(c.clone() for c in caches), (slots, tables, seq_lens), D ** -0.5, window)
            got = decode(q, k, v, *(c.clone() for c in caches), (slots, tables, seq_lens), D ** -0.5, window)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            if got.shape != want.shape or not torch.allclose(got.float(), want.float(), rtol=tol, atol=tol):
                return f"its trial disagrees with SDPA ({dtype}, {heads} heads over {kv}, window {window})"
    return None
