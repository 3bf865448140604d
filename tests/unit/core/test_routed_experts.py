"""join_chunks: a request's routing rows stitched from the steps that computed them."""

import numpy as np
import pytest

from spmd_engine.core.routed_experts import join_chunks


def rows(values):
    return np.asarray(values, dtype=np.int16).reshape(-1, 1, 1)


def test_chunks_join_in_position_order_and_a_recomputation_overwrites():
    # prompt 0..3 in two chunks, a decode at 4, then (preempted) 0..4 again from the prefix cache
    chunks = [(0, rows([1, 2])), (2, rows([3, 4])), (4, rows([5])), (0, rows([11, 12, 13, 14, 15]))]
    assert join_chunks(chunks, 5).ravel().tolist() == [11, 12, 13, 14, 15]
    assert join_chunks(chunks[:3], 5).ravel().tolist() == [1, 2, 3, 4, 5]
    assert join_chunks(chunks[:3], 5).dtype == np.int16


def test_a_position_no_step_reported_is_an_error_not_zeros():
    with pytest.raises(RuntimeError, match="no rows for 1 of 5 positions \\(first: 2\\)"):
        join_chunks([(0, rows([1, 2])), (3, rows([4, 5]))], 5)
