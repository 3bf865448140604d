"""The lines of an OpenAI batch file, read and checked one by one.

A line is `{"custom_id", "method": "POST", "url": "/v1/completions" or
"/v1/chat/completions", "body": {...}}`. A line that is wrong on its own (bad
JSON, an unknown URL, a bad field) does not stop the file: it becomes an error
result for its custom_id (status 400), as with OpenAI and vLLM, and the other
lines still run. Only a file that cannot be read at all is a usage error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from spmd_engine.config import ConfigError
from spmd_engine.sampling_params import SamplingParams

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
URLS = (CHAT_URL, COMPLETIONS_URL)


class BadRequest(ValueError):
    """What is wrong with one line: its error result's message."""


@dataclass
class BatchRequest:
    """One line: its custom_id, endpoint and body, or why it is invalid."""
    custom_id: str | None
    url: str | None = None
    body: dict = field(default_factory=dict)
    error: str | None = None

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


def check_body(request: BatchRequest) -> None:
    """The fields this runner reads, checked (others are ignored, as a server ignores them)."""
    body = request.body
    if body.get("stream"):
        raise BadRequest('"stream" is not supported in a batch')
    if request.is_chat:
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            raise BadRequest('a chat request needs "messages", a non-empty list')
        if not isinstance(body.get("logprobs", False), bool):
            raise BadRequest(f'"logprobs" must be true or false, got {body["logprobs"]!r}')
        if _integer(body, "top_logprobs", 0, 20) is not None and not body.get("logprobs"):
            raise BadRequest('"top_logprobs" needs "logprobs": true')
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a list holding one prompt
        ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        if not (isinstance(prompt, str) and prompt) and not ids:
            raise BadRequest('a completions request needs "prompt": a non-empty string or list of token ids '
                             '(one prompt per request)')
        _integer(body, "logprobs", 0, 20)
    for name in ("max_tokens", "max_completion_tokens", "n"):
        _integer(body, name, 1)
    _integer(body, "seed", -(1 << 63))
    _number(body, "temperature", 0.0, 2.0)
    _number(body, "top_p", 0.0, 1.0)
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise BadRequest(f'"stop" must be a string or a list of strings, got {stop!r}')


def completion_prompt(body: dict):
    """The completions prompt as generate takes it: text, or a list of token ids."""
    prompt = body["prompt"]
    return prompt[0] if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)) else prompt


def sampling_params(request: BatchRequest, prompt_len: int, max_model_len: int) -> SamplingParams:
    """The body's fields as SamplingParams; max_tokens defaults to the rest of the context (vLLM's
    default). Raises BadRequest for values SamplingParams refuses."""
    body = request.body
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if request.is_chat:
        logprobs = (body.get("top_logprobs") or 0) if body.get("logprobs") else None
    else:
        logprobs = body.get("logprobs")
    try:
        return SamplingParams(
            n=body.get("n") or 1, max_tokens=max_tokens or max_model_len - prompt_len,
            temperature=1.0 if body.get("temperature") is None else body["temperature"],
            top_p=1.0 if body.get("top_p") is None else body["top_p"], stop=body.get("stop"),
            seed=body.get("seed"), logprobs=logprobs)
    except ConfigError as exc:
        raise BadRequest(str(exc)) from None
