"""Prompts to token ids, checked against the model before any process or collective.

The run CLI uses this before it builds an engine, so a prompt that cannot fit
fails with one line in a second, not after every rank has loaded its shard.
"""

from __future__ import annotations

from spmd_engine.config import ConfigError

MAX_MODEL_LEN_CAP = 4096


class InputProcessor:
    def __init__(self, model_dir: str, max_model_len: int | None = None):
        from spmd_engine.model.loader import read_hf_config
        from spmd_engine.model.tokenizer import load_tokenizer
        self.hf_config = read_hf_config(model_dir)
        try:
            self.tokenizer, self._tokenizer_error = load_tokenizer(model_dir), None
        except ConfigError as exc:  # token-id prompts still work without one
            self.tokenizer, self._tokenizer_error = None, exc
        positions = int(self.hf_config.get("max_position_embeddings", MAX_MODEL_LEN_CAP))
        if max_model_len is not None and max_model_len > positions:
            raise ConfigError(f"max_model_len ({max_model_len}) exceeds the model's "
                              f"max_position_embeddings ({positions})")
        self.max_model_len = max_model_len or min(positions, MAX_MODEL_LEN_CAP)
        self.vocab_size = int(self.hf_config["vocab_size"])
        eos = getattr(self.tokenizer, "eos_token_id", None)
        self.eos_token_id = eos if eos is not None else _first_int(self.hf_config.get("eos_token_id"))

    def encode(self, prompt, index: int) -> tuple[str | None, list[int]]:
        """(text or None, token ids) for a string or a list of token ids; raises ConfigError."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError(f"text prompts need a tokenizer: {self._tokenizer_error}; "
                                  f"give prompt_token_ids instead")
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ConfigError(f"prompt {index}: token id {bad[0]} outside the vocabulary "
                                  f"[0, {self.vocab_size})")
        if not ids:
            raise ConfigError(f"prompt {index} is empty")
        if len(ids) >= self.max_model_len:
            raise ConfigError(f"prompt {index} has {len(ids)} tokens; max_model_len is {self.max_model_len} "
                              f"(a prompt must leave room for at least one new token)")
        return text, ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""


def _first_int(value) -> int | None:
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) else None
