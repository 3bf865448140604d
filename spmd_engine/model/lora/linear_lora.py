"""The adapters' share of one linear layer's output: y += scaling * B A x, per token's adapter.

A step's tokens belong to the base model or to one of up to `max_loras` adapters, each held in a
slot. `StepMapping` says which rows use which slot; each layer with LoRA (`LinearLoRA`, hung on
the linear layer as `.lora`) takes those rows, multiplies them by that slot's low-rank A then B,
and adds the product to their rows of the base output. Rows of the base model are untouched,
so a base request's bits do not depend on what else is batched.

Under tensor parallelism A and B are cut as their base layer is: a column-parallel layer
(q/k/v, gate/up) holds all of A and its rows of B, so the product needs no communication; a
row-parallel layer (o, down) holds its columns of A, so the rank-r products are summed over
the group before B (an all-reduce of r numbers per token, not of the layer's output).
Merged layers (qkv, gate_up) keep one (A, B) per part, each adding to its own columns.

In batch-invariant mode every product is batch_invariant.linear and the rows are gathered and
added back element by element, so a token's result depends on that token alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from spmd_engine.model.layers import batch_invariant as bi


@dataclass
class StepMapping:
    """(slot, rows) for each adapter in this forward; rows None: every row of the step."""

    groups: list[tuple[int, torch.Tensor | None]]


class LoRAState:
    """What every LinearLoRA of one model reads: this forward's mapping (None: base only)."""

    def __init__(self):
        self.mapping: StepMapping | None = None


class SlotWeights:
    """One adapter's tensors for one layer on this rank, from per output part (A, B * scaling)
    or None for a part the adapter does not target: the parts' A stacked ([R, in], R the sum
    of their ranks) and their B's laid block-diagonally ([out, R], zero rows for a part not
    targeted), so a merged layer's adapter is two products, not two a part."""

    def __init__(self, parts: list[tuple[torch.Tensor, torch.Tensor] | None], part_sizes: list[int]):
        present = [p for p in parts if p is not None]
        self.a = torch.cat([a for a, _ in present]) if len(present) > 1 else present[0][0]
        total, before, rows = self.a.shape[0], 0, []
        for part, size in zip(parts, part_sizes):
            if part is None:
                rows.append(self.a.new_zeros(size, total))
                continue
            b = part[1]
            rows.append(F.pad(b, (before, total - before - b.shape[1])) if b.shape[1] != total else b)
            before += b.shape[1]
        self.b = torch.cat(rows) if len(rows) > 1 else rows[0]


class LinearLoRA:
    def __init__(self, state: LoRAState, part_sizes: list[int], max_loras: int, group=None,
                 batch_invariant: bool = False):
        """`part_sizes`: this rank's output columns of each part, in order; `group`: the TP
        group when the layer is row-parallel (the rank-r products are summed over it)."""
        self.state = state
        self.part_sizes = list(part_sizes)
        self.slots: list[SlotWeights | None] = [None] * max_loras
        self.row_group = group
        self.batch_invariant = batch_invariant

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        mapping = self.state.mapping
        if mapping is None:
            return y
        lead = y.shape[:-1]
        rows_x = x.reshape(-1, x.shape[-1])
        out = y.reshape(-1, y.shape[-1])
        for slot, rows in mapping.groups:
            weights = self.slots[slot]
            if weights is None:
                continue
            xs = rows_x if rows is None else rows_x.index_select(0, rows)
            xs = xs if xs.dtype == out.dtype else xs.to(out.dtype)
            delta = self._delta(xs, weights)
            out = out + delta if rows is None else out.index_add(0, rows, delta)
        return out.view(*lead, out.shape[-1])

    def _delta(self, xs: torch.Tensor, weights: SlotWeights) -> torch.Tensor:
        linear = bi.linear if self.batch_invariant else F.linear
        return linear(self._shrink(xs.to(weights.a.dtype), weights.a), weights.b).to(xs.dtype)

    def _shrink(self, xs: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """x A^T; a row-parallel layer's summed over its group, in batch-invariant mode by the
        fixed tree its base weight uses (the same bits at every TP size, the trainer's too)."""
        group = self.row_group
        if self.batch_invariant:
            return bi.linear(xs, a) if group is None else bi.row_parallel_linear(xs, a, group)
        shrunk = F.linear(xs, a)
        return group.all_reduce(shrunk) if group is not None and group.world_size > 1 else shrunk
