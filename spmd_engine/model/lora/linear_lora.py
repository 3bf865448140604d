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

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from spmd_engine import forward_context
from spmd_engine.model.layers import batch_invariant as bi
from spmd_engine.model.lora.stacked import StackPlan, stacked_delta


@dataclass
class StepMapping:
    """(slot, rows) for each adapter in this forward; rows None: every row of the step.
    `stack`: with several adapters, how their rows are laid out for one batched product."""

    groups: list[tuple[int, torch.Tensor | None]]
    stack: StackPlan | None = None

    @property
    def single(self) -> int | None:
        """The slot of the one adapter every row uses, else None."""
        return self.groups[0][0] if len(self.groups) == 1 and self.groups[0][1] is None else None


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
        self.version = next(_versions)  # names these weights in a cache (an id() may be reused)
        self._fast: tuple[torch.Tensor, torch.Tensor] | None = None

    def fast(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(A^T, B^T) for the default mode's products: on CPU a half-precision adapter's in fp32,
        where products this small run faster than in bf16 (no AMX needed)."""
        if self._fast is None:
            a, b = self.a, self.b
            if a.device.type == "cpu" and a.dtype in (torch.bfloat16, torch.float16):
                a, b = a.float(), b.float()
            self._fast = (a.t().contiguous(), b.t().contiguous())
        return self._fast


_versions = itertools.count()


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
        self.stack_cache: tuple | None = None  # stacked.py's weights of the last set of adapters

    chunk_position = -1  # its place in its compiled chunk (compilation/compiled_layers.py)

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y plus this step's adapters' products on their rows. Traced into a compiled graph as
        one opaque op: which rows use which adapter changes every step and is no graph input."""
        if torch.compiler.is_compiling():
            return torch.ops.spmd_engine.lora(x, y, self.chunk_position)
        return self.apply_eager(x, y)

    def apply_eager(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        mapping = self.state.mapping
        if mapping is None:
            return y
        if mapping.single is not None and not self.batch_invariant:  # one adapter on every row: few ops
            weights = self.slots[mapping.single]
            if weights is None:
                return y
            at, bt = weights.fast()
            rows_x = x.reshape(-1, x.shape[-1])
            delta = torch.mm(self.reduce(torch.mm(rows_x.to(at.dtype), at)), bt)
            return y + delta.to(y.dtype).view(y.shape)
        lead = y.shape[:-1]
        rows_x = x.reshape(-1, x.shape[-1])
        out = y.reshape(-1, y.shape[-1])
        if mapping.stack is not None and not self.batch_invariant:  # several adapters: one batched product
            found = stacked_delta(self, rows_x, mapping)
            if found is None:
                return y
            rows, delta = found
            return out.index_add(0, rows, delta.to(out.dtype)).view(*lead, out.shape[-1])
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
        if self.batch_invariant:
            return bi.linear(self._shrink(xs.to(weights.a.dtype), weights.a), weights.b).to(xs.dtype)
        at, bt = weights.fast()
        return torch.mm(self.reduce(torch.mm(xs.to(at.dtype), at)), bt).to(xs.dtype)

    def reduce(self, shrunk: torch.Tensor) -> torch.Tensor:
        """A row-parallel layer's rank-r products summed over its group (default mode)."""
        group = self.row_group
        return group.all_reduce(shrunk) if group is not None and group.world_size > 1 else shrunk

    def _shrink(self, xs: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """Batch-invariant mode's x A^T; a row-parallel layer's summed over its group by the
        fixed tree its base weight uses (the same bits at every TP size, the trainer's too)."""
        group = self.row_group
        return bi.linear(xs, a) if group is None else bi.row_parallel_linear(xs, a, group)


_lib = torch.library.Library("spmd_engine", "FRAGMENT")  # the op lives as long as the process
_lib.define("lora(Tensor x, Tensor y, int position) -> Tensor")


def _lora_op(x, y, position):
    out = forward_context.lora_chunk()[position].apply_eager(x, y)
    return out.clone() if out.data_ptr() == y.data_ptr() else out  # an op's output never aliases its input


_lib.impl("lora", _lora_op, "CompositeExplicitAutograd")


@torch.library.register_fake("spmd_engine::lora")
def _lora_fake(x, y, position):
    return torch.empty_like(y)
