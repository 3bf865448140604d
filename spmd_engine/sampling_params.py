"""SamplingParams: how one request's tokens are chosen, validated up front."""

from __future__ import annotations

from dataclasses import dataclass

from spmd_engine.config import ConfigError


@dataclass
class SamplingParams:
    """vLLM's names and meanings. temperature 0 is greedy; top_k -1 means no limit.

    `seed` fixes this request's random stream, so it gets the same tokens
    whichever replica or batch it lands in. Left as None, the request draws a
    fresh seed from the engine's stream (started by LLM(seed=...)), different
    on every generate call, as in vLLM. With `n` > 1 sample k draws from its
    own stream (`seed + k`). `logprobs=0` returns the sampled token's logprob,
    K > 0 the top K as well: the model's own distribution (log_softmax of the
    raw logits, before temperature / top-k / top-p, as vLLM's default
    "raw_logprobs").

    `stop` strings end a request (finish_reason "stop", stop_reason the string)
    as soon as its text contains one, wherever the token boundaries fall; the
    text ends before the string unless `include_stop_str_in_output`. The
    tokens that produced it stay in token_ids, as in vLLM. `detokenize=False`
    leaves `text` empty (token ids only, no decoding cost), and
    `skip_special_tokens` drops special tokens from the text.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    logprobs: int | None = None
    ignore_eos: bool = False
    n: int = 1  # samples per prompt: RequestOutput.outputs[0..n-1]
    stop: str | list[str] | None = None  # normalised to a list of strings
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0 or self.temperature != self.temperature:
            raise ConfigError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            raise ConfigError(f"top_k must be -1 (no limit) or an integer >= 1, got {self.top_k!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or self.logprobs < 0):
            raise ConfigError(f"logprobs must be an integer >= 0, got {self.logprobs!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ConfigError(f"n must be an integer >= 1 (samples per prompt), got n={self.n!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}")
        self._check_stop()

    def _check_stop(self) -> None:
        stop = [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise ConfigError(f"stop must be a string or a list of strings, got stop={self.stop!r}")
        if any(s == "" for s in stop):
            raise ConfigError(f"stop must not contain an empty string (it would match at once), got stop={self.stop!r}")
        self.stop = list(stop)
        for name in ("include_stop_str_in_output", "skip_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {name}={getattr(self, name)!r}")
        if self.stop and not self.detokenize:
            raise ConfigError("stop strings need detokenize=True (they are found in the text)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
