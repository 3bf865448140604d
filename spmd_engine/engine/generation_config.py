"""The checkpoint's own sampling defaults, as vLLM reads them (`generation_config="auto"`).

A model card's `generation_config.json` often asks for a temperature or top_p of its
own; vLLM applies those to `generate`/`chat` calls that pass no SamplingParams, and
returns them from `get_default_sampling_params()`. vLLM takes the values that differ
from Hugging Face's GenerationConfig defaults (`to_diff_dict()`); under transformers 5,
which vLLM 0.34 requires, every sampling default is None, so every value the file sets
counts, `"top_k": 50` included.
"""

from __future__ import annotations

import json
import logging
import os

from spmd_engine.config import ConfigError

logger = logging.getLogger("spmd_engine")

# The sampling fields vLLM takes from a generation config.
SAMPLING_FIELDS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k",
                   "top_p", "min_p", "max_new_tokens", "skip_special_tokens")


def read_generation_config(model_dir: str, source: str = "auto") -> dict:
    """The generation config's fields: "auto" the model directory's file, "vllm" none (vLLM's
    neutral defaults), any other string a directory holding a generation_config.json."""
    if not isinstance(source, str):
        raise ConfigError(f"generation_config must be 'auto', 'vllm' or a directory, got {source!r}")
    if source == "vllm":
        return {}
    folder = model_dir if source == "auto" else source
    if source != "auto" and not os.path.isdir(folder):
        raise ConfigError(f"generation_config={source!r}: no such directory")
    path = os.path.join(folder, "generation_config.json")
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return config


def default_sampling_kwargs(model_dir: str, source: str = "auto", override: dict | None = None) -> dict:
    """SamplingParams keyword arguments the model asks for (vLLM's get_diff_sampling_param):
    the file's sampling values, then `override` (override_generation_config) on top."""
    config = {k: v for k, v in read_generation_config(model_dir, source).items()
              if k in SAMPLING_FIELDS and v is not None}
    if override is not None:
        if not isinstance(override, dict):
            raise ConfigError(f"override_generation_config must be a dict, got {override!r}")
        config.update({k: v for k, v in override.items() if k in SAMPLING_FIELDS and v is not None})
    if "max_new_tokens" in config:
        config["max_tokens"] = config.pop("max_new_tokens")
    if config and source != "vllm":
        logger.info("default sampling parameters from the model's generation config: %s "
                    "(generation_config='vllm' turns them off)", config)
    return config
