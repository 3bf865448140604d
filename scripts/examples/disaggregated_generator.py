"""The generator job of a disaggregated RL loop (docs/weight-transfer.md): every torchrun rank is
an engine (external_launcher); after each rollout it takes the trainer's next weights.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 scripts/examples/disaggregated_generator.py --port 29600 -tp 2 -dp 2
"""

import argparse
import os

from spmd_engine import LLM, SamplingParams
from spmd_engine.distributed.weight_transfer.config import WeightTransferConfig

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1", help="the trainer's address")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--backend", default="nccl", choices=["nccl", "ipc"])
    ap.add_argument("-tp", type=int, default=1)
    ap.add_argument("-dp", type=int, default=1)
    args = ap.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    llm = LLM(tensor_parallel_size=args.tp, data_parallel_size=args.dp, distributed_executor_backend="external_launcher",
              seed=0, weight_transfer_config=WeightTransferConfig(backend=args.backend))
    llm.init_weight_transfer_engine({"init_info": {"master_address": args.host, "master_port": args.port,
                                                   "world_size": 1 + world, "timeout_s": 120}})
    params = SamplingParams(temperature=0.0, max_tokens=24)
    for step in range(args.steps):
        out = llm.generate(["Beautiful is"], params)[0]
        if int(os.environ["RANK"]) == 0:
            print(f"step {step} (weights {out.weight_version}): {out.outputs[0].text!r}", flush=True)
        llm.start_weight_update()
        llm.update_weights({"update_info": {}})
        llm.finish_weight_update(f"v{step + 1}")
        llm.reset_prefix_cache()
    llm.shutdown_weight_transfer_engine()
    llm.shutdown()
