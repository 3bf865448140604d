"""LLM built under srun alone (SLURM_* variables, no torchrun's): it must resolve to
external_launcher, refuse a missing engine seed, and sample alike on both TP ranks.
Prints one JSON line per rank; argv[1] is the checkpoint."""

import json
import sys

from spmd_engine import LLM, SamplingParams
from spmd_engine.config import ConfigError

if __name__ == "__main__":
    model = sys.argv[1]
    try:  # refused before any process group exists, so the ranks carry on
        LLM(model=model, tensor_parallel_size=2, max_model_len=64)
        without_seed = "accepted"
    except ConfigError as exc:
        without_seed = str(exc)
    params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    with LLM(model=model, tensor_parallel_size=2, max_model_len=64, seed=5) as llm:
        backend = llm.config.parallel_config.distributed_executor_backend
        first, second = ([o.outputs[0].token_ids for o in llm.generate([[5, 6, 7], [8, 9]], params)]
                         for _ in range(2))
    print(json.dumps({"backend": backend, "without_seed": without_seed, "first": first, "second": second}),
          flush=True)
