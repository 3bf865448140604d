"""RMSNorm over a whole column-parallel projection whose features are split over the TP group.

OLMo 2 normalises q and k over all of q_proj's and k_proj's outputs (num_heads x head_dim
wide), not per head, but under TP a rank holds only its heads' columns. Each rank sums the
squares of its columns and one all-reduce (of q's and k's sums together) makes the full
sum; dividing by the features summed over all ranks gives the full mean whether or not KV
heads are replicated (TP above num_key_value_heads: each KV head is on tp / kv ranks, so
its squares and its width are both counted that many times). The weight is cut as the
projection is. The arithmetic is transformers' Olmo2RMSNorm: float32 throughout, the weight
applied before the cast back.

In batch-invariant mode the sum must not depend on the TP size: each head's squares are
summed alone (batch_invariant.row_sum), the heads' sums all-gathered (a copy, no arithmetic)
with each KV head taken once, and added in head order, so TP 1, 2, 4 and 8 give one bit
pattern.
"""

from __future__ import annotations

import torch
from torch import nn

from spmd_engine.model.layers import batch_invariant as bi
from spmd_engine.model.shard import Loaded, check_shape, copy_into, read_range


class ShardedRMSNorm(nn.Module):
    batch_invariant = False
    compile_group = -1  # compiled_layers.register_group's number for `group` (its all-reduce op)

    def __init__(self, full_size: int, local_size: int, start: int, head_dim: int, group, eps: float,
                 dtype: torch.dtype | None = None):
        """`local_size` features of the `full_size`, from feature `start` (this rank's heads,
        `head_dim` each), over `group` (the TP group)."""
        super().__init__()
        self.full_size, self.local_size, self.start, self.head_dim = full_size, local_size, start, head_dim
        self.group, self.tp_size, self.eps = group, group.world_size, eps
        self.weight = nn.Parameter(torch.ones(local_size, dtype=dtype), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id=None) -> None:
        check_shape(loaded, (self.full_size,), "sharded norm")
        copy_into(param.data, read_range(loaded, 0, self.start, self.start + self.local_size))

    def local_sum(self, x32: torch.Tensor) -> torch.Tensor:
        """[..., 1] this rank's sum of squares; batch-invariant: [..., local heads], per head."""
        if self.batch_invariant:
            return bi.row_sum((x32 * x32).unflatten(-1, (-1, self.head_dim)))
        return (x32 * x32).sum(-1, keepdim=True)

    def total(self, heads: torch.Tensor) -> torch.Tensor:
        """[..., 1] the full sum from the group's per-head sums [..., tp, local heads]
        (batch-invariant mode): each head once (replicated KV heads sit on consecutive ranks),
        added in head order."""
        copies = self.tp_size * self.local_size // self.full_size  # ranks holding each head
        return bi.row_sum(heads[..., ::copies, :].flatten(-2)).unsqueeze(-1)

    def scale(self, x32: torch.Tensor, square_sum: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # All-reduced sums count each replicated head as often as it is held; `total`'s once.
        mean = square_sum / (self.full_size if self.batch_invariant else self.tp_size * self.local_size)
        rsqrt = bi.pointwise(torch.rsqrt, mean + self.eps) if self.batch_invariant else torch.rsqrt(mean + self.eps)
        return (self.weight * (x32 * rsqrt)).to(dtype)


def norm_together(pairs: list[tuple[ShardedRMSNorm, torch.Tensor]]) -> list[torch.Tensor]:
    """Each (norm, x) normalised over its whole projection, with one collective for all of them
    (they share the TP group)."""
    norms = [n for n, _ in pairs]
    x32 = [x.float() for _, x in pairs]
    sums = [n.local_sum(x) for n, x in zip(norms, x32)]
    first = norms[0]
    if first.tp_size == 1 and not first.batch_invariant:
        totals = sums
    else:
        widths = [s.shape[-1] for s in sums]
        joined = torch.cat(sums, dim=-1)
        if first.batch_invariant:
            gathered = first.group.all_gather(joined.unsqueeze(-2), dim=-2) if first.tp_size > 1 \
                else joined.unsqueeze(-2)  # [..., tp, widths]
            parts = gathered.split(widths, dim=-1)
            totals = [n.total(p) for n, p in zip(norms, parts)]
        elif torch.compiler.is_compiling():  # the collective stays out of the graph
            totals = torch.ops.spmd_engine.all_reduce(joined, first.compile_group).split(widths, dim=-1)
        else:
            totals = first.group.all_reduce(joined).split(widths, dim=-1)
    return [n.scale(x, t, x_in.dtype) for n, x, t, (_, x_in) in zip(norms, x32, totals, pairs)]
