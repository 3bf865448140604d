"""Chat messages to a prompt, with the checkpoint's own chat template (jinja2).

An instruct checkpoint was trained on one exact text layout of a conversation;
its template (tokenizer_config.json "chat_template", or chat_template.jinja,
which wins) writes that layout. We render it the way Hugging Face transformers
does, so a prompt here is the prompt the model saw in training and the prompt
`apply_chat_template` gives: a sandboxed environment with trim_blocks and
lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson`
that does not HTML-escape, the tokenizer's special tokens (bos_token,
eos_token, ...) as variables, `add_generation_prompt`, `tools`, and
continue_final_message (the prompt ends inside the last message, so the model
continues it). The rendered text already holds the special tokens the template
writes, so it is tokenized without adding any (LLM.chat does that).
"""

from __future__ import annotations

import functools
import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any

from spmd_engine.config import ConfigError

TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Appended to the final message to find where it ends in the rendered text (continue_final_message).
# Its trailing space shows whether the template trimmed the message's end.
_END_MARK = "\x1fEND_OF_FINAL_MESSAGE\x1f "


def _import_jinja2():
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError:
        raise ConfigError("chat templates need the 'jinja2' package: pip install 'spmd_engine[hf]' "
                          "(or pip install jinja2)") from None
    return jinja2


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config writes it: a string, or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def special_tokens(model_dir: str | os.PathLike) -> dict[str, str]:
    """bos_token, eos_token, ... of tokenizer_config.json (else special_tokens_map.json)."""
    model_dir = Path(model_dir)
    found = {}
    for source in (_read_json(model_dir / "special_tokens_map.json"), _read_json(model_dir / "tokenizer_config.json")):
        for name in SPECIAL_TOKEN_NAMES:
            text = _token_text(source.get(name))
            if text is not None:
                found[name] = text
    return found


def checkpoint_templates(model_dir: str | os.PathLike) -> dict[str, str]:
    """The checkpoint's templates by name ("default", "tool_use", ...); chat_template.jinja is "default"."""
    model_dir = Path(model_dir)
    config = _read_json(model_dir / "tokenizer_config.json").get("chat_template")
    templates: dict[str, str] = {}
    if isinstance(config, str):
        templates["default"] = config
    elif isinstance(config, list):
        templates.update({t["name"]: t["template"] for t in config
                          if isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)})
    path = model_dir / TEMPLATE_FILE
    if path.is_file():
        templates["default"] = path.read_text(encoding="utf-8")
    return templates


def load_chat_template(value: str | os.PathLike | None) -> str | None:
    """LLM(chat_template=...) as vLLM takes it: a file's path (its text is the template), or the
    template text itself (it holds a brace or a newline); anything else is a path that failed."""
    if value is None:
        return None
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        text = str(value)
        if any(c in text for c in "{}\n"):
            return text
        raise ConfigError(f"chat_template {text!r} looks like a file path but cannot be read: {exc}") from None


def choose_template(model_dir: str | os.PathLike, chat_template: str | None, tools) -> str:
    """`chat_template` (template text, or the name of one of the checkpoint's), else the
    checkpoint's: its "tool_use" one when tools are given and it has one, else "default"."""
    templates = checkpoint_templates(model_dir)
    if chat_template is not None:
        return templates.get(chat_template, chat_template)
    if tools and "tool_use" in templates:
        return templates["tool_use"]
    if "default" in templates:
        return templates["default"]
    if templates:
        raise ConfigError(f"{model_dir} has chat templates {sorted(templates)} and none is \"default\": "
                          f"pass chat_template=NAME")
    raise ConfigError(f"no chat template: {model_dir} has none (tokenizer_config.json \"chat_template\" or "
                      f"{TEMPLATE_FILE}); pass one (--chat-template FILE, or LLM.chat(chat_template=...))")


@functools.lru_cache(maxsize=16)
def compile_template(source: str):
    """The template compiled in transformers' environment (sandboxed, immutable)."""
    jinja2 = _import_jinja2()

    class GenerationBlock(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it
        renders its body unchanged."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ConfigError(f"chat template: syntax error on line {exc.lineno}: {exc.message}") from None


def _plain(value: Any, what: str) -> Any:
    """JSON data only reaches the sandbox (no objects with methods of their own)."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{what} must be JSON data (dicts, lists, strings, numbers): {exc}") from None


def _text_content(message: dict) -> dict:
    """A list of content parts ({"type": "text", "text": ...}) as one string, parts joined by newlines
    (vLLM's "string" content format, which text-only templates expect)."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts = []
    for part in content:
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise ConfigError(f"message content parts must be {{\"type\": \"text\", \"text\": str}}, got {part!r}")
        texts.append(part["text"])
    return {**message, "content": "\n".join(texts)}


def normalize_messages(messages, content_format: str = "auto") -> list[dict]:
    """A conversation checked and made plain: dicts with a string "role"; None values dropped (as
    transformers does: templates handle a missing key, not a None)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ConfigError("a conversation must be a non-empty list of messages")
    if content_format not in ("auto", "string", "openai"):
        raise ConfigError(f"chat_template_content_format must be 'auto', 'string' or 'openai', got {content_format!r}")
    out = []
    for i, message in enumerate(_plain(list(messages), "messages")):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ConfigError(f"message {i} must be an object with a string \"role\", got {message!r}")
        message = {k: v for k, v in message.items() if v is not None}
        out.append(message if content_format == "openai" else _text_content(message))
    return out


def render(template: str, messages: list[dict], *, add_generation_prompt: bool = True,
           continue_final_message: bool = False, tools: list[dict] | None = None,
           variables: dict | None = None) -> str:
    """One conversation (already normalized) as the prompt text the template writes."""
    jinja2 = _import_jinja2()
    if continue_final_message and add_generation_prompt:
        raise ConfigError("continue_final_message and add_generation_prompt cannot both be set: the first "
                          "continues the last message, the second starts a new assistant message")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ConfigError("tools must be a list of JSON-schema dicts")
    messages = [dict(m) for m in messages]
    final = None
    if continue_final_message:
        final = messages[-1].get("content")
        if not isinstance(final, str):
            raise ConfigError("continue_final_message needs a final message with string content")
        messages[-1]["content"] = final + _END_MARK
    try:
        text = compile_template(template).render(
            messages=messages, tools=_plain(tools, "tools"), add_generation_prompt=add_generation_prompt,
            **_plain(variables or {}, "template variables"))
    except jinja2.exceptions.TemplateError as exc:  # raise_exception(...) and undefined names
        raise ConfigError(f"chat template: {exc}") from None
    if final is None:
        return text
    end = text.rfind(_END_MARK.rstrip())
    if end < 0 or final.strip() not in text:
        raise ConfigError("continue_final_message: the chat template does not write the final message's "
                          "content as given, so the prompt cannot end inside it")
    if text.startswith(_END_MARK, end):
        return text[:end]
    return text[:end].rstrip()  # the template trimmed the message's end: so do we


def chat_prompt(tokenizer, model_dir: str | os.PathLike, messages: list[dict], template: str, *,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                tools: list[dict] | None = None, variables: dict | None = None) -> dict:
    """A conversation as vLLM's prompt dict {"prompt": rendered text, "prompt_token_ids": ids}.
    The template writes the special tokens it wants, so none are added when tokenizing (as
    vLLM and transformers do); `variables` override the checkpoint's special tokens."""
    if tokenizer is None:
        raise ConfigError(f"chat needs a tokenizer, and {model_dir} has none")
    text = render(template, messages, add_generation_prompt=add_generation_prompt,
                  continue_final_message=continue_final_message, tools=tools,
                  variables={**special_tokens(model_dir), **(variables or {})})
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
