"""Load one rank's shard of a HF-format checkpoint (config.json + *.safetensors).

The model is given uninitialised storage for this rank's shard only and filled
tensor by tensor from lazily opened safetensors files: `get_slice` reads just
the rows or columns this rank owns, and tensors of other pipeline stages are
never touched. So a rank's peak memory while loading stays close to its own
shard, however large the checkpoint.
"""

from __future__ import annotations

import json
import os
import zlib
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from spmd_engine.config import ConfigError
from spmd_engine.model.models.llama import CausalLM
from spmd_engine.model.partition import check_model_parallel
from spmd_engine.model.registry import ModelRegistry
from spmd_engine.model.spec import architecture_of
from spmd_engine.model.weights import WeightLoadError
from spmd_engine.platform import resolve_dtype

BUNDLED_MODEL_DIR = Path(__file__).resolve().parent.parent / "bundled"
INDEX_FILE = "model.safetensors.index.json"


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
