"""Chat templates rendered as transformers renders them: for templates written here (ChatML,
Llama-3 style with a system prompt, add_generation_prompt logic with raise_exception, tools),
the token ids we build equal `apply_chat_template`'s on the same tokenizer files."""

from __future__ import annotations

import json
import sys

import pytest
from chat_checkpoint import ALTERNATING, CHATML, LLAMA3, TOOLS, WEATHER, write_tokenizer
from conftest import require_reference

from spmd_engine.config import ConfigError
from spmd_engine.engine.chat_template import chat_prompt, choose_template, normalize_messages, render
from spmd_engine.model.tokenizer import load_tokenizer

TALK = [{"role": "user", "content": "Beautiful is better than ugly?"},
        {"role": "assistant", "content": "  Explicit is better than implicit.  "},
        {"role": "user", "content": "And simple?"}]
WITH_SYSTEM = [{"role": "system", "content": "You recite the Zen."}] + TALK
TOOL_TALK = [{"role": "user", "content": "Weather in Zürich?"},
             {"role": "assistant", "content": None,
              "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"place": "Zürich"}}}]},
             {"role": "tool", "content": "{\"celsius\": 21}"}]

CASES = [
    ("chatml", CHATML, TALK, {}),
    ("chatml-no-generation-prompt", CHATML, TALK[:2], {"add_generation_prompt": False}),
    ("chatml-continue", CHATML, TALK[:2], {"add_generation_prompt": False, "continue_final_message": True}),
    ("llama3-system", LLAMA3, WITH_SYSTEM, {}),
    ("llama3-default-system", LLAMA3, TALK, {}),
    ("llama3-continue-trimmed", LLAMA3, TALK[:2], {"add_generation_prompt": False, "continue_final_message": True}),
    ("alternating", ALTERNATING, WITH_SYSTEM, {}),
    ("alternating-no-generation-prompt", ALTERNATING, TALK, {"add_generation_prompt": False}),
    ("alternating-after-answer", ALTERNATING, TALK[:2], {"add_generation_prompt": False}),
    ("tools", TOOLS, TOOL_TALK, {"tools": [WEATHER]}),
    ("tools-none", TOOLS, TALK, {}),
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    require_reference("tokenizers")
    path = tmp_path_factory.mktemp("tok")
    (path / "config.json").write_text(json.dumps({"vocab_size": 300}))
    write_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer_dir):
    transformers = require_reference("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))


def ours(tokenizer_dir, template, messages, **kwargs):
    kwargs.setdefault("add_generation_prompt", True)
    return chat_prompt(load_tokenizer(tokenizer_dir), tokenizer_dir, normalize_messages(messages), template, **kwargs)


@pytest.mark.parametrize("name, template, messages, kwargs", CASES, ids=[c[0] for c in CASES])
def test_token_ids_equal_transformers(tokenizer_dir, hf_tokenizer, name, template, messages, kwargs):
    hf_kwargs = {"add_generation_prompt": True, **kwargs}
    text = hf_tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, **hf_kwargs)
    ids = hf_tokenizer.apply_chat_template(messages, chat_template=template, return_dict=False, **hf_kwargs)
    got = ours(tokenizer_dir, template, messages, **kwargs)
    assert got["prompt"] == text
    assert got["prompt_token_ids"] == list(ids)
    assert len(set(ids)) > 10  # a real tokenization, with merges and special tokens
    if "tools" in kwargs:
        assert "<now>" in text and "°C" in text  # tojson neither HTML- nor ASCII-escapes


def test_the_checkpoints_template_and_its_file(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    assert choose_template(tmp_path, None, None) == CHATML
    assert choose_template(tmp_path, LLAMA3, None) == LLAMA3  # an explicit template wins
    (tmp_path / "chat_template.jinja").write_text(TOOLS)
    assert choose_template(tmp_path, None, None) == TOOLS  # the file wins, as in transformers
    named = [{"name": "default", "template": CHATML}, {"name": "tool_use", "template": TOOLS}]
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert choose_template(tmp_path, None, None) == CHATML
    assert choose_template(tmp_path, None, [WEATHER]) == TOOLS
    assert choose_template(tmp_path, "tool_use", None) == TOOLS


def test_no_template_is_one_clear_error(tmp_path):
    with pytest.raises(ConfigError, match=r"no chat template: .* has none .*--chat-template FILE"):
        choose_template(tmp_path, None, None)


@pytest.mark.parametrize("template, messages, kwargs, message", [
    (ALTERNATING, TALK[1:], {}, "chat template: Conversation roles must alternate"),
    (CHATML, TALK, {"continue_final_message": True}, "cannot both be set"),
    ("{% for m in messages %}", TALK, {}, "chat template: syntax error on line 1"),
    (CHATML, [], {}, "non-empty list of messages"),
    (CHATML, [{"content": "no role"}], {}, 'string "role"'),
    (CHATML, TALK, {"tools": ["not a schema"]}, "tools must be a list of JSON-schema dicts"),
])
def test_bad_conversations_are_config_errors(template, messages, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        render(template, normalize_messages(messages) if messages else normalize_messages(messages), **kwargs)


def test_text_parts_join_as_one_string():
    parts = [{"role": "user", "content": [{"type": "text", "text": "Flat is"}, {"type": "text", "text": "better"}]}]
    assert render(CHATML, normalize_messages(parts)) == "<|im_start|>user\nFlat is\nbetter<|im_end|>\n<|im_start|>assistant\n"


def test_missing_jinja2_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "jinja2", None)
    with pytest.raises(ConfigError, match=r"jinja2.*pip install 'spmd_engine\[hf\]'"):
        render(CHATML, normalize_messages(TALK))
