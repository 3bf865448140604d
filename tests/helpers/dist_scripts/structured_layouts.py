"""One rank of a torchrun TP 2 x DP 2 launch (external_launcher) with structured outputs.

usage: structured_layouts.py OUT_DIR   (writes OUT_DIR/rank<r>.json)

Every rank's engine computes the grammar masks of its own replica's steps itself; the tokens
it returns must equal a one-process engine's. Both replicas run every request (each engine
is given the same prompts), so every rank's tokens are compared.
"""

import json
import os
import sys

import torch.distributed as dist

from spmd_engine import LLM, SamplingParams

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from structured import CONSTRAINTS  # noqa: E402

PROMPTS = ["Beautiful is", "Flat is", "Errors should", "Now is", "Simple is", "Readability"]


def params() -> list[SamplingParams]:
    names = ["json", "date", "choice", "grammar", "email", "json"]
    return [SamplingParams(temperature=1.0, max_tokens=300, seed=s, structured_outputs=dict(CONSTRAINTS[n][0]))
            for s, n in enumerate(names)]


if __name__ == "__main__":
    out_dir = sys.argv[1]
    with LLM(tensor_parallel_size=2, data_parallel_size=2, distributed_executor_backend="external_launcher",
             seed=0, max_model_len=512) as llm:
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params())]
        rank = dist.get_rank()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "tokens": tokens}, f)
    sys.stdout.write(f"rank {rank} done\n")
