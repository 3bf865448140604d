"""RMSNorm, with the fused residual-add form the decoder layers use.

The fused form lets a decoder layer carry the residual stream separately
(`hidden, residual = norm(hidden, residual)`), which is also what a pipeline
stage hands to the next one. The arithmetic follows HF Llama: normalise in
float32, cast back, then scale. Gemma's norms (`unit_offset`) store weight - 1 and scale by
1 + weight in float32 before the cast, as HF Gemma does: the two orders round differently in
bf16.
"""

from __future__ import annotations

import torch
from torch import nn

from spmd_engine.model.layers import batch_invariant as bi
from spmd_engine.model.shard import replicated_weight_loader


class RMSNorm(nn.Module):
    batch_invariant = False  # batch_invariant.rms_norm: the row's sum in a fixed order

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None,
                 unit_offset: bool = False):
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            return bi.rms_norm(x, self.weight, self.eps, self.unit_offset)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (x32 * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * x32.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x), or with a residual: (norm(x + residual), x + residual)."""
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    weight_loader = staticmethod(replicated_weight_loader)
