"""`tokenization_kwargs` (vLLM's generate / add_request argument): how a prompt is cut.

Trainers and evaluation harnesses pass Hugging Face's tokenizer options to keep a long
prompt inside the context: `truncation` with `max_length`, or vLLM's own
`truncate_prompt_tokens`, on the side `truncation_side` names ("right" unless asked,
as HF's tokenizers), and `add_special_tokens`. These change which tokens the model sees,
so an option this engine does not implement is refused by name (vLLM warns and goes on).
"""

from __future__ import annotations

from dataclasses import dataclass

from spmd_engine.config import ConfigError

KNOWN = ("truncation", "max_length", "truncate_prompt_tokens", "truncation_side", "add_special_tokens")


@dataclass(frozen=True)
class Tokenization:
    keep: int | None = None  # the most prompt tokens kept (None: all)
    side: str = "right"  # the side cut off: "right" keeps the first tokens, "left" the last
    add_special_tokens: bool = True

    @classmethod
    def parse(cls, kwargs: dict | None, max_model_len: int) -> "Tokenization":
        if not kwargs:
            return cls()
        if not isinstance(kwargs, dict):
            raise ConfigError(f"tokenization_kwargs must be a dict, got {kwargs!r}")
        odd = sorted(set(kwargs) - set(KNOWN))
        if odd:
            raise ConfigError(f"tokenization_kwargs {odd} are not supported by spmd_engine "
                              f"(supported: {', '.join(KNOWN)})")
        keep = kwargs.get("truncate_prompt_tokens")
        truncation = kwargs.get("truncation")
        if truncation not in (None, True, False, "longest_first", "do_not_truncate"):
            raise ConfigError(f"tokenization_kwargs truncation={truncation!r} is not supported")
        if truncation in (True, "longest_first"):
            keep = kwargs.get("max_length", max_model_len - 1)
        elif truncation in (False, "do_not_truncate"):
            keep = None
        if keep == -1:  # vLLM: as many as the context allows
            keep = max_model_len - 1
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ConfigError(f"tokenization_kwargs: the truncation length must be an integer >= 1, got {keep!r}")
        side = kwargs.get("truncation_side") or "right"
        if side not in ("left", "right"):
            raise ConfigError(f"tokenization_kwargs truncation_side must be 'left' or 'right', got {side!r}")
        special = kwargs.get("add_special_tokens", True)
        if not isinstance(special, bool):
            raise ConfigError(f"tokenization_kwargs add_special_tokens must be True or False, got {special!r}")
        return cls(keep, side, special)

    def truncate(self, ids: list[int]) -> list[int]:
        if self.keep is None or len(ids) <= self.keep:
            return ids
        return ids[-self.keep:] if self.side == "left" else ids[:self.keep]
