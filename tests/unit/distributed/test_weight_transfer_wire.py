"""The weight transfer's pure parts: the bucket plan and its packing round trip (tensors larger
than a bucket, straddling two, empty streams), the manifest's JSON and its checks, and the
init / update info a peer sends (every bad field named, before anything connects)."""

from __future__ import annotations

import pytest
import torch

from spmd_engine.distributed.weight_transfer.config import (
    TransferInitInfo,
    TransferUpdateInfo,
    WeightTransferConfig,
)
from spmd_engine.distributed.weight_transfer.packing import ALIGN, Manifest, SpanBuffers, Unpacker, bucket_plan, pack


def _tensors(seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(12):
        shape = [int(x) for x in torch.randint(1, 40, (int(torch.randint(1, 3, (1,), generator=gen)),), generator=gen)]
        dtype = [torch.float32, torch.bfloat16, torch.float16][i % 3]
        out.append((f"t{i}", torch.randn(shape, generator=gen).to(dtype)))
    return out


@pytest.mark.parametrize("bucket_bytes", [ALIGN, 48, 256, 1024, 1 << 20])
@pytest.mark.parametrize("seed", [0, 1])
def test_packing_round_trip_at_any_bucket_size(bucket_bytes, seed):
    tensors = _tensors(seed)
    manifest = Manifest.decode(Manifest.of(tensors, bucket_bytes).encode())
    plan = bucket_plan(manifest)
    unpack = Unpacker(manifest)
    got = {}
    bucket = torch.empty(manifest.bucket_bytes, dtype=torch.uint8)
    for k, pieces in enumerate(plan):
        bucket.fill_(0xAB)  # a stale byte anywhere shows up below
        used = pack(bucket, pieces, [t for _, t in tensors])
        assert used <= manifest.bucket_bytes
        for name, t in unpack.feed(k, bucket[:used]):
            got[name] = t.clone()  # views of the bucket: copied before it is reused
    assert list(got) == [n for n, _ in tensors]
    for name, t in tensors:
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    total = manifest.offsets()[1]
    assert len(plan) == -(-total // manifest.bucket_bytes)  # bounded: no bucket beyond the stream


def test_a_tensor_larger_than_a_bucket_spans_several():
    tensors = [("big", torch.arange(1000, dtype=torch.float32)), ("small", torch.ones(3))]
    manifest = Manifest.of(tensors, 1024)
    plan = bucket_plan(manifest)
    assert len(plan) == 4 and [p.index for p in plan[0]] == [0] and plan[3][-1].index == 1
    assert max(p.bucket_offset + p.length for b in plan for p in b) <= 1024


def test_spanning_buffers_are_reused_across_updates_and_never_while_handed_out():
    """Two updates through one SpanBuffers (as a receiver keeps it): the buffers a spanning tensor
    is assembled in come back for the next update (no fresh pages each push), and a buffer whose
    tensor the last feed handed out is not taken by the next spanning tensor of that size before
    the caller has applied it (A ends in the bucket where B, the same size, starts)."""
    spans = SpanBuffers()
    seen = []
    for update in range(2):
        tensors = [("a", torch.arange(1000, dtype=torch.float32) + update),
                   ("b", torch.arange(1000, dtype=torch.float32) * -1 - update)]
        manifest = Manifest.of(tensors, 1024)
        unpack = Unpacker(manifest, spans=spans)
        bucket = torch.empty(manifest.bucket_bytes, dtype=torch.uint8)
        got = {}
        for k, pieces in enumerate(unpack.plan):
            used = pack(bucket, pieces, [t for _, t in tensors])
            for name, t in unpack.feed(k, bucket[:used]):
                seen.append(t.data_ptr())
                got[name] = t.clone()  # applied only now, after the whole feed
        unpack.release()
        for name, t in tensors:
            assert torch.equal(got[name], t), (update, name)
    assert len(set(seen)) == 2 and set(seen[:2]) == set(seen[2:])  # two buffers, the same ones both times
    spans.trim()
    assert sum(len(b) for b in spans._free.values()) == 2  # the last update took these sizes: kept
    spans.trim()  # an update that took nothing of that size (the trainer's tensors changed): dropped
    assert not spans._free


@pytest.mark.parametrize("bad, needle", [
    (b"\x80not json", "not JSON"),
    (b'{"names": []}', "expected fields"),
    (b'{"names": ["a"], "dtype_names": [], "shapes": [], "bucket_bytes": 16, "shm": null}', "one length"),
    (b'{"names": ["a"], "dtype_names": ["float32"], "shapes": [[-1]], "bucket_bytes": 16, "shm": null}', "bad entry"),
    (b'{"names": [], "dtype_names": [], "shapes": [], "bucket_bytes": 7, "shm": null}', "bucket_bytes"),
    (b'{"names": [], "dtype_names": [], "shapes": [], "bucket_bytes": 16, "shm": "x"}', "shared-memory"),
])
def test_a_bad_manifest_is_refused_by_name(bad, needle):
    with pytest.raises(ValueError, match=needle):
        Manifest.decode(bad)


GOOD = {"master_address": "127.0.0.1", "master_port": 29555, "world_size": 5}


@pytest.mark.parametrize("change, needle", [
    ({"master_port": 0}, "master_port"), ({"master_port": "1"}, "master_port"),
    ({"world_size": 1}, "world_size"), ({"rank_offset": 5}, "rank_offset"), ({"rank_offset": 0}, "rank_offset"),
    ({"timeout_s": 0}, "timeout_s"), ({"packed_buffer_size_bytes": 10}, "packed_buffer_size_bytes"),
    ({"master_address": ""}, "master_address"), ({"bogus": 1}, "unknown field"), ({"backend": "rdma"}, "backend"),
])
def test_init_info_fields_are_checked(change, needle):
    with pytest.raises(ValueError, match=needle):
        TransferInitInfo.from_dict({**GOOD, **change})


def test_init_info_accepts_vllms_fields_and_places_every_engine_rank():
    info = TransferInitInfo.from_dict({**GOOD, "packed": True, "packed_num_buffers": 2})
    assert [info.group_rank(r) for r in range(4)] == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="outside world_size"):
        info.group_rank(4)
    with pytest.raises(ValueError, match="missing"):
        TransferInitInfo.from_dict({"master_address": "h"})
    assert TransferInitInfo.from_dict({**GOOD, "master_port": 0}, sender=True).master_port == 0


def test_update_info_and_config():
    assert TransferUpdateInfo.from_dict(None).names == []
    with pytest.raises(ValueError, match="same length"):
        TransferUpdateInfo.from_dict({"names": ["a"], "dtype_names": [], "shapes": []})
    with pytest.raises(ValueError, match="unknown"):
        TransferUpdateInfo.from_dict({"nmes": []})
    assert WeightTransferConfig.of({"backend": "ipc"}).backend == "ipc"
    with pytest.raises(ValueError, match="backend"):
        WeightTransferConfig("rdma")
    with pytest.raises(TypeError):
        WeightTransferConfig.of("nccl")
