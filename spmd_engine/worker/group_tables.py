"""The runner's side of a KV cache of several groups (core/kv_groups.py, issue 53): each group's
layers get caches of that group's block count, each request a block table per group, and each
step metadata per group, which every layer picks by its window (AttentionMetadata.for_window).

The groups' metadata differ only in their tables and slots: positions, packing and rows are
the step's, so the top metadata (the full group's) serves everything else the runner reads.
"""

from __future__ import annotations

import dataclasses

import torch


def allocate(model, counts: dict[int | None, int], block_size: int, zeros=torch.zeros) -> None:
    """Zeroed K and V caches for each layer, of its group's block count (`counts`, by window)."""
    caches = []
    for layer in model._attention_layers():
        shape = model.kv_cache_shape(counts[layer.sliding_window], block_size)
        caches.append((zeros(shape, dtype=model.dtype, device=model.device),
                       zeros(shape, dtype=model.dtype, device=model.device)))
    model.bind_kv_cache(caches)


def update(tables: dict, request_id: str, block_ids: tuple[list[int], ...], new_block_table: bool) -> tuple:
    """A request's tables after a step's ScheduledSeq (one list per group)."""
    if new_block_table:
        tables[request_id] = tuple(list(b) for b in block_ids)
    else:
        for table, added in zip(tables[request_id], block_ids):
            table.extend(added)
    return tables[request_id]


def build(context, lens, tables, windows, block_size, device, invariant):
    """The step's metadata: the full group's, carrying every group's by window."""
    from spmd_engine.model.layers.attention import AttentionMetadata
    by_window = {w: AttentionMetadata.build(context, lens, [t[g] for t in tables], block_size, device,
                                            invariant=invariant)
                 for g, w in enumerate(windows)}
    return dataclasses.replace(by_window[windows[0]], by_window=by_window)
