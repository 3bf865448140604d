"""The checkpoint's safetensors headers against the model's config, before any process starts.

Why: a tensor of the wrong shape or dtype used to surface only when every rank loaded its
shard (exit 1, one line per rank, after seconds to minutes of loading). The headers carry
each tensor's shape and dtype and cost a few KB to read, so the whole checkpoint is
checked up front against `hf_tensor_shapes(spec)`: one `error:` line naming the file and
the tensor, exit 2. Tensor data (NaN/Inf) is not read: see docs/long-jobs-and-failures.md.
"""

from __future__ import annotations

import os
from pathlib import Path

from spmd_engine.config import ConfigError
from spmd_engine.model.loader import INDEX_FILE, _open, checkpoint_files
from spmd_engine.model.spec import ModelSpec
from spmd_engine.model.weights import hf_tensor_shapes, is_skipped_name

# safetensors' names of the dtypes a weight_loader casts to the model dtype.
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def check_checkpoint(model_dir: str | os.PathLike, spec: ModelSpec) -> None:
    """Every file readable, every tensor the model needs present, each of its full shape and
    a float dtype; tensors the model does not use are left alone."""
    model_dir = Path(model_dir)
    files = checkpoint_files(model_dir)
    expected, seen = hf_tensor_shapes(spec), set()
    for file in sorted(set(files.values())):
        with _open(file) as handle:
            for name in handle.keys():
                if name in expected and not is_skipped_name(name) and files.get(name) == file:
                    _check_tensor(file, name, handle.get_slice(name), expected[name])
                    seen.add(name)
    if spec.tie_word_embeddings:
        expected.pop("lm_head.weight")
    missing = sorted(set(expected) - seen)
    if missing:
        where = model_dir / INDEX_FILE if (model_dir / INDEX_FILE).is_file() else model_dir
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConfigError(f"tensor {missing[0]}{more} not found in checkpoint {where}")


def _check_tensor(file: Path, name: str, header, shape: tuple[int, ...]) -> None:
    dtype, found = header.get_dtype(), tuple(header.get_shape())
    if dtype not in FLOAT_DTYPES:
        raise ConfigError(f"checkpoint file {file}: tensor {name} is {dtype}, not a float dtype "
                          f"({', '.join(FLOAT_DTYPES)})")
    if found != shape:
        raise ConfigError(f"checkpoint file {file}: tensor {name} has shape {list(found)}, "
                          f"config.json gives {list(shape)}")
