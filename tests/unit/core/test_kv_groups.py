"""A KV cache of several groups (issue 53) through the real Scheduler and GroupedKVCacheManager:
a model mixing full and sliding-window layers keeps every block of its full group and only the
window's of its sliding group; prefix hits need both; allocation and preemption take every
group or none. `python tests/unit/core/test_kv_groups.py` prints the Gemma-3-shaped count."""

from __future__ import annotations

import pytest

from spmd_engine.config import SchedulerConfig
from spmd_engine.core import kv_groups
from spmd_engine.core.grouped_kv_cache_manager import GroupedKVCacheManager
from spmd_engine.core.kv_cache_manager import NULL_BLOCK, KVCacheManager
from spmd_engine.core.scheduler import Scheduler
from spmd_engine.core.step_messages import ModelRunnerOutput
from tests.helpers.scheduler_helpers import EOS, make

pytestmark = pytest.mark.timeout(60)


def grouped_scheduler(num_blocks: int, block_size: int, window: int, budget: int, max_model_len: int,
                      max_num_seqs: int = 256, caching: bool = True) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             enable_chunked_prefill=True).resolve(max_model_len, block_size)
    kv = GroupedKVCacheManager(num_blocks, block_size, caching, (None, window), config)
    return Scheduler(config, kv, EOS)


def held(s: Scheduler) -> list[int]:
    """The blocks each group's pool has handed out."""
    return [g.pool.num_blocks - g.num_free_blocks for g in s.kv.groups]


def drive_counting(s: Scheduler) -> list[list[int]]:
    """Run to the end with a fake model (token EOS - 1); each group's blocks held after each step."""
    peaks = []
    while s.has_unfinished():
        out = s.schedule()
        for q in out.seqs:
            assert isinstance(q.block_ids, tuple) and len(q.block_ids) == len(s.kv.groups)
        peaks.append(held(s))
        ids = [q.request_id for q in out.seqs if q.sample]
        s.update_from_output(out, ModelRunnerOutput(ids, [EOS - 1] * len(ids)))
    return peaks


def gemma3_32k_block_counts(num_layers=62, every=6, window=1024, bs=16, tokens=32768, chunk=2048) -> dict:
    """A `tokens`-token request (chunked prefill of `chunk`) of a Gemma-3-shaped model (each
    `every`th layer full attention, the rest sliding over `window`) through one Scheduler and its
    grouped manager, against the same Scheduler over one table without windows: each group's
    peak blocks, and blocks x layers."""
    full_layers = num_layers // every
    sliding_layers = num_layers - full_layers
    n = tokens // bs + 8
    s = grouped_scheduler(n, bs, window, chunk, tokens + 8, max_num_seqs=1)
    s.add_request(make(0, prompt_len=tokens, max_tokens=1, ignore_eos=True))
    peaks = drive_counting(s)
    full, sliding = (max(p[g] for p in peaks) for g in range(2))
    assert held(s) == [0, 0]
    config = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=chunk).resolve(tokens + 8, bs)
    plain = Scheduler(config, KVCacheManager(n, bs), EOS)
    plain.add_request(make(0, prompt_len=tokens, max_tokens=1, ignore_eos=True))
    without = 0
    while plain.has_unfinished():
        out = plain.schedule()
        without = max(without, n - plain.kv.num_free_blocks)
        ids = [q.request_id for q in out.seqs if q.sample]
        plain.update_from_output(out, ModelRunnerOutput(ids, [EOS - 1] * len(ids)))
    return {"tokens": tokens, "window": window, "block_size": bs, "layers_full_sliding": (full_layers, sliding_layers),
            "full_group_blocks": full, "sliding_group_blocks": sliding, "sliding_pool_blocks": s.kv.groups[1].pool.num_blocks,
            "blocks_without_windows": without,
            "block_layers_with_groups": full * full_layers + sliding * sliding_layers,
            "block_layers_without_windows": without * num_layers}


def test_a_gemma3_shaped_32k_request_through_the_scheduler():
    c = gemma3_32k_block_counts()
    print(c)
    assert c["full_group_blocks"] == c["blocks_without_windows"] == 32768 // 16
    assert c["sliding_group_blocks"] <= -(-(1024 - 1 + 2048) // 16) + 1
    assert c["block_layers_with_groups"] * 4 < c["block_layers_without_windows"]


def _long_generation(window=8, bs=4, chunk=4) -> tuple[list[list[int]], int]:
    s = grouped_scheduler(512, bs, window, chunk, 1024)  # a sliding pool as large as the full one
    s.add_request(make(0, prompt_len=40, max_tokens=300, ignore_eos=True))
    return drive_counting(s), -(-(window - 1 + chunk) // bs) + 1


def _bounded(peaks: list[list[int]], bound: int) -> None:
    assert max(p[1] for p in peaks) <= bound, (max(p[1] for p in peaks), bound)


def test_a_long_generation_holds_a_bounded_sliding_group():
    peaks, bound = _long_generation()
    _bounded(peaks, bound)
    assert peaks[-1][0] == -(-340 // 4)  # the full group keeps every block


def test_negative_control_without_freeing_the_sliding_group_grows(monkeypatch):
    monkeypatch.setattr(KVCacheManager, "_free_out_of_window", lambda self, table, num_computed: None)
    peaks, bound = _long_generation()
    with pytest.raises(AssertionError):
        _bounded(peaks, bound)


def test_a_prefix_hit_needs_the_full_prefix_and_the_window_before_it():
    s = grouped_scheduler(64, 4, 6, 64, 128, max_num_seqs=4)
    s.add_request(make(0, prompt_len=33, max_tokens=1, ignore_eos=True))
    drive_counting(s)
    full, sliding = s.kv.get_computed_blocks(make(1, prompt_len=33))
    # 8 full blocks before the last token; the sliding group's first 6 are out of the window.
    assert len(full) == len(sliding) == 8 and NULL_BLOCK not in full
    assert sliding[:6] == [NULL_BLOCK] * 6 and NULL_BLOCK not in sliding[6:]
    # The sliding group's window blocks evicted: no hit, though the full group has all 8.
    pool = s.kv.groups[1].pool
    pool.get_new_blocks(pool.num_free_blocks)
    assert len(s.kv.groups[0].get_computed_blocks(make(2, prompt_len=33))) == 8
    assert s.kv.get_computed_blocks(make(2, prompt_len=33)) == [[], []]


def test_a_refused_allocation_changes_no_group():
    s = grouped_scheduler(64, 4, 6, 64, 128, max_num_seqs=4)
    kv, request = s.kv, make(0, prompt_len=40)
    kv.groups[1].pool.get_new_blocks(kv.groups[1].num_free_blocks - 2)  # the sliding group short
    assert kv.allocate_slots(request, 40) is None
    assert kv.blocks_of("0") == [[], []] and kv.groups[0].num_free_blocks == 64


def test_preemption_returns_every_block_of_every_group():
    s = grouped_scheduler(8, 4, 5, 8, 64, max_num_seqs=4)
    for i in range(4):
        s.add_request(make(i, prompt_len=20, max_tokens=12, ignore_eos=True, first=i))
    drive_counting(s)
    assert s.stats["preemptions"] > 0 and held(s) == [0, 0]


def test_block_counts_per_group_fit_the_budget():
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16).resolve(64, 4)
    assert kv_groups.window_blocks(6, 4, config) == 2 * (2 + 2) + 4
    shares = {None: 100, 6: 500}
    n = kv_groups.num_blocks_for(400_000, 4, shares, config)
    assert kv_groups.bytes_held(n, 4, shares, config) <= 400_000 < kv_groups.bytes_held(n + 1, 4, shares, config)
    assert kv_groups.blocks_per_group(n, (None, 6), 4, config) == {None: n, 6: 12}
    assert kv_groups.group_windows((6, None, 6)) == (None, 6) and kv_groups.group_windows((6, 6)) == ()


if __name__ == "__main__":  # the count for the report
    print(gemma3_32k_block_counts())
