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
from spmd_engine.engine.core_client import EngineDeadError
from spmd_engine.engine.llm_engine import check_request_extras
from spmd_engine.engine.output_processor import SEED_MASK
from spmd_engine.engine.outputs import RequestOutput
from spmd_engine.sampling_params import RequestOutputKind, SamplingParams


def request_seed(engine_seed: int, index: int) -> int:
    """A prompt's random stream from the engine seed and its index in the whole input."""
    return (engine_seed * 1_000_003 + index * 7919 + 12345) & SEED_MASK


class LLM:
    def __init__(self, model: str | None = None, *, tensor_parallel_size: int = 1,
                 pipeline_parallel_size: int = 1, data_parallel_size: int = 1,
                 prefill_context_parallel_size: int = 1, decode_context_parallel_size: int = 1,
                 distributed_executor_backend: str | type | None = None, seed: int | None = 0,
                 dtype: str | None = None, max_model_len: int | None = None,
                 max_num_seqs: int | None = DEFAULT_MAX_NUM_SEQS, enable_expert_parallel: bool = False,
                 pp_partition: str | None = None, device: str | None = None, timeout_s: float | None = None,
                 nnodes: int = 1, block_size: int | None = 16, gpu_memory_utilization: float | None = 0.9,
                 kv_cache_memory_bytes: int | None = None, max_num_batched_tokens: int | None = None,
                 enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True,
                 async_scheduling: bool = False, load_format: str = "auto", enable_sleep_mode: bool = False,
                 logprobs_mode: str = "raw_logprobs", enable_return_routed_experts: bool = False,
                 admission: str = "identical", batch_invariant: bool | None = None,
                 enforce_eager: bool | None = None, compilation_config=None, max_logprobs: int = 20,
                 generation_config: str = "auto", override_generation_config: dict | None = None,
                 chat_template: str | None = None, skip_tokenizer_init: bool = False,
                 weight_transfer_config=None, **vllm_kwargs):
        """vLLM's arguments, defaults and meanings (docs/vllm-compatibility.md lists each). `seed` is
        the engine seed (None: 0, as in vLLM): requests without their own seed draw from a stream
        it starts, fresh on every generate call; under external_launcher it must be the same on
        every rank of a replica (checked). As in vLLM, None for a sizing argument means its
        default. `generation_config="auto"` takes the checkpoint's generation_config.json
        sampling values as the defaults of generate/chat without SamplingParams ("vllm": none).
        `skip_tokenizer_init=True`: no tokenizer; token-id prompts, outputs without text.
        `enable_return_routed_experts` (MoE only): each output's `routed_experts` (docs/moe.md).
        `admission` (external_launcher, this engine's own): "identical", every rank of a replica
        adds the same requests (checked each step), or "rank0", only its first rank does
        (engine/admission.py). `batch_invariant=True` (or VLLM_BATCH_INVARIANT=1): bitwise
        reproducible outputs whatever the batch, cache and layout. `enforce_eager` /
        `compilation_config`: by default the decoder layers run through torch.compile on CPU
        (docs/running.md). Other vLLM arguments are accepted and ignored with one warning when
        they cannot change a result, refused by name when they would (engine/vllm_args.py)."""
        from spmd_engine.engine.admission import check_mode
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
            enforce_eager=enforce_eager, compilation_config=compilation_config, max_logprobs=max_logprobs,
            generation_config=generation_config, override_generation_config=override_generation_config,
            enable_sleep_mode=enable_sleep_mode, admission=check_mode(admission),
            skip_tokenizer_init=skip_tokenizer_init, **vllm_kwargs)
        from spmd_engine.engine.chat_template import load_chat_template
        template = load_chat_template(chat_template)
        from spmd_engine.distributed.weight_transfer.config import WeightTransferConfig
        transfer = WeightTransferConfig.of(weight_transfer_config)  # checked before any process starts
        self._start(engine_args.create_engine_config(), engine_args.enable_sleep_mode, engine_args.admission)
        self.chat_template = template
        self._transfer.config = transfer

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "LLM":
        """vLLM's: an LLM on EngineArgs (their vLLM-only arguments were checked when made)."""
        llm = cls.__new__(cls)
        llm._start(engine_args.create_engine_config(), engine_args.enable_sleep_mode, engine_args.admission)
        llm.chat_template = None
        return llm

    @classmethod
    def from_engine_setup(cls, setup: EngineSetup, enable_sleep_mode: bool = False) -> "LLM":
        """An LLM on a configuration already built and checked (the run CLI checks its
        prompts against it first)."""
        llm = cls.__new__(cls)
        llm._start(setup, enable_sleep_mode, "identical")
        llm.chat_template = None
        return llm

    def _start(self, setup: EngineSetup, enable_sleep_mode: bool, admission: str) -> None:
        from spmd_engine.engine.llm_engine import LLMEngine
        self.config, self.inputs, self.model_spec = setup.config, setup.inputs, setup.spec
        self.hf_config, self.tokenizer = self.inputs.hf_config, self.inputs.tokenizer
        self.max_model_len = self.inputs.max_model_len
        self.enable_sleep_mode = bool(enable_sleep_mode)
        self._generate_calls, self._next_request = 0, 0
        self._llm_engine = LLMEngine.from_setup(setup, admission, enable_sleep_mode)
        # The executor's owner: ends it at shutdown (an LLMEngine made by from_engine_args keeps its
        # LLM alive through this reference).
        self._llm_engine.front_end = self
        self._engine = self._llm_engine._client
        from spmd_engine.engine.weight_transfer import WeightTransferFrontEnd
        self._transfer = WeightTransferFrontEnd(self._llm_engine, None)

    @property
    def seed(self) -> int:
        """The engine seed (under external_launcher the same on every rank of a replica: checked)."""
        return self._llm_engine.seed

    @seed.setter
    def seed(self, value: int) -> None:
        self._llm_engine.seed = value

    # -- what vLLM's LLM answers ---------------------------------------------------------
    def get_tokenizer(self):
        return self._llm_engine.get_tokenizer()

    def get_world_size(self, include_dp: bool = True) -> int:
        """TP x PP, times DP when `include_dp` (vLLM's)."""
        pc = self.config.parallel_config
        size = pc.tensor_parallel_size * pc.pipeline_parallel_size * pc.prefill_context_parallel_size
        return size * pc.data_parallel_size if include_dp else size

    def get_default_sampling_params(self) -> SamplingParams:
        """The checkpoint's generation_config.json sampling values (generation_config="auto"), vLLM's
        defaults for the rest: what generate and chat use when given no SamplingParams."""
        return self._llm_engine.get_default_sampling_params()

    # -- generation ---------------------------------------------------------------
    def generate(self, prompts: str | dict | Sequence[str | dict | Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool | Callable = False, lora_request=None, priority: int | Sequence[int] | None = None,
                 tokenization_kwargs: dict | None = None, mm_processor_kwargs: dict | None = None,
                 progress: Callable[[int, int], None] | None = None,
                 on_output: Callable[[int, RequestOutput], None] | None = None) -> list[RequestOutput]:
        """Results complete and in input order. Prompts as vLLM takes them: a string, a list of
        token ids, {"prompt": text}, {"prompt_token_ids": ids}, or a list mixing these; no
        `sampling_params`: get_default_sampling_params(). `use_tqdm` (off by default here: under
        torchrun every rank would draw a bar) shows a tqdm bar when tqdm is installed (a
        callable is used as the tqdm class). `lora_request` (one, or one per prompt): the LoRA
        adapter each runs with, loaded first if it is not (LLM(enable_lora=True)); `priority` 0 (no priority scheduling, as vLLM's default);
        `tokenization_kwargs` cut long prompts (engine/tokenization.py). `progress(requests,
        tokens)` is called as requests finish (from every replica this process drives), for a
        progress display; `on_output(position, output)` too, with each finished request."""
        if mm_processor_kwargs is not None:
            raise ConfigError("mm_processor_kwargs: multimodal inputs are not supported by spmd_engine")
        loras = _per_prompt(lora_request)
        for one in loras:
            check_request_extras(one, 0)
        for one in _per_prompt(priority if priority is not None else 0):
            check_request_extras(None, one)
        self._llm_engine.check_can_generate()
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
                engine.use_loras(loras)
                news = self._new_requests(prompts, sampling_params, call, tokenization_kwargs, loras)
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

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | Callable = False, lora_request=None, priority: int | Sequence[int] | None = None,
             chat_template: str | None = None, chat_template_content_format: str = "auto",
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
             tokenization_kwargs: dict | None = None, mm_processor_kwargs=None) -> list[RequestOutput]:
        """vLLM's LLM.chat: one conversation (a list of {"role", "content"} messages) or a list of
        them, rendered with `chat_template` (template text), else LLM(chat_template=...), else the
        checkpoint's own, then generated as `generate` would; each RequestOutput's `prompt` is
        the rendered text. See engine/chat_template.py for how a template is rendered."""
        from spmd_engine.engine.chat_template import chat_prompt, choose_template, normalize_messages
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        model_dir = self.config.model_config.model_dir
        template = choose_template(model_dir, chat_template or self.chat_template, tools)
        prompts = [chat_prompt(self.tokenizer, model_dir, normalize_messages(c, chat_template_content_format),
                               template, add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message, tools=tools,
                               variables=chat_template_kwargs) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request,
                             priority=priority, tokenization_kwargs=tokenization_kwargs,
                             mm_processor_kwargs=mm_processor_kwargs)

    @property
    def dp_waves(self) -> bool:
        """The DP replicas step in lockstep (a mixture of experts under DP: engine/dp_waves.py).
        Under external_launcher every replica must then call generate the same number of
        times, a replica without prompts with an empty list."""
        return self.config.dp_waves

    def _new_requests(self, prompts, sampling_params, call: int, tokenization_kwargs=None, loras=(None,)) -> list:
        """Every prompt tokenized, checked and seeded before any is queued: a refused call
        queues nothing and draws nothing, so every rank's seed stream stays with the others'.
        Each gets id str(k), k counting over this LLM's generate calls, and FINAL_ONLY outputs."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ConfigError("no prompts given")
        engine = self._llm_engine
        if sampling_params is None:
            sampling_params = engine.get_default_sampling_params()
        params_list = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ConfigError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        loras = list(loras) if len(loras) != 1 else list(loras) * len(prompts)
        if len(loras) != len(prompts):
            raise ConfigError(f"{len(loras)} lora requests for {len(prompts)} prompts")
        stream, first = engine.seed_stream.getstate(), self._next_request
        news = []
        try:
            for index, (prompt, params) in enumerate(zip(prompts, params_list)):
                final = copy.copy(params)
                final.output_kind = RequestOutputKind.FINAL_ONLY
                news.append(engine.new_request(str(self._next_request), prompt, final, origin=(call, index),
                                               index=index, tokenization_kwargs=tokenization_kwargs,
                                               lora_request=loras[index]))
                self._next_request += 1
        except BaseException:
            engine.seed_stream.setstate(stream)
            self._next_request = first
            raise
        return news

    # -- the control surface trainers call (engine/llm_engine.py holds each) -----------------
    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget every cached prefix block (as vLLM: False while requests are running).
        `reset_running_requests=True`: running requests keep their tokens and recompute their KV
        when next scheduled (after a weight update their old KV is stale); it always succeeds."""
        return self._llm_engine.reset_prefix_cache(reset_running_requests, reset_connector)

    def pause_generation(self, mode: str = "abort", clear_cache: bool = False) -> list[RequestOutput]:
        """Stop generating (engine/pause.py): "abort" (partial outputs of every unfinished request,
        returned), "wait" (run them to the end first; their outputs returned) or "keep" (they
        stay, with their KV, and continue after resume_generation())."""
        return self._llm_engine.pause_generation(mode, clear_cache)

    def resume_generation(self) -> None:
        self._llm_engine.resume_generation()

    def is_paused(self) -> bool:
        return self._llm_engine.is_paused()

    def get_metrics(self) -> list:
        """vLLM's metrics (engine/metrics.py): request, token, preemption and prefix-cache
        counters, running / waiting gauges, latency histograms."""
        return self._llm_engine.outputs.stats.metrics(self.get_stats())

    def sleep(self, level: int = 1, mode: str = "abort", reset_connector: bool = True) -> list[dict]:
        """vLLM's levels and modes (engine/sleep_mode.py): 0 pauses scheduling, 1 also frees the KV
        cache, 2 also discards the weights (load them before generating). Returns each worker's
        report (rss_before, rss_after, freed_bytes; device_freed_bytes on CUDA)."""
        return self._llm_engine.sleep(level, mode, reset_connector)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Bring back "weights", "kv_cache" and/or "scheduling" (None: all); True once all are
        back (vLLM's order for a weight update after sleep(2): weights, load them, kv_cache)."""
        return self._llm_engine.wake_up(tags)

    @property
    def is_sleeping(self) -> bool:
        return self._llm_engine.is_sleeping()

    def get_stats(self) -> list[dict]:
        """Per replica this process drives: scheduler and block counters (steps, preemptions,
        peak_running, prefix_queries_tokens, prefix_hits_tokens, ...) and the output rank's
        runner counters under "runner" (tokens, prefill_tokens: prompt tokens computed)."""
        return self._engine.call_core("get_stats")

    @property
    def llm_engine(self):
        """vLLM's `llm.llm_engine` (engine/llm_engine.py): add_request / step / abort_request, the
        control calls; with one replica here its `model_executor.driver_worker.model_runner.model`
        is this rank's CausalLM (uni and external_launcher; under mp the model lives in the
        workers: use collective_rpc)."""
        return self._llm_engine

    def collective_rpc(self, method: str | Callable, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None, *, unique_reply_rank: int | None = None) -> list[Any]:
        """vLLM's: a Worker method on every worker of each replica this process drives. Besides the
        engine's own, `load_weights` ((HF name, full tensor) pairs: an in-place update) and
        `reload_weights` (from the model directory) are there for trainers; after either, call
        `reset_prefix_cache()`, or cached blocks keep serving keys and values of the old weights.
        `unique_reply_rank` (vLLM's executor argument): only that worker's reply."""
        return self._llm_engine.collective_rpc(method, timeout, args, kwargs, unique_reply_rank=unique_reply_rank)

    def apply_model(self, func: Callable) -> list[Any]:
        """vLLM's: func(model) on every worker's model."""
        return self._llm_engine.call_workers("apply_model", (func,))

    # -- versioned weight updates (engine/weight_update.py), vLLM's names -------------------
    def start_weight_update(self) -> None:
        """Begin pushing a policy: load_weights (any number of calls, here or on the model itself)
        until finish_weight_update(); generate refuses in between. Under external_launcher
        every rank of the replica calls both."""
        self._llm_engine.start_weight_update()

    def finish_weight_update(self, weight_version: int | str | None = None) -> None:
        """Complete the update on every rank, or fail it on every rank (RuntimeError naming the
        first rank's reason): then generate refuses until an update that writes every tensor
        completes. `weight_version` names the new weights (None keeps the last name)."""
        self._llm_engine.finish_weight_update(weight_version)

    # -- weight transfer from a trainer job (engine/weight_transfer.py), vLLM 0.34's four phases --
    def init_weight_transfer_engine(self, request) -> None:
        """Join the trainer's transfer group on every worker: `{"init_info": {"master_address",
        "master_port", "world_size", "rank_offset", ...}}` (docs/weight-transfer.md). Needs
        `LLM(weight_transfer_config=...)`; refused while a trainer is connected."""
        self._transfer.init(request)

    def update_weights(self, request) -> None:
        """Receive one update from the trainer (`{"update_info": {"names", "dtype_names", "shapes"}}`,
        or empty lists: the trainer's own manifest), between start_weight_update and
        finish_weight_update; a refused or broken transfer fails the update on every rank."""
        self._transfer.update(request)

    def shutdown_weight_transfer_engine(self) -> None:
        """Leave the trainer's transfer group (not during an update); inference goes on."""
        self._transfer.shutdown()

    def get_weight_version(self) -> int | str:
        """The last completed update's version ("default" before any, as vLLM)."""
        return self._llm_engine.get_weight_version()

    def update_weight_version(self, new_version: int | str) -> None:
        self._llm_engine.update_weight_version(new_version)

    @property
    def weight_version(self) -> int | str | None:
        """The version outputs report (None before any update)."""
        return self._llm_engine.updates.version

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


def _per_prompt(value) -> list:
    """One value, or a list of them (one per prompt): as a list."""
    return list(value) if isinstance(value, (list, tuple)) else [value]
