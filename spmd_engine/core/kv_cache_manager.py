"""Per-request block tables over a BlockPool: prefix hits, allocation as tokens arrive, free.

A request's token at position p lives in block `table[p // block_size]`, at
offset `p % block_size`. Blocks are allocated only for tokens about to be
computed. A block that becomes full is registered under its chain hash, so a
later request with the same prefix (another of `n` samples, a repeated system
prompt, a resumed request) reuses it instead of computing it again. A hit is
capped one token short of the whole request: the last token must run through
the model to produce logits.
"""

from __future__ import annotations

from spmd_engine.core.block_pool import BlockPool, chain_hash
from spmd_engine.core.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.tables: dict[str, list[int]] = {}
        # How many of each request's first blocks were offered to the prefix cache: each full
        # block once (as vLLM's num_cached_block), not every block of the table every step.
        self._offered: dict[str, int] = {}

    @property
    def enable_caching(self) -> bool:
        return self.pool.enable_caching

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_of(self, request_id: str) -> list[int]:
        return self.tables.get(request_id, [])

    def _hashes(self, request: Request, num_full_blocks: int) -> list[bytes]:
        """The chain hashes of the request's first `num_full_blocks` blocks (computed once each)."""
        hashes, bs = request.block_hashes, self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else request.cache_root
            hashes.append(chain_hash(parent, request.token_slice(i * bs, (i + 1) * bs)))
        return hashes

    def get_computed_blocks(self, request: Request) -> list[int]:
        """The longest run of cached blocks that starts the request (not yet referenced)."""
        if not self.enable_caching:
            return []
        hits = []
        usable = (request.num_tokens - 1) // self.block_size
        # [:usable]: a request preempted while its step was in flight (PP, async scheduling) comes
        # back with that step's token dropped, and may hold the hash of a block its tokens fill.
        for h in self._hashes(request, usable)[:usable]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[int] | None = None) -> list[int] | None:
        """Blocks for `num_new_tokens` more tokens after the request's computed ones.

        `computed_blocks` (a fresh request's prefix hits) are taken first. Returns
        the blocks added to the table this step (hits included), or None, changing
        nothing, when the pool cannot supply them.
        """
        computed_blocks = computed_blocks or []
        table = self.tables.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        total = num_computed + num_new_tokens
        needed = -(-total // self.block_size) - len(table) - len(computed_blocks)
        # A hit on a free cached block takes it out of the free queue too.
        reclaimed = sum(1 for b in computed_blocks if self.pool.ref_cnt[b] == 0)
        if needed + reclaimed > self.pool.num_free_blocks:
            return None
        self.pool.touch(computed_blocks)
        added = computed_blocks + self.pool.get_new_blocks(max(0, needed))
        table = table + added
        self.tables[request.request_id] = table
        # Blocks full once this step's tokens are computed become findable now: a request
        # scheduled later in the same step may share them (each layer writes this step's
        # K/V before any row reads the cache). A block offered once is not offered again while
        # the request holds it (held, it cannot be evicted; one whose content another block
        # already had stays unregistered, as in vLLM).
        if self.enable_caching:
            full = min(total, request.num_tokens) // self.block_size
            offered = self._offered.get(request.request_id, 0)
            if full > offered:
                hashes = self._hashes(request, full)
                for i in range(offered, full):
                    self.pool.cache_block(table[i], hashes[i])
                self._offered[request.request_id] = full
        return added

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its last blocks are evicted first."""
        table = self.tables.pop(request.request_id, [])
        self._offered.pop(request.request_id, None)
        self.pool.free_blocks(reversed(table))

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
