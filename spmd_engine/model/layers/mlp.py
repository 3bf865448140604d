"""The SwiGLU feed-forward block: down(silu(gate(x)) * up(x)).

gate and up are one column-parallel matmul (each rank holds matching slices
of both, so the product needs no communication); down is row-parallel and
does the block's single all-reduce.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from spmd_engine.model.layers import batch_invariant as bi
from spmd_engine.model.layers.linear import MergedColumnParallelLinear, RowParallelLinear


class SwiGLUMLP(nn.Module):
    batch_invariant = False  # silu through batch_invariant.pointwise

    def __init__(self, hidden_size: int, intermediate_size: int, group, bias: bool = False,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, group,
                                                       bias=bias, dtype=dtype)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, group, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        silu = bi.silu if self.batch_invariant else F.silu
        return self.down_proj(silu(gate) * up)
