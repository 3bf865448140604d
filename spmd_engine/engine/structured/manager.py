"""The engine's structured-output state: one grammar matcher per constrained request.

Like vLLM, the matchers live beside the scheduler, not in the workers: after a
step is scheduled, each constrained request that samples in it gets a row of
the packed bitmask (core/step_messages.GrammarBitmask), which travels with the
step to the ranks that sample. A matcher is only ever a function of the
request's constraint and its output tokens so far: before a row is filled it is
brought up to the request's tokens (advanced by the new ones, or reset and
replayed when it holds more than the request does), so tokens dropped in flight,
preemption and recompute never leave it stale, and every external_launcher rank,
running its own engine on the same tokens, fills the same rows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from spmd_engine.core.request import Request
from spmd_engine.core.step_messages import GrammarBitmask, SchedulerOutput
from spmd_engine.engine.structured.backend import GrammarMatcher, grammar_backend

logger = logging.getLogger("spmd_engine")


@dataclass
class _Track:
    matcher: GrammarMatcher
    accepted: int = 0  # output tokens the matcher has taken
    rejected: bool = False  # a token the grammar forbids came back (then the request samples freely)


class StructuredOutputManager:
    def __init__(self, model_dir: str, stop_ids: list[int]):
        self.model_dir, self.stop_ids = str(model_dir), list(stop_ids)
        self._backend = None
        self.tracks: dict[str, _Track] = {}

    @property
    def backend(self):
        if self._backend is None:
            from spmd_engine.model.loader import read_hf_config
            from spmd_engine.model.spec import ModelSpec
            from spmd_engine.model.tokenizer import load_tokenizer
            vocab = ModelSpec.from_hf_config(read_hf_config(self.model_dir), self.model_dir).vocab_size
            self._backend = grammar_backend(self.model_dir, load_tokenizer(self.model_dir), vocab, self.stop_ids)
        return self._backend

    def add(self, request: Request) -> None:
        """Start a constrained request's matcher (its grammar compiled, or taken from the cache)."""
        constraint = request.params.structured_outputs
        if constraint is not None and request.request_id not in self.tracks:
            backend = self.backend
            self.tracks[request.request_id] = _Track(backend.matcher(backend.compile(constraint)))

    def remove(self, request_id: str) -> None:
        self.tracks.pop(request_id, None)

    def bitmask(self, out: SchedulerOutput, requests: dict[str, Request]) -> GrammarBitmask | None:
        """The rows of the step's constrained requests that sample, in schedule order."""
        if not self.tracks:
            return None
        rids = [s.request_id for s in out.seqs if s.sample and s.request_id in self.tracks]
        rows = [rid for rid in rids if not self._sync(requests[rid])]
        if not rows:
            return None
        bitmask = self.backend.allocate_bitmask(len(rows))
        for k, rid in enumerate(rows):
            self.tracks[rid].matcher.fill_bitmask(bitmask, k)
        return GrammarBitmask(rows, bitmask.numpy())

    def ended(self, request: Request) -> bool:
        """Whether the request's grammar has taken a stop token (nothing may follow it)."""
        track = self.tracks.get(request.request_id)
        if track is None:
            return False
        self._sync(request)
        return track.matcher.is_terminated()

    def _sync(self, request: Request) -> bool:
        """Bring the matcher up to the request's output tokens; True when it constrains nothing
        more (its grammar ended, or a token it forbids came back)."""
        track, tokens = self.tracks[request.request_id], request.output_token_ids
        if track.accepted > len(tokens):  # more than the request holds: start again
            track.matcher.reset()
            track.accepted, track.rejected = 0, False
        while track.accepted < len(tokens) and not track.rejected and not track.matcher.is_terminated():
            if not track.matcher.accept_token(tokens[track.accepted]):
                logger.error("request %s: token %d is outside its grammar; it samples unconstrained from here",
                             request.request_id, tokens[track.accepted])
                track.rejected = True
                break
            track.accepted += 1
        return track.rejected or track.matcher.is_terminated()
