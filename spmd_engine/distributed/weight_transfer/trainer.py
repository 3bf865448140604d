"""The trainer's side: `trainer_init(init_info)` on the sending rank, then one
`send_weights(named_tensors)` per update, while the generator runs
`start_weight_update()` / `update_weights(...)` / `finish_weight_update(version)`.

Usable from a plain torchrun trainer: only the sending rank calls it (its other ranks take no
part; with FSDP every rank gathers each tensor, `full_tensor()`, as the sender iterates).
The trainer hosts the transfer store, so it starts first or at the same time as the
generator's `init_weight_transfer_engine`; both wait up to `timeout_s` for each other.

One update on the wire (packing.py, group.py): the manifest (JSON), one agreement in which
any engine rank may refuse it (a name it does not have, a wrong shape or dtype: the reason
comes back here, named, and nothing is sent), the buckets, and a last agreement that every
engine rank applied them. With the "ipc" backend the buckets go through a shared-memory
segment the engine ranks map through /proc (it never has a /dev/shm name), and only the
control messages through the group.
"""

from __future__ import annotations

import torch

from spmd_engine.distributed.weight_transfer.config import SENDER_RANK, TransferInitInfo
from spmd_engine.distributed.weight_transfer.group import TransferError, TransferGroup, host_store
from spmd_engine.distributed.weight_transfer.packing import Manifest, bucket_plan, pack, segments, source


class WeightTransferRefused(ValueError):
    """An engine rank refused the update (names the tensor and why); nothing was sent."""


class TrainerWeightTransferEngine:
    backend = "nccl"

    def __init__(self, info: TransferInitInfo, group: TransferGroup, store):
        self.info, self.group, self._store = info, group, store
        self.master_port = store.port

    @classmethod
    def trainer_init(cls, init_info: dict, device: torch.device | str | None = None) -> "TrainerWeightTransferEngine":
        """Host the transfer store at init_info's master_address:master_port (port 0: the OS picks
        one, read `.master_port`; the engines need it, so a fixed port is the usual choice) and
        form the group with every engine rank (they call init_weight_transfer_engine meanwhile)."""
        info = TransferInitInfo.from_dict(dict(init_info, backend=cls.backend), sender=True)
        dev = torch.device(device) if device is not None else torch.device("cpu")
        if cls.backend == "ipc":
            dev = torch.device("cpu")  # control messages only; the bytes go through shared memory
        store = host_store(info.master_address, info.master_port, info.timeout_s)
        try:
            group = TransferGroup(store, SENDER_RANK, info.world_size, info.timeout_s, dev,
                                  session=TransferGroup.new_session())
        except BaseException:
            del store
            raise
        return cls(info, group, store)

    def send_weights(self, named_tensors) -> int:
        """Push one update: (HF name, full tensor) pairs (a DTensor is gathered). Returns the
        bytes sent. Raises WeightTransferRefused when an engine rank refused the manifest
        (the group stays usable), TransferError when an engine rank died, hung or failed."""
        if self.group is None:
            raise TransferError("send_weights after shutdown()")
        tensors = []
        for name, t in (named_tensors.items() if hasattr(named_tensors, "items") else named_tensors):
            t = t.full_tensor() if hasattr(t, "full_tensor") else t
            tensors.append((name, t.detach().contiguous()))
        manifest = Manifest.of(tensors, self.info.packed_buffer_size_bytes)
        segment = self._segment(manifest)
        try:
            self.group.send_bytes(manifest.encode(), "sending the manifest")
            verdict = self.group.agree(None, "the manifest check")
            if segment is not None:
                segment.unlink()  # every engine rank mapped it (or refused): no name, no descriptor left
            if verdict:
                raise WeightTransferRefused(f"the engine refused the update: {verdict}")
            self._send_buckets(manifest, [t for _, t in tensors], segment)
            verdict = self.group.agree(None, "applying the weights")
        finally:
            if segment is not None:
                segment.close()
        if verdict:
            raise TransferError(f"the update failed on the engine: {verdict}")
        return manifest.offsets()[1]

    def _segment(self, manifest: Manifest):
        if self.backend != "ipc":
            return None
        from spmd_engine.distributed.shm.segment import Lifetime, Segment
        size = min(manifest.bucket_bytes, max(manifest.offsets()[1], 1))
        size = -(-size // 16) * 16
        manifest.bucket_bytes = size
        segment = Segment.create(size, "spmd_wt_", lifetime=Lifetime.NAMELESS, what="the weight-transfer buffer")
        ref = segment.ref()
        manifest.shm = {"name": ref.name, "size": ref.size, "creator_pid": ref.creator_pid, "fd": ref.fd}
        return segment

    def _send_buckets(self, manifest: Manifest, tensors: list[torch.Tensor], segment) -> None:
        plan = bucket_plan(manifest)
        if segment is not None:
            shared = torch.frombuffer(segment.mm, dtype=torch.uint8)
            host = [t.cpu() for t in tensors] if any(t.device.type != "cpu" for t in tensors) else tensors
            for k, pieces in enumerate(plan):
                pack(shared, pieces, host)
                self.group.broadcast(torch.tensor([k], dtype=torch.int64), f"bucket {k} ready")
                verdict = self.group.agree(None, f"bucket {k} read")
                if verdict:
                    raise TransferError(f"the update failed on the engine: {verdict}")
            del shared
            return
        dev = self.group.device
        tensors = [t.to(dev) for t in tensors]
        sizes = manifest.nbytes()
        # Large pieces go out from the tensors themselves; small ones are packed into one of two
        # buffers (untouched pages cost nothing), so bucket k is packed while k-1 is on the wire.
        buffers = [torch.empty(manifest.bucket_bytes, dtype=torch.uint8, device=dev)
                   for _ in range(min(2, len(plan)))]
        works: list[list] = []
        for k, pieces in enumerate(plan):
            if k >= 2:
                self._wait_all(works[k - 2], k - 2)
            bucket, sent = buffers[k % 2], []
            for seg in segments(pieces, sizes):
                if seg.direct:
                    data = source(seg.pieces[0], tensors)
                else:
                    pack(bucket, seg.pieces, tensors)
                    data = bucket[seg.bucket_offset:seg.bucket_offset + seg.length]
                sent.append(self.group.broadcast_async(data, f"bucket {k}"))
            works.append(sent)
        for k in range(max(0, len(plan) - 2), len(plan)):
            self._wait_all(works[k], k)

    def _wait_all(self, works: list, k: int) -> None:
        for work in works:
            self.group.wait(work, f"bucket {k}")

    def shutdown(self) -> None:
        """Leave the group and close the store (the engines' next update fails at once; they
        call shutdown_weight_transfer_engine, or init again for a new trainer)."""
        group, self.group = self.group, None
        if group is not None:
            group.close()
        self._store = None


class NCCLTrainerWeightTransferEngine(TrainerWeightTransferEngine):
    """vLLM's name: a process group broadcast (NCCL on CUDA, gloo on CPU)."""

    backend = "nccl"


class IPCTrainerWeightTransferEngine(TrainerWeightTransferEngine):
    """vLLM's name: a trainer on the engine's node; the bytes go through shared memory."""

    backend = "ipc"


def trainer_engine(backend: str):
    return {"nccl": NCCLTrainerWeightTransferEngine, "ipc": IPCTrainerWeightTransferEngine}[backend]
