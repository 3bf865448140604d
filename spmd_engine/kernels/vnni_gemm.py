"""The decode GEMM of kernels/vnni_gemm.cpp, bf16 and fp32: built once per machine, loaded, checked.

On CPUs with AVX512-BF16, oneDNN's packed bf16 call has a fixed cost before it reads a byte
and its one-row call is as slow as its eight-row one; the hand-written kernel streams a weight
repacked for `vdpbf16ps` and takes less time than oneDNN for a decode step's matmuls
(docs/performance.md has the figures). It is compiled with g++ for this CPU
(`-march=native`) the first time a process needs it and kept in the compile cache folder,
under a lock, so the processes of one job build it once; a CPU without the instructions, a
machine without g++, a failed build or a trial that disagrees with `F.linear` leaves the
weights to oneDNN (`SPMD_ENGINE_CPU_BF16_GEMM=vnni` makes any of those an error instead).

On CPUs with AMX, oneDNN uses the tile unit and the AVX-512 kernel, bound by arithmetic from
eight rows up, lost to it; so the kernel has an AMX path on the same packed layout, for
weights whose K is a multiple of 32, tried at start-up beside the AVX-512 one and used where the
build targets AMX and the OS grants the tile state (`SPMD_ENGINE_CPU_BF16_GEMM=avx512` keeps the
AVX-512 path). Which path
a weight takes depends on its K and the process, never on the batch.

fp32 weights go to the same kernel's fp32 path (plain AVX-512 FMAs: any CPU with AVX-512 F, BW
and VL, AVX512-BF16 or not; built for a CPU without it, the library has this path only) packed
as [N / 16, K, 16, 1]: oneDNN's fp32 call streamed a decode step's small matrices well below
one core's read bandwidth, and the kernel takes less time (docs/performance.md). `SPMD_ENGINE_CPU_FP32_GEMM` chooses as the bf16 variable does.

A packed weight is a plain tensor of shape [N / 16, K / 2, 16, 2] (bf16) or [N / 16, K, 16, 1]
(fp32): the four dimensions tell `packed_weights.linear` which kernel it is for, and no code
that expects an [N, K] weight can read it by mistake.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from spmd_engine import envs, platform
from spmd_engine.config import ConfigError
from spmd_engine.kernels import native

logger = logging.getLogger("spmd_engine")

SOURCE = Path(__file__).resolve().with_name("vnni_gemm.cpp")
# Each as torch's cpuinfo names it and as /proc/cpuinfo does (platform.cpu_flags reads either):
# what any path needs, and what the bf16 paths need besides.
NEEDED_FLAGS = (("avx512_f", "avx512f"), ("avx512_bw", "avx512bw"), ("avx512_vl", "avx512vl"))
BF16_FLAGS = (("avx512_bf16", "avx512_bf16"),)


def _per_line(dtype: torch.dtype) -> int:
    """Values of k in one 64-byte line of 16 columns: a bf16 pair, or one fp32."""
    return 1 if dtype == torch.float32 else 2


def fits(out_features: int, in_features: int, dtype: torch.dtype = torch.bfloat16) -> bool:
    """The kernel's shapes: whole blocks of 16 output columns; for bf16, pairs of input columns."""
    return out_features > 0 and out_features % 16 == 0 and in_features > 0 and in_features % _per_line(dtype) == 0


def pack(dense: torch.Tensor) -> torch.Tensor:
    """[N, K] row-major -> [N / 16, K / p, 16, p] (p = 2 for bf16, 1 for fp32): one 64-byte line
    per k pair (or k) and 16 columns."""
    n, k = dense.shape
    p = _per_line(dense.dtype)
    return dense.detach().contiguous().view(n // 16, 16, k // p, p).permute(0, 2, 1, 3).contiguous()


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The [N, K] row-major weight back (a new tensor)."""
    return packed.permute(0, 2, 1, 3).reshape(dense_shape(packed)).contiguous()


def write_rows(packed: torch.Tensor, start: int, src: torch.Tensor) -> None:
    """Set rows [start, start + len(src)) of a packed weight to `src` ([n, K], any strides, any
    float dtype) in place: the bytes `pack` of the whole updated weight would give, without
    unpacking or allocating it. A block of 16 rows that `src` covers in part is unpacked,
    written and packed again."""
    n, k = src.shape
    if n == 0:
        return
    p = packed.shape[3]
    first, end = start // 16, -(-(start + n) // 16)
    if start % 16 == 0 and n % 16 == 0:
        if (src.dtype in (torch.float32, torch.bfloat16) and src.stride(-1) == 1 and src.device.type == "cpu"
                and unavailable(packed.dtype) is None):
            # Converted and transposed in one pass on this thread: no converted copy of src,
            # and no intra-op threads for a loaded machine (or a transfer receiving beside it)
            # to starve.
            torch.ops.spmd_vnni_gemm.write_blocks(packed, first, src.detach())
            return
        if src.dtype != packed.dtype or src.stride(-1) != 1:
            src = src.to(packed.dtype).contiguous()
        # As 4-byte words (a bf16 pair is one), the layout is a transpose of each block of 16
        # rows, which numpy copies on this thread alone.
        lines = _words(packed[first:end]).reshape(end - first, k // p, 16)
        np.copyto(lines, _words(src).reshape(n // 16, 16, k // p).transpose(0, 2, 1))
        return
    block = unpack(packed[first:end])
    block[start - first * 16:start - first * 16 + n].copy_(src)
    packed[first:end].copy_(pack(block))


def _words(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor whose last dimension is contiguous, as numpy 4-byte words (bf16 in pairs)."""
    return t.detach().view(torch.int32).numpy()


def dense_shape(packed: torch.Tensor) -> tuple[int, int]:
    return packed.shape[0] * 16, packed.shape[1] * packed.shape[3]


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b with a weight from `pack` (any leading dims of x)."""
    lead = x.shape[:-1]
    out = torch.ops.spmd_vnni_gemm.linear(x.reshape(-1, x.shape[-1]).contiguous(), packed, bias)
    return out.view(*lead, out.shape[-1])


def linear_argmax(x: torch.Tensor, packed: torch.Tensor, valid: int | None = None) -> torch.Tensor:
    """[M] int64: each row's argmax over the first `valid` columns (all by default) of
    `linear(x, packed)`, its bf16 or fp32 values in torch.argmax's order (first NaN, else first maximum),
    scanned by each thread over the columns it has just computed: greedy decoding's LM head
    without the logits' float copy or a second pass over them."""
    valid = dense_shape(packed)[0] if valid is None else valid
    return torch.ops.spmd_vnni_gemm.linear_argmax(x.reshape(-1, x.shape[-1]).contiguous(), packed, valid)


def wanted(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether weights of `dtype` (bf16 or fp32) should go to this kernel: "auto" (default)
    where it loads and checks out, "onednn" never, "vnni" (and for bf16 "avx512") always (an
    error where it cannot). For bf16 also sets whether the kernel uses its AMX tiles: "avx512"
    never, the others where they were tried."""
    fp32 = dtype == torch.float32
    variable, choice = (envs.CPU_FP32_GEMM, envs.cpu_fp32_gemm()) if fp32 else (envs.CPU_BF16_GEMM, envs.cpu_bf16_gemm())
    if choice == "onednn":
        return False
    reason = unavailable(dtype)
    if reason is None:
        if fp32:
            _announce_fp32()
        else:
            _announce(_use_tiles(choice != "avx512" and _tiles_tried()))
        return True
    if choice in ("vnni", "avx512"):
        raise ConfigError(f"{variable}={choice}, but the kernel is unavailable: {reason}")
    logger.debug("%s linear weights stay with oneDNN: %s", "fp32" if fp32 else "bf16", reason)
    return False


class _Tiles:
    """The kernel's AMX path in this process: whether it passed the trial, whether it is on."""

    tried = False
    on = False


def amx_in_use() -> bool:
    """Whether the kernel now sends weights with K % 32 == 0 through its AMX tiles."""
    return unavailable() is None and _Tiles.on


def _use_tiles(enable: bool) -> bool:
    """Turn the kernel's AMX path on or off (process-wide); returns whether it is on."""
    _Tiles.on = bool(torch.ops.spmd_vnni_gemm.use_amx(enable))
    return _Tiles.on


@functools.lru_cache(maxsize=None)
def _announce(tiles: bool) -> None:
    logger.info("bf16 linear weights: the hand-written GEMM (kernels/vnni_gemm.cpp), %s",
                "AMX tiles for K % 32 == 0, AVX512-BF16 for the rest" if tiles else "AVX512-BF16")


@functools.lru_cache(maxsize=None)
def _announce_fp32() -> None:
    logger.info("fp32 linear weights: the hand-written GEMM (kernels/vnni_gemm.cpp), AVX-512 FMA")


def _tiles_tried() -> bool:
    """Whether the AMX path exists here (built for a CPU with AMX, the OS grants the tile
    state) and passed the trial; unavailable(bf16) runs the trial on both paths."""
    return unavailable() is None and _Tiles.tried


def start_building(dtype: torch.dtype) -> None:
    """Start building the library now (native.start_building) where weights of `dtype` may go
    to it: the flags are there and neither variable says oneDNN."""
    if dtype not in (torch.float32, torch.bfloat16) or not envs.cpu_packed_weights():
        return
    choice = envs.cpu_fp32_gemm() if dtype == torch.float32 else envs.cpu_bf16_gemm()
    flags = platform.cpu_flags()
    needed = NEEDED_FLAGS + (() if dtype == torch.float32 else BF16_FLAGS)
    if choice != "onednn" and all(flags.intersection(names) for names in needed):
        native.start_building(SOURCE)


@functools.lru_cache(maxsize=None)
def unavailable(dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Why the kernel cannot take `dtype`'s weights here, or None once it is loaded and its
    trial for them agrees. fp32 needs AVX-512 F, BW and VL; bf16 AVX512-BF16 as well (a CPU with
    AVX-512 but without it, Skylake to Ice Lake, gets the fp32 path only)."""
    flags = platform.cpu_flags()
    needed = NEEDED_FLAGS + (() if dtype == torch.float32 else BF16_FLAGS)
    missing = [names[0] for names in needed if not flags.intersection(names)]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    return native.unavailable(functools.partial(_load_and_try, dtype))


def _load_and_try(dtype: torch.dtype) -> str | None:
    """Load the library and try its paths for `dtype` (for bf16 the AMX one too, where this
    build and OS have it)."""
    native.load(SOURCE, {"spmd_vnni_gemm::linear": _fake})
    if dtype == torch.float32:  # one path, no tiles
        return _trial_disagrees(torch.float32)
    if not torch.ops.spmd_vnni_gemm.has_bf16():
        return "the library was built without AVX512-BF16"
    for tiles in (False, True):
        if _use_tiles(tiles) != tiles:
            break  # no AMX in this build or from this OS: the AVX-512 path only
        disagrees = _trial_disagrees(torch.bfloat16)
        if disagrees:
            _use_tiles(False)
            return disagrees + (" on its AMX path" if tiles else "")
        _Tiles.tried = tiles
    _use_tiles(False)
    return None


def _fake(x, packed, bias):
    return x.new_empty(x.shape[0], packed.shape[0] * 16)


def _trial_disagrees(dtype: torch.dtype) -> str | None:
    """The kernel's code paths (groups of 1-4 blocks, 6-row tiles and shorter tails, bias; on
    the AMX path, K % 32 == 0: one and two blocks, up to 16 rows, an overlapping last chunk,
    chunks in pairs from 32 rows; the fp32 path's same tiles)
    against an fp32 matmul of the same values."""
    gen = torch.Generator().manual_seed(0)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
    for n, k, m, with_bias in ((48, 40, 11, True), (32, 64, 8, False), (16, 6, 1, True), (64, 128, 19, False),
                               (48, 96, 16, True), (16, 32, 1, False), (48, 64, 37, True)):
        w = torch.randn(n, k, generator=gen).to(dtype)
        x = torch.randn(m, k, generator=gen).to(dtype)
        b = torch.randn(n, generator=gen).to(dtype) if with_bias else None
        got = linear(x, pack(w), b).float()
        want = F.linear(x.float(), w.float(), None if b is None else b.float())
        if not torch.allclose(got, want, rtol=tol, atol=tol) or not torch.equal(unpack(pack(w)), w):
            return f"its trial {dtype} matmul disagrees with F.linear ({n}x{k}, {m} rows)"
    return None
