"""One rank of a torchrun TP 2 x DP 2 launch (external_launcher) with and without async scheduling.

usage: async_scheduling.py OUT_DIR   (writes OUT_DIR/rank<r>.json)

The bundled model, the same mixed requests through `generate` with async scheduling off,
then on, then on again through the online loop (add_request / step, which exchanges between
the replica's ranks at every step while a step is in flight). Each replica takes its own
prompts, so the replicas' outputs differ.
"""

import json
import os
import sys

import torch.distributed as dist

from spmd_engine import LLM, SamplingParams

PROMPTS = ["Beautiful is", "Explicit is", "Simple is better", "Flat is", "Errors should never"]


def params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=30, stop=["than"]), SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[ord("b")]),
            SamplingParams(max_tokens=16, temperature=1.0, seed=3, logprobs=1), SamplingParams(temperature=0.0, max_tokens=1),
            SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.2)]


def outputs(outs) -> list:
    return [[o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason,
             o.outputs[0].logprobs and [{str(k): v.logprob for k, v in e.items()} for e in o.outputs[0].logprobs]]
            for o in outs]


def online(llm, prompts) -> list:
    engine, final, step = llm.llm_engine, {}, 0
    while step < len(prompts) or engine.has_unfinished_requests():
        if step < len(prompts):
            engine.add_request(f"q{step}", prompts[step], params()[step])
        final.update({o.request_id: o for o in engine.step() if o.finished})
        step += 1
    return outputs([final[f"q{i}"] for i in range(len(prompts))])


if __name__ == "__main__":
    out_dir = sys.argv[1]
    layout = dict(tensor_parallel_size=2, data_parallel_size=2, distributed_executor_backend="external_launcher",
                  seed=0, max_model_len=128, max_num_seqs=3)
    result = {}
    for flag in (False, True):
        with LLM(**layout, async_scheduling=flag) as llm:
            result["rank"] = dist.get_rank()
            replica = result["replica"] = llm.replica_index
            prompts = PROMPTS[replica:] + PROMPTS[:replica]
            key = "async" if flag else "sync"
            result[f"{key}_generate"] = outputs(llm.generate(prompts, params()))
            if flag:
                result["async_online"] = online(llm, prompts)
            result[f"{key}_peak"] = llm.get_stats()[0]["peak_in_flight"]
    with open(os.path.join(out_dir, f"rank{result['rank']}.json"), "w") as f:
        json.dump(result, f)
    sys.exit(0)
