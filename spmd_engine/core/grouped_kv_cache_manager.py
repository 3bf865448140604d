"""One block table per KV-cache group for a model mixing full and sliding-window layers (issue 53).

Each group (core/kv_groups.py) is a KVCacheManager over its own pool: the full group keeps every
block, a sliding group frees what falls out of its window, exactly as a single-window model
does. A request is allocated, freed and preempted in every group at once: `allocate_slots`
asks each group whether it fits before any takes a block, so a refusal changes nothing and the
scheduler preempts as it would for one table. Its answers carry a list per group, in the
groups' order, where the single manager's carry one list.

A prefix hit must hold in every group: the full group's whole prefix and each sliding group's
blocks inside the window before the hit point. The full group's hit is a run from the start,
so any shorter hit is one too; each sliding group then picks its longest hit within that run
(its scan from the end), and the shortest of those is the hit every group agrees on.
"""

from __future__ import annotations

from spmd_engine.core.block_pool import BlockPool
from spmd_engine.core.kv_cache_manager import KVCacheManager
from spmd_engine.core.kv_groups import blocks_per_group
from spmd_engine.core.request import Request


class GroupedKVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, windows: tuple[int | None, ...],
                 scheduler_config):
        if windows[0] is not None:
            raise ValueError(f"a grouped KV cache needs a full-attention group first, got windows {windows}")
        self.block_size = block_size
        self.windows = windows
        counts = blocks_per_group(num_blocks, windows, block_size, scheduler_config)
        self.groups = [KVCacheManager(counts[w], block_size, enable_caching, w) for w in windows]

    @property
    def enable_caching(self) -> bool:
        return self.groups[0].enable_caching

    @property
    def pool(self) -> BlockPool:
        """The full group's pool: the count the engine reports (`num_blocks`)."""
        return self.groups[0].pool

    @property
    def num_free_blocks(self) -> int:
        """The full group's, beside `pool`: every request holding blocks holds some of its."""
        return self.groups[0].num_free_blocks

    def blocks_of(self, request_id: str) -> list[list[int]]:
        return [g.blocks_of(request_id) for g in self.groups]

    def get_computed_blocks(self, request: Request) -> list[list[int]]:
        full = self.groups[0].get_computed_blocks(request)
        if not full:
            return [[] for _ in self.groups]
        n, sliding = len(full), None
        while sliding is None or any(len(h) != n for h in sliding):
            if sliding is not None:
                n = min(len(h) for h in sliding)
            sliding = [g._window_hits(request.block_hashes[:n]) for g in self.groups[1:]]
        return [full[:n], *sliding]

    def hit_tokens(self, computed_blocks: list[list[int]]) -> int:
        return len(computed_blocks[0]) * self.block_size if computed_blocks else 0

    def fits(self, request: Request, num_new_tokens: int, computed_blocks: list[list[int]] | None = None) -> bool:
        computed = computed_blocks or [[] for _ in self.groups]
        return all(g.fits(request, num_new_tokens, c) for g, c in zip(self.groups, computed))

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[list[int]] | None = None) -> tuple[list[int], ...] | None:
        """Each group's blocks added this step (hits included), or None, changing nothing."""
        computed = computed_blocks or [[] for _ in self.groups]
        if not self.fits(request, num_new_tokens, computed):
            return None
        return tuple(g.allocate_slots(request, num_new_tokens, c) for g, c in zip(self.groups, computed))

    def free(self, request: Request) -> None:
        for g in self.groups:
            g.free(request)

    def reset_prefix_cache(self) -> bool:
        if any(any(g.pool.ref_cnt) for g in self.groups):
            return False
        return all([g.reset_prefix_cache() for g in self.groups])

