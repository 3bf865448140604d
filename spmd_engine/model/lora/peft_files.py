"""An adapter as PEFT writes it: its config, and its A and B tensors named after the base model.

PEFT saves `adapter_config.json` (r, lora_alpha, use_rslora, target_modules, ...) and
`adapter_model.safetensors` with tensors such as
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` ([r, in]) and `...lora_B.weight`
([out, r]); a trainer may hand the same two things over in memory (verl). Everything that
would change results and is not implemented here (DoRA, modules_to_save, a bias, per-module
ranks) is refused by name rather than silently served as a plain LoRA. Tensors stay unread
(safetensors slices) until a rank takes its shard of them.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

from spmd_engine.model.shard import Loaded, loaded_shape
from spmd_engine.model.spec import ModelSpec

# The base model's linear layers an adapter may target: attention and the dense MLP.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = ATTENTION_MODULES + MLP_MODULES

_NAME = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.weight)?$")


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served: one line naming the adapter and the reason."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"LoRA adapter {name!r}: {reason}")
        self.adapter_name = name


@dataclass
class AdapterFile:
    """One adapter, checked against the base model: `tensors[(layer, module)] = (A, B)`, full
    (unsharded) tensors or lazy safetensors slices; `scaling` multiplies B A x."""

    name: str
    rank: int
    scaling: float
    tensors: dict[tuple[int, str], tuple[Loaded, Loaded]]

    def num_parameters(self) -> int:
        total = 0
        for a, b in self.tensors.values():
            sa, sb = loaded_shape(a), loaded_shape(b)
            total += sa[0] * sa[1] + sb[0] * sb[1]
        return total


def read_adapter(name: str, path: str | None, in_memory: tuple[dict, dict] | None, spec: ModelSpec,
                 max_lora_rank: int) -> AdapterFile:
    """The adapter of a LoRARequest: `in_memory` (peft_config, tensors) when it carries one, else
    the PEFT directory `path`."""
    if in_memory is not None:
        config, tensors = in_memory
        return check_adapter(name, config, dict(tensors), spec, max_lora_rank)
    if not path or not os.path.isdir(path):
        raise LoRAAdapterError(name, f"no adapter directory at {path!r}")
    config_path = os.path.join(path, "adapter_config.json")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise LoRAAdapterError(name, f"{config_path} is missing") from None
    except (OSError, ValueError) as exc:
        raise LoRAAdapterError(name, f"{config_path} is not readable JSON ({exc})") from None
    weights = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(weights):
        if os.path.isfile(os.path.join(path, "adapter_model.bin")):
            raise LoRAAdapterError(name, "only adapter_model.safetensors is read (adapter_model.bin is a pickle: "
                                         "save the adapter with safe_serialization=True)")
        raise LoRAAdapterError(name, f"{weights} is missing")
    from safetensors import safe_open
    try:
        handle = safe_open(weights, framework="pt")
        tensors = {key: handle.get_slice(key) for key in handle.keys()}
    except Exception as exc:  # a truncated or foreign file
        raise LoRAAdapterError(name, f"{weights} is not a readable safetensors file ({exc})") from None
    return check_adapter(name, config, tensors, spec, max_lora_rank)


def check_adapter(name: str, config: dict, tensors: dict[str, Any], spec: ModelSpec,
                  max_lora_rank: int) -> AdapterFile:
    if not isinstance(config, dict):
        raise LoRAAdapterError(name, f"its config must be a dict (adapter_config.json), got {type(config).__name__}")
    _check_features(name, config)
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoRAAdapterError(name, f"LoRA rank `r` must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise LoRAAdapterError(name, f"LoRA rank {rank} is greater than max_lora_rank {max_lora_rank}.")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise LoRAAdapterError(name, f"lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    parts = _group_tensors(name, tensors, spec)
    shapes = base_shapes(spec)
    checked = {}
    for (layer, module), pair in sorted(parts.items()):
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise LoRAAdapterError(name, f"layer {layer} {module} has no {missing} tensor")
        out_features, in_features = shapes[module]
        a, b = pair["A"], pair["B"]
        for which, got, want in (("lora_A", loaded_shape(a), (rank, in_features)),
                                 ("lora_B", loaded_shape(b), (out_features, rank))):
            if tuple(got) != want:
                raise LoRAAdapterError(name, f"layer {layer} {module}.{which} has shape {list(got)}, this base "
                                             f"model needs {list(want)} (an adapter of another model, or r != {rank})")
        checked[(layer, module)] = (a, b)
    if not checked:
        raise LoRAAdapterError(name, "it holds no LoRA tensors")
    return AdapterFile(name, rank, float(scaling), checked)


def _check_features(name: str, config: dict) -> None:
    """What PEFT can save that a plain LoRA forward would serve wrongly."""
    peft_type = config.get("peft_type") or "LORA"
    peft_type = str(getattr(peft_type, "value", peft_type)).upper()  # PEFT's enum in a to_dict() / asdict()
    if peft_type != "LORA":
        raise LoRAAdapterError(name, f"peft_type {peft_type} is not LoRA")
    refused = []
    if config.get("use_dora"):
        refused.append("DoRA (use_dora)")
    if config.get("modules_to_save"):
        refused.append(f"modules_to_save {config['modules_to_save']}")
    if config.get("bias", "none") != "none":
        refused.append(f"bias={config['bias']!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            refused.append(f"per-module ranks or alphas ({key})")
    for key in ("layers_to_transform", "layer_replication", "alora_invocation_tokens"):
        if config.get(key):
            refused.append(key)
    if config.get("fan_in_fan_out"):
        refused.append("fan_in_fan_out")
    if config.get("target_parameters"):
        refused.append("target_parameters (expert LoRA)")
    if refused:
        raise LoRAAdapterError(name, f"{', '.join(refused)} not supported")


def _group_tensors(name: str, tensors: dict[str, Any], spec: ModelSpec) -> dict[tuple[int, str], dict]:
    parts: dict[tuple[int, str], dict] = {}
    for key, value in tensors.items():
        match = _NAME.match(key)
        if match is None:
            raise LoRAAdapterError(name, f"unknown target module in tensor {key!r} (LoRA applies to "
                                         f"{', '.join(TARGET_MODULES)} of the decoder layers)")
        layer, block, module, which = int(match[1]), match[2], match[3], match[4]
        if layer >= spec.num_layers:
            raise LoRAAdapterError(name, f"tensor {key!r} is for layer {layer}; the base model has {spec.num_layers}")
        if block == "mlp" and spec.is_moe_layer(layer):
            raise LoRAAdapterError(name, f"tensor {key!r}: LoRA on a mixture-of-experts block is not supported "
                                         f"(attention LoRA is)")
        expected = ATTENTION_MODULES if block == "self_attn" else MLP_MODULES
        if module not in expected:
            raise LoRAAdapterError(name, f"unknown target module {block}.{module} in tensor {key!r}")
        parts.setdefault((layer, module), {})[which] = value
    return parts


def base_shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each target module, the whole (unsharded) layer."""
    h, q, kv, inter = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, \
        spec.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}
