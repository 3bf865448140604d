"""Several adapters in one step, in two batched products instead of two a adapter.

With G adapters in a step the default mode would run 2G small matmuls a layer, each mostly
call overhead at decode sizes. Instead each adapter's rows are gathered into one [G, m, in]
block (m: the largest group, shorter groups padded with a copy of row 0 whose result is
dropped) and multiplied by the adapters' A^T and B^T stacked ([G, in, R] and [G, R, out], R the
largest rank, smaller ones padded with zeros, which add nothing). The stacks are built once
for a set of adapters and kept until a slot's weights change. Batch-invariant mode does not
come here: its products go row group by row group through its own kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class StackPlan:
    """Where each adapter's rows go in the [G, m] block, built once a step for every layer."""

    slots: tuple[int, ...]  # the block's G adapters' slots, in order
    gather: torch.Tensor  # [G * m] row of the step for each block row (pads: row 0)
    keep: torch.Tensor  # block rows that are real rows
    rows: torch.Tensor  # the step's row of each kept block row
    width: int  # m


def plan(groups: list[tuple[int, torch.Tensor]], device) -> StackPlan:
    width = max(len(rows) for _, rows in groups)
    gather, keep = [], []
    for g, (_, rows) in enumerate(groups):
        ids = rows.tolist()
        gather += ids + [0] * (width - len(ids))
        keep += range(g * width, g * width + len(ids))
    rows = torch.cat([r for _, r in groups])
    return StackPlan(tuple(s for s, _ in groups), torch.tensor(gather, device=device),
                     torch.tensor(keep, device=device), rows, width)


def stacked_delta(lora, rows_x: torch.Tensor, mapping) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(the step's rows, their adapters' products) for `lora` (a LinearLoRA) this step; None when
    none of the step's adapters targets this layer."""
    stack = mapping.stack
    if all(lora.slots[s] is None for s in stack.slots):
        return None
    at, bt = _stacked_weights(lora, stack.slots)
    xg = rows_x.index_select(0, stack.gather).to(at.dtype).view(len(stack.slots), stack.width, -1)
    shrunk = lora.reduce(torch.bmm(xg, at))
    delta = torch.bmm(shrunk, bt).view(len(stack.slots) * stack.width, -1)
    return stack.rows, delta.index_select(0, stack.keep)


def _stacked_weights(lora, slots: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    weights = [lora.slots[s] for s in slots]
    key = (slots, tuple(w.version if w is not None else -1 for w in weights))
    if lora.stack_cache is not None and lora.stack_cache[0] == key:
        return lora.stack_cache[1]
    fast = [w.fast() if w is not None else None for w in weights]
    ref = next(f for f in fast if f is not None)
    rank = max(f[0].shape[1] for f in fast if f is not None)
    ats, bts = [], []
    for f in fast:
        if f is None:  # an adapter that leaves this layer alone: zeros
            ats.append(ref[0].new_zeros(ref[0].shape[0], rank))
            bts.append(ref[1].new_zeros(rank, ref[1].shape[1]))
            continue
        pad = rank - f[0].shape[1]
        ats.append(F.pad(f[0], (0, pad)) if pad else f[0])
        bts.append(F.pad(f[1], (0, 0, 0, pad)) if pad else f[1])
    stacked = (torch.stack(ats), torch.stack(bts))
    lora.stack_cache = (key, stacked)
    return stacked
