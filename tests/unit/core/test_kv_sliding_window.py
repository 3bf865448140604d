"""The KV cache manager under a sliding window (issue 53): blocks out of every query's window go
back to the pool, prefix hits need only the window before them, and a Gemma-3-shaped model's
32k-token request holds a fraction of a full cache's blocks."""

from __future__ import annotations

import pytest

from spmd_engine.core.kv_cache_manager import NULL_BLOCK, KVCacheManager
from tests.helpers.scheduler_helpers import EOS, drive, make, scheduler

pytestmark = pytest.mark.timeout(60)


def _generate(kv: KVCacheManager, request, chunk: int, steps: int) -> list[int]:
    """Allocate the prompt in chunks of `chunk`, then one token a step; the blocks held after each."""
    held = []
    while request.num_computed_tokens < request.num_tokens:
        n = min(chunk, request.num_tokens - request.num_computed_tokens)
        assert kv.allocate_slots(request, n) is not None
        request.num_computed_tokens += n
        held.append(kv.pool.num_blocks - kv.num_free_blocks)
    for _ in range(steps):
        request.output_token_ids.append(7)
        assert kv.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
        held.append(kv.pool.num_blocks - kv.num_free_blocks)
    return held


@pytest.mark.parametrize("window,chunk", [(8, 4), (9, 5), (1, 3), (16, 16)])
def test_a_long_generation_holds_a_bounded_number_of_blocks(window, chunk):
    bs = 4
    kv = KVCacheManager(512, bs, sliding_window=window)
    held = _generate(kv, make(0, prompt_len=40, max_tokens=1000), chunk, steps=300)
    # The next chunk's first query needs W - 1 keys before it, then the chunk's own blocks.
    bound = -(-(window - 1 + chunk) // bs) + 1
    assert max(held) <= bound, (max(held), bound)
    table = kv.tables["0"]
    live = [b for b in table if b != NULL_BLOCK]
    assert table[:len(table) - len(live)] == [NULL_BLOCK] * (len(table) - len(live))  # freed ones lead
    # Every block a query of the next step can see is still held.
    first_visible = max(0, 40 + 300 - window + 1) // bs
    assert all(b != NULL_BLOCK for b in table[first_visible:])


def test_without_freeing_the_blocks_grow_with_the_sequence():
    """The negative control: the same generation with no window keeps every block."""
    kv = KVCacheManager(512, 4)
    held = _generate(kv, make(0, prompt_len=40, max_tokens=1000), 4, steps=300)
    assert held[-1] == -(-340 // 4)


def test_a_prefix_hit_needs_only_the_window_before_it():
    bs, window = 4, 6
    kv = KVCacheManager(64, bs, sliding_window=window)
    first = make(0, prompt_len=33)
    _generate(kv, first, 33, steps=0)
    kv.free(first)
    hits = kv.get_computed_blocks(make(1, prompt_len=33))
    # 8 full blocks before the last token; the first query after them sees 5 keys: blocks 6 and 7.
    assert len(hits) == 8 and hits[:6] == [NULL_BLOCK] * 6 and NULL_BLOCK not in hits[6:]
    # Blocks inside the window evicted: the hit stops before them.
    kv.pool.get_new_blocks(kv.num_free_blocks)  # evicts every cached block
    assert kv.get_computed_blocks(make(2, prompt_len=33)) == []


def test_a_hit_runs_through_the_scheduler_and_frees_at_the_end():
    s = scheduler(num_blocks=16, block_size=4, budget=8, max_model_len=64)
    s.kv.sliding_window = 5
    for i in range(3):
        s.add_request(make(i, prompt_len=30, max_tokens=20, ignore_eos=True))
    drive(s, lambda rid, step: EOS - 1)
    assert s.kv.num_free_blocks == 16 and s.stats["prefix_hits_tokens"] > 0


def _held_by_a_request(num_tokens: int, window: int | None, bs: int, chunk: int) -> int:
    kv = KVCacheManager(num_tokens // bs + 8, bs, sliding_window=window)
    request = make(0, prompt_len=num_tokens)
    _generate(kv, request, chunk, steps=0)
    return kv.pool.num_blocks - kv.num_free_blocks


def gemma3_comparison(num_layers=62, every=6, window=1024, bs=16, tokens=32768, chunk=2048) -> dict:
    """Blocks x layers a `tokens`-token request holds in a Gemma-3-shaped model (each 6th layer
    full attention, the rest sliding over `window`), one manager per group, against a cache
    without windows."""
    full_layers = num_layers // every
    sliding_layers = num_layers - full_layers
    full = _held_by_a_request(tokens, None, bs, chunk)
    sliding = _held_by_a_request(tokens, window, bs, chunk)
    return {"full_group_blocks": full, "sliding_group_blocks": sliding,
            "block_layers_with_windows": full * full_layers + sliding * sliding_layers,
            "block_layers_without_windows": full * num_layers}


def test_a_gemma3_shaped_request_holds_far_fewer_blocks():
    c = gemma3_comparison()
    print(c)
    assert c["full_group_blocks"] == 32768 // 16
    assert c["sliding_group_blocks"] <= -(-(1024 - 1 + 2048) // 16) + 1
    assert c["block_layers_with_windows"] * 4 < c["block_layers_without_windows"]


if __name__ == "__main__":  # the comparison for the report
    print(gemma3_comparison())


def test_preemption_under_a_window_returns_every_block():
    """Requests outgrowing a 6-block pool are preempted and recomputed; freed (NULL) entries are
    never freed twice and the pool ends whole."""
    s = scheduler(num_blocks=6, block_size=4, budget=8, max_model_len=64)
    s.kv.sliding_window = 5
    for i in range(4):
        s.add_request(make(i, prompt_len=20, max_tokens=20, ignore_eos=True, first=i))
    trace = drive(s, lambda rid, step: EOS - 1)
    assert s.stats["preemptions"] > 0 and s.kv.num_free_blocks == 6
    assert sum(n for step in trace for (_, n, _, _) in step) >= 4 * 39


def test_check_fits_counts_a_window_and_a_chunk():
    from spmd_engine.config import ConfigError
    from spmd_engine.core.kv_sizing import check_fits, sequence_tokens
    assert sequence_tokens(64, 4, 6, 8) == 20 and sequence_tokens(64, 4, None, 8) == 64
    assert sequence_tokens(16, 4, 6, 8) == 16  # never more than max_model_len
    check_fits(8, 4, 64, 1, 32, window=6, max_num_batched_tokens=8)
    with pytest.raises(ConfigError, match="fewer than max_model_len 64"):
        check_fits(8, 4, 64, 1, 32)
    with pytest.raises(ConfigError, match="sliding window 6, max_num_batched_tokens 32"):
        check_fits(8, 4, 64, 1, 32, window=6, max_num_batched_tokens=32)
