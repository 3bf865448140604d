"""LLM built under srun alone (SLURM_* variables, no torchrun's): it must resolve to
external_launcher, take a missing engine seed as 0 (vLLM's default), sample alike on both TP
ranks, and name ranks whose engine seeds differ. Three engines are built one after another in
the same tasks.
Prints one JSON line per rank; argv[1] is the checkpoint."""

import json
import os
import sys

from spmd_engine import LLM, SamplingParams
from spmd_engine.config import ConfigError

if __name__ == "__main__":
    model = sys.argv[1]
    params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    with LLM(model=model, tensor_parallel_size=2, max_model_len=64) as llm:
        without_seed = [o.outputs[0].token_ids for o in llm.generate([[5, 6, 7], [8, 9]], params)]
    with LLM(model=model, tensor_parallel_size=2, max_model_len=64, seed=0) as llm:
        seed_0 = [o.outputs[0].token_ids for o in llm.generate([[5, 6, 7], [8, 9]], params)]
    with LLM(model=model, tensor_parallel_size=2, max_model_len=64, seed=5) as llm:
        backend = llm.config.parallel_config.distributed_executor_backend
        first, second = ([o.outputs[0].token_ids for o in llm.generate([[5, 6, 7], [8, 9]], params)]
                         for _ in range(2))
        llm.seed = 5 + int(os.environ["SLURM_PROCID"])  # as if each rank had passed its own seed
        try:
            llm.generate([[5, 6, 7]], params)
            seed_mismatch = "accepted"
        except ConfigError as exc:
            seed_mismatch = str(exc)
    record = {"backend": backend, "without_seed": without_seed, "seed_0": seed_0, "seed_mismatch": seed_mismatch,
              "first": first, "second": second}
    # One write per line: unbuffered (the tests' PYTHONUNBUFFERED), print() writes the text and
    # its newline apart, and the two tasks' lines run together in the shared stdout.
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()
