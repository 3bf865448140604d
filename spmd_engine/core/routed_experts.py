"""A request's routing replay rows, stitched from the steps that computed them.

Each step that computes positions of a request sends back (first position, rows
[n, MoE layers, top_k]) (spmd_engine.worker.routing_replay). They are kept as they
arrive, in step order, and joined once when the request finishes: a later chunk
overwrites an earlier one at the same positions (recomputation after preemption),
so the cost is one copy of the rows, however many steps made them.
"""

from __future__ import annotations

import numpy as np

Chunk = tuple[int, np.ndarray]


def join_chunks(chunks: list[Chunk], num_positions: int) -> np.ndarray:
    """[num_positions, layers, top_k]: every position 0 .. num_positions - 1 exactly once.
    A position no step reported is a bug in the bookkeeping, never a row of zeros."""
    first = chunks[0][1]
    out = np.empty((num_positions,) + first.shape[1:], dtype=first.dtype)
    seen = np.zeros(num_positions, dtype=bool)
    for start, rows in chunks:
        out[start:start + len(rows)] = rows
        seen[start:start + len(rows)] = True
    if not seen.all():
        missing = np.flatnonzero(~seen)
        raise RuntimeError(f"routed experts: no rows for {len(missing)} of {num_positions} positions "
                           f"(first: {int(missing[0])})")
    return out
