"""The runner's per-group block tables and metadata (worker/group_tables.py): each layer of a
model mixing windows reads and writes through its own group's table, and a step of several
groups never goes through a single DecodeStep (decode graphs, compiled decode layers)."""

from __future__ import annotations

import pytest
import torch

from spmd_engine.model.layers.attention import Attention, AttentionMetadata
from spmd_engine.worker import group_tables

pytestmark = pytest.mark.timeout(60)

BS, W = 4, 5


def _step(tables):
    """Two decode rows (contexts 9 and 6) over per-group tables (full, sliding)."""
    return group_tables.build([9, 6], [1, 1], tables, (None, W), BS, "cpu", False)


def test_each_window_gets_its_groups_slots_and_no_single_decode_step():
    tables = [([0, 1, 2], [7, 0, 3]), ([4, 5], [0, 6])]
    attn = _step(tables)
    full, sliding = attn.for_window(None), attn.for_window(W)
    assert full.slot_mapping.tolist() == [2 * BS + 1, 5 * BS + 2]
    assert sliding.slot_mapping.tolist() == [3 * BS + 1, 6 * BS + 2]
    assert attn.slot_mapping.tolist() == full.slot_mapping.tolist()  # the top is the full group's
    assert attn.decode_step() is None and sliding.decode_step() is not None


def test_a_sliding_layer_reads_its_own_groups_cache():
    """The same keys stored at the sliding group's blocks only: a sliding layer through the
    grouped metadata equals one given its group's metadata directly, and differs from one
    reading the full group's table (the negative control)."""
    torch.manual_seed(0)
    layer = Attention(2, 1, 8, 8 ** -0.5, sliding_window=W)
    layer.allocate_kv_cache(8, BS, torch.float32, "cpu")
    layer.k_cache.normal_()
    layer.v_cache.normal_()
    tables = [([0, 1, 2], [7, 0, 3]), ([4, 5], [0, 6])]
    q, k, v = (torch.randn(2, n, 8) for n in (2, 1, 1))
    k_cache, v_cache = layer.k_cache.clone(), layer.v_cache.clone()
    grouped = layer(q, k, v, _step(tables))
    layer.k_cache.copy_(k_cache)
    layer.v_cache.copy_(v_cache)
    direct = layer(q, k, v, AttentionMetadata.build([9, 6], [1, 1], [t[1] for t in tables], BS, "cpu"))
    layer.k_cache.copy_(k_cache)
    layer.v_cache.copy_(v_cache)
    wrong = layer(q, k, v, AttentionMetadata.build([9, 6], [1, 1], [t[0] for t in tables], BS, "cpu"))
    torch.testing.assert_close(grouped, direct)
    assert not torch.allclose(grouped, wrong)


def test_tables_replace_then_extend_per_group():
    tables = {}
    group_tables.update(tables, "r", ([1], [2]), True)
    group_tables.update(tables, "r", ([3], []), False)
    assert tables["r"] == ([1, 3], [2])
