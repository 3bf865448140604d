"""Routing replay through one engine layout: two rounds of greedy rollouts, the second hitting
the prefix cache of the first (each first-round sequence, prompt + output, resubmitted as a
prompt, and the last prompt again). Writes every output's prompt, tokens and routed experts.

    python routed_experts.py MODEL_DIR PROMPTS_JSON OUT_JSON LAYOUT_JSON
    torchrun --nproc-per-node N routed_experts.py ...   (each rank writes OUT_JSON.rank<RANK>)

`rounds` is also called in-process by tests/integration/model/test_routing_replay.py (uni).
"""

from __future__ import annotations

import json
import os
import sys

from spmd_engine import LLM, SamplingParams

MAX_TOKENS = 12


def rounds(llm: LLM, prompts: list[list[int]]) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = llm.generate(prompts, params)
    hits_before = sum(s["prefix_hits_tokens"] for s in llm.get_stats())
    again = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in first] + [prompts[-1]]
    second = llm.generate(again, params)
    records = [{"prompt": list(o.prompt_token_ids), "tokens": list(o.outputs[0].token_ids),
                "dtype": str(o.outputs[0].routed_experts.dtype), "routed": o.outputs[0].routed_experts.tolist()}
               for o in first + second]
    return {"records": records, "prefix_hits_tokens": sum(s["prefix_hits_tokens"] for s in llm.get_stats())
            - hits_before, "preemptions": sum(s["preemptions"] for s in llm.get_stats())}


if __name__ == "__main__":
    model, prompts_file, out_file, layout = sys.argv[1:5]
    with LLM(model=model, enable_return_routed_experts=True, **json.loads(layout)) as llm:
        result = rounds(llm, json.load(open(prompts_file)))
    if "RANK" in os.environ:  # external_launcher: every rank has its replica's outputs
        out_file += f".rank{os.environ['RANK']}"
    json.dump(result, open(out_file, "w"))
