"""ms-swift's GRPO colocate mode (swift/rlhf_trainers/rollout_mixin.py): the engine asleep
between steps, woken by tags around `load_weights` in two halves, caches reset, and the TP group's
requests gathered with one seed stream per group."""

from __future__ import annotations

import inspect

import torch.distributed as dist

from vllm_replays.common import (
    BREAK,
    Gaps,
    Launch,
    checkpoint,
    collect,
    import_engine_classes,
)
from vllm_replays.swift_engine import swift_engine_args, swift_infer

SWIFT_GRPO = {"tp": 2, "sleep_level": 1, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1,
              "max_completion_length": 6, "temperature": 0.9, "top_p": 0.9, "top_k": 50, "min_p": 0.05,
              "repetition_penalty": 1.1, "stop_words": ["\n\n"]}


def swift_grpo(cfg: dict, launch: Launch) -> dict:
    gaps = Gaps()
    EngineArgs, LLMEngine = import_engine_classes(gaps)
    args = SWIFT_GRPO
    tp = args["tp"] if launch.external else 1
    process_index = launch.rank
    tp_group = None
    if tp > 1:
        tp_group, _ = dist.new_subgroups_by_enumeration(
            [list(range(i * tp, (i + 1) * tp)) for i in range(launch.world // tp)])
    max_num_seqs = args["per_device_train_batch_size"] * tp  # x steps_per_generation (1)

    def build(model: str, sleep: bool):
        return LLMEngine.from_engine_args(swift_engine_args(
            EngineArgs, model, launch, tp, process_index // tp, sleep, "processed_logprobs", max_num_seqs))

    engine = build(cfg["orig"], True)
    gaps.call("llm_engine.reset_mm_cache()", lambda: engine.reset_mm_cache())
    engine.sleep(args["sleep_level"])

    def is_sleeping() -> bool:
        """rollout_mixin reads `engine.inner_model_executor.is_sleeping` (vLLM's executor flag)."""
        return gaps.call("llm_engine.model_executor.is_sleeping", lambda: engine.model_executor.is_sleeping,
                         lambda: engine.is_sleeping())

    mine = [cfg["prompts"][(process_index + k) % len(cfg["prompts"])] for k in range(args["per_device_train_batch_size"])]
    request = {"max_tokens": args["max_completion_length"], "temperature": args["temperature"], "top_p": args["top_p"],
               "top_k": args["top_k"], "min_p": args["min_p"], "repetition_penalty": args["repetition_penalty"],
               "stop": args["stop_words"], "logprobs": True}
    if tp > 1:  # _get_request_config: one seed stream per TP group
        batch_size = args["per_device_train_batch_size"] * args["gradient_accumulation_steps"] * tp
        request["seed"] = batch_size * (process_index // tp)

    def colocate_rollout(eng, counter) -> list[dict]:
        """_colocate_rollout: the TP group's requests gathered, each rank keeps its own slice."""
        prompts = list(mine)
        start = 0
        if tp > 1:
            rank_in_group = dist.get_rank(group=tp_group)
            lengths = [None] * tp
            dist.all_gather_object(lengths, len(prompts), group=tp_group)
            start = sum(lengths[:rank_in_group])
            gathered = [None] * tp
            dist.all_gather_object(gathered, prompts, group=tp_group)
            prompts = [p for chunk in gathered for p in chunk]
        outputs = swift_infer(eng, prompts, request, cfg["swift_stop"], counter)
        return outputs[start:start + len(mine)] if tp > 1 else outputs

    counter = [0]
    steps = []
    for path in cfg["steps"]:
        if is_sleeping():  # _fast_infer
            if "tags" in inspect.signature(engine.wake_up).parameters:
                engine.wake_up(tags=["weights"])
        inner_model = engine.model_executor.driver_worker.worker.model_runner.model
        state_dict = checkpoint(path)
        names = list(state_dict)
        if "swift_grpo" not in BREAK:
            for group in (names[: len(names) // 2], names[len(names) // 2:]):  # _move_full_model_to_vllm
                inner_model.load_weights({n: state_dict[n] for n in group}.items())
        engine.reset_prefix_cache()  # _reset_vllm_cache
        gaps.call("llm_engine.reset_encoder_cache()", lambda: engine.reset_encoder_cache())
        if is_sleeping() and "tags" in inspect.signature(engine.wake_up).parameters:
            engine.wake_up(tags=["kv_cache"])
        steps.append(colocate_rollout(engine, counter))
        engine.reset_prefix_cache()
        engine.sleep(level=args["sleep_level"])
    engine = None
    collect()

    fresh = {}
    for path in [cfg["orig"], *cfg["steps"]]:  # step k's infer call is the engine's k-th
        ref = build(path, False)
        ref_counter = [0]
        fresh[path] = [colocate_rollout(ref, ref_counter) for _ in cfg["steps"]]
        ref = None
        collect()
    if tp_group is not None:
        dist.destroy_process_group(tp_group)
    return {"steps": steps, "fresh": fresh, "seeded": "seed" in request, "gaps": gaps.found}
