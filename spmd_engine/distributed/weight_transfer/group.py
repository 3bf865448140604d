"""The transfer group: a process group of its own between the trainer's sender (rank 0) and
every engine rank, made from its own store, so neither job's default world is touched.

The trainer hosts the store on master_address:master_port (the socket is bound to that
address alone, as loopback_store does: docs/security.md), writes a fresh session token, and
every rank builds its group under that token's prefix. The group is gloo on CPU and NCCL on
CUDA; every collective is bounded by the init info's timeout, so a peer that dies or hangs
is an error on the others, never a hang. A control message (`agree`) lets any rank stop the
others with a reason: each rank offers an error or None, and all learn the first one.
"""

from __future__ import annotations

import datetime
import errno
import secrets
import socket

import torch
import torch.distributed as dist

SESSION_KEY = "spmd_engine/weight_transfer/session"
REASON_BYTES = 2048


class TransferError(RuntimeError):
    """The transfer group failed (a peer died, hung past the timeout, or refused)."""


def host_store(address: str, port: int, timeout_s: float) -> dist.TCPStore:
    """The trainer's store, listening on `address` only; port 0: the OS picks (see `.port`).
    A port in use means another trainer (or anything else) holds this endpoint: refused."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((address, port))
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise TransferError(f"weight transfer endpoint {address}:{port} is in use: another trainer is "
                                f"connected there (one sender per engine; shut it down first)") from None
        raise
    port = sock.getsockname()[1]
    return dist.TCPStore(address, port, is_master=True, wait_for_workers=False, master_listen_fd=sock.detach(),
                         timeout=datetime.timedelta(seconds=timeout_s))


def join_store(address: str, port: int, timeout_s: float) -> dist.TCPStore:
    try:
        return dist.TCPStore(address, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, dist.DistStoreError) as exc:
        raise TransferError(f"no trainer's weight transfer endpoint at {address}:{port} within {timeout_s} s "
                            f"({str(exc).splitlines()[0]})") from None


class TransferGroup:
    def __init__(self, store, rank: int, world_size: int, timeout_s: float, device: torch.device,
                 session: str | None = None):
        self.rank, self.world_size, self.device = rank, world_size, device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store = store
        if session is None:
            try:
                session = store.get(SESSION_KEY).decode()
            except (RuntimeError, dist.DistStoreError) as exc:
                raise TransferError(f"the trainer published no transfer session within {timeout_s} s "
                                    f"({str(exc).splitlines()[0]})") from None
        else:
            store.set(SESSION_KEY, session)
        prefixed = dist.PrefixStore(f"spmd_engine/weight_transfer/{session}/", store)
        try:
            if device.type == "cuda":
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = self.timeout
                self.pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
            else:
                self.pg = dist.ProcessGroupGloo(prefixed, rank, world_size, self.timeout)
        except (RuntimeError, dist.DistError) as exc:
            raise TransferError(f"the transfer group of {world_size} ranks did not form within {timeout_s} s "
                                f"(rank {rank}: {str(exc).splitlines()[0]})") from None
        self.failed: str | None = None

    @staticmethod
    def new_session() -> str:
        return secrets.token_hex(8)

    def _run(self, work, what: str) -> None:
        try:
            work.wait(self.timeout)
        except (RuntimeError, dist.DistError) as exc:
            self.failed = f"{what} failed on transfer rank {self.rank}: {str(exc).splitlines()[0]}"
            raise TransferError(self.failed) from None

    def broadcast(self, tensor: torch.Tensor, what: str = "broadcast") -> None:
        self._run(self.broadcast_async(tensor, what), what)

    def broadcast_async(self, tensor: torch.Tensor, what: str):
        """Start a broadcast from the sender; `wait(work, what)` ends it (two in flight let
        packing or applying one bucket overlap the next one's transfer)."""
        if self.failed:
            raise TransferError(f"the transfer group failed earlier: {self.failed}")
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        try:
            return self.pg.broadcast([tensor], opts)
        except (RuntimeError, dist.DistError) as exc:
            self.failed = f"{what} failed on transfer rank {self.rank}: {str(exc).splitlines()[0]}"
            raise TransferError(self.failed) from None

    def wait(self, work, what: str) -> None:
        self._run(work, what)

    def broadcast_from(self, tensor: torch.Tensor, root: int, what: str) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = root, 0
        self._run(self.pg.broadcast([tensor], opts), what)

    def all_reduce_min(self, value: int, what: str) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self._run(self.pg.allreduce([t], opts), what)
        return int(t.item())

    def agree(self, error: str | None, what: str) -> str | None:
        """Every rank offers its error (or None); all return the lowest erring rank's, naming it."""
        first = self.all_reduce_min(self.rank if error else self.world_size, what)
        if first == self.world_size:
            return None
        buf = torch.zeros(REASON_BYTES, dtype=torch.uint8, device=self.device)
        if first == self.rank:
            data = error.encode()[:REASON_BYTES]
            buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.broadcast_from(buf, first, what)
        text = bytes(buf.cpu().tolist()).rstrip(b"\0").decode(errors="replace")
        return f"{'trainer' if first == 0 else f'engine transfer rank {first}'}: {text}"

    def send_bytes(self, data: bytes, what: str) -> None:
        self.broadcast(torch.tensor([len(data)], dtype=torch.int64, device=self.device), what)
        self.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device), what)

    def recv_bytes(self, limit: int, what: str) -> bytes:
        n = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.broadcast(n, what)
        if not 0 < int(n) <= limit:
            self.failed = f"{what}: the trainer announced {int(n)} bytes (limit {limit})"
            raise TransferError(self.failed)
        buf = torch.empty(int(n), dtype=torch.uint8, device=self.device)
        self.broadcast(buf, what)
        return buf.cpu().numpy().tobytes()

    def close(self) -> None:
        pg, self.pg = getattr(self, "pg", None), None
        if pg is not None:
            try:
                pg.shutdown()
            except (RuntimeError, AttributeError):
                pass
        self.store = None
