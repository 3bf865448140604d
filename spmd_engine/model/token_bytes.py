"""Each token id as the bytes it adds to the output: what a grammar backend matches against.

A grammar constrains text, the sampler picks token ids, so the backend needs
every token's bytes. The byte tokenizer's are its ids. A `tokenizer.json`
stores its tokens in its decoder's encoding: GPT-2's byte-level alphabet
(`Ġ` is a space), SentencePiece's `▁` for a space and `<0xNN>` byte-fallback
tokens, or plain text. Special tokens (BOS, EOS, chat markers) get None: no
grammar may emit them; EOS comes back as the backend's stop token instead.
"""

from __future__ import annotations

import json


def token_bytes(tokenizer, vocab_size: int) -> list[bytes | None]:
    """`vocab_size` entries (the model's, which may exceed the tokenizer's): bytes, or None for
    ids that are special or that the tokenizer lacks."""
    from spmd_engine.model.tokenizer import ByteTokenizer
    if isinstance(tokenizer, ByteTokenizer):
        return [bytes([i]) if i < 256 else None for i in range(vocab_size)]
    backend = tokenizer.backend
    spec = json.loads(backend.to_str())
    special = {t["id"] for t in spec.get("added_tokens", ()) if t.get("special")}
    decoders = _decoder_types(spec.get("decoder"))
    to_bytes = _byte_level if "ByteLevel" in decoders else _sentencepiece if (
        "ByteFallback" in decoders or "Metaspace" in decoders or "Replace" in decoders) else _plain
    out: list[bytes | None] = [None] * vocab_size
    for text, i in backend.get_vocab(with_added_tokens=True).items():
        if i < vocab_size and i not in special:
            out[i] = to_bytes(text)
    return out


def _decoder_types(decoder) -> set[str]:
    if not decoder:
        return set()
    if decoder.get("type") == "Sequence":
        return set().union(*(_decoder_types(d) for d in decoder.get("decoders", ())))
    return {decoder.get("type")}


def _byte_level(text: str) -> bytes:
    table = _unicode_to_byte()
    if all(c in table for c in text):
        return bytes(table[c] for c in text)
    return text.encode("utf-8")  # an added (non-special) token, stored as plain text


def _sentencepiece(text: str) -> bytes:
    if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        return bytes([int(text[3:5], 16)])
    return text.replace("\u2581", " ").encode("utf-8")


def _plain(text: str) -> bytes:
    return text.encode("utf-8")


_TABLE: dict[str, int] = {}


def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: printable bytes stand for themselves, the other
    bytes for the code points from 256 up, in byte order."""
    if not _TABLE:
        printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
        extra = 0
        for b in range(256):
            if b in printable:
                _TABLE[chr(b)] = b
            else:
                _TABLE[chr(256 + extra)] = b
                extra += 1
    return _TABLE
