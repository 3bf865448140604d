"""Replica heads' records to global rank 0 through the launcher's store, as JSON.

Why JSON: the store is a TCP server (torchrun's agent, MASTER_ADDR:MASTER_PORT) that any
process able to reach that port can write to. What rank 0 reads from it must be data it
parses, never an object it rebuilds: `pickle.loads` of a value planted there would run the
planter's code in rank 0. A value that is not the JSON list of records we expect is refused
with StoreDataError naming the key's rank (see docs/security.md).
"""

from __future__ import annotations

import json
import time

RESULTS_KEY = "spmd_engine/results/{}"


class StoreDataError(RuntimeError):
    """A value read from the launcher's store is not what a rank of this job writes there."""


def encode_records(records: list[dict]) -> bytes:
    return json.dumps(records, separators=(",", ":")).encode()


def decode_records(raw: bytes, rank: int) -> list[dict]:
    """Parse one replica head's records; anything else is refused, never executed."""
    try:
        records = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise StoreDataError(f"results of rank {rank} in the launcher's store are not JSON "
                             f"({type(exc).__name__}): refused") from None
    if not isinstance(records, list) or not all(isinstance(r, dict) and type(r.get("index")) is int
                                                for r in records):
        raise StoreDataError(f"results of rank {rank} in the launcher's store are not JSON records "
                             f"with an int 'index': refused")
    return records


def gather_records(records: list[dict], rank: int, is_replica_head: bool, heads: list[int]) -> list[dict] | None:
    """Every replica head's records to global rank 0, through the launcher's store.

    Not a collective: a collective runs under the hang timeout, and replicas that
    finish more than --timeout apart are merely uneven, not hung. Rank 0 polls the
    store with no deadline; a replica that died instead still ends the job (torchrun
    and srun --kill-on-bad-exit stop every rank when one fails).
    """
    from torch.distributed.distributed_c10d import _get_default_store
    store = _get_default_store()
    if is_replica_head:
        store.set(RESULTS_KEY.format(rank), encode_records(records))
    if rank != 0:
        return None
    keys = [RESULTS_KEY.format(r) for r in heads]
    while not store.check(keys):
        time.sleep(0.1)
    merged = [r for head, k in zip(heads, keys) for r in decode_records(store.get(k), head)]
    return sorted(merged, key=lambda r: r["index"])
