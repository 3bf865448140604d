"""The lines of an OpenAI batch file, read and checked one by one.

A line is `{"custom_id", "method": "POST", "url": "/v1/completions" or
"/v1/chat/completions", "body": {...}}`. A line that is wrong on its own (bad
JSON, an unknown URL, a bad field) does not stop the file: it becomes an error
result for its custom_id (status 400), as with OpenAI and vLLM, and the other
lines still run. Only a file that cannot be read at all is a usage error.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

from spmd_engine.config import ConfigError
from spmd_engine.distributed.launch_env import launched_rank
from spmd_engine.run_batch.fields import BadRequest, check_fields
from spmd_engine.sampling_params import SamplingParams

logger = logging.getLogger("spmd_engine")

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
URLS = (CHAT_URL, COMPLETIONS_URL)


@dataclass
class BatchRequest:
    """One line: its custom_id, endpoint and body, or why it is invalid. The job sets the rest
    from the rendered prompt, since the result needs them after generation: the text "echo"
    puts first, the reply's role (vLLM's: the last message's without a generation prompt) and
    the first prompt token's text (it has no logprob entry to carry it)."""
    custom_id: str | None
    url: str | None = None
    body: dict = field(default_factory=dict)
    error: str | None = None
    ignored: list[str] = field(default_factory=list)
    echo: str | None = None
    role: str = "assistant"
    first_token: str = ""

    @property
    def is_chat(self) -> bool:
        return self.url == CHAT_URL


def read_requests(path: str) -> tuple[list[BatchRequest], bytes]:
    """Every non-blank line of the file, checked, with the file's bytes (the job's identity)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
        text = data.decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"--input-file {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--input-file {path}: cannot read: {exc}") from None
    requests = [parse_line(line, n) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not requests:
        raise ConfigError(f"--input-file {path} holds no request")
    ignored = sorted({name for r in requests for name in r.ignored})
    if ignored and launched_rank() == 0:
        logger.warning("request fields outside vLLM's request models, ignored (as vLLM ignores them): %s",
                       ", ".join(ignored))
    return requests, data


def parse_line(line: str, lineno: int) -> BatchRequest:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        return BatchRequest(None, error=f"line {lineno}: malformed JSON: {exc.msg} (column {exc.colno})")
    if not isinstance(obj, dict):
        return BatchRequest(None, error=f"line {lineno}: expected a JSON object")
    custom_id = obj.get("custom_id")
    request = BatchRequest(custom_id if isinstance(custom_id, str) else None)
    try:
        if not isinstance(custom_id, str):
            raise BadRequest('"custom_id" must be a string')
        if obj.get("method") != "POST":
            raise BadRequest(f'"method" must be "POST", got {obj.get("method")!r}')
        if obj.get("url") not in URLS:
            raise BadRequest(f"URL {obj.get('url')!r} was used; supported endpoints: {', '.join(URLS)}")
        if not isinstance(obj.get("body"), dict):
            raise BadRequest('"body" must be an object')
        request.url, request.body = obj["url"], obj["body"]
        check_body(request)
    except BadRequest as exc:
        request.error = f"line {lineno}: {exc}"
    return request


def _integer(body: dict, name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise BadRequest(f'"{name}" must be an integer {bounds}, got {value!r}')
    return value


def _number(body: dict, name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise BadRequest(f'"{name}" must be a number in [{low}, {high}], got {value!r}')
    return float(value)


def _flag(body: dict, name: str) -> None:
    if body.get(name) is not None and not isinstance(body[name], bool):
        raise BadRequest(f'"{name}" must be true or false, got {body[name]!r}')


def check_body(request: BatchRequest) -> None:
    """The body's fields checked (see fields.py for which are read, accepted or refused); the
    ranges of those SamplingParams checks are left to it."""
    body = request.body
    if body.get("stream"):
        raise BadRequest('"stream" is not supported in a batch')
    request.ignored = check_fields(body, request.is_chat)
    if request.is_chat:
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            raise BadRequest('a chat request needs "messages", a non-empty list')
        _flag(body, "logprobs")
        if _integer(body, "top_logprobs", -1) and not body.get("logprobs"):
            raise BadRequest('"top_logprobs" needs "logprobs": true')
        _integer(body, "max_completion_tokens", 1)
        _integer(body, "max_tokens", 1)
        for name in ("add_generation_prompt", "continue_final_message"):
            _flag(body, name)
        if body.get("tool_choice") not in (None, "none", "auto"):  # a forced call needs structured outputs
            raise BadRequest(f'"tool_choice" {body["tool_choice"]!r} is not supported by spmd_engine '
                             f'(only "none" or "auto": the reply is text, tool calls are not parsed)')
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise BadRequest(f'"chat_template_kwargs" must be an object, got {kwargs!r}')
        if kwargs and {"chat_template", "tokenize"} & set(kwargs):  # vLLM refuses these two
            raise BadRequest('"chat_template_kwargs" must not hold "chat_template" or "tokenize"')
        documents = body.get("documents")
        if documents is not None and not (isinstance(documents, list) and all(isinstance(d, dict) for d in documents)):
            raise BadRequest(f'"documents" must be a list of objects, got {documents!r}')
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a list holding one prompt
        ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        if not (isinstance(prompt, str) and prompt) and not ids:
            raise BadRequest('a completions request needs "prompt": a non-empty string or list of token ids '
                             '(one prompt per request)')
        _integer(body, "logprobs", -1)
        _integer(body, "max_tokens", 0 if body.get("echo") else 1)  # 0 with echo: the prompt alone (vLLM)
    _integer(body, "n", 1)
    _integer(body, "prompt_logprobs", -1)
    _integer(body, "seed", -(1 << 63), (1 << 63) - 1)
    _number(body, "temperature", 0.0, 2.0)
    _number(body, "top_p", 0.0, 1.0)
    for name in ("echo", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "add_special_tokens"):
        _flag(body, name)
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise BadRequest(f'"stop" must be a string or a list of strings, got {stop!r}')


def completion_prompt(body: dict):
    """The completions prompt as generate takes it: text, or a list of token ids."""
    prompt = body["prompt"]
    return prompt[0] if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)) else prompt


# vLLM's values for the fields a model's generation config may set, used when neither sets one.
NEUTRAL = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "temperature": 1.0,
           "top_p": 1.0, "top_k": 0, "min_p": 0.0, "skip_special_tokens": True}
PASSED = ("seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "include_stop_str_in_output",
          "logit_bias", "allowed_token_ids", "bad_words", "prompt_logprobs")


def sampling_params(request: BatchRequest, prompt_len: int, max_model_len: int,
                    defaults: dict | None = None) -> SamplingParams:
    """The body's fields as SamplingParams, as vLLM's to_sampling_params: a field absent or null
    takes the model's generation-config default (`defaults`), else vLLM's. max_tokens defaults
    to 16 for completions and to the rest of the context for chat, and is cut to the rest of
    the context. Raises BadRequest for values SamplingParams refuses."""
    body, defaults = request.body, defaults or {}
    kwargs = {name: defaults.get(name, value) if body.get(name) is None else body[name]
              for name, value in NEUTRAL.items()}
    kwargs.update((name, body[name]) for name in PASSED if body.get(name) is not None)
    if request.is_chat:
        top = body.get("top_logprobs") or 0
        kwargs["logprobs"] = top if body.get("logprobs") else None
        name = next((n for n in ("max_completion_tokens", "max_tokens") if body.get(n) is not None), None)
        asked = body[name] if name else defaults.get("max_tokens", max_model_len)
    else:
        top = kwargs["logprobs"] = body.get("logprobs")
        name, asked = "max_tokens", 16 if body.get("max_tokens") is None else body["max_tokens"]
    if body.get("echo") and body.get("prompt_logprobs") is None:
        kwargs["prompt_logprobs"] = top
    if name and asked > max_model_len:
        raise BadRequest(f'"{name}" = {asked} cannot be greater than max_model_len = {max_model_len}')
    # echo with max_tokens 0 generates one token and returns none of it, as vLLM
    kwargs["max_tokens"] = min(asked, max_model_len - prompt_len) or 1
    try:
        kwargs["structured_outputs"] = structured_outputs(body)
        return SamplingParams(n=body.get("n") or 1, **kwargs)
    except ConfigError as exc:
        raise BadRequest(str(exc)) from None


def structured_outputs(body: dict) -> dict | None:
    """OpenAI's `response_format` ({"type": "json_object"}, {"type": "json_schema", "json_schema":
    {"schema": ...}}; "text" is no constraint) or vLLM's `structured_outputs` object, as the
    StructuredOutputsParams fields they mean (docs/structured-outputs.md)."""
    fmt, so = body.get("response_format"), body.get("structured_outputs")
    if fmt is not None and so is not None:
        raise BadRequest('"response_format" and "structured_outputs" cannot both be set')
    if so is not None:
        if not isinstance(so, dict):
            raise BadRequest(f'"structured_outputs" must be an object, got {so!r}')
        return so
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema", spec.get("schema_")) if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise BadRequest('"response_format": {"type": "json_schema"} needs "json_schema": {"schema": {...}}')
        return {"json": schema}
    raise BadRequest(f'"response_format" type must be "text", "json_object" or "json_schema", got {fmt!r}')
