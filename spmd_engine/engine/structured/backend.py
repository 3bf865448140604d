"""What the engine needs of a grammar backend, and where the one in use comes from.

The engine asks three things: compile a constraint into a grammar (once per
constraint and tokenizer), start a matcher on it, and have the matcher fill a
row of the packed bitmask of ids allowed next / accept each sampled id. xgrammar
(vLLM's default) is the backend; another would implement these two classes.
A constraint the backend refuses raises StructuredOutputError with its message.
"""

from __future__ import annotations

import threading
from typing import Protocol

from spmd_engine.config import ConfigError
from spmd_engine.sampling_params import StructuredOutputsParams


class StructuredOutputError(ConfigError):
    """A constraint the backend cannot compile (a bad schema, regex or grammar)."""


class GrammarMatcher(Protocol):
    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled id; False (state unchanged) when the grammar forbids it."""

    def fill_bitmask(self, bitmask, row: int) -> None:
        """Write the ids allowed next into row `row` of an int32 torch bitmask."""

    def is_terminated(self) -> bool:
        """The grammar accepted a stop id: nothing may follow."""

    def reset(self) -> None:
        """Back to the start, as if no id had been accepted."""


class GrammarBackend(Protocol):
    name: str
    vocab_size: int

    def compile(self, params: StructuredOutputsParams):
        """A compiled grammar (cached by the backend); raises StructuredOutputError."""

    def matcher(self, compiled) -> GrammarMatcher:
        """A fresh matcher at the grammar's start."""

    def allocate_bitmask(self, rows: int):
        """An int32 torch tensor [rows, ceil(vocab / 32)] for fill_bitmask."""


_BACKENDS: dict[tuple, GrammarBackend] = {}
_LOCK = threading.Lock()


def grammar_backend(model_dir: str, tokenizer, vocab_size: int, stop_ids: list[int]) -> GrammarBackend:
    """The process's backend for this tokenizer (one per model directory, vocabulary and stop
    ids): the front end's checks and the engine share its compiled grammars."""
    key = (str(model_dir), vocab_size, tuple(stop_ids))
    with _LOCK:
        backend = _BACKENDS.get(key)
        if backend is None:
            from spmd_engine.engine.structured.xgrammar_backend import XgrammarBackend
            backend = _BACKENDS[key] = XgrammarBackend(tokenizer, vocab_size, stop_ids)
        return backend
