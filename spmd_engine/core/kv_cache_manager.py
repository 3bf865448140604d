"""Per-request block tables over a BlockPool: prefix hits, allocation as tokens arrive, free.

A request's token at position p lives in block `table[p // block_size]`, at
offset `p % block_size`. Blocks are allocated only for tokens about to be
computed. A block that becomes full is registered under its chain hash, so a
later request with the same prefix (another of `n` samples, a repeated system
prompt, a resumed request) reuses it instead of computing it again. A hit is
capped one token short of the whole request: the last token must run through
the model to produce logits.

Sliding window (issue 53): when every layer attends over the same window W (Mistral,
`sliding_window` here), a block whose positions are all before a request's next query's
window (each < first new position - W + 1; a chunk's earliest query still needs its window)
is never read again: it goes back to the pool (still findable by its hash) and its place in
the table becomes NULL_BLOCK, which the runner sees as block 0, read only under the mask. A
prefix hit then needs only the blocks inside the window before the hit point. A model whose
layers differ in window has one of these per group of layers sharing a window
(core/grouped_kv_cache_manager.py). A model under routing replay keeps every block: it reads
a cached prefix's expert rows back by KV slot (model/windows.py kv_freeing_window and
core/kv_groups.py decide, for the engine, the workers and the plan alike).
"""

from __future__ import annotations

from spmd_engine.core.block_pool import BlockPool, chain_hash
from spmd_engine.core.request import Request

NULL_BLOCK = -1  # a table entry freed or skipped (out of the window); the runner reads block 0

class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_window: int | None = None):
        self.block_size = block_size
        self.sliding_window = sliding_window  # every layer's window, None: keep every block
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
        hashes = self._hashes(request, usable)[:usable]
        if self.sliding_window is not None:
            return self._window_hits(hashes)
        for h in hashes:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def _window_hits(self, hashes: list[bytes]) -> list[int]:
        """The longest hit whose last blocks, those holding the W - 1 keys a query right after it
        sees, are all cached: found scanning back from the end (as vLLM's sliding-window manager
        does); the blocks before them are NULL_BLOCK. A run of cached blocks from the start
        shorter than that is a hit too (there is nothing before it)."""
        need = -(-(self.sliding_window - 1) // self.block_size)
        run: list[int] = []
        for i in range(len(hashes) - 1, -1, -1):
            if len(run) >= need:
                return [NULL_BLOCK] * (i + 1) + run
            block = self.pool.lookup(hashes[i])
            run = [block] + run if block is not None else []
        return run  # cached from the start: nothing before it to need
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[int] | None = None) -> list[int] | None:
        """Blocks for `num_new_tokens` more tokens after the request's computed ones.

        `computed_blocks` (a fresh request's prefix hits) are taken first. Returns
        the blocks added to the table this step (hits included), or None, changing
        nothing, when the pool cannot supply them.
        """
        computed_blocks = computed_blocks or []
        table = self.tables.get(request.request_id, [])
        total = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        if not self.fits(request, num_new_tokens, computed_blocks):
            return None
        needed = -(-total // self.block_size) - len(table) - len(computed_blocks)
        self.pool.touch(b for b in computed_blocks if b != NULL_BLOCK)
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
                    if table[i] != NULL_BLOCK:
                        self.pool.cache_block(table[i], hashes[i])
                self._offered[request.request_id] = full
        if self.sliding_window is not None:
            return [0 if b == NULL_BLOCK else b for b in added]
        return added

    def fits(self, request: Request, num_new_tokens: int, computed_blocks: list[int] | None = None) -> bool:
        """Whether `allocate_slots` would succeed. Frees the blocks out of the window first (no
        query from here on reads them), so a grouped cache asks every group before taking any."""
        computed_blocks = computed_blocks or []
        table = self.tables.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        if self.sliding_window is not None and table:
            self._free_out_of_window(table, num_computed)
        needed = -(-(num_computed + num_new_tokens) // self.block_size) - len(table) - len(computed_blocks)
        # A hit on a free cached block takes it out of the free queue too.
        reclaimed = sum(1 for b in computed_blocks if b != NULL_BLOCK and self.pool.ref_cnt[b] == 0)
        return needed + reclaimed <= self.pool.num_free_blocks

    def hit_tokens(self, computed_blocks: list[int]) -> int:
        """The tokens a prefix hit (get_computed_blocks' answer) covers."""
        return len(computed_blocks) * self.block_size

    def _free_out_of_window(self, table: list[int], num_computed: int) -> None:
        """Free, in place and oldest first, the table's blocks that no query from position
        `num_computed` on can see (the NULL_BLOCKs lead the table: skipped)."""
        dead = min(len(table), max(0, num_computed - self.sliding_window + 1) // self.block_size)
        for i in range(dead):
            if table[i] != NULL_BLOCK:
                self.pool.free_blocks([table[i]])
                table[i] = NULL_BLOCK

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its last blocks are evicted first."""
        table = self.tables.pop(request.request_id, [])
        self._offered.pop(request.request_id, None)
        self.pool.free_blocks(b for b in reversed(table) if b != NULL_BLOCK)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
