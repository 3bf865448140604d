"""verl's last SPMD rollout (vllm_rollout_spmd.py before PR #4411 retired it): an LLM built
with dummy weights, put to sleep, then per step woken by tags around `load_weights`, generating,
and put back to sleep; validation makes the shared SamplingParams greedy by setting attributes."""

from __future__ import annotations

import inspect

from spmd_engine import LLM, SamplingParams
from vllm_replays.common import (
    BREAK,
    Gaps,
    Launch,
    checkpoint,
    collect,
    tokens_and_logprobs,
)

VERL_ROLLOUT_CONFIG = {  # the rollout config keys SamplingParams also has (verl copies them over)
    "temperature": 1.0, "top_k": -1, "top_p": 1.0, "ignore_eos": False, "n": 1,
    # keys SamplingParams lacks are skipped by verl's hasattr check, and so is seed
    "prompt_length": 16, "response_length": 6, "seed": 0, "free_cache_engine": True,
}


def verl_llm(model: str, launch: Launch, load_format: str) -> LLM:
    """vLLMRollout.__init__'s constructor call (dtype float32 for this CPU model)."""
    cfg = VERL_ROLLOUT_CONFIG
    return LLM(model=model, enable_sleep_mode=cfg["free_cache_engine"], tensor_parallel_size=2 if launch.external else 1,
               distributed_executor_backend=launch.backend, dtype="float32", enforce_eager=True,
               gpu_memory_utilization=0.5, disable_custom_all_reduce=True, skip_tokenizer_init=False,
               max_model_len=cfg["prompt_length"] + cfg["response_length"], max_num_seqs=1024,
               load_format=load_format, disable_log_stats=True, max_num_batched_tokens=8192,
               enable_chunked_prefill=True, enable_prefix_caching=True, trust_remote_code=False, seed=0)


def verl_sampling_params() -> SamplingParams:
    kwargs = dict(n=1, logprobs=0, max_tokens=VERL_ROLLOUT_CONFIG["response_length"], repetition_penalty=1.0)
    kwargs["detokenize"] = False
    for key, value in VERL_ROLLOUT_CONFIG.items():
        if hasattr(SamplingParams(), key) and key != "seed":
            kwargs[key] = value
    kwargs["n"] = 1
    return SamplingParams(**kwargs)


def verl_generate(llm: LLM, params: SamplingParams, prompts: list[list[int]], greedy: bool) -> list[dict]:
    """generate_sequences: do_sample=False (validation) sets greedy values on the shared params
    for the call and puts the old ones back after."""
    overrides = {"best_of": 1, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "temperature": 0, "n": 1} if greedy else {}
    old = {}
    for key, value in overrides.items():
        if hasattr(params, key):
            old[key] = getattr(params, key)
            setattr(params, key, value)
    outputs = llm.generate(prompts=[{"prompt_token_ids": list(ids)} for ids in prompts], sampling_params=params,
                           lora_request=None, use_tqdm=False)
    for key, value in old.items():
        setattr(params, key, value)
    return [tokens_and_logprobs(out.outputs[sample]) for out in outputs for sample in range(len(out.outputs))]


def verl(cfg: dict, launch: Launch) -> dict:
    gaps = Gaps()
    if launch.external:  # the rollout device mesh (dp, infer_tp, infer_pp), in the trainer's world
        from torch.distributed.device_mesh import init_device_mesh
        init_device_mesh("cpu", mesh_shape=(1, 2, 1), mesh_dim_names=["dp", "infer_tp", "infer_pp"])
    llm = verl_llm(cfg["orig"], launch, "dummy")
    params = verl_sampling_params()
    llm.reset_prefix_cache()  # trainer_mode() right after the rollout is built: release()
    llm.sleep(level=2)
    prompts = cfg["prompts"][:3]
    calls = [(step, False) for step in cfg["steps"]] + [(cfg["steps"][-1], True)]  # then validation
    rollouts = []
    for path, greedy in calls:
        # rollout_mode(): the actor's HF-named full tensors, one at a time
        pushed = cfg["steps"][0] if "verl_stale" in BREAK else path  # a control: the first step's weights every time
        per_tensor_param = ((name, param) for name, param in checkpoint(pushed).items())
        if "tags" in inspect.signature(llm.wake_up).parameters:
            llm.wake_up(tags=["weights"])
        else:
            llm.wake_up()
        model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        if "verl" not in BREAK:
            model.load_weights(per_tensor_param)
        llm.llm_engine.vllm_config.model_config  # noqa: B018 - read for process_weights_after_loading (vLLM's)
        next(model.parameters()).device  # noqa: B018 - likewise
        llm.wake_up(tags=["kv_cache"])
        rollouts.append(verl_generate(llm, params, prompts, greedy))
        llm.reset_prefix_cache()  # trainer_mode(): release()
        llm.sleep(level=2)
    asleep = llm.is_sleeping
    llm = None
    collect()

    fresh = []  # fresh engines on each step's checkpoint, the same generate calls up to that step
    for k, (path, _) in enumerate(calls):
        ref = verl_llm(path, launch, "auto")
        ref_params = verl_sampling_params()
        out = [verl_generate(ref, ref_params, prompts, greedy) for _, greedy in calls[:k + 1]][-1]
        ref.shutdown()
        fresh.append(out)
    dummy = verl_llm(cfg["orig"], launch, "dummy")  # what the rollouts would be without the pushes
    unpushed = verl_generate(dummy, verl_sampling_params(), prompts, False)
    dummy.shutdown()
    return {"rollouts": rollouts, "fresh": fresh, "dummy": unpushed, "asleep_at_end": asleep,
            "gaps": gaps.found}
