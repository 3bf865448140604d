"""ms-swift's VllmEngine (swift/infer_engine/vllm_engine.py), shared by its GRPO colocate mode
and its batch inference: the EngineArgs it builds, the SamplingParams it prepares per request
(stop words set after construction), and its synchronous add_request / step() loop."""

from __future__ import annotations

from spmd_engine import SamplingParams
from vllm_replays.common import (
    Launch,
    tokens_and_logprobs,
)


def swift_engine_args(EngineArgs, model: str, launch: Launch, tp: int, seed: int, sleep: bool,
                      logprobs_mode: str | None, max_num_seqs: int):
    """VllmEngine._prepare_engine_kwargs: vLLM-version-dependent keys passed when not None."""
    engine_kwargs = {"enable_expert_parallel": False, "disable_cascade_attn": False, "load_format": "auto"}
    if sleep:
        engine_kwargs["enable_sleep_mode"] = True
    if logprobs_mode is not None:
        engine_kwargs["logprobs_mode"] = logprobs_mode
    engine_kwargs["seed"] = seed
    engine_kwargs["enable_prefix_caching"] = True
    return EngineArgs(model=model, dtype="float32", gpu_memory_utilization=0.9, tensor_parallel_size=tp,
                      pipeline_parallel_size=1, max_model_len=None, max_num_seqs=max_num_seqs, disable_log_stats=True,
                      disable_custom_all_reduce=True, enforce_eager=True, trust_remote_code=True,
                      distributed_executor_backend=launch.backend if launch.external else None, **engine_kwargs)


def swift_generation_config(request: dict, defaults: SamplingParams, seed: int | None) -> SamplingParams:
    """VllmEngine._prepare_generation_config: unset values from the generation config (a plain
    SamplingParams() without generation_config.json), logprobs=True as logprobs=0."""
    kwargs = {"max_tokens": request["max_tokens"]}
    for key in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty"):
        kwargs[key] = request.get(key) if request.get(key) is not None else getattr(defaults, key)
    if request.get("logprobs"):
        kwargs["logprobs"] = 0
    for key, value in (("n", 1), ("best_of", None), ("frequency_penalty", 0.0), ("presence_penalty", 0.0),
                       ("seed", seed)):
        if hasattr(SamplingParams, key):
            kwargs[key] = value
    return SamplingParams(**kwargs)


def swift_infer(engine, prompts: list[list[int]], request: dict, stop: dict, counter: list[int]) -> list[dict]:
    """VllmEngine.infer (the synchronous engine): every request added, then step() until none is
    unfinished, the finished outputs taken by request id."""
    defaults = SamplingParams()  # _load_generation_config without generation_config.json
    ids = []
    for i, prompt in enumerate(prompts):
        request_id = str(counter[0])
        counter[0] += 1
        ids.append(request_id)
        params = swift_generation_config(request, defaults, request.get("seed"))
        if params.seed is not None:
            params.seed += i
        words = request.get("stop", []) + stop["template_words"]  # _add_stop_words
        params.stop = list(dict.fromkeys(words))
        params.stop_token_ids = list(dict.fromkeys(stop["encoded"][w][0] for w in words if len(stop["encoded"][w]) == 1))
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output
    results = []
    for request_id in ids:
        completion = outputs[request_id].outputs[0]
        results.append({**tokens_and_logprobs(completion), "text": completion.text,
                        "finish_reason": completion.finish_reason})
    return results
