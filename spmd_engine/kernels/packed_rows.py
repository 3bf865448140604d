"""A vnni-packed weight as the dense [N, K] parameter a layer's weight_loader writes into.

Why: loaders write a full or fused weight as row ranges (`param.data[a:b]` then `copy_`, or a
`zero_` of padding rows), and a packed weight cannot be sliced that way. Handing the loader this
stand-in lets an in-place update write straight into the packed layout (vnni_gemm.write_rows)
with the loaders unchanged: no unpacked copy, no new packed tensor, the same storage.
"""

from __future__ import annotations

import torch

from spmd_engine.kernels import vnni_gemm


class PackedRows:
    """Rows [start, stop) of a vnni-packed weight; answers what the loaders ask of a dense one
    (`data`, `shape`, `dim`, `dtype`, row slices, `copy_`, `zero_`)."""

    def __init__(self, packed: torch.Tensor, start: int = 0, stop: int | None = None):
        rows, self.k = vnni_gemm.dense_shape(packed)
        self.packed, self.start, self.stop = packed, start, rows if stop is None else stop

    @property
    def data(self) -> "PackedRows":
        return self

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.stop - self.start, self.k))

    @property
    def dtype(self) -> torch.dtype:
        return self.packed.dtype

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def dim(self) -> int:
        return 2

    def __getitem__(self, index) -> "PackedRows":
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError(f"a packed weight is written by row ranges, not {index!r}")
        start, stop, _ = index.indices(self.stop - self.start)
        return PackedRows(self.packed, self.start + start, self.start + max(start, stop))

    def copy_(self, src: torch.Tensor) -> "PackedRows":
        if tuple(src.shape) != tuple(self.shape):
            raise ValueError(f"rows of shape {list(src.shape)} into packed rows of shape {list(self.shape)}")
        vnni_gemm.write_rows(self.packed, self.start, src)
        return self

    def zero_(self) -> "PackedRows":
        return self.copy_(torch.zeros(self.shape, dtype=self.dtype, device=self.device))
