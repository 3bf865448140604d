"""The xgrammar backend (vLLM's default): the optional extra `spmd_engine[structured]`.

xgrammar compiles a constraint against the whole vocabulary once (its token
bytes, model/token_bytes.py), then a matcher fills each step's bitmask in
microseconds. Compiled grammars are cached here by the constraint's canonical
text, so a batch of requests with one schema compiles it once.
"""

from __future__ import annotations

import json
import logging
import re
import threading

from spmd_engine.config import ConfigError
from spmd_engine.engine.structured.backend import StructuredOutputError
from spmd_engine.sampling_params import StructuredOutputsParams

logger = logging.getLogger("spmd_engine")

EXTRA_HINT = "structured outputs need xgrammar: pip install 'spmd_engine[structured]'"


def import_xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise ConfigError(EXTRA_HINT) from None
    return xgrammar


class XgrammarMatcher:
    def __init__(self, matcher):
        self._m = matcher

    def accept_token(self, token_id: int) -> bool:
        return bool(self._m.accept_token(int(token_id)))

    def fill_bitmask(self, bitmask, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())

    def reset(self) -> None:
        self._m.reset()


class XgrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int]):
        from spmd_engine.model.token_bytes import token_bytes
        xgr = self._xgr = import_xgrammar()
        vocab = [b if b is not None else b"" for b in token_bytes(tokenizer, vocab_size)]
        stops = [i for i in stop_ids if 0 <= i < vocab_size]
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stops)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.vocab_size = vocab_size
        self._compiled: dict[tuple, object] = {}
        self._lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams):
        key = cache_key(params)
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is None:
                compiled = self._compiled[key] = self._compile(params)
            return compiled

    def _compile(self, params: StructuredOutputsParams):
        kind, compiler = params.kind, self._compiler
        if params.whitespace_pattern is not None:
            logger.warning("structured_outputs.whitespace_pattern is ignored by the xgrammar backend (as in vLLM)")
        separators = (",", ":") if params.disable_any_whitespace else None
        json_options = {"any_whitespace": not params.disable_any_whitespace, "separators": separators}
        try:
            if kind == "json":
                return compiler.compile_json_schema(_schema(params), **json_options)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', **json_options)
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(params.choice))
            if kind == "grammar":
                if "::=" in params.grammar:
                    return compiler.compile_grammar(params.grammar)
                return compiler.compile_lark(params.grammar)
        except StructuredOutputError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError with its C++ location first
            raise StructuredOutputError(f"structured_outputs.{kind} was refused by xgrammar: {_message(exc)}") from None
        raise StructuredOutputError(f"structured_outputs.{kind} is not supported by the xgrammar backend here")

    def matcher(self, compiled) -> XgrammarMatcher:
        return XgrammarMatcher(self._xgr.GrammarMatcher(compiled))

    def allocate_bitmask(self, rows: int):
        return self._xgr.allocate_token_bitmask(rows, self.vocab_size)


def cache_key(params: StructuredOutputsParams) -> tuple:
    value = getattr(params, params.kind)
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return (params.kind, text, params.disable_any_whitespace, params.disable_additional_properties)


def _schema(params: StructuredOutputsParams):
    schema = params.json
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise StructuredOutputError(f"structured_outputs.json is not valid JSON: {exc}") from None
    if params.disable_additional_properties:
        schema = _closed(schema)
    return json.dumps(schema)


def _closed(node):
    """The schema with `additionalProperties: false` on every object that does not set it."""
    if isinstance(node, list):
        return [_closed(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _closed(v) for k, v in node.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly the choices."""
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in choices)


def _ebnf_literal(text: str) -> str:
    escapes = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}
    body = "".join(escapes.get(c, c if ord(c) >= 0x20 and ord(c) != 0x7F else f"\\u{ord(c):04x}") for c in text)
    return f'"{body}"'


def _message(exc: Exception) -> str:
    """xgrammar's message without the time and C++ source location it starts with."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)
    return re.sub(r"^Check failed: \(.*?\) is false: ", "", text)
