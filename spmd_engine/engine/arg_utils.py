"""EngineArgs: every argument of an engine, and the one place they become an EngineConfig.

`LLM(...)`, `python -m spmd_engine.run` and `python -m spmd_engine.plan` all come
here (vLLM's `EngineArgs.create_engine_config()` shape), so a rule is checked once,
in one order, with one message, before any process or collective exists: sizes,
the checkpoint's config against TP/PP/EP, the PP partition, the step's token budget
against max_model_len, and a KV budget too small for one sequence.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass, fields

from spmd_engine import envs
from spmd_engine.config import (
    DEFAULT_MAX_NUM_SEQS,
    CacheConfig,
    CompilationConfig,
    ConfigError,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from spmd_engine.core import kv_sizing
from spmd_engine.engine.dp_waves import needs_dp_waves
from spmd_engine.engine.vllm_args import accept_vllm_kwargs, none_means_default

logger = logging.getLogger("spmd_engine")


@dataclass
class _EngineArgFields:
    """vLLM's names, meanings and defaults (None for a sizing argument means its default)."""

    model: str | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    distributed_executor_backend: str | type | None = None
    seed: int | None = 0  # vLLM's; None means 0 too
    dtype: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = DEFAULT_MAX_NUM_SEQS
    enable_expert_parallel: bool = False
    pp_partition: str | None = None
    device: str | None = None
    timeout_s: float | None = None
    nnodes: int = 1
    block_size: int | None = 16
    gpu_memory_utilization: float | None = 0.9
    kv_cache_memory_bytes: int | None = None
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    async_scheduling: bool = False
    load_format: str = "auto"
    logprobs_mode: str = "raw_logprobs"
    enable_return_routed_experts: bool = False
    batch_invariant: bool | None = None  # None: VLLM_BATCH_INVARIANT decides
    enforce_eager: bool | None = None  # None: SPMD_ENGINE_ENFORCE_EAGER decides (default: compiled)
    compilation_config: object = None  # vLLM's forms: a level, a dict, JSON text (CompilationConfig.parse)
    skip_tokenizer_init: bool = False  # vLLM's: no tokenizer; token-id prompts, outputs without text
    max_logprobs: int = 20  # vLLM's: the most logprobs a request may ask for (-1: the vocabulary)
    generation_config: str = "auto"  # vLLM's: where default sampling parameters come from
    override_generation_config: dict | None = None
    enable_sleep_mode: bool = False
    admission: str = "identical"  # this engine's own (engine/admission.py)
    return_sampling_mask: bool = False  # vLLM's: every request returns its sampling masks
    enable_lora: bool = False  # vLLM's LoRA arguments (config.LoRAConfig)
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str | None = "auto"


class EngineArgs(_EngineArgFields):
    """vLLM's EngineArgs: this engine's arguments, and vLLM's others accepted by name (ignored
    with one warning when they cannot change a result, refused when they would: vllm_args.py),
    so `EngineArgs(...)` written for vLLM builds here too."""

    def __init__(self, *args, **kwargs):
        known = {f.name for f in fields(_EngineArgFields)}
        accept_vllm_kwargs({k: kwargs.pop(k) for k in list(kwargs) if k not in known}, "EngineArgs",
                           kwargs.get("model", args[0] if args else None))
        super().__init__(*args, **kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        """The run and plan CLIs' flags (same names; `--timeout` is timeout_s)."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        if hasattr(args, "timeout"):
            values["timeout_s"] = args.timeout
        return cls(**values)

    def create_parallel_config(self) -> ParallelConfig:
        return ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size, pipeline_parallel_size=self.pipeline_parallel_size,
            prefill_context_parallel_size=self.prefill_context_parallel_size,
            decode_context_parallel_size=self.decode_context_parallel_size,
            data_parallel_size=self.data_parallel_size, nnodes=self.nnodes,
            enable_expert_parallel=self.enable_expert_parallel,
            distributed_executor_backend=self.distributed_executor_backend,
        )

    def create_lora_config(self) -> LoRAConfig | None:
        """vLLM's: the LoRA sizes count only with enable_lora."""
        if self.enable_lora is not None and not isinstance(self.enable_lora, bool):
            raise ConfigError(f"enable_lora must be True or False, got {self.enable_lora!r}")
        if not self.enable_lora:
            return None
        return LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                          max_cpu_loras=self.max_cpu_loras, lora_dtype=self.lora_dtype)

    def create_engine_config(self, check_kv_budget: bool = True) -> "EngineSetup":
        """Checked in this order; `check_kv_budget=False` for a plan that reports the budget
        instead of refusing it."""
        from spmd_engine.engine.input_processor import InputProcessor
        from spmd_engine.model.partition import check_layout, parse_pp_partition
        max_num_seqs, block_size, gpu_memory_utilization = none_means_default(
            max_num_seqs=self.max_num_seqs, block_size=self.block_size,
            gpu_memory_utilization=self.gpu_memory_utilization)
        parallel = self.create_parallel_config()
        seed = engine_seed(self.seed)
        if parallel.prefill_context_parallel_size > 1 or parallel.decode_context_parallel_size > 1:
            raise ConfigError("context parallelism (PCP/DCP > 1) is planned but not implemented in the "
                              "model yet; use spmd_engine.plan to inspect such layouts")
        model_config = ModelConfig(model=self.model, dtype=self.dtype, pp_partition=self.pp_partition,
                                   load_format=self.load_format, logprobs_mode=self.logprobs_mode,
                                   enable_return_routed_experts=self.enable_return_routed_experts,
                                   batch_invariant=bool(self.batch_invariant) or envs.batch_invariant())
        inputs = InputProcessor(model_config.model_dir, self.max_model_len,
                                skip_tokenizer_init=bool(self.skip_tokenizer_init))
        inputs.max_logprobs = checked_max_logprobs(self.max_logprobs, inputs.vocab_size)
        model_config.max_model_len = inputs.max_model_len
        inputs.return_sampling_mask = bool(self.return_sampling_mask)
        from spmd_engine.engine.generation_config import default_sampling_kwargs
        inputs.default_sampling_kwargs = default_sampling_kwargs(
            model_config.model_dir, self.generation_config, self.override_generation_config)
        source = os.path.join(model_config.model_dir, "config.json")
        spec = check_layout(inputs.hf_config, parallel, source)
        model_config.model_registration = registration_for_workers(spec.architecture, parallel)
        check_routed_experts(model_config, spec, source)
        if model_config.batch_invariant:
            check_batch_invariant(spec, parallel, source)
        if self.enable_lora is True and spec.mla is not None:
            raise ConfigError(f"{source}: enable_lora does not support multi-head latent attention "
                              f"({spec.architecture})")
        partition = self.pp_partition or envs.pp_partition()
        if partition:
            parse_pp_partition(partition, spec.num_layers, parallel.pipeline_parallel_size)
        cache = CacheConfig(block_size=block_size, gpu_memory_utilization=gpu_memory_utilization,
                            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                            enable_prefix_caching=self.enable_prefix_caching)
        scheduler = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                                    enable_chunked_prefill=self.enable_chunked_prefill,
                                    async_scheduling=bool(self.async_scheduling))
        check_async_scheduling(scheduler, parallel)
        try:
            scheduler.resolve(inputs.max_model_len, block_size)
        except ConfigError as exc:
            exc.flag = "--max-num-batched-tokens"
            raise
        config = EngineConfig(
            model_config=model_config, parallel_config=parallel, scheduler_config=scheduler,
            cache_config=cache, seed=seed, device=self.device or default_device(),
            timeout_s=self.timeout_s if self.timeout_s is not None else envs.timeout_s(),
            dp_waves=needs_dp_waves(parallel, inputs.hf_config), lora_config=self.create_lora_config(),
        )
        from spmd_engine.platform import choose_dtype
        dtype, line = choose_dtype(model_config.dtype, inputs.hf_config, config.device)
        # INFO where the machine decided (a half-precision checkpoint under auto); otherwise the
        # choice is the checkpoint's or the user's own, and a bad-input error stays one line
        machine_chose = "checkpoint bfloat16" in line or "checkpoint float16" in line
        logger.log(logging.INFO if machine_chose else logging.DEBUG, "%s", line)
        config.compilation_config = resolve_compilation(self.enforce_eager, self.compilation_config,
                                                        model_config, spec, config.device, dtype)
        if check_kv_budget:
            check_kv_budget_up_front(config, inputs.hf_config, spec)
        return EngineSetup(config, inputs, spec)


@dataclass(frozen=True)
class EngineSetup:
    """A checked EngineConfig with what checking it read: the prompt processor (config.json,
    tokenizer, max_model_len) and the model's spec."""

    config: EngineConfig
    inputs: "InputProcessor"  # noqa: F821 (imported lazily: it reads tokenizers)
    spec: "ModelSpec"  # noqa: F821


def registration_for_workers(arch: str, parallel: ParallelConfig) -> tuple | None:
    """The user's ModelRegistry entry for `arch`, which the config carries to the workers.
    Processes the engine starts receive it pickled (by reference): a class they could not
    import is refused here, in one line, rather than as a worker's unpickling error."""
    import pickle

    from spmd_engine.model.registry import ModelRegistry
    if ModelRegistry.user_registration(arch) is not None:
        ModelRegistry.resolve_model_cls(arch)  # a "module:Class" that fails to import fails here
    registration = ModelRegistry.user_registration(arch)
    spawns = parallel.distributed_executor_backend == "mp" or parallel.spans_dp_world
    if registration is not None and spawns and not isinstance(registration[1], str):
        try:
            pickle.dumps(registration[1])
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            raise ConfigError(f"ModelRegistry: {registration[1].__qualname__} (registered for {arch!r}) cannot "
                              f"reach the worker processes ({exc}): define it at module level, or register "
                              f"it as 'module:Class'") from None
    return registration


def check_async_scheduling(scheduler: SchedulerConfig, parallel: ParallelConfig) -> None:
    """Async scheduling schedules a request's next step while its last one runs, which needs
    the sampled token on the rank that runs the next step's first layer: with PP that is
    another stage (and PP's batch queue already keeps its stages busy)."""
    if scheduler.async_scheduling and parallel.pipeline_parallel_size > 1:
        exc = ConfigError(f"async scheduling is not supported with pipeline parallelism (pipeline_parallel_size="
                          f"{parallel.pipeline_parallel_size}): PP keeps one step per stage in flight already")
        exc.flag = "--async-scheduling"
        raise exc


def resolve_compilation(enforce_eager: bool | None, compilation_config, model_config: ModelConfig, spec,
                        device: str, dtype=None) -> CompilationConfig:
    """The level the workers use: enforce_eager (or SPMD_ENGINE_ENFORCE_EAGER=1) means 0;
    otherwise the level asked for, by default 3 on CPU in bf16/fp16, where the fused
    elementwise work pays (docs/performance.md); fp32 on CPU decodes about as fast compiled as
    eager for a slower start, and CUDA is not measured (no CUDA graphs): those compile by
    request only. Batch-invariant mode and MoE models run
    eager, said in one log line."""
    from dataclasses import replace
    compilation = CompilationConfig.parse(compilation_config)
    if compilation.ignored:
        logger.warning("compilation_config: vLLM key(s) with no effect here, ignored: %s",
                       ", ".join(compilation.ignored))
    eager = envs.enforce_eager() if enforce_eager is None else bool(enforce_eager)
    asked = compilation.level
    if eager:
        level = 0
    elif asked is None:
        import torch
        half = dtype in (torch.bfloat16, torch.float16)
        level = 3 if device == "cpu" and half else 0
        if level == 0:
            why = "not measured there" if device != "cpu" else "float32 decode measured about as fast compiled"
            logger.info("compiled forward: off by default on %s (%s); compilation_config=3 turns it on",
                        device, why)
    else:
        level = asked
    if level and model_config.batch_invariant:
        (logger.warning if asked else logger.info)(
            "compiled forward: batch-invariant mode runs eager (its kernels fix every reduction "
            "order; a compiled graph would choose its own)")
        level = 0
    if level and spec.moe is not None:
        (logger.warning if asked else logger.info)(
            "compiled forward: %s has MoE layers, which run eager (data-dependent routing)", spec.architecture)
        level = 0
    return replace(compilation, level=level,
                   cudagraph_mode=_cudagraph_mode(compilation.cudagraph_mode, eager, device, model_config, spec))


def _cudagraph_mode(asked: str | None, eager: bool, device: str, model_config: ModelConfig, spec) -> str:
    """vLLM's rule: CUDA graphs unless enforce_eager (here decode steps only, worker/decode_graphs.py);
    none off CUDA, in batch-invariant mode (its kernels are not captured) or for MoE models
    (data-dependent routing)."""
    if asked == "NONE" or eager:
        return "NONE"
    if device != "cuda":
        if asked is not None:
            logger.info("compilation_config cudagraph_mode=%s: CUDA graphs are captured on CUDA only; off on %s",
                        asked, device)
        return "NONE"
    why = ("batch-invariant mode" if model_config.batch_invariant
           else f"{spec.architecture} has MoE layers" if spec.moe is not None else None)
    if why:
        (logger.warning if asked else logger.info)("CUDA graphs: off (%s)", why)
        return "NONE"
    return asked or "FULL_DECODE_ONLY"


def checked_max_logprobs(value: int, vocab_size: int) -> int:
    """vLLM's max_logprobs: -1 allows the whole vocabulary."""
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise ConfigError(f"max_logprobs must be an integer >= 0, or -1 (the vocabulary), got {value!r}")
    return vocab_size if value == -1 else value


def engine_seed(seed: int | None) -> int:
    """LLM(seed=...): None means 0, as in vLLM (V1), under every backend. Under
    external_launcher each rank samples for itself, so the ranks of a replica must agree on
    it: generate checks that they do (a trainer passing seed=rank would get different text)."""
    if seed is None:
        return 0
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed must be an integer, got seed={seed!r}")
    return seed


def check_routed_experts(model_config: ModelConfig, spec, source: str) -> None:
    """Routing replay on a dense model would return nothing a trainer could replay: refused
    up front rather than answered with None, which reads as "replayed" to a trainer."""
    if model_config.enable_return_routed_experts and spec.moe is None:
        raise ConfigError(f"enable_return_routed_experts=True needs a mixture-of-experts model; "
                          f"{spec.architecture} ({source}) has no MoE layers")


def default_device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_kv_budget_up_front(config: EngineConfig, hf_config, spec) -> None:
    """An explicit (or CPU default) KV budget too small for one sequence is a usage error,
    found before any process starts; workers check again with their device's numbers."""
    plan = front_end_kv_plan(config, hf_config, spec)
    if plan.budget_bytes is not None:
        from spmd_engine.core import kv_groups
        from spmd_engine.model.windows import kv_freeing_window
        sc = config.scheduler_config
        groups, windows = kv_groups.group_windows(spec.layer_windows, config.model_config), spec.layer_windows
        # A pool per KV group (core/kv_groups.py): the groups' shares of the fullest stage's bytes.
        blocks = kv_groups.num_blocks_for(plan.budget_bytes, plan.block_size, {
            w: plan.bytes_per_token * windows.count(w) // len(windows) for w in groups}, sc) if groups \
            else plan.num_blocks
        kv_sizing.check_fits(blocks, plan.block_size, sc.max_model_len, plan.bytes_per_token,
                             plan.budget_bytes, kv_freeing_window(spec.layer_windows, config.model_config), sc.max_num_batched_tokens)


def front_end_kv_plan(config: EngineConfig, hf_config, spec) -> kv_sizing.KVPlan:
    from spmd_engine.platform import resolve_dtype
    itemsize = resolve_dtype(config.model_config.dtype, hf_config, config.device).itemsize
    from spmd_engine.model.partition import pp_layer_range
    available, procs = kv_sizing.host_share(config.parallel_config)
    pp = config.parallel_config.pipeline_parallel_size
    layers = max(b - a for a, b in (pp_layer_range(spec.num_layers, r, pp, config.model_config.pp_partition)
                                    for r in range(pp)))
    return kv_sizing.plan_kv(config, spec, itemsize, available, procs, layers)


def check_batch_invariant(spec, parallel: ParallelConfig, source: str) -> None:
    """Batch-invariant mode cuts every row-parallel reduction into REDUCE_CHUNKS slices that TP
    ranks share evenly: TP must divide it, and so must each reduced width."""
    from spmd_engine.model.layers.batch_invariant import REDUCE_CHUNKS, chunks_per_rank
    tp = parallel.tensor_parallel_size
    try:
        chunks_per_rank(tp)
    except ValueError:
        raise ConfigError(f"batch-invariant mode supports tensor parallel sizes dividing {REDUCE_CHUNKS} "
                          f"(1, 2, 4, 8), got {tp}") from None
    widths = {"num_attention_heads x head_dim": spec.num_heads * spec.head_dim,
              "intermediate_size": spec.intermediate_size}
    if spec.mla is not None:  # o_proj reduces the heads' values
        widths = {"num_attention_heads x v_head_dim": spec.num_heads * spec.mla.v_head_dim,
                  "intermediate_size": spec.intermediate_size}
    if spec.moe is not None:
        widths["moe_intermediate_size"] = spec.moe.expert_intermediate_size
    for name, width in widths.items():
        if width % REDUCE_CHUNKS:
            raise ConfigError(f"batch-invariant mode needs {name} ({width}, {source}) divisible by "
                              f"{REDUCE_CHUNKS}")
