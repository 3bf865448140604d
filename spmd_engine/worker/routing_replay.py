"""Routing replay on the ranks that reply: each computed position's experts, kept by KV slot.

A trainer replaying an MoE rollout (R3) needs the experts of every position the
engine computed for a sample, prompt included. Positions found in the prefix cache
are not computed by the request that hits them, so their routing is kept where
their K/V is: a buffer with one row [MoE layers, top_k] per KV slot
(num_blocks x block_size rows), written for every row a step computes. A cached
block's routing therefore stays with its K/V until the block is reused, and a
request's first schedule (or its resumption after preemption) reads its cached
prefix's rows back from its block table. Recomputation rewrites the same slots.

Each step's rows go back with the sampled tokens as {request id: (first position,
rows [n, layers, top_k])}, numpy int16 (int32 beyond 32767 experts); the engine
stitches them per request (spmd_engine.core.routed_experts).
"""

from __future__ import annotations

import numpy as np
import torch

from spmd_engine.core.step_messages import ScheduledSeq


def routing_dtype(num_experts: int) -> np.dtype:
    return np.dtype(np.int16 if num_experts <= np.iinfo(np.int16).max else np.int32)


class RoutingBuffer:
    def __init__(self, num_slots: int, num_moe_layers: int, top_k: int, num_experts: int, block_size: int):
        # np.zeros is calloc: pages never written cost no resident memory.
        self.rows = np.zeros((num_slots, num_moe_layers, top_k), dtype=routing_dtype(num_experts))
        self.block_size = block_size

    def record(self, seqs: list[ScheduledSeq], row_start: list[int], slot_mapping: torch.Tensor,
               routed: torch.Tensor, block_tables: dict[str, list[int]]) -> dict[str, tuple[int, np.ndarray]]:
        """Store this step's rows (packed order, `routed` [N, layers, k]) at their slots, then
        each scheduled request's new rows, from position 0 when its block table is new and
        starts with cached blocks."""
        computed = routed.cpu().numpy().astype(self.rows.dtype)
        # Every write first: a request later in this step may hit a block computed in it.
        self.rows[slot_mapping.cpu().numpy()] = computed
        out = {}
        for i, s in enumerate(seqs):
            new = computed[row_start[i]:row_start[i] + len(s.token_ids)]
            if s.new_block_table and s.context_len:
                positions = np.arange(s.context_len)
                table = np.asarray(block_tables[s.request_id])
                cached = self.rows[table[positions // self.block_size] * self.block_size
                                   + positions % self.block_size]
                out[s.request_id] = (0, np.concatenate([cached, new]))
            else:
                out[s.request_id] = (s.context_len, new)
        return out
