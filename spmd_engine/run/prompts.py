"""Prompts from the command line or a file, checked before any process starts.

Mistakes name the file and line: a malformed JSONL line in a 10,000-line file
should not cost a cluster allocation to find.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from spmd_engine.config import ConfigError

DEFAULT_PROMPT = "Beautiful is"


@dataclass(frozen=True)
class PromptInput:
    text: str | None = None
    token_ids: tuple[int, ...] | None = None

    def as_llm_input(self):
        return self.text if self.text is not None else list(self.token_ids)


def load_prompts(cli_prompts: list[str], path: str | None) -> list[PromptInput]:
    if path is None:
        return [PromptInput(text=p) for p in (cli_prompts or [DEFAULT_PROMPT])]
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise ConfigError(f"--prompts-file {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--prompts-file {path}: cannot read: {exc}") from None
    if path.endswith(".jsonl"):
        prompts = [_jsonl_prompt(path, n, line) for n, line in enumerate(lines, 1) if line.strip()]
    else:
        prompts = [PromptInput(text=line) for line in lines if line.strip()]
    if not prompts:
        raise ConfigError(f"--prompts-file {path} holds no prompt")
    return prompts


def _jsonl_prompt(path: str, lineno: int, line: str) -> PromptInput:
    where = f"{path}:{lineno}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: malformed JSON: {exc.msg} (column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise ConfigError(f'{where}: expected an object with "prompt" or "prompt_token_ids"')
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise ConfigError(f'{where}: "prompt" must be a non-empty string')
        return PromptInput(text=obj["prompt"])
    if "prompt_token_ids" in obj:
        ids = obj["prompt_token_ids"]
        if (not isinstance(ids, list) or not ids
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
            raise ConfigError(f'{where}: "prompt_token_ids" must be a non-empty list of non-negative integers')
        return PromptInput(token_ids=tuple(ids))
    raise ConfigError(f'{where}: expected "prompt" or "prompt_token_ids"')
