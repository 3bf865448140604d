"""SamplingParams: how one request's tokens are chosen, validated up front."""

from __future__ import annotations

import copy
import enum
import logging
import math
from dataclasses import dataclass

from spmd_engine.config import ConfigError

logger = logging.getLogger("spmd_engine")

# vLLM's thresholds: a temperature below SAMPLING_EPS is greedy; one in (0, MIN_TEMPERATURE) is raised
# to MIN_TEMPERATURE, since dividing logits by it overflows.
SAMPLING_EPS, MIN_TEMPERATURE = 1e-5, 1e-2


class SamplingType(enum.IntEnum):
    """vLLM's: how a request's tokens are drawn."""
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class RequestOutputKind(enum.Enum):
    """What `LLMEngine.step()` returns for a running request (vLLM's): CUMULATIVE every token so
    far at each step, DELTA only the tokens new since its last output, FINAL_ONLY one output when
    it finishes (what `generate` asks for)."""
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """vLLM's: the one constraint every sampled token of a request obeys (docs/structured-outputs.md).

    Exactly one of `json` (a JSON schema, dict or text), `regex`, `choice` (strings),
    `grammar` (EBNF, or Lark when it has no `::=`) or `json_object` (any JSON object) is set;
    none or several is an error here, before any engine sees it. `disable_any_whitespace`
    makes JSON compact; `disable_additional_properties` closes every object of the schema that
    does not say otherwise; `whitespace_pattern` is read by vLLM's other backends only
    (xgrammar's ignores it, as here). `structural_tag` is vLLM's too and refused here.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        set_ = [name for name in CONSTRAINT_FIELDS if getattr(self, name) not in (None, False)]
        if len(set_) > 1:
            raise ConfigError(f"structured_outputs: only one constraint may be set, got {', '.join(set_)}")
        if not set_:
            raise ConfigError(f"structured_outputs: set one constraint of {', '.join(CONSTRAINT_FIELDS)}; none is set")
        kind = set_[0]
        if kind == "structural_tag":  # vLLM's tool-call tags: no backend here builds them
            raise ConfigError("structured_outputs.structural_tag is not supported by spmd_engine "
                              "(json, regex, choice, grammar or json_object are)")
        value = getattr(self, kind)
        expected = {"json": (str, dict), "regex": str, "grammar": str, "structural_tag": str, "json_object": bool}
        if kind == "choice":
            if (not isinstance(value, (list, tuple)) or not value
                    or not all(isinstance(c, str) for c in value)):
                raise ConfigError(f"structured_outputs.choice must be a non-empty list of strings, got {value!r}")
            self.choice = list(value)
        elif not isinstance(value, expected[kind]) or (isinstance(value, str) and not value):
            raise ConfigError(f"structured_outputs.{kind} has the wrong type or is empty: {value!r}")
        for flag in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(f"structured_outputs.{flag} must be True or False, got {getattr(self, flag)!r}")

    @property
    def kind(self) -> str:
        """The constraint's field name."""
        return next(name for name in CONSTRAINT_FIELDS if getattr(self, name) not in (None, False))

    @classmethod
    def from_dict(cls, fields: dict) -> "StructuredOutputsParams":
        """From a JSON object (a prompts-file line, a batch body); unknown keys are an error."""
        known = set(cls.__dataclass_fields__)
        odd = sorted(set(fields) - known)
        if odd:
            raise ConfigError(f"structured_outputs: unknown field(s) {odd} (known: {', '.join(sorted(known))})")
        return cls(**fields)


@dataclass
class SamplingParams:
    """vLLM's names, defaults and meanings: temperature 1.0 unless asked (0 is greedy, below
    0.01 is raised to 0.01); top_k 0 or -1 means no limit; max_tokens None runs up to the
    model's context; seed None or -1 means unseeded; logprobs True is 1, -1 the whole
    vocabulary (LLM(max_logprobs=...) bounds it, as in vLLM).

    `seed` fixes this request's random stream, so it gets the same tokens
    whichever replica or batch it lands in. Left as None, the request draws a
    fresh seed from the engine's stream (started by LLM(seed=...)), different
    on every generate call, as in vLLM. With `n` > 1 sample k draws from its
    own stream (`seed + k`). `logprobs=0` returns the sampled token's logprob,
    K > 0 the top K as well: the model's own distribution (log_softmax of the
    raw logits, before temperature / top-k / top-p, as vLLM's default
    "raw_logprobs"). `prompt_logprobs=K` does the same for every prompt token
    after the first (the request then skips the prefix cache, as vLLM).

    Processing order, as vLLM's sampler: `min_tokens` masks EOS and
    `stop_token_ids`; penalties (`repetition_penalty` over prompt and output
    tokens: positive logits divided, negative multiplied; `frequency_penalty` x
    count and `presence_penalty` over output tokens only, subtracted); then
    temperature, `min_p` (drop tokens below min_p x the top probability),
    `top_k`, `top_p`. A sampled id in `stop_token_ids` ends the request with
    finish_reason "stop" and stop_reason that id, and stays in the output.

    `stop` strings end a request (finish_reason "stop", stop_reason the string)
    as soon as its text contains one, wherever the token boundaries fall; the
    text ends before the string unless `include_stop_str_in_output`. The
    tokens that produced it stay in token_ids, as in vLLM. `detokenize=False`
    leaves `text` empty (token ids only, no decoding cost), and
    `skip_special_tokens` drops special tokens from the text.

    Logit processors, applied first (vLLM's order): `allowed_token_ids` keeps
    only those ids; `bad_words` bans each word's last token wherever the output
    so far ends with the word's other tokens (a one-token word always; each
    word tokenized as given and with a leading space); `min_tokens` (above);
    `logit_bias` adds {id: bias}; then the penalties. `return_sampling_mask`
    returns, per generated token, the ids the sampler could have chosen after
    min_p / top_k / top_p (`CompletionOutput.sampling_mask`): what a trainer
    needs to renormalise its own distribution over the same support.

    `output_kind` (a RequestOutputKind) is what `llm.llm_engine.step()` returns for the
    request as it runs; `generate` always returns final outputs.
    """

    # vLLM's fields, in vLLM's order (a positional call lands where it would in vLLM).
    n: int = 1  # samples per prompt: RequestOutput.outputs[0..n-1]
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    watermarking: bool | None = None  # vLLM's output watermark: refused when set
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None  # normalised to a list of strings
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    thinking_token_budget: int | None = None  # refused when set (no reasoning parser here)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # vLLM reads it for slow tokenizers only; none here is
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    stream_interval: int | None = None
    structured_outputs: "StructuredOutputsParams | None" = None  # a dict is read as one
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    extra_args: dict | None = None  # carried for custom logits processors; read by none here
    skip_clone: bool = False
    # This engine's own.
    return_sampling_mask: bool = False

    def __post_init__(self) -> None:
        mt = self.max_tokens
        if mt is not None and (isinstance(mt, bool) or not isinstance(mt, int) or mt < 1):
            raise ConfigError(f"max_tokens must be an integer >= 1 or None (up to max_model_len), got {mt!r}")
        self._check_temperature()
        if self.seed == -1 and not isinstance(self.seed, bool):
            self.seed = None  # vLLM: -1 is "no seed"
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ConfigError(f"top_k must be 0 or -1 (no limit) or an integer >= 1, got {self.top_k!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is True:
                value = 1  # vLLM: True asks for the one sampled token's logprob
                setattr(self, name, value)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < -1):
                raise ConfigError(f"{name} must be an integer >= 0, or -1 (the whole vocabulary), got {value!r}")
        self._check_unsupported()
        _check_number("min_p", self.min_p, lambda v: 0 <= v <= 1, "in [0, 1]")
        _check_number("repetition_penalty", self.repetition_penalty, lambda v: v > 0, "> 0")
        _check_number("presence_penalty", self.presence_penalty, lambda v: -2 <= v <= 2, "in [-2, 2]")
        _check_number("frequency_penalty", self.frequency_penalty, lambda v: -2 <= v <= 2, "in [-2, 2]")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ConfigError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ConfigError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.stop_token_ids is not None:
            ids = self.stop_token_ids
            if (not isinstance(ids, (list, tuple))
                    or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids)):
                raise ConfigError(f"stop_token_ids must be a list of token ids >= 0, got {ids!r}")
            self.stop_token_ids = list(ids)
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ConfigError(f"n must be an integer >= 1 (samples per prompt), got n={self.n!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ConfigError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        self._check_stop()
        self._check_processors()
        if self.greedy:  # as vLLM: the filters mean nothing to an argmax
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _check_temperature(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or not 0 <= t <= 2:
            raise ConfigError(f"temperature must be a number in [0, 2], got {t!r}")
        if 0 < t < MIN_TEMPERATURE:
            logger.warning("temperature %s is below %s, which overflows the scaled logits: raised to %s "
                           "(vLLM does the same)", t, MIN_TEMPERATURE, MIN_TEMPERATURE)
            self.temperature = MIN_TEMPERATURE

    def _check_unsupported(self) -> None:
        """vLLM's fields that would change a result and that this engine does not implement: a
        one-line error naming each, never a silent default."""
        unsupported = {"watermarking": self.watermarking is not None and self.watermarking is not False,
                       "thinking_token_budget": self.thinking_token_budget is not None}
        for name, set_ in unsupported.items():
            if set_:
                raise ConfigError(f"SamplingParams.{name}={getattr(self, name)!r} is not supported by spmd_engine")
        if isinstance(self.structured_outputs, dict):  # JSON bodies and prompt files carry a dict
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ConfigError(f"structured_outputs must be a StructuredOutputsParams, got {self.structured_outputs!r}")
        si = self.stream_interval
        if si is not None and (isinstance(si, bool) or not isinstance(si, int) or si < 1):
            raise ConfigError(f"stream_interval must be an integer >= 1, got {si!r}")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ConfigError(f"extra_args must be a dict, got {self.extra_args!r}")

    @classmethod
    def from_optional(cls, **kwargs) -> "SamplingParams":
        """vLLM's: None for any argument means its default (what a generation config left unset)."""
        return cls(**{k: v for k, v in kwargs.items() if v is not None})

    def clone(self) -> "SamplingParams":
        """A copy the engine may change (vLLM's: deep unless skip_clone)."""
        return copy.copy(self) if self.skip_clone else copy.deepcopy(self)

    @property
    def sampling_type(self) -> SamplingType:
        if self.greedy:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    def _check_processors(self) -> None:
        ids = self.allowed_token_ids
        if ids is not None:
            if (not isinstance(ids, (list, tuple)) or not ids
                    or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids)):
                raise ConfigError(f"allowed_token_ids must be a non-empty list of token ids >= 0, got {ids!r}")
            self.allowed_token_ids = list(ids)
        if self.logit_bias is not None:
            self.logit_bias = _checked_bias(self.logit_bias)
        words = self.bad_words
        if words is not None:
            if isinstance(words, str) or not isinstance(words, (list, tuple)) or not all(
                    isinstance(w, str) and w.strip() for w in words):
                raise ConfigError(f"bad_words must be a list of non-empty strings, got {words!r}")
            self.bad_words = list(words)
        if not isinstance(self.return_sampling_mask, bool):
            raise ConfigError(f"return_sampling_mask must be True or False, got {self.return_sampling_mask!r}")

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
        return self.temperature < SAMPLING_EPS

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        """bad_words as token ids, set by the front end's tokenizer (vLLM: update_from_tokenizer)."""
        return self.__dict__.get("_bad_words_token_ids")

    def set_bad_words_token_ids(self, ids: list[list[int]]) -> None:
        self.__dict__["_bad_words_token_ids"] = ids

    @property
    def keeps_history(self) -> bool:
        """The sampler needs this request's output tokens (penalties, bad words)."""
        return self.penalized or bool(self.bad_words)

    @property
    def penalized(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def _check_number(name: str, value, ok, allowed: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or not ok(value):
        raise ConfigError(f"{name} must be a number {allowed}, got {name}={value!r}")


def _checked_bias(bias) -> dict[int, float]:
    """{token id: finite bias}; ids may come as decimal strings (JSON objects' keys)."""
    if not isinstance(bias, dict):
        raise ConfigError(f"logit_bias must be a dict {{token id: bias}}, got {bias!r}")
    out = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.strip().isdigit() else key
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ConfigError(f"logit_bias keys must be token ids >= 0, got {key!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"logit_bias[{key!r}] must be a finite number, got {value!r}")
        out[token] = float(value)
    return out
