"""Tokenizers: a built-in byte-level one, and HF `tokenizer.json` when available.

The byte tokenizer needs no files and no packages, which is what lets the
bundled model run anywhere: ids 0..255 are the UTF-8 bytes, 256 is BOS and 257
EOS. Real checkpoints bring a `tokenizer.json`, read with the optional
`tokenizers` package. Both expose the same small interface: encode, decode,
bos_token_id, eos_token_id, vocab_size.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable

from spmd_engine.config import ConfigError

TOKENIZER_MARKER_KEY = "spmd_engine_tokenizer"


class ByteTokenizer:
    bos_token_id = 256
    eos_token_id = 257
    vocab_size = 258

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """UTF-8 bytes of `text`, after BOS unless add_special_tokens is False."""
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id] + ids if add_special_tokens else ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Bytes back to text (invalid UTF-8 becomes U+FFFD); BOS/EOS are dropped."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers.Tokenizer` behind the ByteTokenizer interface."""

    def __init__(self, path: Path, bos_token_id: int | None, eos_token_id: int | None):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ConfigError(
                f"{path} needs the 'tokenizers' package: pip install tokenizers"
            ) from None
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises plain Exception subclasses
            raise ConfigError(f"{path}: cannot load tokenizer: {exc}") from None
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def backend(self):
        """The `tokenizers.Tokenizer` itself (model/token_bytes.py reads its vocabulary)."""
        return self._tok


def _first_id(value: Any) -> int | None:
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) else None


def load_tokenizer(model_dir: str | os.PathLike | None = None):
    """The tokenizer of a model directory (None: the bundled model).

    config.json `"spmd_engine_tokenizer": "bytes"` selects the byte tokenizer;
    otherwise `tokenizer.json` is required.
    """
    from spmd_engine.model.loader import BUNDLED_MODEL_DIR, read_hf_config

    model_dir = Path(model_dir) if model_dir is not None else BUNDLED_MODEL_DIR
    config = read_hf_config(model_dir)
    marker = config.get(TOKENIZER_MARKER_KEY)
    if marker == "bytes":
        return ByteTokenizer()
    if marker is not None:
        raise ConfigError(f"{model_dir / 'config.json'}: unknown {TOKENIZER_MARKER_KEY} {marker!r} (expected 'bytes')")
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(
            f"no tokenizer in {model_dir}: expected tokenizer.json "
            f"(or config.json key \"{TOKENIZER_MARKER_KEY}\": \"bytes\")"
        )
    return HFTokenizer(path, _first_id(config.get("bos_token_id")), _first_id(config.get("eos_token_id")))
