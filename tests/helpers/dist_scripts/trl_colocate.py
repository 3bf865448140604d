"""TRL's colocate mode, call for call (trl/generation/vllm_generation.py), against our LLM.

Every rank is a trainer process that owns a colocated engine (external_launcher). The
"trainer" holds checkpoints on disk: ORIG (what the engine starts from) and one per
training step (every weight perturbed). Per step it does what VLLMGeneration does:
sync_weights (wake weights, load_weights one tensor at a time through
`llm.llm_engine.model_executor.driver_worker.model_runner.model`, reset_prefix_cache), then
generate (wake weights, collective_rpc("reload_weights"), gather the TP group's prompts,
wake kv_cache, generate token ids with TRL's SamplingParams, extract logprobs sorted by
rank, sleep(2)). Then the engine is shut down and fresh engines are built in the same
process, one per checkpoint, to say which weights each step's tokens came from.

    python trl_colocate.py TP ORIG STEP1 [STEP2 ...]
under torchrun (the trainer's world is made first, as accelerate does) or with
RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set by hand and no world (argv "bare").
One REPORT line per rank.
"""

import json
import math
import os
import sys

import torch.distributed as dist
from safetensors.torch import load_file

from spmd_engine import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26, 27]]


def trl_llm(model: str, tp: int, process_index: int) -> LLM:
    """VLLMGeneration._init_vllm's constructor call, defaults included (None where unset)."""
    return LLM(model=model, tensor_parallel_size=tp, gpu_memory_utilization=0.9, max_model_len=None,
               max_num_seqs=None, enable_sleep_mode=True, model_impl="auto",
               distributed_executor_backend="external_launcher", seed=process_index // tp,
               max_num_batched_tokens=4096, logprobs_mode="processed_logprobs", quantization=None)


def trl_params(n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, repetition_penalty=1.0, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0,
                          max_tokens=8, logprobs=0)


def extract_logprobs(outputs) -> list:
    """TRL's extract_logprobs: per token, entries sorted by Logprob.rank, NaN as None."""
    seqs = []
    for out in outputs:
        for completion in out.outputs:
            assert completion.logprobs is not None
            seqs.append([[None if math.isnan(lp.logprob) else lp.logprob
                          for _, lp in sorted(step.items(), key=lambda kv: kv[1].rank)]
                         for step in completion.logprobs])
    return seqs


def sync_weights(llm: LLM, checkpoint: str) -> None:
    llm.wake_up(tags=["weights"])
    for name, param in load_file(os.path.join(checkpoint, "model.safetensors")).items():
        llm_model = llm.llm_engine.model_executor.driver_worker.model_runner.model
        llm_model.load_weights([(name, param)])
    llm.reset_prefix_cache()


def gather_tp_prompts(prompts: list, tp: int, tp_group) -> list:
    """TRL gathers the TP group's prompts so each of its ranks generates the same batch. Without
    a trainer world (argv "bare") the ranks of a TP group start from the same prompts instead."""
    if tp_group is None:
        return prompts
    gathered = [None] * tp
    dist.all_gather_object(gathered, prompts, group=tp_group)
    return [p for chunk in gathered for p in chunk]


def trl_generate(llm: LLM, tp: int, tp_group, prompts: list[list[int]], params: SamplingParams):
    llm.wake_up(tags=["weights"])
    llm.collective_rpc("reload_weights")  # TRL's workaround for vllm#29341
    prompts = gather_tp_prompts(prompts, tp, tp_group)
    llm.wake_up(tags=["kv_cache"])
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], sampling_params=params,
                           use_tqdm=False)
    completions = [c.token_ids for out in outputs for c in out.outputs]
    logprobs = extract_logprobs(outputs)
    llm.sleep(level=2)
    return completions, logprobs


def fresh_tokens(model: str, tp: int, process_index: int, tp_group, prompts, params, calls: int) -> list:
    """What a fresh engine on `model` generates for the same generate calls (same seed, same
    layout; the k-th call draws the k-th seeds of the engine's stream)."""
    llm = trl_llm(model, tp, process_index)
    try:
        prompts = gather_tp_prompts(prompts, tp, tp_group)
        return [[c.token_ids for out in llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                                                      sampling_params=params, use_tqdm=False)
                 for c in out.outputs] for _ in range(calls)]
    finally:
        llm.shutdown()


def main() -> None:
    mode, tp, orig, steps = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
    tp_group = None
    if mode == "world":  # accelerate made the trainer's world; TRL makes TP subgroups in it
        dist.init_process_group("gloo")
        world = dist.get_world_size()
        if tp > 1:
            tp_group, _ = dist.new_subgroups_by_enumeration(
                [list(range(i * tp, (i + 1) * tp)) for i in range(world // tp)])
    process_index = int(os.environ["RANK"])
    # Each TP group's ranks start from their own prompts; TRL gathers them inside the group.
    owner = process_index if tp_group is not None else process_index // tp
    mine = [PROMPTS[(owner + k) % len(PROMPTS)] for k in range(2)]

    llm = trl_llm(orig, tp, process_index)
    llm.sleep(level=2)
    report = {"rank": process_index, "steps": [], "n4": None}
    for checkpoint in steps:
        sync_weights(llm, checkpoint)
        tokens, logprobs = trl_generate(llm, tp, tp_group, mine, trl_params())
        report["steps"].append({"tokens": tokens, "logprobs": logprobs})
    tokens, logprobs = trl_generate(llm, tp, tp_group, mine, trl_params(n=4))
    report["n4"] = {"tokens": tokens, "logprobs": logprobs}
    blocks = llm.llm_engine.vllm_config.cache_config
    report["blocks"] = [blocks.num_gpu_blocks, blocks.num_cpu_blocks]
    runner = llm.get_stats()[0]["runner"]  # compiled graphs this engine built itself, and loaded
    report["compiled"] = {"built": runner["compiled_graphs"] - runner["compiled_graphs_loaded"],
                          "loaded": runner["compiled_graphs_loaded"]}
    llm.shutdown()

    report["fresh"] = {path: fresh_tokens(path, tp, process_index, tp_group, mine, trl_params(), len(steps))
                       for path in [orig, *steps]}
    if dist.is_initialized() and mode == "world":
        dist.barrier()
    sys.stdout.write("REPORT " + json.dumps(report) + "\n")  # one write: whole lines do not interleave
    sys.stdout.flush()


if __name__ == "__main__":
    main()
