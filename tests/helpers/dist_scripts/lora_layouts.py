"""Base and LoRA requests mixed in one generate, on a layout under torchrun (external_launcher).

    torchrun --nproc-per-node 4 lora_layouts.py PLAN_JSON OUT_DIR

PLAN_JSON: {"adapters": {name: dir}, "layout": {LLM kwargs}}. Every rank adds the same requests
(`workload`, which the tests also run in-process for mp and uni); the first rank of each DP
replica writes its results to OUT_DIR/rank{RANK}.json. The second half of the workload pushes
the first adapter again, in place, as a trainer's tensors (verl's TensorLoRARequest shape).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field

from safetensors.torch import load_file

from spmd_engine import LLM, SamplingParams
from spmd_engine.lora_request import LoRARequest

PROMPTS = [[256] + list(b"The quick brown fox"), [256] + list(b"Hello, my name is"), [256] + list(b"0123")]
PARAMS = SamplingParams(temperature=0, max_tokens=6, logprobs=0, ignore_eos=True)


@dataclass
class TensorLoRARequest(LoRARequest):
    peft_config: dict = field(default=None)
    lora_tensors: dict = field(default=None)


def workload(llm: LLM, adapters: dict[str, str]) -> list[dict]:
    """Each prompt with the base model and each adapter, in one call; then the first adapter's
    requests again after it was pushed in place from tensors under its own id."""
    names = sorted(adapters)
    requests = [None] + [LoRARequest(n, i + 1, adapters[n]) for i, n in enumerate(names)]
    jobs = [(p, r) for p in PROMPTS for r in requests]
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in jobs], PARAMS, lora_request=[r for _, r in jobs])
    first = adapters[names[0]]
    config = json.load(open(os.path.join(first, "adapter_config.json")))
    pushed = TensorLoRARequest(names[0], 1, "pushed", load_inplace=True, peft_config=config,
                               lora_tensors=load_file(os.path.join(first, "adapter_model.safetensors")))
    llm.llm_engine.add_lora(pushed)
    again = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, lora_request=requests[1])
    results = []
    for (prompt, request), out in zip(jobs + [(p, requests[1]) for p in PROMPTS], list(outs) + list(again)):
        c = out.outputs[0]
        results.append({"prompt": prompt, "adapter": request.lora_name if request else None,
                        "tokens": list(c.token_ids),
                        "logprobs": [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]})
    return results


if __name__ == "__main__":
    plan, out_dir = json.load(open(sys.argv[1])), sys.argv[2]
    llm = LLM(distributed_executor_backend="external_launcher", enable_lora=True, max_loras=2, dtype="float32",
              enforce_eager=True, **plan["layout"])
    results = workload(llm, plan["adapters"])
    rank = int(os.environ["RANK"])
    layout = plan["layout"]
    replica_size = layout.get("tensor_parallel_size", 1) * layout.get("pipeline_parallel_size", 1)
    if rank % replica_size == 0:
        json.dump(results, open(os.path.join(out_dir, f"rank{rank}.json"), "w"))
    llm.shutdown()
    sys.stdout.write(f"rank {rank} done\n")
