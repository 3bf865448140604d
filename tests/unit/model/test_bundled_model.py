"""The bundled default model and the byte tokenizer.

The bundled model recites the Zen of Python: greedy decoding from a line start
must continue the text exactly and stop with EOS. This is the end-to-end check
that loading, the KV cache, the head and the tokenizer agree.
"""

from __future__ import annotations

import codecs
import contextlib
import io
import json
import sys

import pytest
import torch
from conftest import require_reference
from fake_groups import SoloGroup

from spmd_engine.config import ConfigError
from spmd_engine.model import BUNDLED_MODEL_DIR, AttentionMetadata, ByteTokenizer, load_model, load_tokenizer
from spmd_engine.model.tokenizer import HFTokenizer


def zen() -> str:
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return codecs.decode(this.s, "rot13")


@torch.no_grad()
def greedy(model, prompt_ids: list[int], max_new: int, eos: int) -> list[int]:
    """Prefill the prompt, then decode one token per step through the paged KV cache
    (blocks handed out in reverse order, so the table is not the identity)."""
    block_size = 16
    num_blocks = -(-(len(prompt_ids) + max_new + 1) // block_size)
    model.allocate_kv_cache(num_blocks, block_size)
    table = list(reversed(range(num_blocks)))
    tokens, ctx, out = list(prompt_ids), 0, []
    for _ in range(max_new):
        attn = AttentionMetadata.build([ctx], [len(tokens)], [table], block_size, "cpu")
        hidden = model(torch.tensor(tokens), attn.positions, attn)["hidden_states"]
        token = int(model.compute_logits(hidden[-1:]).argmax(-1))
        out.append(token)
        if token == eos:
            break
        ctx, tokens = ctx + len(tokens), [token]
    return out


def test_bundled_model_shape():
    config = json.loads((BUNDLED_MODEL_DIR / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 8
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (8, 2)
    assert config["spmd_engine_tokenizer"] == "bytes"
    assert (BUNDLED_MODEL_DIR / "model.safetensors").stat().st_size < 16 * 2**20


@pytest.mark.timeout(240)  # 811 single-token steps; slow when the suite loads both cores
def test_greedy_decode_recites_the_zen_from_beautiful_is():
    text = zen()
    tok = load_tokenizer(None)
    model = load_model(None, SoloGroup(), SoloGroup())
    prompt = "Beautiful is"
    out = greedy(model, tok.encode(prompt), len(text), tok.eos_token_id)
    expected = text[text.index(prompt) + len(prompt):]
    assert tok.decode(out) == expected
    assert out[-1] == tok.eos_token_id


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode("héllo ✓")
    assert ids[0] == tok.bos_token_id == 256 and tok.eos_token_id == 257
    assert all(0 <= i < 256 for i in ids[1:])
    assert tok.decode(ids + [tok.eos_token_id]) == "héllo ✓"
    assert tok.encode("ab", add_special_tokens=False) == [97, 98]
    assert tok.decode([0xE2, 0x9C]) == "\ufffd"  # truncated UTF-8 is replaced, not an error


def test_load_tokenizer_picks_bytes_by_marker():
    assert isinstance(load_tokenizer(BUNDLED_MODEL_DIR), ByteTokenizer)


def test_load_tokenizer_without_any_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="no tokenizer in .*tokenizer.json"):
        load_tokenizer(tmp_path)


def test_tokenizer_json_needs_the_tokenizers_package(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(ConfigError, match="pip install tokenizers"):
        load_tokenizer(tmp_path)


def test_tokenizer_json_with_tokenizers_installed(tmp_path):
    tokenizers = require_reference("tokenizers")
    vocab = {"<s>": 0, "</s>": 1, "hello": 2, "world": 3, "[UNK]": 4}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tk.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [1, 4]}))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer)
    assert tok.encode("hello world") == [2, 3]
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)
    assert tok.decode([2, 3]) == "hello world"
