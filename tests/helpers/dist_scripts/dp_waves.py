"""One rank of a torchrun DP launch: this replica's share of the prompts, then one JSON file
with its greedy tokens and wave counters. A replica with no share still calls generate when the
replicas run waves (its dummy steps are what the test counts).

usage: dp_waves.py OUT_DIR MODEL TP JOBS_JSON [extra LLM kwargs as JSON]   (writes OUT_DIR/rank<r>.json)
JOBS_JSON: [[prompt token ids, max_tokens], ...], spread over replicas as i::DP.
"""

import json
import os
import sys

import torch.distributed as dist

from spmd_engine import LLM, SamplingParams

if __name__ == "__main__":
    out_dir, model, tp, jobs = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
    extra = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
    with LLM(model=model, tensor_parallel_size=tp, data_parallel_size=2,
             distributed_executor_backend="external_launcher", seed=0, **extra) as llm:
        replica = llm.replica_index
        share = jobs[replica::2]
        tokens = []
        if share or llm.dp_waves:
            outs = llm.generate([ids for ids, _ in share],
                                [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in share])
            tokens = [o.outputs[0].token_ids for o in outs]
        stats = llm.get_stats()[0]
        keep = ("dp_waves", "waves", "wave_steps", "dummy_steps", "steps")
        result = {"rank": dist.get_rank(), "replica": replica, "tokens": tokens,
                  "stats": {k: stats[k] for k in keep}, "runner_dummy": stats["runner"]["dummy_steps"]}
        with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
            json.dump(result, f)
    sys.exit(0)
