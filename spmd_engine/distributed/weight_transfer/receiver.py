"""An engine rank's side of the transfer: join the trainer's group, then per update receive
the manifest, check it, and apply the buckets as they arrive.

Every engine rank receives the whole stream and keeps its own TP / PP / EP shard: the update
is the model's in-place update of full HF-named tensors (the same path as load_weights), so
a bucket's tensors are copied into this rank's shard while the next bucket arrives, and the
bucket is reused. Nothing here knows the model: the worker passes `check(manifest) -> reason
| None` and `open_update(manifest)`, an update whose `apply(pairs)` takes each bucket's tensors
and whose `close()` finishes what is left (called on success and on failure).
A failed group (a peer died or hung) refuses every later update until a new init.
"""

from __future__ import annotations

import torch

from spmd_engine.distributed.weight_transfer.config import TransferInitInfo, TransferUpdateInfo
from spmd_engine.distributed.weight_transfer.group import TransferError, TransferGroup, join_store
from spmd_engine.distributed.weight_transfer.packing import MAX_MANIFEST_BYTES, Manifest, SpanBuffers, Unpacker


class WeightReceiver:
    def __init__(self, info: TransferInitInfo, engine_rank: int, device: torch.device):
        self.info = info
        rank = info.group_rank(engine_rank)
        dev = device if info.backend == "nccl" else torch.device("cpu")
        store = join_store(info.master_address, info.master_port, info.timeout_s)
        self.group = TransferGroup(store, rank, info.world_size, info.timeout_s, dev)
        self.device = device
        self._kept: list[torch.Tensor] = []
        self._spans = SpanBuffers()  # kept as the bucket buffers are (_buffers says why)

    @property
    def failed(self) -> str | None:
        return self.group.failed if self.group is not None else "shut down"

    def receive(self, update_info: TransferUpdateInfo, check, open_update) -> int:
        """One update; returns the number of tensors applied. A refused manifest is a ValueError
        naming the reason (the group stays usable); a failed group a TransferError."""
        manifest = Manifest.decode(self.group.recv_bytes(MAX_MANIFEST_BYTES, "receiving the manifest"))
        error = _against_update_info(manifest, update_info) or check(manifest)
        segment = None
        if error is None and manifest.shm is not None:
            segment, error = _attach(manifest.shm)
        verdict = self.group.agree(error, "the manifest check")
        if verdict:
            if segment is not None:
                segment.close()
            raise ValueError(f"weight update refused: {verdict}")
        unpack = Unpacker(manifest, self.device, self._spans)
        update = open_update(manifest)
        failure: str | None = None
        applied = 0

        def consume(k: int, bucket: torch.Tensor, pieces=None) -> str | None:
            nonlocal failure, applied
            pairs = unpack.feed(k, bucket, pieces)
            if failure is None and pairs:
                try:
                    update.apply(pairs)
                    applied += len(pairs)
                except Exception as exc:  # keep receiving: the trainer learns it at the end
                    failure = f"{type(exc).__name__}: {exc}"
            return failure
        try:
            if segment is not None:
                self._from_shared(segment, unpack, consume)
            else:
                self._from_group(manifest, unpack, consume)
        except BaseException:
            self._kept = []  # a broadcast may still be writing into them
            self._spans.clear()
            _close(update)  # the stream's error is the one to report
            raise
        finally:
            if segment is not None:
                segment.close()
        unpack.release()
        self._spans.trim()
        failure = failure or _close(update)
        verdict = self.group.agree(failure, "applying the weights")
        if verdict:
            raise TransferError(f"weight update failed: {verdict}")
        return applied

    def _from_group(self, manifest: Manifest, unpack: Unpacker, consume) -> None:
        """Each bucket's segments broadcast into one of two buffers (or a spanning tensor's own
        buffer): each segment is applied as soon as it has arrived, while the rest of its bucket
        and the next bucket arrive, so only the last segment's copy-out follows the stream."""
        plan = unpack.plan
        buffers = self._buffers(manifest.bucket_bytes, min(2, len(plan)))

        def post(k: int) -> list:
            return [self.group.broadcast_async(unpack.destination(seg, buffers[k % 2]), f"bucket {k}")
                    for seg in unpack.segments[k]]
        works = [post(0)] if plan else []
        for k in range(len(plan)):
            if k + 1 < len(plan):
                works.append(post(k + 1))
            for seg, work in zip(unpack.segments[k], works[k]):
                self.group.wait(work, f"bucket {k}")
                consume(k, buffers[k % 2], seg.pieces)

    def _buffers(self, nbytes: int, count: int) -> list[torch.Tensor]:
        """The two receive buffers, kept from one update to the next while the bucket size stays:
        an RL loop pushes every step, and fresh buffers would fault in every page each time. They
        are freed by close (shutdown_weight_transfer_engine) and after a stream that broke."""
        if len(self._kept) < count or any(b.numel() != nbytes for b in self._kept):
            self._kept = [torch.empty(nbytes, dtype=torch.uint8, device=self.group.device) for _ in range(count)]
        return self._kept[:count]

    def _from_shared(self, segment, unpack: Unpacker, consume) -> None:
        """The ipc backend: the trainer fills the shared segment bucket by bucket, announcing
        each; every rank reads it, and all agree before the trainer writes the next."""
        shared = torch.frombuffer(segment.mm, dtype=torch.uint8)
        for k in range(len(unpack.plan)):
            index = torch.zeros(1, dtype=torch.int64)
            self.group.broadcast(index, f"bucket {k} ready")
            if int(index) != k:
                raise TransferError(f"bucket {int(index)} announced where {k} was due")
            failure = consume(k, shared.to(self.device) if self.device.type != "cpu" else shared)
            verdict = self.group.agree(failure, f"bucket {k} read")
            if verdict:
                raise TransferError(f"weight update failed: {verdict}")
        del shared

    def close(self) -> None:
        self._kept = []
        self._spans.clear()
        group, self.group = self.group, None
        if group is not None:
            group.close()


def _close(update) -> str | None:
    """Close the model's update (it packs what it holds); a failure there fails the update."""
    try:
        update.close()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _against_update_info(manifest: Manifest, info: TransferUpdateInfo) -> str | None:
    """The trainer's manifest must be the update the engine was told to expect (when told)."""
    if not info.names:
        return None
    expected = list(zip(info.names, info.dtype_names, [list(s) for s in info.shapes]))
    got = list(zip(manifest.names, manifest.dtype_names, manifest.shapes))
    for i, (want, have) in enumerate(zip(expected, got)):
        if want != have:
            return (f"tensor {i} is {have[0]} {have[1]} {have[2]} from the trainer, but update_info says "
                    f"{want[0]} {want[1]} {want[2]}")
    if len(expected) != len(got):
        return f"the trainer sends {len(got)} tensors, update_info names {len(expected)}"
    return None


def _attach(ref: dict):
    from spmd_engine.distributed.shm.segment import Segment, SegmentRef
    try:
        return Segment.attach(SegmentRef(str(ref["name"]), int(ref["size"]), int(ref["creator_pid"]),
                                         None if ref["fd"] is None else int(ref["fd"]))), None
    except (OSError, ValueError, TypeError) as exc:
        return None, (f"cannot map the trainer's shared memory ({exc}): the ipc backend needs the trainer on "
                      f"this node, as the same user")
