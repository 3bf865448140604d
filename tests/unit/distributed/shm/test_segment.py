"""The one shared-memory segment type (spmd_engine.distributed.shm.segment), under every protocol."""

from __future__ import annotations

import dataclasses
import os

import pytest

from spmd_engine.distributed.shm.message_queue import MessageQueue
from spmd_engine.distributed.shm.segment import SHM_DIR, Lifetime, Segment, ShmSpaceError

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
        Segment.create(too_big, prefix, lifetime=Lifetime.UNTIL_ATTACHED, what="the test")
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
    seg = Segment.create(4 << 20, f"spmd_test{os.getpid()}_", lifetime=Lifetime.UNTIL_ATTACHED, what="the test")
    try:
        st = os.stat(seg.path)
        assert st.st_blocks * 512 >= 4 << 20  # allocated, not sparse
    finally:
        seg.unlink()
        seg.close()
    assert not os.path.exists(seg.path)


def test_a_nameless_segment_has_no_name_and_peers_attach_through_the_creators_descriptor():
    prefix = f"spmd_test{os.getpid()}_"
    seg = Segment.create(1 << 16, prefix, lifetime=Lifetime.NAMELESS, what="the test")
    try:
        assert mine(prefix) == []  # nothing a SIGKILL could leave behind, from the start
        ref = seg.ref()
        assert ref.fd is not None and ref.creator_pid == os.getpid()
        peer = Segment.attach(ref)  # through /proc/<pid>/fd/<fd>, as another process would
        seg.mm[:5] = b"hello"
        assert peer.mm[:5] == b"hello"
        peer.close()
        seg.unlink()  # every peer attached: the descriptor goes, nobody else can attach
        assert seg.ref().fd is None and not seg.attachable
        with pytest.raises(FileNotFoundError):
            Segment.attach(dataclasses.replace(ref, fd=None))  # it never had a name to attach by
    finally:
        seg.close()


def test_a_named_segment_keeps_its_name_until_unlink():
    prefix = f"spmd_test{os.getpid()}_"
    seg = Segment.create(1 << 16, prefix, lifetime=Lifetime.UNTIL_ATTACHED, what="the test")
    try:
        assert mine(prefix) == [seg.name.lstrip("/")]
        peer = Segment.attach(seg.ref())  # by name: works across pid namespaces too
        peer.close()  # an attached end never removes the name
        assert mine(prefix) == [seg.name.lstrip("/")]
        seg.unlink()
        assert mine(prefix) == []
        with pytest.raises(FileNotFoundError):
            Segment.attach(seg.ref())
    finally:
        seg.close()
