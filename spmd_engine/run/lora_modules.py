"""`--lora-modules`: the LoRA adapters a run serves, by name (vLLM's serve and run-batch flag).

Each entry is `name=path` or vLLM's JSON form `{"name": ..., "path": ...}`; names get the ids
1, 2, ... in the order given (vLLM's counter), so every rank of a launch, each reading the same
flags, builds the same LoRARequests. Input lines choose an adapter by name; everything a run
can find wrong here (a malformed entry, a duplicate name, the flag without --enable-lora, a
name no entry gives, an adapter directory the model cannot take) is a ConfigError, one line,
found before any process starts.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field

from spmd_engine.config import LORA_DTYPES, MAX_LORA_RANKS, ConfigError
from spmd_engine.lora_request import LoRARequest

FLAG = "--lora-modules"
JSON_FIELDS = ("name", "path", "base_model_name", "is_3d_lora_weight")


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's LoRA flags (EngineArgs reads the first five by name; --lora-modules is run's)."""
    group = parser.add_argument_group("LoRA adapters (docs/lora.md)")
    group.add_argument("--enable-lora", action=argparse.BooleanOptionalAction, default=None)  # vLLM's: None is off
    group.add_argument("--max-loras", type=int, default=1, metavar="N",
                       help="adapters one step may serve")
    group.add_argument("--max-lora-rank", type=int, default=16, choices=MAX_LORA_RANKS, metavar="R",
                       help=f"the highest adapter rank ({', '.join(map(str, MAX_LORA_RANKS))})")
    group.add_argument("--max-cpu-loras", type=int, default=None, metavar="N",
                       help="adapters kept loaded (default: --max-loras)")
    group.add_argument("--lora-dtype", choices=LORA_DTYPES, default="auto")
    group.add_argument(FLAG, nargs="+", default=None, metavar="NAME=PATH",
                       help='adapters by name, ids 1, 2, ... in this order: name=path or '
                            '\'{"name": ..., "path": ...}\'; input lines choose one by name')


def parse_entry(text: str, lora_id: int) -> LoRARequest:
    """One entry as vLLM reads it: `name=path` when it has "=" and no ",", else a JSON object."""
    if "=" in text and "," not in text:
        name, path = text.split("=", 1)
        values = {"name": name, "path": path}
    else:
        try:
            values = json.loads(text)
        except json.JSONDecodeError:
            raise ConfigError(f"{FLAG}: {text!r} is neither name=path nor a JSON object") from None
        if not isinstance(values, dict):
            raise ConfigError(f'{FLAG}: {text!r} must be a JSON object {{"name": ..., "path": ...}}')
        unknown = sorted(set(values) - set(JSON_FIELDS))
        if unknown:
            raise ConfigError(f"{FLAG}: {text!r} has unknown fields {', '.join(unknown)} "
                              f"(known: {', '.join(JSON_FIELDS)})")
    name, path = values.get("name"), values.get("path")
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"{FLAG}: {text!r} needs a non-empty name")
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"{FLAG}: {text!r} needs a non-empty path")
    base, three_d = values.get("base_model_name"), values.get("is_3d_lora_weight", False)
    if base is not None and not isinstance(base, str):
        raise ConfigError(f'{FLAG}: {text!r}: "base_model_name" must be a string')
    if not isinstance(three_d, bool):
        raise ConfigError(f'{FLAG}: {text!r}: "is_3d_lora_weight" must be true or false')
    return LoRARequest(name, lora_id, path, base_model_name=base, is_3d_lora_weight=three_d)


LINE_KEYS = ("lora", "model")  # a prompts-file line's adapter: ours, then the OpenAI field's name


def line_adapter(obj: dict) -> tuple[str, str] | None:
    """A prompts-file line's choice of adapter: (key, name), or None for the base model. "lora"
    always names one; "model" (as in an OpenAI body) counts only where adapters are served."""
    given = {k: obj[k] for k in LINE_KEYS if obj.get(k) is not None}
    for key, name in given.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f'"{key}" must be an adapter\'s name (a non-empty string), got {name!r}')
    if len(set(given.values())) > 1:
        raise ConfigError(f'"lora" ({given["lora"]!r}) and "model" ({given["model"]!r}) name different models')
    return next(iter(given.items()), None)


@dataclass
class ServedAdapters:
    """The adapters of --lora-modules by name, and the base model's name (which selects no
    adapter). Empty without the flag."""
    base_name: str
    by_name: dict[str, LoRARequest] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.by_name)

    def names(self) -> str:
        return ", ".join(self.by_name) or "none"

    def resolve(self, name: str | None) -> LoRARequest | None:
        """The adapter a name selects (None, or the base model's name: the base model); raises
        KeyError for a name that is neither."""
        if name is None or name == self.base_name:
            return None
        return self.by_name[name]

    def for_line(self, choice: tuple[str, str] | None) -> LoRARequest | None:
        """The adapter of a prompts-file line's (key, name) (line_adapter); ConfigError for a
        name not served. Without --lora-modules a "model" key is left alone, as before them."""
        if choice is None or (choice[0] == "model" and not self):
            return None
        key, name = choice
        try:
            return self.resolve(name)
        except KeyError:
            given = f"{FLAG} gives: {self.names()}" if self else f"no {FLAG} given"
            raise ConfigError(f'"{key}": unknown LoRA adapter {name!r} ({given})') from None


def served_adapters(args, base_name: str) -> ServedAdapters:
    """--lora-modules checked against the other LoRA flags (before any file or model is read)."""
    entries = [e for e in (getattr(args, "lora_modules", None) or []) if e]
    if not entries:
        return ServedAdapters(base_name)
    if not getattr(args, "enable_lora", False):
        raise ConfigError(f"{FLAG} needs --enable-lora")
    by_name: dict[str, LoRARequest] = {}
    for lora_id, text in enumerate(entries, 1):
        request = parse_entry(text, lora_id)
        if request.lora_name in by_name:
            raise ConfigError(f"{FLAG}: the name {request.lora_name!r} is given twice")
        if request.lora_name == base_name:
            raise ConfigError(f"{FLAG}: the name {request.lora_name!r} is the base model's name")
        by_name[request.lora_name] = request
    return ServedAdapters(base_name, by_name)


def check_adapter_dirs(adapters: ServedAdapters, setup) -> None:
    """Every adapter's files read and checked against the model (shapes, targets, rank) as the
    engine will check them, so a bad one is a usage error before any process starts."""
    if not adapters:
        return
    from spmd_engine.model.lora.peft_files import read_adapter
    max_rank = setup.config.lora_config.max_lora_rank
    for request in adapters.by_name.values():
        try:
            read_adapter(request.lora_name, request.lora_path, None, setup.spec, max_rank)
        except ValueError as exc:  # LoRAAdapterError names the adapter
            raise ConfigError(f"{FLAG}: {exc}") from None
