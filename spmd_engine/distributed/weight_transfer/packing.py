"""The wire form of one update: a JSON manifest, then the tensors' bytes as one stream cut
into buckets of a set size.

Why a byte stream: the sender never holds more than one bucket beyond the model, and the
receiver never more than one bucket plus the one tensor that straddles two buckets, whatever
the tensor sizes (a tensor larger than a bucket simply spans several). Each tensor starts on
an ALIGN-byte boundary, so the part of it inside one bucket can be viewed as its dtype in
place. The manifest is JSON (names, dtype names, shapes, and the shared-memory reference of
the ipc backend): nothing a peer sends is unpickled.

Why segments: a bucket is sent as several broadcasts (`segments`), so that a large piece goes
from the trainer's tensor straight onto the wire and, when its tensor spans buckets, straight
into the receiver's buffer for that tensor; only small pieces are copied into the bucket, where
one broadcast carries many of them. Both sides derive the same segments from the manifest.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch

ALIGN = 16
# A piece at least this large is its own broadcast (no copy into the bucket); smaller ones are
# gathered, since a broadcast's fixed cost would outweigh copying them.
DIRECT_BYTES = 1 << 18
MAX_MANIFEST_BYTES = 64 << 20
# The dtypes a weight may travel in (by vLLM's dtype names: str(torch.float32) without "torch.").
DTYPES = {name: getattr(torch, name) for name in ("float32", "float16", "bfloat16", "float64")}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class Manifest:
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    bucket_bytes: int
    shm: dict | None = None  # the ipc backend's segment reference

    @classmethod
    def of(cls, named_tensors: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> "Manifest":
        return cls([n for n, _ in named_tensors], [dtype_name(t.dtype) for _, t in named_tensors],
                   [list(t.shape) for _, t in named_tensors], bucket_bytes // ALIGN * ALIGN)

    def nbytes(self) -> list[int]:
        """Each tensor's size in bytes; a dtype outside DTYPES counts 0 (refused by the check)."""
        return [math.prod(s) * (DTYPES[d].itemsize if d in DTYPES else 0) for d, s in zip(self.dtype_names, self.shapes)]

    def offsets(self) -> tuple[list[int], int]:
        """Where each tensor starts in the stream, and the stream's length."""
        starts, end = [], 0
        for n in self.nbytes():
            start = _align(end)
            starts.append(start)
            end = start + n
        return starts, end

    def num_buckets(self) -> int:
        return -(-self.offsets()[1] // self.bucket_bytes)

    def encode(self) -> bytes:
        return json.dumps({"names": self.names, "dtype_names": self.dtype_names, "shapes": self.shapes,
                           "bucket_bytes": self.bucket_bytes, "shm": self.shm}).encode()

    @classmethod
    def decode(cls, data: bytes) -> "Manifest":
        """The peer's manifest, every field's type checked (a ValueError names what is wrong)."""
        try:
            raw = json.loads(data.decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"the trainer's manifest is not JSON: {exc}") from None
        if not isinstance(raw, dict) or set(raw) != {"names", "dtype_names", "shapes", "bucket_bytes", "shm"}:
            raise ValueError("the trainer's manifest does not have the expected fields")
        names, dtypes, shapes = raw["names"], raw["dtype_names"], raw["shapes"]
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
                and len(names) == len(dtypes) == len(shapes)):
            raise ValueError("the trainer's manifest: names, dtype_names and shapes are not lists of one length")
        for n, d, s in zip(names, dtypes, shapes):
            if not (isinstance(n, str) and isinstance(d, str) and isinstance(s, list)
                    and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in s)):
                raise ValueError(f"the trainer's manifest: a bad entry for {n!r}")
        bucket = raw["bucket_bytes"]
        if not (isinstance(bucket, int) and ALIGN <= bucket and bucket % ALIGN == 0):
            raise ValueError(f"the trainer's manifest: bad bucket_bytes {bucket!r}")
        shm = raw["shm"]
        if shm is not None and not (isinstance(shm, dict) and set(shm) == {"name", "size", "creator_pid", "fd"}):
            raise ValueError("the trainer's manifest: a bad shared-memory reference")
        return cls(names, dtypes, shapes, bucket, shm)


@dataclass(frozen=True)
class Piece:
    """Bytes [tensor_offset, +length) of tensor `index` sit at [bucket_offset, +length) of a bucket."""

    index: int
    tensor_offset: int
    bucket_offset: int
    length: int


def bucket_plan(manifest: Manifest) -> list[list[Piece]]:
    """The pieces of every bucket, in stream order (pure: both sides compute the same plan)."""
    starts, total = manifest.offsets()
    size = manifest.bucket_bytes
    buckets: list[list[Piece]] = [[] for _ in range(-(-total // size))]
    for index, (start, n) in enumerate(zip(starts, manifest.nbytes())):
        done = 0
        while done < n:
            at = start + done
            k, off = divmod(at, size)
            length = min(n - done, size - off)
            buckets[k].append(Piece(index, done, off, length))
            done += length
    return buckets


@dataclass(frozen=True)
class Segment:
    """One broadcast: bytes [bucket_offset, +length) of a bucket. `direct`: a single piece sent
    from its tensor's own bytes (`source`); otherwise its pieces are packed into the bucket."""

    bucket_offset: int
    length: int
    pieces: tuple[Piece, ...]
    direct: bool


def segments(pieces: list[Piece], sizes: list[int]) -> list[Segment]:
    """A bucket's broadcasts, in stream order (pure: both sides compute the same ones). A piece
    of a tensor spanning buckets is always direct, so it lands in that tensor's own buffer."""
    out: list[Segment] = []
    run: list[Piece] = []

    def gather() -> None:
        if run:
            start = run[0].bucket_offset
            out.append(Segment(start, run[-1].bucket_offset + run[-1].length - start, tuple(run), False))
            run.clear()
    for p in pieces:
        if p.length >= DIRECT_BYTES or p.length != sizes[p.index]:
            gather()
            out.append(Segment(p.bucket_offset, p.length, (p,), True))
        else:
            run.append(p)
    gather()
    return out


def source(p: Piece, tensors: list[torch.Tensor]) -> torch.Tensor:
    """The bytes of piece `p` in its (contiguous) tensor, as a uint8 view."""
    return tensors[p.index].reshape(-1).view(torch.uint8)[p.tensor_offset:p.tensor_offset + p.length]


def pack(bucket: torch.Tensor, pieces: list[Piece] | tuple[Piece, ...], tensors: list[torch.Tensor]) -> int:
    """Copy the pieces of `tensors` (contiguous, on the bucket's device) into the uint8 `bucket`,
    zeroing the alignment gaps between them (no stale bytes of the sender go out); returns the
    end of the last piece."""
    end = pieces[0].bucket_offset if pieces else 0
    for p in pieces:
        if p.bucket_offset > end:
            bucket[end:p.bucket_offset].zero_()
        bucket[p.bucket_offset:p.bucket_offset + p.length].copy_(source(p, tensors))
        end = p.bucket_offset + p.length
    return end


class SpanBuffers:
    """The buffers that tensors spanning buckets are assembled in, kept from one update to the
    next: an RL loop pushes every step, and a fresh buffer for the embedding or the LM head would
    fault in every page of it each time (as long as receiving it). Holds at most the buffers the
    last update had in use at once (`trim` drops sizes it did not take); `clear` frees them all
    (shutdown, or a stream that broke while a broadcast may still be writing into one)."""

    def __init__(self):
        self._free: dict[tuple[int, str], list[torch.Tensor]] = {}
        self._taken: set[tuple[int, str]] = set()

    def take(self, nbytes: int, device: torch.device | str) -> torch.Tensor:
        key = (nbytes, str(device))
        self._taken.add(key)
        free = self._free.get(key)
        return free.pop() if free else torch.empty(nbytes, dtype=torch.uint8, device=device)

    def trim(self) -> None:
        """After an update: keep only the sizes it took (a trainer whose tensors changed size
        leaves no buffers of the old sizes behind)."""
        self._free = {key: bufs for key, bufs in self._free.items() if key in self._taken}
        self._taken = set()

    def give(self, buffer: torch.Tensor) -> None:
        self._free.setdefault((buffer.numel(), str(buffer.device)), []).append(buffer)

    def clear(self) -> None:
        self._free = {}


class Unpacker:
    """Turns buckets back into tensors: `feed(k, bucket)` returns the (name, tensor) pairs that
    bucket (or one of its segments) completes, to be applied (copied out) before the bucket is
    reused or `feed` is called again. A tensor wholly inside a bucket is a view of it; one that
    spans buckets is assembled in a buffer of its own (from `spans`, returned there by the next
    `feed` or by `release`), either received there directly (`destination`) or copied there
    from the bucket by `feed`."""

    def __init__(self, manifest: Manifest, device: torch.device | str = "cpu", spans: SpanBuffers | None = None):
        self.manifest, self.device = manifest, device
        self.plan = bucket_plan(manifest)
        self.sizes = manifest.nbytes()
        self.segments = [segments(pieces, self.sizes) for pieces in self.plan]
        self.spans = spans if spans is not None else SpanBuffers()
        self._partial: dict[int, torch.Tensor] = {}
        self._completed: list[torch.Tensor] = []  # handed out by the last feed
        self._received: set[Piece] = set()  # pieces already in their tensor's buffer

    def destination(self, segment: Segment, bucket: torch.Tensor) -> torch.Tensor:
        """Where a segment's broadcast should land: its range of the bucket, or for a piece of a
        tensor spanning buckets, its range of that tensor's buffer (no copy later)."""
        p = segment.pieces[0]
        if segment.direct and p.length != self.sizes[p.index]:
            self._received.add(p)
            return self._buffer(p.index)[p.tensor_offset:p.tensor_offset + p.length]
        return bucket[segment.bucket_offset:segment.bucket_offset + segment.length]

    def _buffer(self, index: int) -> torch.Tensor:
        buf = self._partial.get(index)
        if buf is None:
            buf = self._partial[index] = self.spans.take(self.sizes[index], self.device)
        return buf

    def release(self) -> None:
        """The buffers of tensors the last feed completed go back to `spans` (they are applied)."""
        for buf in self._completed:
            self.spans.give(buf)
        self._completed = []

    def feed(self, k: int, bucket: torch.Tensor, pieces=None) -> list[tuple[str, torch.Tensor]]:
        """`pieces`: only these of bucket k (a segment that has arrived), in stream order."""
        self.release()
        out = []
        for p in self.plan[k] if pieces is None else pieces:
            if p.length == self.sizes[p.index]:
                raw = bucket[p.bucket_offset:p.bucket_offset + p.length]
            else:
                buf = self._buffer(p.index)
                if p not in self._received:
                    buf[p.tensor_offset:p.tensor_offset + p.length].copy_(bucket[p.bucket_offset:p.bucket_offset + p.length])
                if p.tensor_offset + p.length < self.sizes[p.index]:
                    continue
                raw = self._partial.pop(p.index)
                self._completed.append(raw)
            out.append((self.manifest.names[p.index], self._typed(p.index, raw)))
        return out

    def _typed(self, i: int, raw: torch.Tensor) -> torch.Tensor:
        dtype = DTYPES[self.manifest.dtype_names[i]]
        shape = self.manifest.shapes[i]
        return (raw.view(dtype) if raw.numel() else torch.empty(0, dtype=dtype, device=raw.device)).view(shape)
