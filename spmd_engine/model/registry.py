"""ModelRegistry: the one map from a config.json architecture name to the class that runs it.

vLLM's `ModelRegistry.register_model(arch, cls)` is how trainers and plugins bring their own
model class; code written for vLLM calls it unchanged (`from spmd_engine import ModelRegistry`).
The built-in architectures are registered here too, lazily ("module:Class"): this is the one
place an architecture name meets a class.

A registered class is built and driven exactly as the built-in CausalLM: it must take
CausalLM's constructor arguments and provide MODEL_INTERFACE (in practice: subclass
`spmd_engine.model.models.llama.CausalLM` and override what differs). A class registered under
a new architecture name has its config.json read as `hf_config_architecture` says (a built-in
name; default LlamaForCausalLM), which decides biases, q/k norms and MoE keys.

Registrations live in the process that made them. The engine carries the one its model uses
to mp workers and DP engine processes (ModelConfig.model_registration), so the class must be
importable there: defined at module level, or given as "module:Class".
"""

from __future__ import annotations

import importlib
import inspect
import logging
from typing import Any, Iterable

from spmd_engine.config import ConfigError

logger = logging.getLogger("spmd_engine")

_LLAMA = "spmd_engine.model.models.llama:CausalLM"
BUILTIN_MODELS = {arch: _LLAMA for arch in (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")}
BUILTIN_MODELS["Gemma3ForCausalLM"] = "spmd_engine.model.models.gemma3:Gemma3ForCausalLM"
BUILTIN_MODELS["GptOssForCausalLM"] = _LLAMA  # its options and names: model/models/gpt_oss.py
BUILTIN_MODELS.update({arch: "spmd_engine.model.models.deepseek:DeepseekForCausalLM"
                       for arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")})
BUILTIN_MODELS.update({"Phi3ForCausalLM": "spmd_engine.model.models.phi3:Phi3ForCausalLM",
                       "Olmo2ForCausalLM": "spmd_engine.model.models.olmo2:Olmo2ForCausalLM"})
DEFAULT_CONFIG_ARCHITECTURE = "LlamaForCausalLM"

# What the worker, model runner and loader call on a model (besides nn.Module's own, and the
# `spec` (ModelSpec) its constructor sets).
MODEL_INTERFACE = (
    "forward", "compute_logits", "greedy_tokens", "kv_bytes_per_token", "check_max_model_len",
    "allocate_kv_cache", "bind_kv_cache", "_attention_layers", "load_weights", "update_weights",
    "_update_targets", "begin_update", "end_update", "mark_weights_mixed", "unwritten_weights",
    "discard_weights", "allocate_discarded_weights", "move_weights", "record_routing", "compile_layers",
)
# The constructor call the loader makes (load_model).
CONSTRUCTOR_KWARGS = ("dtype", "device", "pp_partition", "moe_group", "expert_parallel", "dispatch_group",
                      "batch_invariant")


def check_model_class(model_cls: Any, arch: str) -> None:
    """One-line ConfigError naming what a class registered for `arch` lacks."""
    from torch import nn
    name = getattr(model_cls, "__qualname__", repr(model_cls))
    if not (isinstance(model_cls, type) and issubclass(model_cls, nn.Module)):
        raise TypeError(f"ModelRegistry: the class registered for {arch!r} must be a torch.nn.Module "
                        f"class or a 'module:Class' string, not {type(model_cls).__name__}")
    missing = [attr for attr in MODEL_INTERFACE if not hasattr(model_cls, attr)]
    try:
        if model_cls.__init__ is nn.Module.__init__:  # takes (*args, **kwargs), then refuses them
            raise TypeError
        inspect.signature(model_cls).bind(None, None, None, **dict.fromkeys(CONSTRUCTOR_KWARGS))
    except TypeError:
        missing.insert(0, "__init__(hf_config, tp_group, pp_group, " + ", ".join(f"{k}=" for k in CONSTRUCTOR_KWARGS)
                       + ")")
    except ValueError:  # no signature to read (a C type): let the call say
        pass
    if missing:
        raise ConfigError(f"ModelRegistry: {name} (registered for {arch!r}) lacks {', '.join(missing)}: a model "
                          f"class must provide CausalLM's interface (subclass "
                          f"spmd_engine.model.models.llama.CausalLM)")


class _ModelRegistry:
    """vLLM's registry surface: register_model, get_supported_archs, resolve_model_cls,
    is_text_generation_model."""

    def __init__(self, models: dict[str, Any]):
        self.models: dict[str, Any] = dict(models)  # arch -> class, or "module:Class" until imported
        self._user: set[str] = set()  # archs registered (or overridden) by register_model

    def register_model(self, model_arch: str, model_cls: type | str) -> None:
        """vLLM's: a torch.nn.Module class, or "module:Class" imported when first built."""
        if not isinstance(model_arch, str):
            raise TypeError(f"`model_arch` should be a string, not a {type(model_arch)}")
        if isinstance(model_cls, str):
            if len(model_cls.split(":")) != 2:
                raise ValueError("Expected a string in the format `<module>:<class>`")
        else:
            check_model_class(model_cls, model_arch)
        if model_arch in self.models and self.models[model_arch] is not model_cls:
            logger.debug("Model architecture %s is already registered, and will be overwritten by the new "
                         "model class %s.", model_arch, model_cls)
        self.models[model_arch] = model_cls
        self._user.add(model_arch)

    def get_supported_archs(self):
        return self.models.keys()

    def __contains__(self, arch: str) -> bool:
        return arch in self.models

    def supported_architecture(self, architectures: str | Iterable[str]) -> str | None:
        """The first of `architectures` registered here (vLLM tries them in order)."""
        archs = [architectures] if isinstance(architectures, str) else list(architectures or ())
        return next((a for a in archs if isinstance(a, str) and a in self.models), None)

    def resolve_model_cls(self, architectures: str | Iterable[str], model_config: Any = None) -> tuple[type, str]:
        """(class, architecture) for the first registered of `architectures`; "module:Class"
        entries are imported (and checked) now."""
        arch = self.supported_architecture(architectures)
        if arch is None:
            asked = [architectures] if isinstance(architectures, str) else list(architectures or ())
            raise ConfigError(f"Model architectures {asked} are not supported for now. "
                              f"Supported architectures: {', '.join(self.models)}")
        entry = self.models[arch]
        if isinstance(entry, str):
            module, _, name = entry.partition(":")
            try:
                entry = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError) as exc:
                raise ConfigError(f"ModelRegistry: cannot import {self.models[arch]!r} registered for "
                                  f"{arch!r}: {exc}") from None
            check_model_class(entry, arch)
            self.models[arch] = entry
        return entry, arch

    def is_text_generation_model(self, architectures: str | Iterable[str], model_config: Any = None) -> bool:
        """Every class this engine runs generates text: True for any registered architecture."""
        return self.supported_architecture(architectures) is not None

    def config_architecture(self, arch: str) -> str:
        """Whose config.json reading `arch` follows: a built-in name its own, another the class's
        `hf_config_architecture` (default LlamaForCausalLM)."""
        if arch in BUILTIN_MODELS:
            return arch
        model_cls, _ = self.resolve_model_cls(arch)
        family = getattr(model_cls, "hf_config_architecture", None) or DEFAULT_CONFIG_ARCHITECTURE
        if family not in BUILTIN_MODELS:
            raise ConfigError(f"ModelRegistry: {model_cls.__qualname__}.hf_config_architecture {family!r} is not "
                              f"a built-in architecture ({', '.join(BUILTIN_MODELS)})")
        return family

    def user_registration(self, arch: str) -> tuple[str, Any] | None:
        """(arch, class or "module:Class") where a user registered `arch`; None for a built-in."""
        return (arch, self.models[arch]) if arch in self._user else None

    def adopt(self, registration: tuple[str, Any] | None) -> None:
        """Take over a registration made in the engine's process (a spawned worker's start)."""
        if registration is not None and self.models.get(registration[0]) is not registration[1]:
            self.register_model(*registration)


ModelRegistry = _ModelRegistry(BUILTIN_MODELS)
