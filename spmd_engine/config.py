"""Typed configuration and its validation.

This module sits at the bottom of the package: it imports nothing of ours, so
every layer above (topology, distributed, model, executors, engine) can depend
on it without cycles. Every rule a user can break is checked here, before any
process or collective exists, and the message names the bad value and the rule.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from spmd_engine import topology

BACKENDS = ("uni", "mp", "external_launcher")
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


class ConfigError(ValueError):
    """A user-facing configuration mistake: the CLIs turn it into exit code 2. `flag`, when
    set, names the command-line flag the bad value came from (the CLIs print it first)."""

    flag: str | None = None


def launched_by_torchrun(environ: Mapping[str, str]) -> bool:
    """True when a launcher (torchrun, or anything exporting its variables) started us."""
    return all(name in environ for name in TORCHRUN_VARS)


def launched_by_srun(environ: Mapping[str, str]) -> bool:
    """True in an srun task: SLURM_PROCID and the task count with SLURM_STEP_ID, which only srun
    exports (a command typed in an sbatch or salloc shell sees the allocation's variables too)."""
    return ("SLURM_PROCID" in environ and "SLURM_STEP_ID" in environ
            and ("SLURM_NTASKS" in environ or "SLURM_NPROCS" in environ))


def resolve_backend(
    requested: str | type | None,
    world_size: int,
    world_size_across_dp: int,
    environ: Mapping[str, str],
) -> str | type:
    """The backend string as vLLM's ParallelConfig.__post_init__ resolves it.

    An explicit value wins (a string from BACKENDS, or an Executor subclass: the
    subclass check itself lives in Executor.get_class, which config may not
    import). Under a torchrun or srun launch the default is external_launcher, since
    the launcher already made every process (the CLI resolves it alike). Otherwise
    "mp" as soon as more than one rank is in play across DP, and "uni" only when
    TP = PP = PCP = DP = 1.
    """
    if requested is not None:
        if isinstance(requested, type):
            return requested
        if requested not in BACKENDS:
            raise ConfigError(
                f"Unknown distributed executor backend: {requested!r} "
                f"(expected one of {', '.join(BACKENDS)} or an Executor subclass)"
            )
        return requested
    if launched_by_torchrun(environ) or launched_by_srun(environ):
        return "external_launcher"
    if world_size_across_dp > 1:
        return "mp"
    return "uni"


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")


# Each layout axis (topology's name) and the ParallelConfig field holding its size.
SIZE_FIELDS = {"tp": "tensor_parallel_size", "pp": "pipeline_parallel_size", "pcp": "prefill_context_parallel_size",
               "dcp": "decode_context_parallel_size", "dp": "data_parallel_size"}


@dataclass
class ParallelConfig:
    """How one model is cut up (TP, PP, PCP, DCP) and copied (DP).

    `world_size` is TP x PP x PCP: the processes of one DP replica, the count a
    MultiprocExecutor spawns. `world_size_across_dp` multiplies in DP. Neither
    counts external-DP replicas, which exist only in the launcher's world.
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    data_parallel_rank_local: int | None = None
    nnodes: int = 1
    enable_expert_parallel: bool = False
    distributed_executor_backend: str | type | None = None
    # Rendezvous of the one torch world across DP replicas (mp / uni with DP > 1): the store
    # the front end hosts, on a port the OS picked. 0 until the front end sets it.
    data_parallel_master_ip: str = "127.0.0.1"
    data_parallel_master_port: int = 0
    world_size: int = field(init=False)

    def __post_init__(self) -> None:
        self.validate()
        self.world_size = (
            self.tensor_parallel_size
            * self.pipeline_parallel_size
            * self.prefill_context_parallel_size
        )
        if self.data_parallel_rank_local is None:
            self.data_parallel_rank_local = self.data_parallel_rank
        self.distributed_executor_backend = resolve_backend(
            self.distributed_executor_backend,
            self.world_size,
            self.world_size_across_dp,
            os.environ,
        )
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ConfigError(
                f"distributed_executor_backend 'uni' runs one worker, but "
                f"TP x PP x PCP = {self.world_size}; use 'mp' or 'external_launcher'"
            )

    def validate(self) -> None:
        """The sizes by topology's one rule (check_sizes, under these field names), then what only
        a configuration can get wrong."""
        topology.check_sizes({axis: getattr(self, name) for axis, name in SIZE_FIELDS.items()},
                             SIZE_FIELDS, ConfigError)
        _check_positive("nnodes", self.nnodes)
        if self.prefill_context_parallel_size > 1 and self.data_parallel_size > 1:
            raise ConfigError(
                f"prefill_context_parallel_size ({self.prefill_context_parallel_size}) > 1 "
                f"cannot be combined with data_parallel_size ({self.data_parallel_size}) > 1"
            )
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ConfigError(
                f"data_parallel_rank ({self.data_parallel_rank}) must be in "
                f"[0, data_parallel_size={self.data_parallel_size})"
            )

    @property
    def layout(self):
        """The rank grid of these sizes (topology.Layout), without external DP."""
        return topology.Layout.of(self)

    @property
    def world_size_across_dp(self) -> int:
        """Process world size across TP, PCP, PP and DP."""
        return self.world_size * self.data_parallel_size

    @property
    def spans_dp_world(self) -> bool:
        """Engine-spawned workers of every DP replica share one torch world (vLLM's layout):
        mp or uni with DP > 1. Under a launcher the launched world already holds them."""
        return self.data_parallel_size > 1 and self.distributed_executor_backend != "external_launcher"

    @property
    def local_world_size(self) -> int:
        """Workers of one replica on one node (a replica may span nodes)."""
        return max(1, self.world_size // self.nnodes)

    @property
    def output_rank(self) -> int:
        """First TP worker of the last PP stage, as a rank within the replica."""
        return self.world_size - self.tensor_parallel_size * self.prefill_context_parallel_size


@dataclass
class ModelConfig:
    """Which checkpoint, in which dtype. `model=None` means the bundled model."""

    model: str | None = None
    dtype: str | None = None  # None or "auto": platform.choose_dtype (config.json's on GPU; on CPU
    # its bf16/fp16 where the CPU runs that natively, else float32)
    pp_partition: str | None = None  # e.g. "3,3,2"; else SPMD_ENGINE_PP_PARTITION or vLLM's split
    load_format: str = "auto"  # "dummy": random weights, the checkpoint's tensors are never read
    logprobs_mode: str = "raw_logprobs"  # vLLM's four: what logprobs and prompt_logprobs hold
    # MoE routing replay: every computed position's experts come back on CompletionOutput.routed_experts
    enable_return_routed_experts: bool = False
    # Bitwise reproducible outputs: every layer, attention and logprob through batch_invariant.py
    batch_invariant: bool = False
    # (architecture, class or "module:Class") when the model's architecture was registered with
    # ModelRegistry in this process: spawned workers and DP engine processes register it too.
    model_registration: tuple | None = None
    # The longest sequence (prompt and output), set from the checkpoint and LLM(max_model_len=...)
    # when the engine is configured (vLLM's model_config.max_model_len: lm-eval reads it).
    max_model_len: int | None = None

    @property
    def model_dir(self) -> str:
        """The checkpoint directory; the bundled model ships inside the package."""
        if self.model is not None:
            return self.model
        return os.path.join(os.path.dirname(os.path.abspath(__file__)), "bundled")

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(f"load_format {self.load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ConfigError(f"logprobs_mode {self.logprobs_mode!r} is not one of {', '.join(LOGPROBS_MODES)}")
        if not isinstance(self.enable_return_routed_experts, bool):
            raise ConfigError(f"enable_return_routed_experts must be True or False, "
                              f"got {self.enable_return_routed_experts!r}")


DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


DEFAULT_MAX_NUM_SEQS = 256
# Token budget of one step with chunked prefill (vLLM's offline default); without it a step must
# hold a whole prompt, so the budget is max(max_model_len, 2048) as in vLLM.
DEFAULT_CHUNKED_BATCHED_TOKENS = 8192
UNCHUNKED_MIN_BATCHED_TOKENS = 2048


@dataclass
class SchedulerConfig:
    """How many requests and tokens one engine step may take.

    `max_num_batched_tokens` is the token budget of a step, shared by decodes and
    prompt chunks; None picks vLLM's default once max_model_len is known
    (`resolve`). Without chunked prefill a prompt enters whole, so the budget
    must hold the longest one (max_model_len).
    """

    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_model_len: int | None = None  # None: the model's max_position_embeddings, capped at 4096
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    # vLLM's async_scheduling: step k+1 is scheduled and sent while step k runs (core/scheduler.py)
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        _check_positive("max_num_seqs", self.max_num_seqs)
        if self.max_model_len is not None:
            _check_positive("max_model_len", self.max_model_len)
        if self.max_num_batched_tokens is not None:
            _check_positive("max_num_batched_tokens", self.max_num_batched_tokens)

    def resolve(self, max_model_len: int, block_size: int) -> "SchedulerConfig":
        """Fill in max_model_len and the token budget, then check them together."""
        self.max_model_len = max_model_len
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = (DEFAULT_CHUNKED_BATCHED_TOKENS if self.enable_chunked_prefill
                                           else max(max_model_len, UNCHUNKED_MIN_BATCHED_TOKENS))
        budget = self.max_num_batched_tokens
        if budget < block_size:
            raise ConfigError(f"max_num_batched_tokens ({budget}) must be >= block_size ({block_size})")
        if not self.enable_chunked_prefill and budget < max_model_len:
            raise ConfigError(
                f"max_num_batched_tokens ({budget}) is smaller than max_model_len ({max_model_len}): "
                f"without chunked prefill a prompt must fit one step; raise --max-num-batched-tokens, "
                f"lower --max-model-len or use --enable-chunked-prefill"
            )
        return self


@dataclass
class CacheConfig:
    """The paged KV cache: block size, how much memory it gets, prefix caching.

    The budget per rank is `kv_cache_memory_bytes` when given; otherwise on CUDA
    `gpu_memory_utilization` of the device's memory minus what the process
    already holds (weights) and an activation reserve, and on CPU
    min(4 GiB, 40% of available host memory / processes on the host).
    """

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    # vLLM's names for the block counts the workers agreed on, filled in by the engine once its
    # KV cache exists: num_gpu_blocks is the device's (the CPU's when it runs on CPU),
    # num_cpu_blocks the swap space's (none: preemption recomputes).
    num_gpu_blocks: int | None = None
    num_cpu_blocks: int | None = None

    def __post_init__(self) -> None:
        b = self.block_size
        if isinstance(b, bool) or not isinstance(b, int) or b < 1 or b & (b - 1):
            raise ConfigError(f"block_size must be a power of two >= 1, got {b!r}")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {u!r}")
        if self.kv_cache_memory_bytes is not None:
            _check_positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes)


# vLLM's CompilationConfig keys that mean nothing here (its own passes, CUDA-graph details): accepted,
# named in one warning. Any other key is an error (a typo is never swallowed).
VLLM_COMPILATION_KEYS_IGNORED = frozenset("""
    full_cuda_graph cudagraph_num_of_warmups cudagraph_copy_inputs cudagraph_specialize_lora
    max_capture_size max_cudagraph_capture_size
    splitting_ops use_inductor compile_sizes compile_ranges_split_points inductor_compile_config
    inductor_passes custom_ops pass_config debug_dump_path use_inductor_graph_partition
    compile_cache_save_format local_cache_dir dynamic_shapes_config
""".split())
COMPILATION_BACKENDS = ("inductor", "aot_eager", "eager")
# vLLM's cudagraph_mode values. Every mode but NONE captures decode steps only here
# (worker/decode_graphs.py): the other steps' shapes vary and run without a graph.
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")


@dataclass
class CompilationConfig:
    """vLLM's `compilation_config`, the part that means something here (compilation/compiled_layers.py).

    `level` (vLLM's name; its newer `mode` is the same number): 0 runs the model eager; 1, 2
    and 3 (vLLM's stock torch.compile, dynamo-once and its own backend) all mean the decoder
    layers through torch.compile, one or two graphs per model. None: 3, unless enforce_eager.
    Resolved by EngineArgs (batch-invariant mode and MoE models run eager). `min_tokens` (ours):
    steps with fewer tokens run eager, where the compiled graph's fixed cost exceeds its gain.
    `layers_per_graph` (ours): decoder layers per graph call; more is faster per step (fewer
    graph entries) and slower to trace at start-up. `cache_dir` (vLLM's name): inductor's
    on-disk cache, TORCHINDUCTOR_CACHE_DIR when unset. `cudagraph_mode` and
    `cudagraph_capture_sizes` (vLLM's names): CUDA graphs of decode steps on CUDA unless
    enforce_eager (worker/decode_graphs.py); `use_cudagraph: false` (vLLM's older switch) is mode
    NONE.
    """

    level: int | None = None
    backend: str = "inductor"  # torch.compile's backend; "aot_eager" / "eager" to debug a graph
    min_tokens: int = 1
    layers_per_graph: int = 8
    cache_dir: str | None = None
    cudagraph_mode: str | None = None  # None: FULL_DECODE_ONLY where graphs apply (CUDA, not eager)
    cudagraph_capture_sizes: tuple[int, ...] | None = None  # None: vLLM's 1, 2, 4, 8, 16, ... to max_num_seqs
    ignored: tuple = ()  # vLLM keys given that have no effect here

    def __post_init__(self) -> None:
        if self.level is not None and (isinstance(self.level, bool) or self.level not in (0, 1, 2, 3)):
            raise ConfigError(f"compilation_config level/mode must be 0, 1, 2 or 3, got {self.level!r}")
        if self.backend not in COMPILATION_BACKENDS:
            raise ConfigError(f"compilation_config backend {self.backend!r} is not one of "
                              f"{', '.join(COMPILATION_BACKENDS)}")
        _check_positive("compilation_config min_tokens", self.min_tokens)
        _check_positive("compilation_config layers_per_graph", self.layers_per_graph)
        if self.cudagraph_mode is not None:
            mode = str(self.cudagraph_mode).upper().removeprefix("CUDAGRAPHMODE.")
            if mode not in CUDAGRAPH_MODES:
                raise ConfigError(f"compilation_config cudagraph_mode must be one of {', '.join(CUDAGRAPH_MODES)}, "
                                  f"got {self.cudagraph_mode!r}")
            self.cudagraph_mode = mode
        if self.cudagraph_capture_sizes is not None:
            sizes = self.cudagraph_capture_sizes
            if isinstance(sizes, (str, bytes)) or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0
                                                          for n in sizes) or not sizes:
                raise ConfigError(f"compilation_config cudagraph_capture_sizes must be a list of positive "
                                  f"integers, got {sizes!r}")
            self.cudagraph_capture_sizes = tuple(sorted(set(sizes)))

    @property
    def compiled(self) -> bool:
        return bool(self.level)

    @classmethod
    def parse(cls, value: Any) -> "CompilationConfig":
        """vLLM's forms: None, a level (int, or its text "3"), a dict, JSON text of one, or a
        CompilationConfig. A dict may say `level` or `mode`."""
        import json
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            text = value.strip()
            try:
                value = int(text) if text.lstrip("-").isdigit() else json.loads(text)
            except ValueError:
                raise ConfigError(f"compilation_config {text!r} is neither a level nor JSON") from None
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(level=value)
        if not isinstance(value, Mapping):
            raise ConfigError(f"compilation_config must be a level (0-3), a dict or JSON, got {value!r}")
        values = dict(value)
        if "mode" in values and "level" in values and values["mode"] != values["level"]:
            raise ConfigError(f"compilation_config gives level={values['level']!r} and mode={values['mode']!r}")
        if "mode" in values:
            values["level"] = values.pop("mode")
        if values.get("use_cudagraph") is False and values.get("cudagraph_mode") is None:
            values["cudagraph_mode"] = "NONE"  # vLLM's older switch
        values.pop("use_cudagraph", None)
        ours = {"level", "backend", "min_tokens", "layers_per_graph", "cache_dir", "cudagraph_mode",
                "cudagraph_capture_sizes"}
        unknown = sorted(k for k in values if k not in ours and k not in VLLM_COMPILATION_KEYS_IGNORED)
        if unknown:
            raise ConfigError(f"compilation_config: unknown key(s) {', '.join(map(repr, unknown))} "
                              f"(known here: {', '.join(sorted(ours | {'mode', 'use_cudagraph'}))}, and vLLM's "
                              f"pass keys, which are ignored)")
        ignored = tuple(sorted(k for k in values if k in VLLM_COMPILATION_KEYS_IGNORED))
        return cls(**{k: v for k, v in values.items() if k in ours}, ignored=ignored)


MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's MaxLoRARanks
LORA_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class LoRAConfig:
    """LoRA adapters (vLLM's LoRAConfig names and defaults): `max_loras` adapters may serve one
    step (each holds a slot of the model's adapter weights), `max_cpu_loras` stay loaded on the
    host (least recently used evicted beyond), none of rank above `max_lora_rank`."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras
    lora_dtype: str = "auto"  # "auto": the model's dtype

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_lora_rank not in MAX_LORA_RANKS:
            raise ConfigError(f"max_lora_rank {self.max_lora_rank} is not one of vLLM's "
                              f"{', '.join(map(str, MAX_LORA_RANKS))}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        elif isinstance(self.max_cpu_loras, bool) or not isinstance(self.max_cpu_loras, int):
            raise ConfigError(f"max_cpu_loras must be an integer or None, got {self.max_cpu_loras!r}")
        elif self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}).")
        if self.lora_dtype is None:
            self.lora_dtype = "auto"
        if str(self.lora_dtype).removeprefix("torch.") not in LORA_DTYPES:
            raise ConfigError(f"lora_dtype {self.lora_dtype!r} is not one of {', '.join(LORA_DTYPES)}")
        self.lora_dtype = str(self.lora_dtype).removeprefix("torch.")


@dataclass
class EngineConfig:
    """Everything one engine (one DP replica) needs; pickled to its workers under mp."""

    model_config: ModelConfig
    parallel_config: ParallelConfig
    scheduler_config: SchedulerConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    seed: int = 0
    device: str = "cpu"  # "cuda" when GPUs are present
    timeout_s: float = 300.0
    dp_waves: bool = False  # replicas step in lockstep (MoE under DP): engine/dp_waves.py
    # Resolved by EngineArgs: level 0 (eager) here, so a config built by hand runs eager.
    compilation_config: CompilationConfig = field(default_factory=lambda: CompilationConfig(level=0))
    lora_config: LoRAConfig | None = None  # LLM(enable_lora=True): adapters (model/lora/)
