"""Greedy Gemma 3 generation with logprobs on a layout under torchrun (external_launcher).

    torchrun --nproc-per-node 4 gemma3_layouts.py PLAN_JSON OUT_DIR

PLAN_JSON: {"model": dir, "layout": {LLM kwargs}}. The first rank of each DP replica writes
OUT_DIR/rank{RANK}.json: per prompt, its tokens and each step's logprobs ({token: logprob}),
which tests/integration/model/test_gemma3.py scores against transformers.
"""

from __future__ import annotations

import json
import os
import sys

from spmd_engine import LLM, SamplingParams

# The test checkpoint's window is 8: all but the first prompt outrun it before generating.
PROMPTS = [[5, 17, 3], [(7 * i + 3) % 131 for i in range(12)], [(11 * i + 1) % 131 for i in range(21)]]
PARAMS = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)

if __name__ == "__main__":
    plan, out_dir = json.load(open(sys.argv[1])), sys.argv[2]
    llm = LLM(model=plan["model"], distributed_executor_backend="external_launcher", **plan["layout"])
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)
    rank = int(os.environ["RANK"])
    layout = plan["layout"]
    if rank % (layout.get("tensor_parallel_size", 1) * layout.get("pipeline_parallel_size", 1)) == 0:
        results = [{"tokens": list(o.outputs[0].token_ids),
                    "logprobs": [{str(t): e.logprob for t, e in d.items()} for d in o.outputs[0].logprobs]}
                   for o in outs]
        json.dump(results, open(os.path.join(out_dir, f"rank{rank}.json"), "w"))
    llm.shutdown()
    sys.stdout.write(f"rank {rank} done\n")
