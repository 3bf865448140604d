"""Prompts from the command line or a file, checked before any process starts.

Mistakes name the file and line: a malformed JSONL line in a 10,000-line file
should not cost a cluster allocation to find.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from spmd_engine.config import ConfigError
from spmd_engine.run.lora_modules import line_adapter

DEFAULT_PROMPT = "Beautiful is"


@dataclass(frozen=True)
class PromptInput:
    """A prompt as text, token ids, or a conversation; a rendered conversation has both the
    text its chat template wrote and that text's ids (tokenized without added special tokens)."""
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    messages: list[dict] | None = None
    where: str | None = field(default=None, compare=False)  # "FILE:LINE", for errors found later
    structured_outputs: dict | None = None  # the line's own constraint (docs/structured-outputs.md)
    adapter: tuple[str, str] | None = None  # the line's ("lora" or "model", name) (run/lora_modules.py)

    def as_llm_input(self):
        if self.text is not None and self.token_ids is not None:
            return {"prompt": self.text, "prompt_token_ids": list(self.token_ids)}
        return self.text if self.text is not None else list(self.token_ids)


def load_prompts(cli_prompts: list[str], path: str | None) -> list[PromptInput]:
    if path is None:
        return [PromptInput(text=p) for p in (cli_prompts or [DEFAULT_PROMPT])]
    lines = _read_lines(path)
    if path.endswith(".jsonl"):
        prompts = [_jsonl_prompt(path, n, line) for n, line in enumerate(lines, 1) if line.strip()]
    else:
        prompts = [PromptInput(text=line, where=f"{path}:{n}") for n, line in enumerate(lines, 1) if line.strip()]
    if not prompts:
        raise ConfigError(f"--prompts-file {path} holds no prompt")
    return prompts


def _read_lines(path: str) -> list[str]:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ConfigError(f"--prompts-file {path}: no such file") from None
    except OSError as exc:
        raise ConfigError(f"--prompts-file {path}: cannot read: {exc}") from None
    try:
        return data.decode("utf-8").splitlines()
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise ConfigError(f"--prompts-file {path}:{line}: not UTF-8 (byte 0x{data[exc.start]:02x} at "
                          f"column {column})") from None


def _jsonl_prompt(path: str, lineno: int, line: str) -> PromptInput:
    where = f"{path}:{lineno}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: malformed JSON: {exc.msg} (column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise ConfigError(f'{where}: expected an object with "prompt", "prompt_token_ids" or "messages"')
    so = obj.get("structured_outputs")
    if so is not None:
        from spmd_engine.sampling_params import StructuredOutputsParams
        if not isinstance(so, dict):
            raise ConfigError(f'{where}: "structured_outputs" must be an object')
        try:
            StructuredOutputsParams.from_dict(so)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    try:
        adapter = line_adapter(obj)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if "messages" in obj:
        from spmd_engine.engine.chat_template import normalize_messages
        try:
            return PromptInput(messages=normalize_messages(obj["messages"]), where=where, structured_outputs=so,
                               adapter=adapter)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise ConfigError(f'{where}: "prompt" must be a non-empty string')
        return PromptInput(text=obj["prompt"], where=where, structured_outputs=so, adapter=adapter)
    if "prompt_token_ids" in obj:
        ids = obj["prompt_token_ids"]
        if (not isinstance(ids, list) or not ids
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
            raise ConfigError(f'{where}: "prompt_token_ids" must be a non-empty list of non-negative integers')
        return PromptInput(token_ids=tuple(ids), where=where, structured_outputs=so, adapter=adapter)
    raise ConfigError(f'{where}: expected "prompt", "prompt_token_ids" or "messages"')


def read_chat_template(path: str | None) -> str | None:
    """--chat-template FILE: the template text (None: the checkpoint's)."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise ConfigError(f"--chat-template {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--chat-template {path}: cannot read: {exc}") from None


def render_conversations(prompts: list[PromptInput], model_dir: str, tokenizer,
                         chat_template: str | None) -> list[PromptInput]:
    """Each conversation as the prompt its chat template writes (text and ids); other prompts
    as they are. Without any conversation no template is needed."""
    if all(p.messages is None for p in prompts):
        return prompts
    from spmd_engine.engine.chat_template import chat_prompt, choose_template
    template = choose_template(model_dir, chat_template, None)
    rendered = []
    for index, p in enumerate(prompts):
        if p.messages is not None:
            try:
                d = chat_prompt(tokenizer, model_dir, p.messages, template)
            except ConfigError as exc:
                raise ConfigError(f"{p.where or f'prompt {index}'}: {exc}") from None
            p = PromptInput(text=d["prompt"], token_ids=tuple(d["prompt_token_ids"]), where=p.where,
                            structured_outputs=p.structured_outputs, adapter=p.adapter)
        rendered.append(p)
    return rendered
