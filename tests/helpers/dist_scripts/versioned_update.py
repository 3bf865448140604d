"""The versioned update protocol under torchrun TP2 x DP2 (external_launcher): every rank starts
an update, one rank of replica 0 pushes a tensor of the wrong shape half-way, every rank
finishes (and must fail), generate must refuse on every rank, then a complete update to
another checkpoint serves it with its version. One JSON line per rank."""

import json
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from spmd_engine import LLM, SamplingParams


def outcome(call):
    try:
        return ["ok", call()]
    except Exception as exc:
        return [type(exc).__name__, str(exc)]


if __name__ == "__main__":
    old, mid, new = sys.argv[1:4]
    rank = int(os.environ["RANK"])
    prompts = [list(range(1, 40)), [4, 5, 6, 7, 8]]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    report = {"rank": rank}
    with LLM(model=old, tensor_parallel_size=2, data_parallel_size=2, max_model_len=64, seed=0,
             distributed_executor_backend="external_launcher") as llm:
        def generate():
            return [[o.outputs[0].token_ids, o.weight_version] for o in llm.generate(prompts, greedy)]
        llm.start_weight_update()
        report["during"] = outcome(generate)
        pairs = list(load_file(f"{mid}/model.safetensors").items())
        half = len(pairs) // 2
        llm.collective_rpc("load_weights", args=(pairs[:half],))
        if rank == 1:  # one rank of replica 0 fails in the middle of the push
            name, tensor = pairs[half]
            report["bad_load"] = outcome(lambda: llm.collective_rpc("load_weights", args=([(name, tensor[:1])],)))
        else:
            llm.collective_rpc("load_weights", args=(pairs[half:],))
        report["finish_failed"] = outcome(lambda: llm.finish_weight_update(1))
        report["after_failure"] = outcome(generate)
        llm.start_weight_update()
        model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        model.load_weights(load_file(f"{new}/model.safetensors").items())  # the trainers' path
        report["finish_ok"] = outcome(lambda: llm.finish_weight_update("v2"))
        llm.reset_prefix_cache()
        report["after"] = outcome(generate)
        report["replica"] = llm.replica_index
        dist.barrier()
    sys.stdout.write("REPORT " + json.dumps(report) + "\n")
    sys.stdout.flush()
    torch.distributed.destroy_process_group() if dist.is_initialized() else None
    sys.exit(0)
