"""One rank of a torchrun TP 2 x PP 2 x DP 2 launch driving `llm.llm_engine` step by step.

usage: online_engine.py OUT_DIR MODEL   (writes OUT_DIR/rank<r>.json)

The same staggered requests run under admission="identical" (every rank adds them) and
"rank0" (only the replica's first rank does; the others only step), beside `generate`;
then one rank adds a different request than its replica's others, which must be an error
on every rank at the next step.
"""

import json
import os
import sys
import time

import torch.distributed as dist

from spmd_engine import LLM, SamplingParams
from spmd_engine.config import ConfigError

STARTS = [0, 1, 3]  # the step at which each request is added: known to every rank


def params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def staggered(engine, prompts, lead: bool) -> list[list[int]]:
    """Every rank runs the same loop (the calls are collective); only a lead rank adds."""
    final, step = {}, 0
    while step <= max(STARTS) or engine.has_unfinished_requests():
        for i, start in enumerate(STARTS):
            if lead and start == step:
                engine.add_request(f"q{i}", prompts[i], params())
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
        step += 1
    return [final[f"q{i}"] for i in range(len(STARTS))]


if __name__ == "__main__":
    out_dir, model = sys.argv[1], sys.argv[2]
    layout = dict(model=model, tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2,
                  distributed_executor_backend="external_launcher", seed=0)
    result = {"rank": dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"])}
    with LLM(**layout) as llm:
        replica = result["replica"] = llm.replica_index
        prompts = [[replica * 20 + j + 1 for j in range(4 + 3 * i)] for i in range(len(STARTS))]
        result["generate"] = [o.outputs[0].token_ids for o in llm.generate(prompts, params())]
        result["identical"] = staggered(llm.llm_engine, prompts, lead=True)
        odd = dist.get_rank() % 4 == 3  # the second TP rank of the last stage, in each replica
        llm.llm_engine.add_request("m", prompts[1] if odd else prompts[0], params())
        start = time.monotonic()
        try:
            llm.llm_engine.step()
            result["mismatch"] = "accepted"
        except ConfigError as exc:
            result["mismatch"] = str(exc)
        result["mismatch_s"] = time.monotonic() - start
        result["unfinished_after_mismatch"] = llm.llm_engine.get_num_unfinished_requests()
    with LLM(**layout, admission="rank0") as llm:
        lead = result["lead"] = llm.llm_engine.takes_input
        result["rank0"] = staggered(llm.llm_engine, prompts, lead)
        result["rank0_generate"] = [o.outputs[0].token_ids for o in llm.generate(prompts if lead else [], params())]
    with open(os.path.join(out_dir, f"rank{result['rank']}.json"), "w") as f:
        json.dump(result, f)
    sys.exit(0)
