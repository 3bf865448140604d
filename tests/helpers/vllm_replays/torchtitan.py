"""torchtitan's RL generator (torchtitan/experiments/rl/actors/generator.py): an LLMEngine
driven by rank 0's broadcast loop decisions, FINAL_ONLY outputs with per-sample seeds, and a weight
pull into the model's own state dict followed by a prefix cache reset of the running requests."""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist

from spmd_engine import LLM, RequestOutputKind, SamplingParams
from vllm_replays.common import (
    BREAK,
    MAX_MODEL_LEN,
    Gaps,
    Launch,
    checkpoint,
    collect,
    import_engine_classes,
    tokens_and_logprobs,
)


def torchtitan_params(sampling: dict) -> SamplingParams:
    """Generator._build_sampling_params: one sample per request, its own seed."""
    return SamplingParams(temperature=sampling["temperature"], top_p=sampling["top_p"],
                          max_tokens=sampling["max_tokens"], n=1,
                          stop_token_ids=sampling["stop_token_ids"] or None, seed=sampling["seed"],
                          logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY)


def torchtitan_requests(cfg: dict, tag: str) -> list[dict]:
    """Two prompts, two samples each; the rollouter offsets the seed per sample."""
    out = []
    for g, ids in enumerate(cfg["prompts"][:2]):
        for k in range(2):
            out.append({"request_id": f"{tag}-g{g}-s{k}", "prompt_token_ids": ids,
                        "sampling": {"temperature": 0.8, "top_p": 0.95, "max_tokens": 6, "seed": 1000 * g + k,
                                     "stop_token_ids": [cfg["stop_token_id"]]}})
    return out


def torchtitan(cfg: dict, launch: Launch) -> dict:
    gaps = Gaps()
    EngineArgs, LLMEngine = import_engine_classes(gaps)
    tp = 2 if launch.external else 1
    # Generator.__init__'s EngineArgs: left out are config_format (torchtitan's registered config
    # parser), worker_cls and attention_config (its own classes), compilation_config (CUDA
    # graphs) and block_size=256 (FlashAttention-2 GPUs).
    engine_args = EngineArgs(model=cfg["orig"], trust_remote_code=True, dtype="float32",
                             tensor_parallel_size=tp, data_parallel_size=1, enable_expert_parallel=False,
                             distributed_executor_backend=launch.backend, gpu_memory_utilization=0.9,
                             enforce_eager=True, disable_log_stats=False, max_model_len=MAX_MODEL_LEN,
                             max_num_seqs=8, scheduling_policy="fcfs", seed=7)
    engine = LLMEngine.from_engine_args(engine_args)
    rank = dist.get_rank()
    broadcast_group = dist.new_group(backend="gloo")  # for the loop decisions

    first, second = torchtitan_requests(cfg, "a"), torchtitan_requests(cfg, "b")
    # Rank 0's inbox: two batches arriving while the first still runs, a weight pull once
    # they are done (the controller holds off pulling until its rollouts come back), the same
    # prompts and seeds again on the new weights, then close.
    plan = [("STEP", first[:2]), ("STEP", first[2:]), ("PULL", 1), ("STEP", second), ("CLOSE", [])]
    pending: set[str] = set()
    results: dict[str, dict] = {}
    seen: dict[str, int] = {}
    decisions = 0

    def decide():
        if plan and (plan[0][0] == "STEP" or not pending):
            return plan.pop(0)
        return ("STEP", [])  # in-flight requests keep rank 0 issuing STEP

    while True:
        box = [decide()] if rank == 0 else [None]
        dist.broadcast_object_list(box, src=0, group=broadcast_group, device=torch.device("cpu"))
        action, requests = box[0]
        decisions += 1
        if action == "CLOSE":
            break
        if action == "PULL":
            torchtitan_pull(engine, cfg, gaps)
            continue
        for request in requests:
            prompt = {"prompt_token_ids": request["prompt_token_ids"]}
            rendered = gaps.call("llm_engine.renderer.render_cmpl([{'prompt_token_ids': ...}])",
                                 lambda: engine.renderer.render_cmpl([prompt])[0], lambda: prompt)
            engine.add_request(request_id=request["request_id"], prompt=rendered,
                               params=torchtitan_params(request["sampling"]))
            pending.add(request["request_id"])
        for _ in range(2):  # max_engine_steps_between_decisions
            if not engine.has_unfinished_requests():
                break
            with torch.no_grad():
                outputs = engine.step()
            for out in outputs:  # RequestDispatcher.process_finished_requests
                seen[out.request_id] = seen.get(out.request_id, 0) + 1
                if out.finished:
                    results[out.request_id] = {**tokens_and_logprobs(out.outputs[0]),
                                               "finish_reason": out.outputs[0].finish_reason}
                    pending.discard(out.request_id)
    engine = None
    collect()
    world_after = dist.is_initialized()

    def fresh(model: str, requests: list[dict]) -> list[dict]:
        """A plain LLM.generate on a fresh engine: the same prompts, each with its own params."""
        llm = LLM(model=model, tensor_parallel_size=tp, distributed_executor_backend=launch.backend,
                  seed=7, max_model_len=MAX_MODEL_LEN, enforce_eager=True, dtype="float32")
        outs = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in requests],
                            [torchtitan_params(r["sampling"]) for r in requests])
        llm.shutdown()
        return [tokens_and_logprobs(o.outputs[0]) for o in outs]

    return {"first": [results.get(r["request_id"]) for r in first],
            "second": [results.get(r["request_id"]) for r in second],
            "outputs_per_request": sorted(set(seen.values())), "decisions": decisions,
            "world_left_after_drop": world_after,
            "fresh_orig": fresh(cfg["orig"], first), "fresh_step": fresh(cfg["steps"][0], second),
            "gaps": gaps.found}


def torchtitan_pull(engine, cfg: dict, gaps: Gaps) -> None:
    """Generator._pull_model_state_dict: the model's own state dict, filled in place by name from
    what the trainer stored (torchstore's get_state_dict), then load_state_dict(strict=False) so
    the modules' load hooks run, then the prefix cache reset with the running requests'."""
    from spmd_engine.model import load_model
    worker = engine.model_executor.driver_worker
    model = worker.get_model()
    if "torchtitan" not in BREAK:
        # The trainer's copy of the same model (same definition and sharding, as in torchtitan,
        # where trainer and generator share the model code) holds the next policy.
        stored = load_model(cfg["steps"][0], worker.tp_group, worker.pp_group, dtype="float32").state_dict()

        def fill_and_load():
            model_sd = model.state_dict()
            for name, tensor in model_sd.items():
                if name in stored:
                    tensor.copy_(stored[name])
            model.load_state_dict(model_sd, strict=False)

        # Where the state dict cannot take the trainer's tensors, the other route torchtitan's
        # pull could take: the HF-named tensors through load_weights.
        gaps.call("get_model().state_dict() filled in place + load_state_dict(strict=False)", fill_and_load,
                  lambda: model.load_weights(checkpoint(cfg["steps"][0]).items()))
    engine.reset_prefix_cache(reset_running_requests=True)
    gc.collect()
