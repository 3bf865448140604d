"""What the two sides of a weight transfer agree on, as typed dataclasses checked on arrival.

vLLM 0.34's names: `WeightTransferConfig(backend)` on `LLM`, the worker-side init info
(`master_address`, `master_port`, `rank_offset`, `world_size`, `packed_buffer_size_bytes`)
and the per-update info (`names`, `dtype_names`, `shapes`, `packed`). Everything here arrives
as plain dicts from another job, so each field is checked for its type and range before
anything connects: a bad dict is a ValueError naming the field, never a hang.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

BACKENDS = ("nccl", "ipc")
# vLLM's default bucket is 1 GiB; a CPU engine would hold that twice (buffer and copy), so the
# default here is smaller: big enough that a bucket's broadcast dwarfs its per-call cost.
DEFAULT_BUCKET_BYTES = 64 << 20
DEFAULT_TIMEOUT_S = 300.0
SENDER_RANK = 0  # the trainer's sending rank in the transfer group


@dataclass
class WeightTransferConfig:
    """`LLM(weight_transfer_config=WeightTransferConfig(backend="nccl"))` (vLLM's name and default).
    "nccl": a process group of its own between the trainer's sender and every engine rank (NCCL
    on CUDA, gloo on CPU). "ipc": a trainer on the same node; the bytes go through shared memory."""

    backend: str = "nccl"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"weight_transfer_config backend must be one of {BACKENDS}, got {self.backend!r}")

    @classmethod
    def of(cls, value) -> "WeightTransferConfig | None":
        """None, a WeightTransferConfig, or a dict of its fields (vLLM accepts both)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {f.name for f in dataclasses.fields(cls)}
            if unknown:
                raise ValueError(f"weight_transfer_config: unknown field(s) {sorted(unknown)}")
            return cls(**value)
        raise TypeError(f"weight_transfer_config must be a WeightTransferConfig or a dict, got {type(value).__name__}")


@dataclass
class TransferInitInfo:
    """How one rank joins the transfer group: the trainer's store at master_address:master_port,
    a group of `world_size` ranks where the sender is rank 0 and engine rank r is
    `rank_offset + r` (r: the rank in the generator's launched world, so every DP and
    external-DP replica receives)."""

    master_address: str
    master_port: int
    world_size: int
    rank_offset: int = 1
    packed_buffer_size_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S
    backend: str = "nccl"
    extra: dict = field(default_factory=dict)  # vLLM's fields that change nothing here

    IGNORED = ("packed", "packed_num_buffers", "use_load_plan", "metadata", "nccl_unique_id_b64")

    @classmethod
    def from_dict(cls, info, *, sender: bool = False) -> "TransferInitInfo":
        if not isinstance(info, dict):
            raise ValueError(f"init_info must be a dict, got {type(info).__name__}")
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        unknown = set(info) - known - set(cls.IGNORED)
        if unknown:
            raise ValueError(f"init_info: unknown field(s) {sorted(unknown)}")
        missing = [k for k in ("master_address", "master_port", "world_size") if k not in info]
        if missing:
            raise ValueError(f"init_info: missing field(s) {missing}")
        out = cls(**{k: v for k, v in info.items() if k in known},
                  extra={k: v for k, v in info.items() if k in cls.IGNORED})
        out.check(sender)
        return out

    def check(self, sender: bool = False) -> None:
        if not isinstance(self.master_address, str) or not self.master_address:
            raise ValueError(f"init_info: master_address must be a host name, got {self.master_address!r}")
        _int_in("master_port", self.master_port, 0 if sender else 1, 65535)
        _int_in("world_size", self.world_size, 2, 1 << 20)
        _int_in("rank_offset", self.rank_offset, 1, self.world_size - 1)
        _int_in("packed_buffer_size_bytes", self.packed_buffer_size_bytes, 1 << 10, 1 << 40)
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise ValueError(f"init_info: timeout_s must be a number of seconds > 0, got {self.timeout_s!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"init_info: backend must be one of {BACKENDS}, got {self.backend!r}")

    def group_rank(self, engine_rank: int) -> int:
        rank = self.rank_offset + engine_rank
        if not self.rank_offset <= rank < self.world_size:
            raise ValueError(f"init_info: engine rank {engine_rank} + rank_offset {self.rank_offset} is outside "
                             f"world_size {self.world_size} (it counts the sender and every engine rank)")
        return rank


@dataclass
class TransferUpdateInfo:
    """One update as the engine expects it: parallel lists of HF names, dtype names and full
    shapes, or all empty (take the trainer's own manifest). `packed` is vLLM's switch; every
    update here is packed into buckets, so it is accepted either way."""

    names: list = field(default_factory=list)
    dtype_names: list = field(default_factory=list)
    shapes: list = field(default_factory=list)
    packed: bool = True

    @classmethod
    def from_dict(cls, info) -> "TransferUpdateInfo":
        if info is None:
            return cls()
        if not isinstance(info, dict):
            raise ValueError(f"update_info must be a dict, got {type(info).__name__}")
        unknown = set(info) - {f.name for f in dataclasses.fields(cls)} - {"src", "is_checkpoint_format"}
        if unknown:
            raise ValueError(f"update_info: unknown field(s) {sorted(unknown)}")
        out = cls(**{k: v for k, v in info.items() if k in {f.name for f in dataclasses.fields(cls)}})
        n = len(out.names)
        if len(out.dtype_names) != n or len(out.shapes) != n:
            raise ValueError(f"update_info: names, dtype_names and shapes must have the same length, got "
                             f"{n}, {len(out.dtype_names)}, {len(out.shapes)}")
        return out


def _int_in(name: str, value, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"init_info: {name} must be an integer in [{low}, {high}], got {value!r}")
