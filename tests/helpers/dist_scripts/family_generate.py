"""Greedy generation of one checkpoint on a layout under torchrun (external_launcher).

    torchrun --nproc-per-node 4 family_generate.py MODEL_DIR PROMPTS_JSON LAYOUT_JSON OUT_DIR

Every rank adds the same prompts (lists of token ids); the first rank of each DP replica writes
each prompt's tokens and logprobs (id -> logprob per step) to OUT_DIR/rank{RANK}.json.
"""

from __future__ import annotations

import json
import os
import sys

from spmd_engine import LLM, SamplingParams

if __name__ == "__main__":
    model, prompts_file, layout_file, out_dir = sys.argv[1:5]
    prompts, layout = json.load(open(prompts_file)), json.load(open(layout_file))
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, ignore_eos=True)
    llm = LLM(model=model, distributed_executor_backend="external_launcher", enforce_eager=True, **layout)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    rank = int(os.environ["RANK"])
    if rank % (layout.get("tensor_parallel_size", 1) * layout.get("pipeline_parallel_size", 1)) == 0:
        rows = [{"tokens": list(o.outputs[0].token_ids),
                 "logprobs": [{str(t): e.logprob for t, e in step.items()} for step in o.outputs[0].logprobs]}
                for o in outs]
        json.dump(rows, open(os.path.join(out_dir, f"rank{rank}.json"), "w"))
    llm.shutdown()
    sys.exit(0)
