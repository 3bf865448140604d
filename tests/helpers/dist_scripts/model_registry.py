"""A trainer's own model class under torchrun (external_launcher, TP 2): every rank registers
it with ModelRegistry, as a script written for vLLM does, before building the LLM on a
checkpoint whose config.json names that architecture. One JSON line per rank."""

import json
import sys

import torch.distributed as dist

from spmd_engine import LLM, ModelRegistry, SamplingParams
from spmd_engine.model.models.llama import CausalLM


class NegatedLogitsLlama(CausalLM):
    def compute_logits(self, hidden):
        return -super().compute_logits(hidden)


if __name__ == "__main__":
    model_dir, arch = sys.argv[1], sys.argv[2]
    ModelRegistry.register_model(arch, NegatedLogitsLlama)
    prompts = [list(range(1, 40)), [4, 5, 6, 7, 8]]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(model=model_dir, tensor_parallel_size=2, max_model_len=64, seed=0,
             distributed_executor_backend="external_launcher") as llm:
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        # One write under PIPE_BUF: the ranks share a stdout pipe, whole lines do not interleave.
        sys.stdout.write("REPORT " + json.dumps({"rank": dist.get_rank(), "class": type(model).__name__,
                                                 "tokens": tokens}) + "\n")
        sys.stdout.flush()
    sys.exit(0)
