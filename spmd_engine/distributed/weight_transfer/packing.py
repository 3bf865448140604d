"""The wire form of one update: a JSON manifest, then the tensors' bytes as one stream cut
into buckets of a set size.

Why a byte stream: the sender never holds more than one bucket beyond the model, and the
receiver never more than one bucket plus the one tensor that straddles two buckets, whatever
the tensor sizes (a tensor larger than a bucket simply spans several). Each tensor starts on
an ALIGN-byte boundary, so the part of it inside one bucket can be viewed as its dtype in
place. The manifest is JSON (names, dtype names, shapes, and the shared-memory reference of
the ipc backend): nothing a peer sends is unpickled.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch

ALIGN = 16
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


def pack(bucket: torch.Tensor, pieces: list[Piece], tensors: list[torch.Tensor]) -> int:
    """Copy the pieces of `tensors` (contiguous, on the bucket's device) into the uint8 `bucket`;
    returns the bucket's used length."""
    end = 0
    for p in pieces:
        src = tensors[p.index].reshape(-1).view(torch.uint8)[p.tensor_offset:p.tensor_offset + p.length]
        bucket[p.bucket_offset:p.bucket_offset + p.length].copy_(src)
        end = p.bucket_offset + p.length
    return end


class Unpacker:
    """Turns buckets back into tensors: `feed(k, bucket)` returns the (name, tensor) pairs that
    bucket completes. A tensor wholly inside a bucket is a view of it (valid until the bucket is
    reused: apply it first); one that spans buckets is assembled in a buffer of its own."""

    def __init__(self, manifest: Manifest, device: torch.device | str = "cpu"):
        self.manifest, self.device = manifest, device
        self.plan = bucket_plan(manifest)
        self.sizes = manifest.nbytes()
        self._partial: dict[int, torch.Tensor] = {}

    def feed(self, k: int, bucket: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        out = []
        for p in self.plan[k]:
            chunk = bucket[p.bucket_offset:p.bucket_offset + p.length]
            if p.length == self.sizes[p.index]:
                raw = chunk
            else:
                buf = self._partial.get(p.index)
                if buf is None:
                    buf = self._partial[p.index] = torch.empty(self.sizes[p.index], dtype=torch.uint8, device=self.device)
                buf[p.tensor_offset:p.tensor_offset + p.length].copy_(chunk)
                if p.tensor_offset + p.length < self.sizes[p.index]:
                    continue
                raw = self._partial.pop(p.index)
            out.append((self.manifest.names[p.index], self._typed(p.index, raw)))
        return out

    def _typed(self, i: int, raw: torch.Tensor) -> torch.Tensor:
        dtype = DTYPES[self.manifest.dtype_names[i]]
        shape = self.manifest.shapes[i]
        return (raw.view(dtype) if raw.numel() else torch.empty(0, dtype=dtype, device=raw.device)).view(shape)
