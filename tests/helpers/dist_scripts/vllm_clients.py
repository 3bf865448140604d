"""Five open-source clients of vLLM, replayed call for call against this engine.

Each replay makes the calls its client makes on vLLM, with the same arguments and in the same
order, written here from a reading of the client's source (never copied):

- torchtitan's RL generator (torchtitan/experiments/rl/actors/generator.py, Aug 2026):
  `LLMEngine.from_engine_args(EngineArgs(...))`, rank 0 deciding each loop action and
  broadcasting it over a gloo group, `add_request` with per-sample seeds and FINAL_ONLY
  outputs, bursts of `step()` while `has_unfinished_requests()`, and a weight pull through
  `model_executor.driver_worker.get_model()`'s state dict (filled in place, then
  `load_state_dict(strict=False)`) followed by `reset_prefix_cache(reset_running_requests=True)`.
- verl's last SPMD rollout (verl/workers/rollout/vllm_rollout/vllm_rollout_spmd.py and
  verl/workers/fsdp_workers.py before PR #4411 retired it): `LLM(load_format="dummy", ...)`,
  trainer mode at start (`reset_prefix_cache`, `sleep(level=2)`), then per step
  `wake_up(tags=["weights"])`, `...driver_worker.worker.model_runner.model.load_weights(gen)`,
  `wake_up(tags=["kv_cache"])`, `generate`, `reset_prefix_cache`, `sleep(2)`; its validation
  pass makes the shared SamplingParams greedy by setting attributes on it.
- ms-swift's GRPO colocate mode (swift/rlhf_trainers/rollout_mixin.py with
  swift/infer_engine/vllm_engine.py and grpo_vllm_engine.py): an LLMEngine built from
  EngineArgs, `reset_mm_cache`, `sleep(level)`, per step a wake by tags around
  `load_weights`, `reset_prefix_cache` / `reset_encoder_cache`, requests gathered in the TP
  group with per-request seeds, stop words set on the SamplingParams after it is made,
  `add_request` then `step()` until done, `reset_prefix_cache`, `sleep(level)`.
- ms-swift's batch inference under torchrun (swift/pipelines/infer/infer.py): engine seed
  `seed + rank // tp`, the dataset sharded contiguously over the replicas, results gathered
  (JsonlWriter(gather_obj=True)) and written by rank 0.
- lm-evaluation-harness's vLLM backend (lm_eval/models/vllm_causallms.py, with the torchrun
  arguments of its PR #3304): `LLM(**model_args)`, loglikelihood from `prompt_logprobs=1`
  and generate_until with stop strings, requests reordered by its Collator.

What a client does through vLLM internals that have no counterpart here is left out and
named where it would be (verl's and ms-swift's `process_weights_after_loading`, torchtitan's
registered model class, worker class and attention config). A call the engine lacks is
recorded in the report's "gaps" (with the error it raised) and replaced by the nearest call
that exists, so the rest of the replay still runs; the tests treat every gap as a failure to
fix in the engine (tests/integration/rl/test_vllm_clients.py).

    torchrun --nproc-per-node 2 vllm_clients.py CONFIG.json    (TP 2 / DP 2, external_launcher)
One REPORT line per client per rank (with "error", its traceback, when the replay raised: every
rank raises alike, and the launch goes on with the next client). The tests also call `run_client(name, config, "uni")` in
their own process.
`VLLM_CLIENTS_BREAK=torchtitan,verl,swift_grpo` skips those clients' weight pushes, and
`verl_stale` pushes the first step's weights at every verl step (negative controls, run by hand:
those tests must then fail).
"""

from __future__ import annotations

import gc
import inspect
import json
import os
import sys
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from spmd_engine import LLM, RequestOutputKind, SamplingParams

BREAK = set(os.environ.get("VLLM_CLIENTS_BREAK", "").split(","))
MAX_MODEL_LEN = 96


@dataclass
class Launch:
    """Where a replay runs: "external_launcher" under torchrun (two ranks), or "uni" in one process."""

    backend: str
    rank: int = 0
    world: int = 1

    @property
    def external(self) -> bool:
        return self.backend == "external_launcher"


class Gaps:
    """Calls of a client the engine does not have: each recorded, then replaced by `instead`."""

    def __init__(self):
        self.found: list[str] = []

    def call(self, what: str, fn, instead=None):
        try:
            return fn()
        except Exception as exc:
            gap = f"{what}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            if gap not in self.found:
                self.found.append(gap)
            return instead() if instead is not None else None


def import_engine_classes(gaps: Gaps):
    """`from vllm import EngineArgs, LLMEngine` (torchtitan, ms-swift)."""
    def top_level():
        from spmd_engine import EngineArgs, LLMEngine
        return EngineArgs, LLMEngine

    def modules():
        from spmd_engine.engine.arg_utils import EngineArgs
        from spmd_engine.engine.llm_engine import LLMEngine
        return EngineArgs, LLMEngine
    return gaps.call("from spmd_engine import EngineArgs, LLMEngine", top_level, modules)


def collect() -> None:
    """The clients never shut their engine down: the object goes away (a process ends, an actor
    drops it). The callers here drop their last reference, then the collector runs, which must
    end the engine (and the world it made)."""
    gc.collect()


def checkpoint(path: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(path, "model.safetensors"))


def tokens_and_logprobs(completion) -> dict:
    """Generated ids and each one's logprob, read the way the RL clients read them
    (`completion.logprobs[i][token_id].logprob`)."""
    ids = list(completion.token_ids)
    return {"tokens": ids, "logprobs": [completion.logprobs[i][t].logprob for i, t in enumerate(ids)]
            if completion.logprobs is not None else None,
            "entries": [len(d) for d in completion.logprobs] if completion.logprobs is not None else None}


# --------------------------------------------------------------------------------------------
# torchtitan: the continuous-batching generator
# --------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------
# verl: the last SPMD rollout (sync mode, free_cache_engine, sleep level 2)
# --------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------
# ms-swift: GRPO colocate mode (the engine driven by add_request / step)
# --------------------------------------------------------------------------------------------

SWIFT_GRPO = {"tp": 2, "sleep_level": 1, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1,
              "max_completion_length": 6, "temperature": 0.9, "top_p": 0.9, "top_k": 50, "min_p": 0.05,
              "repetition_penalty": 1.1, "stop_words": ["\n\n"]}


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


# --------------------------------------------------------------------------------------------
# ms-swift: `swift infer --infer_backend vllm` under torchrun
# --------------------------------------------------------------------------------------------

SWIFT_INFER = {"seed": 42, "vllm_tensor_parallel_size": 1, "max_new_tokens": 6}


def contiguous_shard(items: list, num_shards: int, index: int) -> list:
    """datasets.Dataset.shard(num_shards, index, contiguous=True)."""
    div, mod = divmod(len(items), num_shards)
    start = div * index + min(index, mod)
    return items[start:start + div + (1 if index < mod else 0)]


def swift_batch_infer(cfg: dict, launch: Launch) -> dict:
    gaps = Gaps()
    EngineArgs, LLMEngine = import_engine_classes(gaps)
    args = SWIFT_INFER
    tp = args["vllm_tensor_parallel_size"]
    seed = args["seed"]
    if launch.external:  # is_dist(): a different seed for each data-parallel replica
        seed += launch.rank // tp
    engine = LLMEngine.from_engine_args(swift_engine_args(EngineArgs, cfg["orig"], launch, tp, seed, False, None, 256))
    dataset = cfg["prompts"]
    rank = launch.rank // tp if launch.external else -1
    data_parallel_size = launch.world // tp
    if rank >= 0 and data_parallel_size > 1:
        dataset = contiguous_shard(dataset, data_parallel_size, rank)
    request = {"max_tokens": args["max_new_tokens"]}  # temperature etc. unset: the generation config's
    results = swift_infer(engine, dataset, request, cfg["swift_stop"], [0])
    if launch.external and launch.rank % tp != 0:
        results = []
    written = None
    if launch.external:  # JsonlWriter.append(result, gather_obj=True): gather_object, rank 0 writes
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, results)
        results = [r for chunk in gathered for r in chunk]
    if launch.rank == 0:
        path = os.path.join(cfg["out_dir"], f"swift_infer_{launch.backend}.jsonl")
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in results)
        with open(path) as f:
            written = [json.loads(line) for line in f]
    engine = None
    collect()
    return {"seed": seed, "shard": dataset, "written": written, "gaps": gaps.found}


# --------------------------------------------------------------------------------------------
# lm-evaluation-harness: the vLLM backend
# --------------------------------------------------------------------------------------------

def lm_eval(cfg: dict, launch: Launch) -> dict:
    gaps = Gaps()
    requests = cfg["lm_eval"]
    model_args = {"model": cfg["orig"], "revision": None, "dtype": "auto", "tokenizer": None,
                  "tokenizer_mode": "auto", "tokenizer_revision": None, "trust_remote_code": False,
                  "tensor_parallel_size": 1, "max_model_len": None, "max_num_seqs": None, "quantization": None,
                  "seed": 1234, "enable_lora": False, "max_lora_rank": 16}
    if launch.external:  # PR #3304: torchrun --nproc-per-node 2 lm_eval --model_args ...,data_parallel_size=2,...
        model_args.update(data_parallel_size=launch.world, distributed_executor_backend="external_launcher")
    llm = LLM(**model_args)
    gaps.call("llm.llm_engine.model_config", lambda: llm.llm_engine.model_config)  # chat template resolution
    max_length = gaps.call("llm.llm_engine.model_config.max_model_len",
                           lambda: llm.llm_engine.model_config.max_model_len,
                           lambda: llm.llm_engine.vllm_config.scheduler_config.max_model_len)

    def model_generate(inputs: list[list[int]], sampling_params=None):
        if sampling_params is None:  # loglikelihood
            sampling_params = SamplingParams(temperature=0, prompt_logprobs=1, max_tokens=1, detokenize=False)
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params] * len(inputs)
        return llm.generate([{"prompt_token_ids": ids} for ids in inputs], sampling_params=sampling_params,
                            use_tqdm=True, lora_request=None)

    # The evaluator hands each rank its share of the requests.
    ll_mine = list(enumerate(requests["loglikelihood"]))[launch.rank::launch.world]
    gen_mine = list(enumerate(requests["generate"]))[launch.rank::launch.world]

    # _loglikelihood_tokens: longest first (Collator), one batch ("auto")
    max_ctx = max_length - 1
    order = sorted(ll_mine, key=lambda item: (-len(item[1][0] + item[1][1]), tuple(item[1][0] + item[1][1])))
    inputs, ctxlens = [], []
    for _, (context_enc, continuation_enc) in order:
        inputs.append((context_enc + continuation_enc)[-max_ctx:])
        ctxlens.append(len(context_enc) - max(0, len(context_enc) + len(continuation_enc) - max_ctx))
    loglikelihoods = {}
    for (index, _), out, ctxlen, tokens in zip(order, model_generate(inputs), ctxlens, inputs):
        dicts = [{tok: getattr(lp, "logprob", lp) for tok, lp in d.items()} if d is not None else None
                 for d in out.prompt_logprobs]
        total = sum(d.get(tok) for tok, d in zip(tokens[ctxlen:], dicts[ctxlen:]))
        greedy = all(max(d, key=d.get) == tok for tok, d in zip(tokens[ctxlen:], dicts[ctxlen:]) if d)
        loglikelihoods[index] = [total, greedy]

    # generate_until: longest context first; greedy (do_sample False); HF defaults for the text
    order = sorted(gen_mine, key=lambda item: (-len(item[1]["context_ids"]), item[1]["context"]))
    params, inputs = [], []
    for _, req in order:
        until = list(req["until"])
        if requests["eos"] not in until:
            until.append(requests["eos"])
        kwargs = {"skip_special_tokens": False, "spaces_between_special_tokens": False, "temperature": 0.0}
        inputs.append(req["context_ids"][-(max_length - req["max_gen_toks"]):])
        params.append(gaps.call(
            "SamplingParams(spaces_between_special_tokens=False)",
            lambda: SamplingParams(max_tokens=req["max_gen_toks"], stop=until, **kwargs),
            lambda: SamplingParams(max_tokens=req["max_gen_toks"], stop=until,
                                   **{k: v for k, v in kwargs.items() if k != "spaces_between_special_tokens"})))
    generations = {}
    for (index, req), out, sp in zip(order, model_generate(inputs, params), params):
        text = out.outputs[0].text
        for term in sp.stop:  # postprocess_generated_text
            if term:
                text = text.split(term)[0]
        generations[index] = text

    if launch.external:  # the evaluator gathers every rank's answers
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (loglikelihoods, generations))
        loglikelihoods = {k: v for ll, _ in gathered for k, v in ll.items()}
        generations = {k: v for _, g in gathered for k, v in g.items()}
    llm = None
    collect()
    return {"loglikelihood": [loglikelihoods[i] for i in range(len(requests["loglikelihood"]))],
            "generate_until": [generations[i] for i in range(len(requests["generate"]))],
            "max_length": max_length, "gaps": gaps.found}


CLIENTS = {"torchtitan": torchtitan, "verl": verl, "swift_grpo": swift_grpo, "swift_infer": swift_batch_infer,
           "lm_eval": lm_eval}
# Clients whose trainer makes the torch world before the engine (accelerate, verl's workers).
IN_TRAINERS_WORLD = ("verl", "swift_grpo")


def run_client(name: str, cfg: dict, backend: str = "uni") -> dict:
    """One client's replay in this process (backend "uni"), or in this torchrun rank."""
    launch = Launch(backend) if backend == "uni" else Launch(backend, int(os.environ["RANK"]),
                                                              int(os.environ["WORLD_SIZE"]))
    try:
        report = CLIENTS[name](cfg, launch)
    except Exception as exc:  # the same on every rank: each reports it and goes on to the next client
        error = "".join(traceback.format_exception(exc))
        traceback.clear_frames(exc.__traceback__)  # the failed replay's engine must not outlive it
        del exc
        collect()
        return {"client": name, "rank": launch.rank, "error": error}
    return {"client": name, "rank": launch.rank, **report}


def main() -> None:
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    names = sys.argv[2:] or list(CLIENTS)
    # The clients whose engine makes the world first, then those run in a trainer's world
    # (made once, as one trainer process would, and torn down by it at the end).
    for name in [n for n in names if n not in IN_TRAINERS_WORLD]:
        emit(run_client(name, cfg, "external_launcher"))
    trainers = [n for n in names if n in IN_TRAINERS_WORLD]
    if trainers:
        dist.init_process_group("gloo")
        for name in trainers:
            emit(run_client(name, cfg, "external_launcher"))
        dist.barrier()
        dist.destroy_process_group()


def emit(report: dict) -> None:
    sys.stdout.write("REPORT " + json.dumps(report) + "\n")  # one write: whole lines do not interleave
    sys.stdout.flush()


if __name__ == "__main__":
    main()
