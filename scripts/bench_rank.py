"""One rank of scripts/bench.py's start-up and loading figures (run under torchrun).

    torchrun --nproc-per-node N scripts/bench_rank.py --tp T --pp P --dp D [--model DIR]

Times this rank's phases with wall-clock marks (process start, default group,
model-parallel groups, weight load, first token), counts the groups created
and records peak RSS before and after loading; rank 0 gathers every rank's
record and prints one JSON line: {"ranks": [...], "launch_t": ...}.
"""

from __future__ import annotations

import time

T_ENTRY = time.time()  # first statement: before torch is imported

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default=None)
    args = ap.parse_args()
    import torch
    torch.set_num_threads(1)
    import torch.distributed as dist

    from spmd_engine import distributed as sd
    from spmd_engine.config import ModelConfig, ParallelConfig
    from spmd_engine.model.loader import load_model
    t_import = time.time()
    n_groups = [0]
    real_new_group = dist.new_group

    def counting_new_group(*a, **k):
        n_groups[0] += 1
        return real_new_group(*a, **k)
    dist.new_group = counting_new_group
    sd.init_distributed_environment(backend="gloo")
    t_world = time.time()
    pc = ParallelConfig(tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp,
                        data_parallel_size=args.dp, distributed_executor_backend="external_launcher")
    sd.initialize_model_parallel(pc)
    t_groups = time.time()
    rss_before = peak_rss()
    mc = ModelConfig(model=args.model, dtype=args.dtype)
    model = load_model(mc.model_dir, sd.get_tp_group(), sd.get_pp_group(), dtype=mc.dtype, device="cpu")
    t_loaded = time.time()
    rss_after = peak_rss()
    shard_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    record = {"rank": dist.get_rank(), "entry": T_ENTRY, "imported": t_import, "world_joined": t_world,
              "groups_created": t_groups, "loaded": t_loaded, "new_group_calls": n_groups[0],
              "peak_rss_before_load": rss_before, "peak_rss_after_load": rss_after,
              "shard_param_bytes": shard_bytes}
    records = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    if dist.get_rank() == 0:
        print("BENCH_RANK " + json.dumps({"ranks": records,
                                          "launch_t": float(os.environ.get("BENCH_LAUNCH_T", "nan"))}),
              flush=True)
    del model
    sd.destroy_distributed_environment()


if __name__ == "__main__":
    main()
