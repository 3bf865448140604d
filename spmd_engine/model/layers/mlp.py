"""The gated feed-forward block: down(act(gate(x)) * up(x)), SwiGLU (silu) or GeGLU (Gemma's
tanh-approximated gelu).

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


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# HF's activation names (config.json's hidden_act / hidden_activation) -> (eager, batch-invariant).
ACTIVATIONS = {"silu": (F.silu, bi.silu), "gelu_pytorch_tanh": (gelu_tanh, bi.gelu_tanh)}


class SwiGLUMLP(nn.Module):
    batch_invariant = False  # the activation through batch_invariant.pointwise

    def __init__(self, hidden_size: int, intermediate_size: int, group, bias: bool = False,
                 dtype: torch.dtype | None = None, activation: str = "silu"):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, group,
                                                       bias=bias, dtype=dtype)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, group, bias=bias, dtype=dtype)
        self.act, self.act_invariant = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        act = self.act_invariant if self.batch_invariant else self.act
        return self.down_proj(act(gate) * up)
