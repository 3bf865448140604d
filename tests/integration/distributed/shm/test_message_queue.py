"""MessageQueue (spmd_engine.distributed.shm.message_queue) across real processes.

Readers and writers run in ``spawn`` children, as the mp executor's workers
do.  Every test gets a unique queue label from the ``leak_check`` fixture;
the label is part of each segment's /dev/shm name, so the fixture can check
that none of *this* test's segments remain (other xdist workers may be
running their own queues at the same time) and that no child is left.
"""

import hashlib
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from spmd_engine.distributed.shm.message_queue import MessageQueue, PeerGoneError

CTX = mp.get_context("spawn")
SMALL = dict(chunk_bytes=4096, n_chunks=4)  # small ring: wraps and blocks often


def shm_entries(label):
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"spmd_mq_{label}_")]


@pytest.fixture
def leak_check(request):
    """Yield a label unique to this test; afterwards no child, no segment."""
    label = "t" + hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:10]
    procs = []
    yield label, procs
    for p in procs:  # a failed test may leave some running
        if p.is_alive():
            p.kill()
        p.join(10)
    assert not [p for p in procs if p.is_alive()], "child process left running"
    assert not mp.active_children(), "child process left running"
    assert shm_entries(label) == [], "shared-memory segment left in /dev/shm"


def start(procs, target, *args):
    p = CTX.Process(target=target, args=args, daemon=True)
    p.start()
    procs.append(p)
    return p


def expected_message(k):
    """Deterministic message k: sizes vary, every 50th spans 3+ chunks."""
    size = 3 * 4096 + 100 if k % 50 == 7 else (k * 37) % 3000
    return (k, bytes([k % 251]) * size)


# ------------------------------------------------------------ child processes
def reader_check_main(bcast_handle, resp_handle, index, n_msgs):
    """Read n_msgs, compare each with expected_message, report a summary."""
    rq = MessageQueue.attach(bcast_handle, index)
    resp = MessageQueue.attach_writer(resp_handle)
    bad = []
    for k in range(n_msgs):
        msg = rq.dequeue(timeout=30)
        if msg != expected_message(k) and len(bad) < 3:
            bad.append((k, msg if not isinstance(msg, tuple) else msg[0]))
    resp.enqueue((index, n_msgs, bad), timeout=30)
    rq.close()
    resp.close()


def echo_main(bcast_handle, resp_handle, index):
    """Send every message back until None."""
    rq = MessageQueue.attach(bcast_handle, index)
    resp = MessageQueue.attach_writer(resp_handle)
    while (msg := rq.dequeue(timeout=60)) is not None:
        resp.enqueue(msg, timeout=60)
    rq.close()
    resp.close()


def slow_reader_main(bcast_handle, resp_handle, index, go, n_msgs):
    rq = MessageQueue.attach(bcast_handle, index)
    resp = MessageQueue.attach_writer(resp_handle)
    go.wait(30)
    got = [rq.dequeue(timeout=30) for _ in range(n_msgs)]
    resp.enqueue(got, timeout=30)
    rq.close()
    resp.close()


def doomed_writer_main(label, conn):
    """Create a queue, wait for the reader, send one message, then hang."""
    mq = MessageQueue.create(1, label=label, **SMALL)
    conn.send(mq.handle())
    mq.wait_attached(timeout=30)  # unlinks: a SIGKILL later leaves no segment
    mq.enqueue("hello")
    conn.send("ready")
    time.sleep(120)


def watching_reader_main(handle, writer_pid):
    """Exit with 3 once the alive callback reports the writer gone."""
    def writer_alive():
        try:
            os.kill(writer_pid, 0)
            return True
        except ProcessLookupError:
            return False

    rq = MessageQueue.attach(handle, 0)
    assert rq.dequeue(timeout=30) == "hello"
    try:
        rq.dequeue(timeout=30, alive=writer_alive)
    except PeerGoneError:
        rq.close()
        sys.exit(3)
    sys.exit(1)


def run_queues(procs, label, n_readers, child, child_args, ring=SMALL):
    """Create a broadcast queue and one response queue per reader, start a
    child per reader and wait until everybody attached."""
    bq = MessageQueue.create(n_readers, label=label, **ring)
    resps = [MessageQueue.create(1, reader_index=0, label=label)
             for _ in range(n_readers)]
    for i in range(n_readers):
        start(procs, child, bq.handle(), resps[i].handle(), i, *child_args)
    for q in [bq] + resps:
        q.wait_attached(timeout=30)
    return bq, resps


# ---------------------------------------------------------------------- tests
@pytest.mark.timeout(60)
@pytest.mark.parametrize("n_readers", [1, 2, 4])
def test_broadcast_many_messages_in_order(leak_check, n_readers):
    label, procs = leak_check
    n_msgs = 1500  # 4-chunk ring: several hundred wrap-arounds
    bq, resps = run_queues(procs, label, n_readers, reader_check_main, (n_msgs,))
    assert shm_entries(label) == []  # unlinked as soon as all attached
    for k in range(n_msgs):
        bq.enqueue(expected_message(k), timeout=30)
    summaries = sorted(r.dequeue(timeout=30) for r in resps)
    assert summaries == [(i, n_msgs, []) for i in range(n_readers)]
    for p in procs:
        p.join(10)
        assert p.exitcode == 0
    for q in [bq] + resps:
        q.close()


def assert_same(back, obj):
    torch = sys.modules.get("torch")  # imported by the torch test only
    assert type(back) is type(obj)
    if isinstance(obj, np.ndarray):
        assert back.dtype == obj.dtype
        assert back.flags.f_contiguous == obj.flags.f_contiguous
        np.testing.assert_array_equal(back, obj)
        back += 0  # reassembled arrays are writable, not ring memory
    elif torch is not None and isinstance(obj, torch.Tensor):
        assert back.dtype == obj.dtype and torch.equal(back, obj)
    elif isinstance(obj, dict):
        assert back.keys() == obj.keys()
        for k in obj:
            assert_same(back[k], obj[k])
    else:
        assert back == obj


def echo_round_trip(procs, label, n_readers, payloads):
    """Broadcast each payload through a 4 MiB ring (1 MiB chunks, so 5 MiB
    messages stream through it) and check every reader's echo."""
    bq, resps = run_queues(procs, label, n_readers, echo_main, (),
                           ring=dict(chunk_bytes=1 << 20, n_chunks=4))
    for obj in payloads:
        bq.enqueue(obj, timeout=60)
        for r in resps:
            assert_same(r.dequeue(timeout=60), obj)
    bq.enqueue(None)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    for q in [bq] + resps:
        q.close()


@pytest.mark.timeout(60)
def test_large_numpy_payloads_round_trip_exactly(leak_check):
    label, procs = leak_check
    rng = np.random.default_rng(0)
    echo_round_trip(procs, label, 2, [
        rng.standard_normal(5 * 2**20 // 4).astype(np.float32),  # 5 MiB
        np.asfortranarray(rng.integers(0, 255, (1500, 1500), dtype=np.uint8)),
        {"ids": list(range(100_000)), "blob": b"\x00\xff" * 2**21,
         "arr": np.arange(2**18, dtype=np.int64)},
        b"x" * (1 << 20),  # a chunk's size: just over one chunk's payload
    ])


@pytest.mark.timeout(90)
def test_large_torch_payloads_round_trip_exactly(leak_check):
    import torch

    label, procs = leak_check  # one reader: importing torch twice is slow here
    echo_round_trip(procs, label, 1, [
        torch.randn(5 * 2**20 // 4, generator=torch.Generator().manual_seed(0)),
        {"half": torch.arange(2**20, dtype=torch.bfloat16),
         "ids": torch.arange(10, dtype=torch.int64)},
    ])


@pytest.mark.timeout(60)
def test_writer_blocks_on_slow_reader_and_resumes(leak_check):
    label, procs = leak_check
    go = CTX.Event()
    n_msgs = 4 + 1 + 20
    bq, (resp,) = run_queues(procs, label, 1, slow_reader_main, (go, n_msgs))
    for k in range(4):  # fills the 4-chunk ring
        bq.enqueue(k, timeout=5)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=label):
        bq.enqueue("lost", timeout=0.3)  # nothing written: the queue stays usable
    assert time.monotonic() - t0 >= 0.3
    threading.Timer(0.5, go.set).start()
    t0 = time.monotonic()
    bq.enqueue(4, timeout=30)  # blocks until the reader starts reading
    assert time.monotonic() - t0 >= 0.4
    for k in range(5, n_msgs):
        bq.enqueue(k, timeout=30)
    assert resp.dequeue(timeout=30) == list(range(n_msgs))
    procs[0].join(10)
    assert procs[0].exitcode == 0
    bq.close()
    resp.close()


@pytest.mark.timeout(30)
def test_shutdown_from_another_thread_cancels_blocked_calls(leak_check):
    label, _ = leak_check
    with MessageQueue.create(1, label=label, **SMALL) as wq, \
            MessageQueue.attach(wq.handle(), 0) as rq:
        for blocked_call, q in [(rq.dequeue, rq), (wq.enqueue, wq)]:
            if q is wq:
                for k in range(4):  # ring full: the next enqueue blocks
                    wq.enqueue(k)
            shut_at = []
            timer = threading.Timer(0.5, lambda: (shut_at.append(time.monotonic()),
                                                  q.shutdown()))
            timer.start()
            with pytest.raises(RuntimeError, match="^cancelled$"):
                blocked_call(*([] if q is rq else ["x"]))
            assert time.monotonic() - shut_at[0] < 1.0
            timer.join()
            with pytest.raises(RuntimeError, match="^cancelled$"):  # stays shut
                blocked_call(*([] if q is rq else ["x"]), timeout=5)


@pytest.mark.timeout(30)
def test_timeouts_eof_and_dead_peer_callback(leak_check):
    label, _ = leak_check
    with MessageQueue.create(1, label=label, **SMALL) as wq, \
            MessageQueue.attach(wq.handle(), 0) as rq:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=f"'{label}'.*waiting for a message"):
            rq.dequeue(timeout=0.2)
        assert 0.2 <= time.monotonic() - t0 < 1.0
        with pytest.raises(PeerGoneError):
            rq.dequeue(timeout=5, alive=lambda: False)
        for k in range(4):
            wq.enqueue(k)
        with pytest.raises(TimeoutError, match="waiting for a free chunk"):
            wq.enqueue(4, timeout=0.2)
        with pytest.raises(PeerGoneError):
            wq.enqueue(4, timeout=5, alive=lambda: False)
        assert [rq.dequeue(timeout=1) for _ in range(4)] == [0, 1, 2, 3]
        wq.enqueue("last")
        wq.close()
        assert rq.dequeue(timeout=1) == "last"  # queued before close: delivered
        with pytest.raises(EOFError):
            rq.dequeue(timeout=5)


@pytest.mark.timeout(60)
def test_reader_exits_when_writer_is_sigkilled(leak_check):
    label, procs = leak_check
    parent_conn, child_conn = CTX.Pipe()
    writer = start(procs, doomed_writer_main, label, child_conn)
    assert parent_conn.poll(30)
    handle = parent_conn.recv()
    reader = start(procs, watching_reader_main, handle, writer.pid)
    assert parent_conn.poll(30) and parent_conn.recv() == "ready"
    os.kill(writer.pid, signal.SIGKILL)
    writer.join(10)  # reap it so its pid is gone
    t0 = time.monotonic()
    reader.join(10)
    assert reader.exitcode == 3
    assert time.monotonic() - t0 < 5.0  # alive is polled every 0.1 s


@pytest.mark.timeout(30)
def test_name_unlinked_once_everyone_attached(leak_check):
    label, _ = leak_check
    wq = MessageQueue.create(2, label=label, **SMALL)
    name = wq.handle().shm_name
    assert name.startswith(f"/spmd_mq_{label}_") and len(shm_entries(label)) == 1
    r0 = MessageQueue.attach(wq.handle(), 0)
    with pytest.raises(ValueError, match="already attached"):
        MessageQueue.attach(wq.handle(), 0)
    wq.enqueue("a")
    assert len(shm_entries(label)) == 1  # reader 1 still missing
    r1 = MessageQueue.attach(wq.handle(), 1)
    wq.enqueue("b")  # the creator notices everybody is attached
    assert shm_entries(label) == []
    with pytest.raises(FileNotFoundError):
        MessageQueue.attach(wq.handle(), 1)
    assert [r0.dequeue(timeout=1) for _ in "ab"] == ["a", "b"]
    assert [r1.dequeue(timeout=1) for _ in "ab"] == ["a", "b"]
    for q in (r0, r1, wq):
        q.close()
    # A second queue never fully attached is unlinked by the creator's close.
    MessageQueue.create(3, label=label, **SMALL).close()
    assert shm_entries(label) == []


_TRACKER_SCRIPT = textwrap.dedent("""
    import multiprocessing as mp, os, signal, sys
    sys.path.insert(0, {root!r})
    from spmd_engine.distributed.shm.message_queue import MessageQueue

    def child(h):
        q = MessageQueue.attach(h, 0)
        assert q.dequeue(timeout=30) == "hi"
        q.close()

    if __name__ == "__main__":
        ctx = mp.get_context("spawn")
        q = MessageQueue.create(1, label={label!r}, chunk_bytes=4096, n_chunks=4)
        p = ctx.Process(target=child, args=(q.handle(),))
        p.start()
        q.enqueue("hi")
        p.join(30)
        assert p.exitcode == 0
        q.close()
        # Crash before anyone attached: the creator's resource tracker
        # must remove the name.
        q2 = MessageQueue.create(1, label={label!r}, chunk_bytes=4096, n_chunks=4)
        print(q2.handle().shm_name, flush=True)
        if {crash}:
            os.kill(os.getpid(), signal.SIGKILL)
        q2.close()
""")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("crash", [False, True])
def test_resource_tracker_quiet_and_cleans_up_after_crash(leak_check, crash,
                                                         tmp_path):
    label, _ = leak_check
    root = str(Path(__file__).resolve().parents[4])  # the repository
    script = tmp_path / "tracker_script.py"  # spawn needs a real main file
    script.write_text(_TRACKER_SCRIPT.format(root=root, label=label, crash=crash))
    res = subprocess.run([sys.executable, str(script)], capture_output=True,
                         text=True, timeout=50)
    assert res.returncode == (-signal.SIGKILL if crash else 0), res.stderr
    if not crash:
        assert res.stderr == ""  # no "leaked shared_memory" warnings
    deadline = time.monotonic() + 10
    while shm_entries(label) and time.monotonic() < deadline:
        time.sleep(0.05)  # the orphaned tracker cleans up as it exits
    assert shm_entries(label) == []
