"""Linear weights pre-packed into oneDNN's blocked layout, for CPU inference.

`F.linear` on CPU hands its row-major weight to a GEMM that, at decode batch
sizes, spends most of its time on the weight rather than on arithmetic: bf16
goes to oneDNN, which reorders the weight into its blocked layout on every
call; fp32 goes to MKL's sgemm, which on some CPUs reads weights far below memory
bandwidth at these shapes. Reordering once after loading and calling oneDNN with
the packed weight removes both (`scripts/bench.py --only decode` measures it).
bf16 results are bitwise identical to `F.linear`; fp32 ones differ in
summation order only (about 1e-6 relative, like a TP split's partial sums).
tests/unit/model/test_packed_weights.py checks both.

A packed weight replaces the layer's `weight` Parameter (an mkldnn-layout
tensor of the same logical shape and dtype, so the dense copy is freed and
`weight.to_dense()` gives it back); `linear` picks the matmul by layout, so a
layer works the same packed or not. bf16 and fp32 weights on CPUs with AVX512-BF16 go to a
hand-written kernel instead (vnni_gemm.py: faster at decode sizes), packed into a
plain 4-D tensor; `layout`, `dense_weight` and `dense_shape` answer for either kind.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from spmd_engine import envs
from spmd_engine.kernels import vnni_gemm

# Set to 0 to keep plain row-major weights (for comparison, or to rule packing out).
ENV_FLAG = envs.CPU_PACKED_WEIGHTS


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b, whether W is a plain tensor or a packed one."""
    if torch.compiler.is_compiling():
        if weight.dim() == 4:  # vnni_gemm's layout, plain to the tracer: its C++ op, no Python between
            return vnni_gemm.linear(x, weight, bias)
        # Traced, a oneDNN-packed weight looks like a plain one (is_mkldnn is False on fake tensors)
        # and inductor cannot read its storage: an opaque op that decides when it runs.
        return torch.ops.spmd_engine.linear(x, weight, bias)
    return eager_linear(x, weight, bias)


def eager_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`linear` when not tracing: also the body of the compiled graph's spmd_engine::linear op."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if weight.dim() == 4:
        return vnni_gemm.linear(x, weight, bias)
    return F.linear(x, weight, bias)


def layout(weight: torch.Tensor) -> str:
    """"onednn", "vnni" or "dense": which kernel a linear weight is packed for."""
    return "onednn" if weight.is_mkldnn else "vnni" if weight.dim() == 4 else "dense"


def is_packed(weight: torch.Tensor) -> bool:
    return layout(weight) != "dense"


def dense_weight(weight: torch.Tensor) -> torch.Tensor:
    """The row-major [out, in] weight of a packed one (a new tensor), or the weight itself."""
    kind = layout(weight)
    return weight.to_dense() if kind == "onednn" else vnni_gemm.unpack(weight) if kind == "vnni" else weight


def dense_shape(weight: torch.Tensor) -> tuple[int, ...]:
    return vnni_gemm.dense_shape(weight) if layout(weight) == "vnni" else tuple(weight.shape)


def packing_applies(dtype: torch.dtype, device: torch.device, batch_invariant: bool = False) -> bool:
    """fp32, or bf16 where oneDNN has bf16 kernels, on CPU, when a trial matmul agrees
    with `F.linear`; unless switched off. Batch-invariant mode too: its `linear` calls
    oneDNN in tiles of 2-32 rows, where a row gets the same bits from the packed weight as
    from the dense one a trainer holds (tests/unit/model/test_batch_invariant_kernels.py);
    the weights its kernels slice stay dense (`pack_linear_weights`)."""
    del batch_invariant  # the same rule: named so the runner and the plan say which mode asked
    if not envs.cpu_packed_weights() or torch.device(device).type != "cpu":
        return False
    ops = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and hasattr(ops, "_linear_pointwise")
            and hasattr(ops, "_reorder_linear_weight")):
        return False
    if dtype == torch.bfloat16 and not ops._is_mkldnn_bf16_supported():
        return False
    return dtype in (torch.float32, torch.bfloat16) and _trial_matmul_agrees(dtype)


@functools.lru_cache(maxsize=None)
def _trial_matmul_agrees(dtype: torch.dtype) -> bool:
    """These are private torch ops: on a build or CPU where they fail or disagree, keep
    plain weights rather than fail at load time or compute something else."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 40, generator=gen).to(dtype)
    x, bias = torch.randn(3, 40, generator=gen).to(dtype), torch.randn(48, generator=gen).to(dtype)
    try:
        got = linear(x, torch.ops.mkldnn._reorder_linear_weight(weight, 3), bias)
    except RuntimeError:
        return False
    return torch.allclose(got.float(), F.linear(x, weight, bias).float(), rtol=1e-2, atol=1e-2)


def pack_linear_weights(model: nn.Module, batch_hint: int, batch_invariant: bool = False) -> int:
    """Pack the `weight` of every module that declares `packable_weight = True`.

    `batch_hint` (the expected rows per matmul, e.g. max_num_seqs) lets oneDNN
    choose a layout for decode; other batch sizes still work. A weight shared
    with another module (tied embedding and LM head) is copied for the head
    and stays dense for the embedding. Memory grows by one matrix at most while
    packing: each dense weight is released as soon as its packed copy exists.
    Returns how many weights were packed. In batch-invariant mode the weights its kernels
    slice stay dense: experts, and row-parallel weights, which in bf16 get packed copies of
    their K slices beside them (RowParallelLinear.pack_slices; fp32 slices go to MKL).
    """
    packed = 0
    for module in model.modules():
        if batch_invariant and hasattr(module, "pack_slices"):
            if module.weight.dtype == torch.bfloat16:
                module.pack_slices(batch_hint)
                packed += 1
            continue
        if batch_invariant and hasattr(module, "pack_experts"):
            continue
        if hasattr(module, "pack_experts"):  # MoE experts: packed per expert (moe.py)
            module.pack_experts(batch_hint)
            packed += 1
            continue
        if not getattr(module, "packable_weight", False) or is_packed(module.weight):
            continue
        module.packed_batch_hint = batch_hint
        module.packed_layout = _layout_for(module.weight, batch_invariant)
        repack(module, module.weight.detach())
        packed += 1
    return packed


def _layout_for(weight: torch.Tensor, batch_invariant: bool) -> str:
    """The hand-written kernel for bf16 and fp32 weights it fits, outside batch-invariant mode
    (whose tiles and bits are oneDNN's, docs/batch-invariant.md); oneDNN for the rest."""
    dtype = weight.dtype
    if batch_invariant or dtype not in (torch.bfloat16, torch.float32) or not vnni_gemm.fits(*weight.shape, dtype):
        return "onednn"
    return "vnni" if vnni_gemm.wanted(dtype) else "onednn"


def repack(module: nn.Module, dense: torch.Tensor) -> None:
    """Make `dense` (the full local weight, row-major) `module`'s packed weight again: after
    an in-place update, which writes into `weight.to_dense()` (packed tensors cannot be
    sliced)."""
    if getattr(module, "packed_layout", "onednn") == "vnni":
        packed = vnni_gemm.pack(dense)
    else:
        packed = torch.ops.mkldnn._reorder_linear_weight(dense, module.packed_batch_hint)
    module.weight = nn.Parameter(packed, requires_grad=False)
