"""Load one rank's shard of a HF-format checkpoint (config.json + *.safetensors).

The model is given uninitialised storage for this rank's shard only and filled
tensor by tensor from lazily opened safetensors files: `get_slice` reads just
the rows or columns this rank owns, and tensors of other pipeline stages are
never touched. So a rank's peak memory while loading stays close to its own
shard, however large the checkpoint.
"""

from __future__ import annotations

import functools
import json
import os
import zlib
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors import SafetensorError, safe_open

from spmd_engine import envs
from spmd_engine.config import ConfigError
from spmd_engine.model.models.llama import CausalLM
from spmd_engine.model.partition import check_model_parallel
from spmd_engine.model.registry import ModelRegistry
from spmd_engine.model.spec import architecture_of
from spmd_engine.model.weights import WeightLoadError

BUNDLED_MODEL_DIR = Path(__file__).resolve().parent.parent / "bundled"
INDEX_FILE = "model.safetensors.index.json"
DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "half": torch.float16}


def read_hf_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    """config.json as a dict, or a ConfigError naming the file (and the line of bad JSON)."""
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        what = "is not a directory" if Path(model_dir).exists() else "does not exist"
        raise ConfigError(f"model directory {model_dir} {what}")
    if not path.is_file():
        raise ConfigError(f"{path} not found: a model directory needs a HF config.json")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: expected a JSON object at the top level")
    return config


def resolve_dtype(dtype: str | torch.dtype | None, hf_config: dict[str, Any],
                  device: str | torch.device) -> torch.dtype:
    """The dtype the engine runs in (choose_dtype's, without the reason)."""
    return choose_dtype(dtype, hf_config, device)[0]


def choose_dtype(dtype: str | torch.dtype | None, hf_config: dict[str, Any], device: str | torch.device,
                 environ: Mapping[str, str] = os.environ) -> tuple[torch.dtype, str]:
    """(dtype, the start-up line saying why). An explicit dtype wins. `auto` (or None) is the
    checkpoint's own dtype on accelerators; on CPU it is the checkpoint's half type only where
    the CPU runs it natively (cpu_native_half), else float32: emulated (AVX2) bf16 matmuls are
    slower than fp32's, and fp16 without AMX-FP16 no faster (docs/running.md, "On CPU")."""
    if isinstance(dtype, torch.dtype):
        return dtype, f"dtype {_name(dtype)} (explicit)"
    if dtype not in (None, "auto"):
        if dtype not in DTYPES:
            raise ConfigError(f"unsupported dtype {dtype!r} (choose from {', '.join(sorted(DTYPES))}, auto)")
        return DTYPES[dtype], f"dtype {_name(DTYPES[dtype])} (explicit)"
    named = hf_config.get("torch_dtype") or hf_config.get("dtype")
    configured = DTYPES.get(str(named or "float32").replace("torch.", ""), torch.float32)
    source = f"checkpoint {_name(configured)}" if named else "config.json names no dtype"
    kind = torch.device(device).type
    if kind != "cpu" or configured == torch.float32:
        chosen, why = configured, source if kind == "cpu" else f"{source}, on {kind}"
    else:
        native, reason = cpu_native_half(configured, environ)
        chosen, why = configured if native else torch.float32, f"{source}, {reason}"
    return chosen, f"dtype auto -> {_name(chosen)} ({why})"


# The instructions (cpuinfo's and /proc/cpuinfo's flag names) that run each half type natively.
NATIVE_HALF = {torch.bfloat16: {"avx512_bf16": "AVX512-BF16", "amx_bf16": "AMX-BF16"},
               torch.float16: {"amx_fp16": "AMX-FP16"}}


def cpu_native_half(dtype: torch.dtype, environ: Mapping[str, str] = os.environ) -> tuple[bool, str]:
    """Whether this CPU runs `dtype` (bf16 or fp16) natively, and why, for the log line:
    "CPU has AVX512-BF16, AMX-BF16", "CPU has no AVX512-BF16 or AMX-BF16: ...", or the override
    ("SPMD_ENGINE_CPU_BF16=0" or "=1"). Native means one of NATIVE_HALF's instructions and a
    torch with oneDNN (whose kernels use them)."""
    name, forced = (envs.CPU_BF16, envs.cpu_bf16(environ)) if dtype == torch.bfloat16 else \
        (envs.CPU_FP16, envs.cpu_fp16(environ))
    if forced is not None:
        return forced, f"{name}={int(forced)}"
    wanted = NATIVE_HALF[dtype]
    have = [label for flag, label in wanted.items() if flag in cpu_flags()]
    if have and torch.backends.mkldnn.is_available():
        return True, "CPU has " + ", ".join(have)
    if have:
        return False, "CPU has " + ", ".join(have) + ", but this torch has no oneDNN"
    return False, "CPU has no " + " or ".join(wanted.values()) + ": float32 is faster"


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """This CPU's instruction-set flags: torch's cpuinfo (torch.cpu.get_capabilities, any OS),
    else Linux's /proc/cpuinfo, else none."""
    get = getattr(torch.cpu, "get_capabilities", None)
    if get is not None:
        try:
            return frozenset(flag for flag, value in get().items() if value is True)
        except (RuntimeError, AttributeError):
            pass
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> file, from the index json (sharded) or the single file's header."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ConfigError(f"{index}: not a valid safetensors index ({exc})") from None
        return {name: model_dir / file for name, file in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors files in {model_dir}")
    mapping: dict[str, Path] = {}
    for file in files:
        with _open(file) as handle:
            mapping.update(dict.fromkeys(handle.keys(), file))
    return mapping


def _open(file: Path):
    if not file.is_file():
        raise ConfigError(f"checkpoint file {file} not found")
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise ConfigError(f"checkpoint file {file} is not a readable safetensors file: {exc}") from None


def load_model(model_dir: str | os.PathLike | None, tp_group, pp_group, dtype: str | torch.dtype | None = None,
               device: str | torch.device = "cpu", pp_partition: str | None = None,
               load_format: str = "auto", moe_group=None, expert_parallel: bool = False,
               dispatch_group=None, batch_invariant: bool = False, model_registration=None) -> CausalLM:
    """This rank's model (the class ModelRegistry gives config.json's architecture: CausalLM for
    the built-ins) with its shard of the weights (model_dir None: the bundled model).
    `load_format="dummy"` fills it with random weights (`dummy_weights`) and reads no tensor.
    MoE sharding (`moe_group`, `expert_parallel`, `dispatch_group`): see CausalLM.
    `model_registration`: the engine process's ModelRegistry entry for this model, when a
    user registered it (ModelConfig.model_registration), taken over here first."""
    model_dir = Path(model_dir) if model_dir is not None else BUNDLED_MODEL_DIR
    hf_config = read_hf_config(model_dir)
    ModelRegistry.adopt(model_registration)
    model_cls, _ = ModelRegistry.resolve_model_cls(architecture_of(hf_config, str(model_dir / "config.json")))
    ep_size = (moe_group or tp_group).world_size if expert_parallel else None
    check_model_parallel(hf_config, tp_group.world_size, pp_group.world_size, source=str(model_dir / "config.json"),
                         ep_size=ep_size)
    torch_dtype = resolve_dtype(dtype, hf_config, device)
    # Built straight on `device` with uninitialised storage of shard size (not via the meta
    # device: a first meta tensor imports torch's symbolic-shape machinery, a cost every rank pays).
    model = model_cls(hf_config, tp_group, pp_group, dtype=torch_dtype, device=device, pp_partition=pp_partition,
                      moe_group=moe_group, expert_parallel=expert_parallel, dispatch_group=dispatch_group,
                      batch_invariant=batch_invariant)
    if load_format == "dummy":
        model.load_weights(dummy_weights(model))
        return model
    load_checkpoint(model, model_dir)
    return model


# vLLM's dummy weights are uniform in a small range; this one has HF's initializer_range (0.02)
# as its standard deviation, with norms 1. vLLM's +-1e-3, norms included, puts the hidden
# states' mean square below RMSNorm's eps, so no layer normalises: unlike any trained network.
DUMMY_RANGE = 0.02 * 3 ** 0.5


def dummy_weights(model: CausalLM, seed: int = 0):
    """Random full HF tensors for the names `model` holds: norms 1, everything else uniform in
    +-DUMMY_RANGE, each drawn from a seed of its own name. So every rank of every layout holds
    slices of the same full tensors: TP=2 builds the model TP=1 does, synced before any update."""
    from spmd_engine.model.weights import hf_tensor_shapes
    shapes = hf_tensor_shapes(model.spec)
    for name in sorted(model._update_targets()):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        if "norm" in name:
            yield name, torch.ones(shapes[name])
        else:
            yield name, (torch.rand(shapes[name], generator=gen) * 2 - 1) * DUMMY_RANGE


def checkpoint_weights(model: CausalLM, model_dir: str | os.PathLike | None):
    """(HF name, full tensor) from the checkpoint on disk, only for the tensors `model` holds
    (another stage's layers are never read): for `reload_weights`."""
    model_dir = Path(model_dir) if model_dir is not None else BUNDLED_MODEL_DIR
    files = checkpoint_files(model_dir)
    for name in sorted(model._update_targets()):
        file = files.get(name)
        if file is None:
            if name == "lm_head.weight" and model.spec.tie_word_embeddings:
                continue
            raise ConfigError(f"tensor {name} not found in checkpoint {model_dir}")
        with _open(file) as handle:
            yield name, handle.get_tensor(name)


def load_checkpoint(model: CausalLM, model_dir: Path) -> None:
    """Fill a freshly built (unpacked) model from the checkpoint, each rank reading its slices."""
    files = checkpoint_files(model_dir)
    with ExitStack() as stack:
        # One file open at a time, reopened for every tensor: a safetensors handle maps
        # its whole file, and every page read through the mapping counts in this
        # process's RSS until the handle closes. Closing it after each tensor (every
        # weight_loader has copied its slice out by the next fetch) keeps the file
        # pages in RSS to one tensor's, instead of the whole checkpoint's.
        def fetch(name: str):
            file = files.get(name)
            if file is None:
                where = model_dir / INDEX_FILE if (model_dir / INDEX_FILE).is_file() else model_dir
                raise ConfigError(f"tensor {name} not found in checkpoint {where}")
            stack.close()
            handle = stack.enter_context(_open(file))
            try:
                return handle.get_slice(name)
            except (SafetensorError, KeyError) as exc:
                raise ConfigError(f"tensor {name} not readable from {file}: {exc}") from None

        try:
            model.load_weights(fetch)
        except WeightLoadError as exc:
            raise ConfigError(f"{exc} (in {files.get(exc.tensor_name)})") from None
        except SafetensorError as exc:
            raise ConfigError(f"checkpoint in {model_dir} is corrupt: {exc}") from None
