"""The pool of KV cache blocks: reference counts, an LRU of free blocks, the prefix cache.

A block is in use while some request holds it (ref_cnt > 0). A block nobody
holds sits in the free queue; if it carries a hash (its 16 or so tokens were
computed as a full block) it is still findable by that hash and can be taken
back by a later request with the same prefix, until it is handed out for new
content. Blocks are handed out from the front of the free queue and freed to
its back, so the least recently freed cached block is the first evicted (LRU).

Everything here is deterministic: the free queue is an insertion-ordered
dict, hashes are bytes from sha256, and no clock or `hash()` is involved, so
every rank of a replica makes the same decisions from the same calls.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Iterable, Sequence


def chain_hash(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """A full block's identity: sha256 over its parent's hash and its token ids (int64).

    Two blocks hash equal only if their whole prefixes are equal, so one lookup
    per block finds the longest cached prefix.
    """
    h = hashlib.sha256(parent or b"\0" * 32)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._cached: dict[bytes, int] = {}  # hash -> block holding that content
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def lookup(self, block_hash: bytes) -> int | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def get_new_blocks(self, n: int) -> list[int]:
        """n blocks for new content, the least recently freed first; evicts their old hashes."""
        if n > len(self._free):
            raise ValueError(f"asked for {n} blocks, {len(self._free)} free")
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            old = self.block_hash[block]
            if old is not None:
                if self._cached.get(old) == block:
                    del self._cached[old]
                self.block_hash[block] = None
                self.num_evictions += 1
            self.ref_cnt[block] = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[int]) -> None:
        """Take a reference on cached blocks (a prefix hit); a free one leaves the free queue."""
        for block in blocks:
            if self.ref_cnt[block] == 0:
                del self._free[block]
            self.ref_cnt[block] += 1

    def free_blocks(self, blocks: Iterable[int]) -> None:
        """Drop one reference each, in the order given; unreferenced blocks go to the queue's back."""
        for block in blocks:
            if self.ref_cnt[block] <= 0:
                raise RuntimeError(f"block {block} freed more often than it was taken")
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] == 0:
                self._free[block] = None

    def cache_block(self, block: int, block_hash: bytes) -> None:
        """Make a full block findable by its hash (first writer wins for equal content)."""
        if not self.enable_caching or self.block_hash[block] is not None:
            return
        if block_hash not in self._cached:
            self._cached[block_hash] = block
            self.block_hash[block] = block_hash

    def reset_prefix_cache(self) -> bool:
        """Forget every hash. Refused (False) while any block is in use, as vLLM does:
        a running request's blocks would be re-registered as it goes."""
        if any(self.ref_cnt):
            return False
        self._cached.clear()
        self.block_hash = [None] * self.num_blocks
        return True
