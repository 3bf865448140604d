"""Prompts to token ids, checked against the model before any process or collective.

The run CLI uses this before it builds an engine, so a prompt that cannot fit
fails with one line in a second, not after every rank has loaded its shard.
"""

from __future__ import annotations

import os

from spmd_engine.config import ConfigError


class InputProcessor:
    def __init__(self, model_dir: str, max_model_len: int | None = None, skip_tokenizer_init: bool = False):
        """max_model_len defaults to the model's max_position_embeddings, as in vLLM; only the KV
        budget limits it (an error naming the numbers when one such sequence cannot fit).
        `skip_tokenizer_init` (vLLM's): no tokenizer is read, as for a model without one, so
        prompts are token ids and outputs carry ids and empty text; each refusal names it."""
        from spmd_engine.model.loader import read_hf_config
        from spmd_engine.model.spec import ModelSpec
        from spmd_engine.model.tokenizer import load_tokenizer
        self.hf_config = read_hf_config(model_dir)
        self.model_dir = str(model_dir)
        # Every field checked (one line naming config.json) before any is used here.
        spec = ModelSpec.from_hf_config(self.hf_config, os.path.join(model_dir, "config.json"))
        self.skip_tokenizer_init = skip_tokenizer_init
        if skip_tokenizer_init:
            self.tokenizer, self._tokenizer_error = None, ConfigError("skip_tokenizer_init=True loads no tokenizer")
        else:
            try:
                self.tokenizer, self._tokenizer_error = load_tokenizer(model_dir), None
            except ConfigError as exc:  # token-id prompts still work without one
                self.tokenizer, self._tokenizer_error = None, exc
        positions = spec.max_position_embeddings
        if max_model_len is not None and max_model_len < 1:
            raise ConfigError(f"max_model_len must be at least 1, got {max_model_len}")
        if max_model_len is not None and max_model_len > positions:
            raise ConfigError(f"max_model_len ({max_model_len}) exceeds the model's "
                              f"max_position_embeddings ({positions})")
        self.max_model_len = max_model_len or positions
        self.vocab_size = spec.vocab_size
        self.eos_token_ids = eos_token_ids(model_dir, self.hf_config, self.tokenizer)
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None
        self.max_logprobs = 20  # EngineArgs sets both (vLLM's max_logprobs, generation_config)
        self.default_sampling_kwargs: dict = {}
        self.return_sampling_mask = False  # LLM(return_sampling_mask=True): every request's masks

    def encode(self, prompt, index: int, tokenization_kwargs: dict | None = None) -> tuple[str | None, list[int]]:
        """(text or None, token ids) for a string, a list of token ids, or vLLM's prompt dicts
        {"prompt": text} / {"prompt_token_ids": ids}, cut as `tokenization_kwargs` asks
        (engine/tokenization.py); raises ConfigError."""
        from spmd_engine.engine.tokenization import Tokenization
        cut = Tokenization.parse(tokenization_kwargs, self.max_model_len)
        if isinstance(prompt, dict):
            prompt = _from_prompt_dict(prompt, index)
            if isinstance(prompt, tuple):  # token ids, with the text they came from if given
                text, ids = prompt
                return text, self.encode(ids, index, tokenization_kwargs)[1]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError(f"text prompts need a tokenizer: {self._tokenizer_error}; "
                                  f"give prompt_token_ids instead")
            text, ids = prompt, self.tokenizer.encode(prompt, add_special_tokens=cut.add_special_tokens)
        else:
            text, ids = None, [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ConfigError(f"prompt {index}: token id {bad[0]} outside the vocabulary "
                                  f"[0, {self.vocab_size})")
        ids = cut.truncate(ids)
        if not ids:
            raise ConfigError(f"prompt {index} is empty")
        if len(ids) >= self.max_model_len:
            raise ConfigError(f"prompt {index} has {len(ids)} tokens; max_model_len is {self.max_model_len} "
                              f"(a prompt must leave room for at least one new token)")
        return text, ids

    def check_params(self, params, index: int) -> None:
        """Token ids in the sampling params against the vocabulary, the logprobs asked for
        against max_logprobs (vLLM's message), and bad_words tokenized."""
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            asked = self.vocab_size if asked == -1 else asked
            if asked and asked > self.max_logprobs:
                raise ConfigError(f"prompt {index}: requested {name.replace('_', ' ')} of {asked}, which is "
                                  f"greater than max allowed: {self.max_logprobs} (LLM(max_logprobs=...))")
        if params.stop and self.skip_tokenizer_init:  # text is never decoded, so never matched
            raise ConfigError(f"prompt {index}: stop strings need the detokenizer, which skip_tokenizer_init=True "
                              f"turns off: use stop_token_ids")
        for name, ids in (("allowed_token_ids", params.allowed_token_ids), ("logit_bias", params.logit_bias)):
            bad = [t for t in ids or () if t >= self.vocab_size]
            if bad:
                raise ConfigError(f"prompt {index}: {name} has token id {bad[0]} outside the vocabulary "
                                  f"[0, {self.vocab_size})")
        if params.structured_outputs is not None:
            self._check_structured(params.structured_outputs, index)
        if params.bad_words and params.bad_words_token_ids is None:
            if self.tokenizer is None:
                raise ConfigError(f"prompt {index}: bad_words need a tokenizer, and this model has none "
                                  f"({self._tokenizer_error})")
            encode = lambda text: self.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
            params.set_bad_words_token_ids(bad_words_token_ids(params.bad_words, encode))

    def _check_structured(self, constraint, index: int) -> None:
        """Compile the constraint now (the engine takes it from the same cache): a schema, regex
        or grammar the backend refuses fails this request with the backend's message."""
        if self.tokenizer is None:
            raise ConfigError(f"prompt {index}: structured_outputs need the tokenizer's vocabulary "
                              f"({self._tokenizer_error})")
        from spmd_engine.engine.structured.backend import grammar_backend
        try:
            grammar_backend(self.model_dir, self.tokenizer, self.vocab_size, sorted(self.eos_token_ids)).compile(constraint)
        except ConfigError as exc:
            raise ConfigError(f"prompt {index}: {exc}") from None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


PROMPT_KEYS = ("prompt", "prompt_token_ids")


def _from_prompt_dict(prompt: dict, index: int):
    """vLLM's TextPrompt / TokensPrompt: the text, or (text or None, token ids)."""
    odd = sorted(set(prompt) - set(PROMPT_KEYS))
    if odd:
        raise ConfigError(f"prompt {index}: unsupported key(s) {odd} (expected 'prompt' or 'prompt_token_ids')")
    if "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if isinstance(ids, str) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ConfigError(f"prompt {index}: prompt_token_ids must be a list of token ids")
        return prompt.get("prompt"), list(ids)
    if not isinstance(prompt.get("prompt"), str):
        raise ConfigError(f"prompt {index}: a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
    return prompt["prompt"]


def _ids(value) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    return [v for v in value if isinstance(v, int)] if isinstance(value, list) else []


def eos_token_ids(model_dir: str, hf_config: dict, tokenizer) -> list[int]:
    """Every id that ends a request: the tokenizer's (or config.json's first) EOS, then the rest
    of config.json's and generation_config.json's `eos_token_id` (an int or a list: vLLM stops
    on all of them, e.g. Llama-3-Instruct's <|eot_id|> beside <|end_of_text|>)."""
    import json
    import os
    path = os.path.join(model_dir, "generation_config.json")
    generation = {}
    if os.path.isfile(path):
        try:
            with open(path) as f:
                generation = json.load(f)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{path}: cannot read: {exc}") from None
    primary = getattr(tokenizer, "eos_token_id", None)
    ids = ([primary] if primary is not None else []) + _ids(hf_config.get("eos_token_id"))
    ids += _ids(generation.get("eos_token_id") if isinstance(generation, dict) else None)
    return list(dict.fromkeys(ids))


def bad_words_token_ids(words: list[str], encode) -> list[list[int]]:
    """Each bad word as token ids, as written (leading spaces dropped) and, where it tokenizes
    to as many tokens but a different first one, with one leading space (the word in the
    middle of a text), as vLLM does."""
    out = []
    for word in words:
        bare = encode(word.lstrip())
        spaced = encode(" " + word.lstrip())
        if bare:
            out.append(bare)
        if spaced and (not bare or (spaced[0] != bare[0] and len(spaced) == len(bare))):
            out.append(spaced)
    return out
