"""`LLM`: the Python front end, shaped like vLLM's so users' habits carry over.

It validates everything it can before any process or collective exists (sizes,
the checkpoint's config, TP/PP against the model), then builds one EngineCore
in this process (uni, mp at DP = 1, external_launcher) or one EngineCore_DP{i}
process per replica (DP > 1), and returns results complete and in input order.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Sequence

from spmd_engine import topology
from spmd_engine.config import DEFAULT_MAX_NUM_SEQS, ConfigError
from spmd_engine.engine.arg_utils import EngineArgs, EngineSetup
from spmd_engine.engine.core_client import EngineCoreClient, EngineDeadError, InProcClient
from spmd_engine.engine.output_processor import SEED_MASK
from spmd_engine.engine.outputs import RequestOutput
from spmd_engine.engine.vllm_args import accept_vllm_kwargs
from spmd_engine.engine.weight_update import WeightUpdates
from spmd_engine.sampling_params import RequestOutputKind, SamplingParams


def request_seed(engine_seed: int, index: int) -> int:
    """A prompt's random stream from the engine seed and its index in the whole input."""
    return (engine_seed * 1_000_003 + index * 7919 + 12345) & SEED_MASK


class LLM:
    def __init__(self, model: str | None = None, tensor_parallel_size: int = 1,
                 pipeline_parallel_size: int = 1, data_parallel_size: int = 1,
                 prefill_context_parallel_size: int = 1, decode_context_parallel_size: int = 1,
                 distributed_executor_backend: str | type | None = None, seed: int | None = None,
                 dtype: str | None = None, max_model_len: int | None = None,
                 max_num_seqs: int | None = DEFAULT_MAX_NUM_SEQS, enable_expert_parallel: bool = False,
                 pp_partition: str | None = None, device: str | None = None, timeout_s: float | None = None,
                 nnodes: int = 1, block_size: int | None = 16, gpu_memory_utilization: float | None = 0.9,
                 kv_cache_memory_bytes: int | None = None, max_num_batched_tokens: int | None = None,
                 enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True,
                 async_scheduling: bool = False, load_format: str = "auto", enable_sleep_mode: bool = False,
                 logprobs_mode: str = "raw_logprobs", enable_return_routed_experts: bool = False,
                 admission: str = "identical", batch_invariant: bool | None = None,
                 enforce_eager: bool | None = None, compilation_config=None, **vllm_kwargs):
        """vLLM's arguments and meanings. `seed` is the engine seed (None: 0, as in vLLM):
        requests without their own seed draw from a stream it starts, fresh on every generate
        call; under external_launcher it must be the same on every rank of a replica
        (checked). Other vLLM arguments are accepted and ignored, with one warning (see
        vllm_args). As in vLLM, None for a sizing argument (trainers pass None for what their
        user left unset) means its default. `enable_return_routed_experts` (MoE only): each
        output's `routed_experts`, the experts every computed position was routed to (docs/moe.md).
        `admission` (external_launcher): "identical", every rank of a replica adds the same
        requests (checked each step), or "rank0", only its first rank does (engine/admission.py).
        `batch_invariant=True` (or VLLM_BATCH_INVARIANT=1): bitwise reproducible outputs
        whatever the batch, cache and layout (README, batch-invariant mode).
        `enforce_eager` / `compilation_config` (vLLM's): by default the decoder layers run
        through torch.compile on CPU; enforce_eager=True, or compilation_config=0, keeps eager
        (docs/running.md, compiled forward). `async_scheduling` (vLLM's): the next step is
        scheduled while one runs (any layout without PP; docs/running.md, async scheduling)."""
        accept_vllm_kwargs(vllm_kwargs)
        from spmd_engine.engine.admission import check_mode
        self._admission = check_mode(admission)
        engine_args = EngineArgs(
            model=model, tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
            data_parallel_size=data_parallel_size, prefill_context_parallel_size=prefill_context_parallel_size,
            decode_context_parallel_size=decode_context_parallel_size,
            distributed_executor_backend=distributed_executor_backend, seed=seed, dtype=dtype,
            max_model_len=max_model_len, max_num_seqs=max_num_seqs, enable_expert_parallel=enable_expert_parallel,
            pp_partition=pp_partition, device=device, timeout_s=timeout_s, nnodes=nnodes, block_size=block_size,
            gpu_memory_utilization=gpu_memory_utilization, kv_cache_memory_bytes=kv_cache_memory_bytes,
            max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill, async_scheduling=bool(async_scheduling),
            load_format=load_format,
            logprobs_mode="raw_logprobs" if logprobs_mode is None else logprobs_mode,
            enable_return_routed_experts=enable_return_routed_experts, batch_invariant=batch_invariant,
            enforce_eager=enforce_eager, compilation_config=compilation_config)
        self._start(engine_args.create_engine_config(), enable_sleep_mode)

    @classmethod
    def from_engine_setup(cls, setup: EngineSetup, enable_sleep_mode: bool = False) -> "LLM":
        """An LLM on a configuration already built and checked (the run CLI checks its
        prompts against it first)."""
        llm = cls.__new__(cls)
        llm._admission = "identical"
        llm._start(setup, enable_sleep_mode)
        return llm

    def _start(self, setup: EngineSetup, enable_sleep_mode: bool) -> None:
        self.config, self.inputs, self.model_spec = setup.config, setup.inputs, setup.spec
        self.hf_config, self.tokenizer = self.inputs.hf_config, self.inputs.tokenizer
        self.max_model_len = self.inputs.max_model_len
        self.enable_sleep_mode = bool(enable_sleep_mode)
        self._asleep: set[str] = set()  # the tags (weights, kv_cache) sleep gave back, until wake_up
        self._weights_discarded = False  # sleep(2) ran: generate checks the workers loaded weights since
        self._generate_calls, self._next_request = 0, 0
        self._engine = self._make_engine()
        external = self.config.parallel_config.distributed_executor_backend == "external_launcher"
        self._updates = WeightUpdates(self._engine, external)
        from spmd_engine.engine.llm_engine import LLMEngine
        self._llm_engine = LLMEngine(self._engine, self.inputs, self.config.seed, self._admission, external,
                                     lambda: self._updates.version, self._check_can_generate)

    @property
    def seed(self) -> int:
        """The engine seed (under external_launcher the same on every rank of a replica: checked)."""
        return self._llm_engine.seed

    @seed.setter
    def seed(self, value: int) -> None:
        self._llm_engine.seed = value

    # -- construction -----------------------------------------------------------
    def _make_engine(self) -> EngineCoreClient:
        from spmd_engine.executor.abstract import Executor
        pc = self.config.parallel_config
        executor_class = Executor.get_class(self.config)
        eos = self.inputs.eos_token_ids
        if pc.distributed_executor_backend == "external_launcher" or pc.data_parallel_size == 1:
            from spmd_engine.engine.core import EngineCore
            return InProcClient(EngineCore(self.config, executor_class, self.max_model_len, eos))
        from spmd_engine.engine.dp_client import DPEngineClient
        return DPEngineClient(self.config, executor_class, self.max_model_len, eos)

    # -- generation ---------------------------------------------------------------
    def generate(self, prompts: str | dict | Sequence[str | dict | Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | Callable = False,
                 progress: Callable[[int, int], None] | None = None,
                 on_output: Callable[[int, RequestOutput], None] | None = None) -> list[RequestOutput]:
        """Results complete and in input order. Prompts as vLLM takes them: a string, a list of
        token ids, {"prompt": text}, {"prompt_token_ids": ids}, or a list mixing these.
        `use_tqdm` (off by default here) shows a tqdm bar when tqdm is installed (a callable is
        used as the tqdm class). `progress(requests, tokens)` is called as requests finish (from
        every replica this process drives), for a progress display; `on_output(position,
        output)` too, with each finished request (to stream results)."""
        self._check_can_generate()
        engine = self._llm_engine
        busy = engine.get_num_unfinished_requests()
        if busy:
            raise RuntimeError(f"generate while {busy} requests added with llm.llm_engine.add_request are "
                               f"unfinished: step them to the end or abort them first")
        call = self._generate_calls
        self._generate_calls += 1
        news = []
        if engine.takes_input and (_has_prompts(prompts) or not self.dp_waves):
            try:
                news = self._new_requests(prompts, sampling_params, call)
            except Exception:
                self._meet_replica_empty_handed()
                raise
        for new in news:
            engine.queue_request(new)
        total = sum(new.params.n for new in news)
        progress = tqdm_progress(use_tqdm, total, progress)
        done: dict[int, RequestOutput] = {}
        try:
            # One exchange for the whole call (under external_launcher): every rank of the replica
            # then holds the same requests, and with nothing queued after it the steps stay equal
            # without exchanging again (an exchange a step cost as much as a small model's step).
            engine.sync()
            while engine.has_unfinished_requests(sync=False):
                for origin, out in engine.step_with_origins(sync=False):
                    if origin is None or origin[0] != call:
                        continue
                    done[origin[1]] = out
                    if on_output is not None:
                        on_output(origin[1], out)
                    if progress is not None:
                        progress(len(out.outputs), sum(len(c.token_ids) for c in out.outputs))
        except EngineDeadError as exc:
            for origin, out in getattr(exc, "outputs", []):
                if origin is not None and origin[0] == call:
                    done[origin[1]] = out
            exc.partial_outputs = [done.get(i) for i in range(max(len(news), len(done)))]
            raise
        return [done[i] for i in range(len(done))]

    def _meet_replica_empty_handed(self) -> None:
        """This rank refused its prompts: under external_launcher it still meets the others at
        their first sync, with nothing queued, so they fail (or, following rank 0, finish
        empty) instead of waiting for it."""
        if self.config.parallel_config.distributed_executor_backend == "external_launcher":
            try:
                self._llm_engine.sync()
            except ConfigError:
                pass

    def _check_can_generate(self) -> None:
        """Refuse to run the model on weights that are not a whole policy, or while asleep."""
        if self._asleep:
            raise RuntimeError(f"the engine is asleep ({', '.join(sorted(self._asleep))} given back by "
                               f"llm.sleep()): call llm.wake_up() before generate")
        self._updates.check_can_generate()
        if self._weights_discarded:
            missing = sorted({name for names in self._engine.collective_rpc("unwritten_weights") for name in names})
            if missing and not any(self._engine.collective_rpc("weights_loaded_since_discard")):
                raise RuntimeError("sleep(level=2) discarded the weights: load_weights(...) or "
                                   "collective_rpc('reload_weights') before generate")
            if missing:  # a half-done push would serve a mix of two policies
                raise RuntimeError(f"sleep(level=2) discarded the weights and {len(missing)} tensors have not "
                                   f"been loaded since (first: {missing[0]}): load_weights(...) every tensor, "
                                   f"or collective_rpc('reload_weights'), before generate")
            self._weights_discarded = False

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | Callable = False, lora_request=None, chat_template: str | None = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, mm_processor_kwargs=None) -> list[RequestOutput]:
        """vLLM's LLM.chat: one conversation (a list of {"role", "content"} messages) or a list of
        them, rendered with the checkpoint's chat template (or `chat_template`, template text),
        then generated as `generate` would; each RequestOutput's `prompt` is the rendered text.
        See engine/chat_template.py for how a template is rendered."""
        if lora_request is not None or mm_processor_kwargs is not None:
            raise ConfigError("LLM.chat: LoRA and multimodal inputs are not supported")
        from spmd_engine.engine.chat_template import chat_prompt, choose_template, normalize_messages
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        model_dir = self.config.model_config.model_dir
        template = choose_template(model_dir, chat_template, tools)
        prompts = [chat_prompt(self.tokenizer, model_dir, normalize_messages(c, chat_template_content_format),
                               template, add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message, tools=tools,
                               variables=chat_template_kwargs) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    @property
    def dp_waves(self) -> bool:
        """The DP replicas step in lockstep (a mixture of experts under DP: engine/dp_waves.py).
        Under external_launcher every replica must then call generate the same number of
        times, a replica without prompts with an empty list."""
        return self.config.dp_waves

    def _new_requests(self, prompts, sampling_params, call: int) -> list:
        """Every prompt tokenized, checked and seeded before any is queued: a refused call
        queues nothing and draws nothing, so every rank's seed stream stays with the others'.
        Each gets id str(k), k counting over this LLM's generate calls, and FINAL_ONLY outputs."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ConfigError("no prompts given")
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ConfigError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        engine = self._llm_engine
        stream, first = engine.seed_stream.getstate(), self._next_request
        news = []
        try:
            for index, (prompt, params) in enumerate(zip(prompts, params_list)):
                final = copy.copy(params)
                final.output_kind = RequestOutputKind.FINAL_ONLY
                news.append(engine.new_request(str(self._next_request), prompt, final, origin=(call, index),
                                               index=index))
                self._next_request += 1
        except BaseException:
            engine.seed_stream.setstate(stream)
            self._next_request = first
            raise
        return news

    # -- the KV cache ---------------------------------------------------------------
    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached prefix block (as vLLM: False while requests are running).
        `reset_running_requests=True`: running requests keep their tokens and recompute their KV
        when next scheduled (after a weight update their old KV is stale); it always succeeds."""
        if not isinstance(reset_running_requests, bool):
            raise ValueError(f"reset_running_requests must be True or False, got {reset_running_requests!r}")
        return all(self._engine.call_core("reset_prefix_cache", reset_running_requests))

    # -- pausing for a weight update mid-rollout (engine/pause.py) -------------------------
    def pause_generation(self, mode: str = "abort", clear_cache: bool = False) -> list[RequestOutput]:
        """Stop generating: "abort" (partial outputs of every unfinished request, returned),
        "wait" (run them to the end first; their outputs returned) or "keep" (they stay, with
        their KV, and continue after resume_generation())."""
        return self._llm_engine.pause_generation(mode, clear_cache)

    def resume_generation(self) -> None:
        self._llm_engine.resume_generation()

    def is_paused(self) -> bool:
        return self._llm_engine.is_paused()

    def get_metrics(self) -> list:
        """vLLM's metrics (engine/metrics.py): request, token, preemption and prefix-cache
        counters, running / waiting gauges, latency histograms."""
        return self._llm_engine.outputs.stats.metrics(self.get_stats())

    # -- sleep mode (colocated training takes the memory between rollouts) -------------
    def sleep(self, level: int = 1) -> list[dict]:
        """Give memory back: level 1 frees the KV cache (on CUDA the weights also move to host
        memory), level 2 also discards the weights (restore them with load_weights or
        collective_rpc("reload_weights") before generating). Refused while requests hold KV
        blocks; the prefix cache is reset. Returns each worker's report (rss_before, rss_after,
        freed_bytes; device_freed_bytes on CUDA)."""
        if not self.enable_sleep_mode:
            raise ConfigError("sleep needs LLM(..., enable_sleep_mode=True)")
        if isinstance(level, bool) or level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got level={level!r}")
        reports = [r for replica in self._engine.call_core("sleep", level) for r in replica]
        self._asleep = {"weights", "kv_cache"}
        self._weights_discarded = self._weights_discarded or level == 2
        return reports

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what sleep gave back: tags None (everything), ["weights"] or ["kv_cache"]
        (vLLM's order for a weight update after sleep(2): weights, load them, then kv_cache)."""
        if tags is None:
            tags = ["weights", "kv_cache"]
        if isinstance(tags, str) or not all(t in ("weights", "kv_cache") for t in tags):
            raise ValueError(f"wake_up tags must be a list of 'weights' and/or 'kv_cache', got tags={tags!r}")
        tags = list(tags)
        self._engine.call_core("wake_up", tags)
        self._asleep -= set(tags)

    @property
    def is_sleeping(self) -> bool:
        return bool(self._asleep)

    def get_stats(self) -> list[dict]:
        """Per replica this process drives: scheduler and block counters (steps, preemptions,
        peak_running, prefix_queries_tokens, prefix_hits_tokens, ...) and the output rank's
        runner counters under "runner" (tokens, prefill_tokens: prompt tokens computed)."""
        return self._engine.call_core("get_stats")

    # -- workers ------------------------------------------------------------------
    @property
    def llm_engine(self):
        """vLLM's `llm.llm_engine` (engine/llm_engine.py): add_request / step / abort_request;
        with one replica here its `model_executor.driver_worker.model_runner.model` is this
        rank's CausalLM (uni and external_launcher; under mp the model lives in the workers:
        use collective_rpc)."""
        return self._llm_engine

    def collective_rpc(self, method: str | Callable, args: tuple = (), kwargs: dict | None = None,
                       unique_reply_rank: int | None = None) -> list[Any]:
        """Call a Worker method on every worker of each replica this process drives. Besides the
        engine's own, `load_weights` ((HF name, full tensor) pairs: an in-place update) and
        `reload_weights` (from the model directory) are there for trainers; after either, call
        `reset_prefix_cache()`, or cached blocks keep serving keys and values of the old weights."""
        if method == "load_weights":
            try:
                args = (self._checked_weights(*args, **(kwargs or {})),)
            except Exception as exc:
                self._updates.note_load_error(exc)
                raise
            kwargs = None
        return self._engine.collective_rpc(method, args, kwargs, unique_reply_rank)

    # -- versioned weight updates (engine/weight_update.py) ------------------------------
    def start_weight_update(self, version: int | str) -> None:
        """Begin pushing policy `version`: load_weights (any number of calls, here or on the
        model itself) until finish_weight_update(); generate refuses in between. Under
        external_launcher every rank of the replica calls both."""
        self._updates.start(version)

    def finish_weight_update(self) -> int | str:
        """Complete the update on every rank, or fail it on every rank (RuntimeError naming the
        first rank's reason): then generate refuses until an update that writes every tensor
        completes. Reset the prefix cache after it, as after any load."""
        return self._updates.finish()

    @property
    def weight_version(self) -> int | str | None:
        """The version of the last completed update (None before any)."""
        return self._updates.version

    def _checked_weights(self, weights) -> list[tuple[str, Any]]:
        """The pairs as a list, each name and full shape checked here, so a bad one is a ValueError
        before any worker sees it (a worker's exception would fail an mp executor)."""
        from collections.abc import Mapping

        from spmd_engine.model.weights import hf_tensor_shapes, is_skipped_name
        shapes = hf_tensor_shapes(self.model_spec)
        pairs = list(weights.items() if isinstance(weights, Mapping) else weights)
        for pair in pairs:
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], str)):
                raise ValueError(f"load_weights expects (name, tensor) pairs, got {type(pair).__name__}")
            name, tensor = pair
            if is_skipped_name(name):
                continue
            if name not in shapes:
                raise ValueError(f"load_weights: unknown weight name {name!r} (not a tensor of this "
                                 f"{self.model_spec.architecture} model)")
            if tuple(getattr(tensor, "shape", ())) != shapes[name]:
                raise ValueError(f"load_weights: {name} has shape {list(getattr(tensor, 'shape', ()))}, "
                                 f"expected {list(shapes[name])}")
        return pairs

    @property
    def replica_index(self) -> int:
        """This process's replica among DP x external-DP replicas (external_launcher)."""
        pc = self.config.parallel_config
        if pc.distributed_executor_backend != "external_launcher":
            return 0
        from spmd_engine.distributed import get_world_group
        world = get_world_group()
        layout = topology.Layout.of(pc, world.world_size)
        return topology.replica_index(layout, topology.rank_to_coord(layout, world.rank))

    def shutdown(self) -> None:
        engine, self._engine = getattr(self, "_engine", None), None
        if engine is not None:
            engine.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass


def tqdm_progress(use_tqdm, total: int, progress: Callable[[int, int], None] | None):
    """A progress callback that also advances a tqdm bar, when asked for and tqdm is installed
    (it is optional: without it use_tqdm does nothing)."""
    if not use_tqdm:
        return progress
    if callable(use_tqdm):
        bar_class = use_tqdm
    else:
        try:
            from tqdm import tqdm as bar_class
        except ImportError:
            return progress
    bar = bar_class(total=total, desc="Processed requests", dynamic_ncols=True)  # n > 1: each sample

    def advance(requests: int, tokens: int) -> None:
        bar.update(requests)
        if bar.n >= total:
            bar.close()
        if progress is not None:
            progress(requests, tokens)
    return advance


def _has_prompts(prompts) -> bool:
    return isinstance(prompts, str) or bool(prompts)
