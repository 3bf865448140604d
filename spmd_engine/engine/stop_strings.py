"""Stop strings, found in each request's text as its tokens arrive.

A stop string is text, not tokens: it may span several tokens, or end inside
one, so it can only be found in the detokenized output (vLLM looks for it
there too). The engine core decodes only the requests that have stop strings,
a few tokens at a time, and finishes a request in the step its text first
contains one. Every engine core that schedules a request (each rank of a
replica under external_launcher) sees the same tokens and decodes them the
same way, so all of them stop it in the same step.

Stop token ids are a different check, on the sampled id itself: they belong in
the scheduler's finish-reason check, beside the EOS ids, which runs first.
"""

from __future__ import annotations

from spmd_engine.core.request import Request

INCOMPLETE = "\ufffd"  # what a decoder returns for the first bytes of a character split across tokens


def held_back(text: str, stops: list[str]) -> int:
    """How many characters at the end of a running request's text could be the start of a stop
    string (the longest end of it that begins one; at most the longest stop string less one).
    A streamed output holds them back: if the stop string completes, the final text drops
    them, and text already sent cannot be taken back. vLLM holds back that many characters
    whatever they are; this holds back only a possible start, so the rest streams at once."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


class StopStringWatcher:
    """Keeps `request.output_text` for requests with stop strings, and says when one appears."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self._tokenizer = None
        # request id -> (prefix, read): the decoded text ends at token `read`; tokens from
        # `prefix` are decoded again with the new ones, so a token's text can depend on the one
        # before it (leading spaces in SentencePiece, bytes of one character in byte-level BPE).
        self._offsets: dict[str, tuple[int, int]] = {}

    @staticmethod
    def watches(request: Request) -> bool:
        return bool(request.params.stop)

    def update(self, request: Request) -> str | None:
        """Decode the request's new tokens into its text; the stop string now in it, if any
        (the text is then cut before it, or after it with include_stop_str_in_output)."""
        params = request.params
        new = self._new_text(request)
        text = request.output_text = (request.output_text or "") + new
        if not new or len(request.output_token_ids) <= getattr(params, "min_tokens", 0):
            return None
        found = None
        for stop in params.stop:  # only where the new text could complete it
            i = text.find(stop, max(0, len(text) - len(new) - len(stop) + 1))
            if i != -1 and (found is None or i < found[0]):
                found = (i, stop)
        if found is None:
            return None
        i, stop = found
        request.output_text = text[:i + len(stop)] if params.include_stop_str_in_output else text[:i]
        return stop

    def forget(self, request_id: str) -> None:
        self._offsets.pop(request_id, None)

    def _new_text(self, request: Request) -> str:
        ids = request.output_token_ids
        prefix, read = self._offsets.get(request.request_id, (0, 0))
        skip = request.params.skip_special_tokens
        tokenizer = self._get_tokenizer()
        before = tokenizer.decode(ids[prefix:read], skip_special_tokens=skip)
        now = tokenizer.decode(ids[prefix:], skip_special_tokens=skip)
        if len(now) <= len(before) or now.endswith(INCOMPLETE):
            return ""  # nothing printable yet: wait for the rest of the character
        self._offsets[request.request_id] = (read, len(ids))
        return now[len(before):]

    def _get_tokenizer(self):
        if self._tokenizer is None:
            from spmd_engine.model.tokenizer import load_tokenizer
            self._tokenizer = load_tokenizer(self.model_dir)
        return self._tokenizer
