"""The one shared-memory segment helper (spmd_engine.shm_segment), used by the queue and the all-reduce."""

from __future__ import annotations

import os

import pytest

from spmd_engine.executor.shm_queue import MessageQueue
from spmd_engine.shm_segment import SHM_DIR, ShmSegment, ShmSpaceError

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs /dev/shm")


def free_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def mine(prefix: str) -> list[str]:
    return [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]


def test_a_segment_larger_than_dev_shm_is_a_clear_error_at_creation():
    too_big = free_bytes() + (1 << 30)
    prefix = f"spmd_test{os.getpid()}_"
    with pytest.raises(ShmSpaceError, match=r"cannot reserve \d+ bytes in /dev/shm for the test"):
        ShmSegment.create(too_big, prefix, what="the test")
    assert mine(prefix) == []


def test_a_queue_that_dev_shm_cannot_hold_fails_at_creation_not_with_sigbus():
    # Before: ftruncate made a sparse segment of any size; the first write past what tmpfs
    # could back killed the process with SIGBUS, possibly minutes into a run.
    chunk = 1 << 20
    n_chunks = free_bytes() // chunk + 1024
    label = f"full{os.getpid()}"
    with pytest.raises(ShmSpaceError, match="cannot reserve .* for message queue"):
        MessageQueue.create(1, chunk_bytes=chunk, n_chunks=n_chunks, label=label)
    assert mine(f"spmd_mq_{label}_") == []


def test_space_is_reserved_up_front():
    seg = ShmSegment.create(4 << 20, f"spmd_test{os.getpid()}_", what="the test")
    try:
        st = os.stat(seg.path)
        assert st.st_blocks * 512 >= 4 << 20  # allocated, not sparse
    finally:
        seg.unlink()
        seg.close()
    assert not os.path.exists(seg.path)
