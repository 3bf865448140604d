"""Figure weight_transfer: seconds to push the bench model from a trainer into a running engine
through the "nccl" backend (gloo on CPU: manifest, agreements, packed buckets, each bucket
applied into the engine's weights), against a plain gloo broadcast of the same tensors, one
broadcast per tensor into tensors already allocated and written, in the same run. The trainer is a thread
of this process in both (gloo releases the GIL), so the two differ only by the protocol."""

from __future__ import annotations

import datetime
import socket
import statistics
import threading
import time

import torch
import torch.distributed as dist

from benchmarks.harness import emit, loadavg, random_llama


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plain_broadcast(tensors: list[torch.Tensor], received: list[torch.Tensor]) -> float:
    """Two gloo ranks (threads) on a store of their own; rank 1 receives every tensor into
    `received`, written before (as the engine's weights are: no page is faulted in here)."""
    store = dist.HashStore()
    timeout = datetime.timedelta(seconds=120)
    groups = [None, None]

    def make(rank):
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, timeout)
    makers = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    [m.start() for m in makers]
    [m.join() for m in makers]

    def run(rank):
        for t, r in zip(tensors, received):
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            groups[rank].broadcast([t if rank == 0 else r], opts).wait()
    for r in received:  # untimed: the check below then sees only this call's bytes
        r.zero_()
    t0 = time.perf_counter()
    sender = threading.Thread(target=run, args=(0,))
    sender.start()
    run(1)
    sender.join()
    elapsed = time.perf_counter() - t0
    assert all(torch.equal(a, b) for a, b in zip(tensors, received))
    return elapsed


class _Discard:
    """An update that keeps nothing: the receiver's side without the engine."""

    def apply(self, pairs) -> None:
        pass

    def close(self) -> None:
        pass


def _protocol_only(state: dict, received: list[torch.Tensor], reps: int) -> tuple[list[float], list[float]]:
    """The same protocol (manifest, agreements, double-buffered buckets) into a bare receiver
    that applies nothing: what the transfer itself costs, without the engine's copy into its
    (packed) weights; each rep followed by a plain broadcast, its baseline in turn."""
    from spmd_engine.distributed.weight_transfer.config import TransferInitInfo, TransferUpdateInfo
    from spmd_engine.distributed.weight_transfer.receiver import WeightReceiver
    from spmd_engine.distributed.weight_transfer.trainer import NCCLTrainerWeightTransferEngine
    info = {"master_address": "127.0.0.1", "master_port": _port(), "world_size": 2, "timeout_s": 120}
    box = {}
    connect = threading.Thread(target=lambda: box.update(t=NCCLTrainerWeightTransferEngine.trainer_init(info)))
    connect.start()
    receiver = WeightReceiver(TransferInitInfo.from_dict(info), 0, torch.device("cpu"))
    connect.join()
    times, plain = [], []
    for _ in range(reps):
        sender = threading.Thread(target=box["t"].send_weights, args=(state.items(),))
        t0 = time.perf_counter()
        sender.start()
        receiver.receive(TransferUpdateInfo(), lambda m: None, lambda m: _Discard())
        sender.join()
        times.append(time.perf_counter() - t0)
        plain.append(_plain_broadcast(list(state.values()), received))
    receiver.close()
    box["t"].shutdown()
    return times, plain


def fig_weight_transfer(args) -> None:
    from safetensors.torch import load_file

    from spmd_engine import LLM
    from spmd_engine.distributed.weight_transfer.trainer import NCCLTrainerWeightTransferEngine

    path = random_llama(args)
    state = {k: v.clone() for k, v in load_file(f"{path}/model.safetensors").items()}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    received = [torch.zeros_like(t) for t in state.values()]
    port = _port()
    info = {"master_address": "127.0.0.1", "master_port": port, "world_size": 2, "timeout_s": 120}
    pushes, plain = [], []
    with LLM(model=path, distributed_executor_backend="uni", max_num_seqs=8, enforce_eager=True,
             weight_transfer_config={"backend": "nccl"}) as llm:
        box = {}
        connect = threading.Thread(target=lambda: box.update(t=NCCLTrainerWeightTransferEngine.trainer_init(info)))
        connect.start()
        llm.init_weight_transfer_engine({"init_info": info})
        connect.join()
        trainer = box["t"]
        for rep in range(args.reps + 1):  # the first round warms both
            sender = threading.Thread(target=trainer.send_weights, args=(state.items(),))
            t0 = time.perf_counter()
            sender.start()
            llm.start_weight_update()
            llm.update_weights({"update_info": {}})
            llm.finish_weight_update(rep)
            sender.join()
            pushes.append(time.perf_counter() - t0)
            plain.append(_plain_broadcast(list(state.values()), received))
        llm.shutdown_weight_transfer_engine()
        trainer.shutdown()
    protocol, protocol_plain = _protocol_only(state, received, args.reps + 1)
    value, base = statistics.median(pushes[1:]), statistics.median(plain[1:])
    wire, wire_base = statistics.median(protocol[1:]), statistics.median(protocol_plain[1:])
    emit("weight_transfer_protocol_s", wire, wire_base, wire_base / wire, "s",
         ratio_is="baseline/value, higher is better (target >= 0.8: the protocol costs little)",
         value_is="the bench model through the transfer protocol (manifest, agreements, 64 MiB double-buffered "
                  "buckets, gloo) into a receiver that applies nothing",
         baseline_is="a plain gloo broadcast of the same tensors, one per tensor, between two threads, "
                     "after each protocol rep",
         bytes=nbytes, bytes_per_s=round(nbytes / wire), baseline_bytes_per_s=round(nbytes / wire_base),
         reps=args.reps, loadavg_1m=loadavg())
    emit("weight_transfer_push_s", value, base, base / value, "s",
         ratio_is="baseline/value, higher is better (the engine's copy into its weights included)",
         value_is="start_weight_update + update_weights + finish_weight_update of the whole bench model from a "
                  "trainer thread (nccl backend: gloo on CPU, 64 MiB buckets), applied into the engine's weights",
         baseline_is="a plain gloo broadcast of the same tensors, one per tensor, between two threads",
         bytes=nbytes, bytes_per_s=round(nbytes / value), baseline_bytes_per_s=round(nbytes / base),
         tensors=len(state), reps=args.reps, loadavg_1m=loadavg())
