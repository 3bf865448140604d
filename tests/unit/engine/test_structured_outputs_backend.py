"""Structured outputs below the engine: StructuredOutputsParams' checks, the tokens' bytes a
grammar is matched against (byte tokenizer, byte-level BPE), the xgrammar backend's cache and
error messages, the missing-extra message, and the manager's matchers following the request's
tokens (reset and replayed when they would be stale)."""

from __future__ import annotations

import builtins

import pytest

from spmd_engine.config import ConfigError
from spmd_engine.core.request import Request
from spmd_engine.core.step_messages import ScheduledSeq, SchedulerOutput
from spmd_engine.model.tokenizer import ByteTokenizer
from spmd_engine.sampling_params import SamplingParams, StructuredOutputsParams

pytest.importorskip("xgrammar")


def test_exactly_one_constraint_and_typed_fields():
    with pytest.raises(ConfigError, match="none is set"):
        StructuredOutputsParams()
    with pytest.raises(ConfigError, match="only one constraint may be set, got json, regex"):
        StructuredOutputsParams(json={}, regex="a")
    with pytest.raises(ConfigError, match="choice must be a non-empty list of strings"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ConfigError, match="unknown field"):
        SamplingParams(structured_outputs={"regexp": "a"})
    with pytest.raises(ConfigError, match="must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs=object())
    assert SamplingParams(structured_outputs={"choice": ("a", "b")}).structured_outputs.choice == ["a", "b"]
    assert StructuredOutputsParams(json_object=True).kind == "json_object"


def test_token_bytes_of_the_byte_and_bpe_tokenizers(tmp_path):
    from chat_checkpoint import write_tokenizer

    from spmd_engine.model.token_bytes import token_bytes
    from spmd_engine.model.tokenizer import load_tokenizer
    assert token_bytes(ByteTokenizer(), 260) == [bytes([i]) for i in range(256)] + [None] * 4
    (tmp_path / "config.json").write_text('{"vocab_size": 300}')
    write_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path)
    table = token_bytes(tok, 300)
    assert table[0] is None and table[1] is None  # <s>, </s>: special
    multi = [i for i, b in enumerate(table) if b is not None and len(b) > 1]
    assert multi, "a trained BPE has merged tokens"
    for i in multi + list(range(10, 200)):  # each token's bytes are what it decodes to (ASCII here)
        if table[i] is not None and table[i].isascii():
            assert table[i].decode() == tok.decode([i]), i
    assert table[tok.encode(" ", add_special_tokens=False)[0]] == b" "  # Ġ is a space


def _backend():
    from spmd_engine.engine.structured.xgrammar_backend import XgrammarBackend
    return XgrammarBackend(ByteTokenizer(), 258, [257])


def test_backend_caches_compiles_and_names_what_xgrammar_refuses():
    from spmd_engine.engine.structured.backend import StructuredOutputError
    backend = _backend()
    so = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    assert backend.compile(so) is backend.compile(StructuredOutputsParams(json='{"properties": {"a": {"type": "integer"}}, "type": "object"}'))
    with pytest.raises(StructuredOutputError, match=r"^structured_outputs.regex was refused by xgrammar: Regex parsing error at position 5: Unclosed '\['$"):
        backend.compile(StructuredOutputsParams(regex="([a-"))
    with pytest.raises(StructuredOutputError, match="structured_outputs.json is not valid JSON"):
        backend.compile(StructuredOutputsParams(json="{"))
    with pytest.raises(StructuredOutputError, match="grammar was refused by xgrammar: EBNF parser error"):
        backend.compile(StructuredOutputsParams(grammar='root ::= "a" |'))
    with pytest.raises(ConfigError, match="structural_tag is not supported"):  # refused before any backend
        StructuredOutputsParams(structural_tag="{}")


def test_disable_additional_properties_closes_every_object():
    from spmd_engine.engine.structured.xgrammar_backend import _closed
    closed = _closed({"type": "object", "properties": {"o": {"type": "object"}, "p": {"type": "object",
                                                                                   "additionalProperties": True}}})
    assert closed["additionalProperties"] is False and closed["properties"]["o"]["additionalProperties"] is False
    assert closed["properties"]["p"]["additionalProperties"] is True


def test_the_missing_extra_is_one_line_naming_it(monkeypatch):
    from spmd_engine.engine.structured import xgrammar_backend
    real_import = builtins.__import__

    def no_xgrammar(name, *args, **kwargs):
        if name == "xgrammar":
            raise ImportError("No module named 'xgrammar'")
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_xgrammar)
    with pytest.raises(ConfigError, match=r"^structured outputs need xgrammar: pip install 'spmd_engine\[structured\]'$"):
        xgrammar_backend.import_xgrammar()


def test_the_matcher_follows_the_requests_tokens_and_is_rebuilt_when_stale(monkeypatch):
    from spmd_engine.engine.structured.manager import StructuredOutputManager
    from spmd_engine.sample.grammar_mask import unpack
    manager = StructuredOutputManager("unused", [257])
    manager._backend = _backend()
    params = SamplingParams(structured_outputs={"choice": ["abc", "abd"]})
    request = Request("r", [256, 65], params, seed=0)
    manager.add(request)

    def allowed():
        out = SchedulerOutput(1, [ScheduledSeq("r", [65], 1, [], False, sample=True)], [], [])
        grammar = manager.bitmask(out, {"r": request})
        return None if grammar is None else unpack(grammar.bitmask, 258, "cpu")[0].nonzero().flatten().tolist()

    assert allowed() == [ord("a")]
    request.output_token_ids += [ord("a"), ord("b")]
    assert allowed() == [ord("c"), ord("d")]
    request.output_token_ids[:] = [ord("a")]  # fewer tokens than the matcher took: reset and replay
    assert allowed() == [ord("b")]
    request.output_token_ids += [ord("b"), ord("d")]
    assert allowed() == [257]  # only EOS once the grammar can end
    request.output_token_ids.append(257)
    assert manager.ended(request) and allowed() is None  # ended: no row (unconstrained, as vLLM)
    manager.remove("r")
    assert manager.tracks == {}
