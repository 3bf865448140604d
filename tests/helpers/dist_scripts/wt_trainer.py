"""The trainer job of the weight-transfer tests: a plain torchrun trainer (or one process)
whose rank 0 sends. `push`: the bundled weights perturbed by a seeded noise, written as a
checkpoint to OUT (so a fresh engine can be loaded from exactly what was pushed) and sent
once. `stall`: sends the manifest and a few buckets, prints STALLED, then sleeps (a test
SIGKILLs it there, or lets the engine time out).

usage: wt_trainer.py MODE PORT WORLD BACKEND OUT"""

import os
import shutil
import sys
import time

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

import spmd_engine
from spmd_engine.distributed.weight_transfer.trainer import trainer_engine

BUNDLED = os.path.join(os.path.dirname(spmd_engine.__file__), "bundled")


def trainer_weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: t + 0.02 * t.abs().mean() * torch.randn(t.shape, generator=gen, dtype=t.dtype)
            for name, t in sorted(load_file(os.path.join(BUNDLED, "model.safetensors")).items())}


if __name__ == "__main__":
    mode, port, world, backend, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    rank = int(os.environ.get("RANK", "0"))
    if "RANK" in os.environ:
        dist.init_process_group("gloo")  # the trainer's own world: untouched by the transfer
    weights = trainer_weights(3)
    if rank == 0:
        info = {"master_address": "127.0.0.1", "master_port": port, "world_size": world,
                "timeout_s": 150 if mode == "push" else 30,  # push: the generator job may start slowly on a busy host
                "packed_buffer_size_bytes": (1 << 20) if mode == "push" else 4096}
        sender = trainer_engine(backend).trainer_init(info)
        sys.stdout.write(f"trainer connected to {world - 1} engine ranks\n")
        sys.stdout.flush()
        if mode == "push":
            os.makedirs(out, exist_ok=True)
            for name in os.listdir(BUNDLED):
                if name != "model.safetensors":
                    shutil.copy(os.path.join(BUNDLED, name), out)
            save_file(weights, os.path.join(out, "model.safetensors"))
            sent = sender.send_weights(weights.items())
            sys.stdout.write(f"sent {sent} bytes\n")
        else:
            broadcast_async = sender.group.broadcast_async  # every bucket goes through it

            def stalling(tensor, what):
                if what in ("bucket 8", "bucket 8 ready"):
                    sys.stdout.write("STALLED\n")
                    sys.stdout.flush()
                    time.sleep(120)
                return broadcast_async(tensor, what)
            sender.group.broadcast_async = stalling
            sender.send_weights(weights.items())
        sender.shutdown()
    if "RANK" in os.environ:
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.write(f"trainer rank {rank} done\n")
