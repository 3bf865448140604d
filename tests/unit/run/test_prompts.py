"""Prompt files: both formats, and errors that name the file and line."""

import pytest

from spmd_engine.config import ConfigError
from spmd_engine.run.prompts import DEFAULT_PROMPT, PromptInput, load_prompts


def test_cli_prompts_and_default():
    assert load_prompts([], None) == [PromptInput(text=DEFAULT_PROMPT)]
    assert load_prompts(["a", "b"], None) == [PromptInput(text="a"), PromptInput(text="b")]


def test_txt_and_jsonl(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_text("one\n\ntwo\n")
    assert [p.text for p in load_prompts([], str(txt))] == ["one", "two"]
    jl = tmp_path / "p.jsonl"
    jl.write_text('{"prompt": "hi"}\n{"prompt_token_ids": [1, 2]}\n')
    assert load_prompts([], str(jl)) == [PromptInput(text="hi"), PromptInput(token_ids=(1, 2))]


@pytest.mark.parametrize("content, needle", [
    ('{"prompt": "ok"}\n{"prompt": \n', "p.jsonl:2: malformed JSON"),
    ('[1, 2]\n', 'p.jsonl:1: expected an object'),
    ('{"text": "x"}\n', 'p.jsonl:1: expected "prompt", "prompt_token_ids" or "messages"'),
    ('{"prompt_token_ids": [1, -2]}\n', 'p.jsonl:1: "prompt_token_ids" must be'),
    ('\n\n', "holds no prompt"),
])
def test_bad_files_name_file_and_line(tmp_path, content, needle):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(ConfigError, match=None) as err:
        load_prompts([], str(path))
    assert needle in str(err.value)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_prompts([], str(tmp_path / "absent.txt"))
