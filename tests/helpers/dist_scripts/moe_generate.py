"""Greedy generation of an MoE checkpoint under torchrun (external_launcher), TP 2, with expert
parallelism (`ep`) or without (`tp`); rank 0 writes every prompt's tokens and logprobs as JSON.

    torchrun --nproc-per-node 2 moe_generate.py MODEL_DIR PROMPTS_JSON OUT_JSON ep|tp
"""

import json
import sys

import torch.distributed as dist

from spmd_engine import LLM, SamplingParams

if __name__ == "__main__":
    model, prompts_file, out_file, mode = sys.argv[1:5]
    prompts = json.load(open(prompts_file))  # lists of token ids
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, ignore_eos=True)
    with LLM(model=model, tensor_parallel_size=2, enable_expert_parallel=mode == "ep",
             distributed_executor_backend="external_launcher", seed=0) as llm:
        outs = llm.generate(prompts, params)
        rank = dist.get_rank()
    if rank == 0:
        rows = [{"tokens": o.outputs[0].token_ids,
                 "logprobs": [{str(t): e.logprob for t, e in step.items()} for step in o.outputs[0].logprobs]}
                for o in outs]
        json.dump(rows, open(out_file, "w"))
    sys.exit(0)
