"""Fuzzed prompts files (issue 25): each refused before any process starts, exit 2 and one
`error:` line naming the file (and its line where there is one), no output written.

Seeded: the same cases every run; a failing id replays with `-k`.
"""

from __future__ import annotations

import json

import pytest
from fuzz_cli import run_checks, seeded

VOCAB = 259  # the bundled model's: 256 bytes and 3 specials
MAX_LEN = 2048


def _random_bad_utf8(rng) -> bytes:
    good = "Beautiful is".encode()
    cut = rng.randrange(len(good))
    return good[:cut] + bytes([rng.choice([0x80, 0xC3, 0xE2, 0xFF, 0xFE])]) + good[cut:] + b"\n"


def _cases():
    rng = seeded(25)
    for i in range(3):
        yield f"utf8-{i}", ".txt", b"Simple is\n" + _random_bad_utf8(rng), "prompts.txt:2: not UTF-8"
    yield "empty", ".txt", b"", "holds no prompt"
    yield "empty-jsonl", ".jsonl", b"\n\n", "holds no prompt"
    yield "10MB-line", ".txt", b"x" * (10 * 2 ** 20) + b"\n", "prompts.txt:1: prompt 0 has 10485761 tokens"
    for i, line in enumerate(['[1, 2]', '5', '"Simple is"', '{}', '{"prompt": 5}', '{"prompt_token_ids": "abc"}',
                              '{"prompt_token_ids": [1.5]}', '{"prompt_token_ids": []}',
                              '{"prompt": "a"', 'null', '{"messages": 3}', '{"prompt_token_ids": [true]}']):
        yield f"shape-{i}", ".jsonl", (line + "\n").encode(), "prompts.jsonl:1: "
    for i, bad in enumerate([-1, VOCAB, 2 ** 40, -2 ** 63]):
        yield f"vocab-{i}", ".jsonl", json.dumps({"prompt_token_ids": [5, bad]}).encode() + b"\n", "prompts.jsonl:1"
    yield "too-long-ids", ".jsonl", json.dumps({"prompt_token_ids": [65] * (MAX_LEN + 1)}).encode() + b"\n", "prompts.jsonl:1: prompt 0 has 2049 tokens"
    yield "too-long-text", ".txt", b"a" * (MAX_LEN + 5) + b"\n", "prompts.txt:1: prompt 0 has 2054 tokens"
    yield "rng-bytes", ".txt", bytes(rng.randrange(256) for _ in range(64)), ""


CASES = list(_cases())


@pytest.mark.parametrize("name,suffix,content,needle", CASES, ids=[c[0] for c in CASES])
def test_a_bad_prompts_file_is_one_error_line(name, suffix, content, needle, tmp_path, monkeypatch, capsys):
    path = tmp_path / f"prompts{suffix}"
    path.write_bytes(content)
    out = tmp_path / "out.jsonl"
    o = run_checks(["--prompts-file", path, "--output", out, "--max-tokens", 4], monkeypatch, capsys)
    assert o.refused(str(path), needle), o
    assert not o.started and list(tmp_path.iterdir()) == [path]


def test_a_good_file_and_unknown_keys_get_past_every_check(tmp_path, monkeypatch, capsys):
    """Control: the checks do not refuse everything. Documented: keys a line does not need are
    ignored (as vLLM's prompt dicts ignore them)."""
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "Simple is", "id": "a-1"}\n{"prompt_token_ids": [65, 66]}\n')
    o = run_checks(["--prompts-file", path, "--max-tokens", 4], monkeypatch, capsys)
    assert o.rc == 0 and o.started and o.stderr == "", o
