"""The environment a job starts in, fuzzed (issue 25): a MASTER_PORT another process holds, a
WORLD_SIZE that does not fit the layout or the rank, an --output directory nobody can write.
Each is refused before any model load: exit 2 and one `error:` line naming the variable or
flag. Seeded; a failing id replays with `-k`. In-process (fuzz_cli): no engine starts.
"""

from __future__ import annotations

import socket

import pytest
from fuzz_cli import run_checks, seeded

PROMPT = ["--prompt", "hi", "--max-tokens", 2]


def _launch(monkeypatch, world, rank=0, port=29500):
    for key, value in {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": world,
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}.items():
        monkeypatch.setenv(key, str(value))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)


def _listen_on_some_port(rng) -> socket.socket:
    """A listener on a seeded port (the next free one from there), as another job's store."""
    for port in range(rng.randrange(20000, 60000), 61000):
        sock = socket.socket()
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            sock.close()
            continue
        sock.listen()
        return sock
    raise AssertionError("no free port to occupy")


@pytest.mark.parametrize("seed", range(3))
def test_a_master_port_in_use_is_one_error_line(seed, tmp_path, monkeypatch, capsys):
    with _listen_on_some_port(seeded(seed)) as taken:
        port = taken.getsockname()[1]
        _launch(monkeypatch, world=1, port=port)
        o = run_checks(PROMPT + ["--output", tmp_path / "out.jsonl"], monkeypatch, capsys)
    assert o.refused("MASTER_PORT", str(port)), o
    assert not o.started and not list(tmp_path.iterdir())


def test_a_free_master_port_gets_past_the_check(monkeypatch, capsys):
    """Control: the check refuses only a port in use (the control's port was just freed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    _launch(monkeypatch, world=1, port=port)
    o = run_checks(PROMPT, monkeypatch, capsys)
    assert o.rc == 0 and o.started, o


def _world_sizes():
    """(WORLD_SIZE, -tp) that cannot be this launch (rank 0's view, which prints the line):
    not whole replicas, fewer ranks than one replica, zero, negative, not a number."""
    rng = seeded(0)
    odd = [(str(2 * rng.randrange(1, 8) + 1), 2) for _ in range(2)]
    return odd + [("1", 2), ("0", 1), (str(-rng.randrange(1, 9)), 1), ("two", 1)]


@pytest.mark.parametrize("world,tp", _world_sizes())
def test_a_world_size_that_disagrees_with_the_launch_is_one_error_line(world, tp, monkeypatch, capsys):
    _launch(monkeypatch, world=world)
    o = run_checks(PROMPT + ["-tp", tp], monkeypatch, capsys)
    assert o.refused("WORLD_SIZE"), o
    assert not o.started


def _unwritable(tmp_path, kind):
    if kind == "under-a-file":
        (tmp_path / "a-file").write_text("")
        return tmp_path / "a-file" / "out.jsonl"
    return f"/{kind}/spmd-engine-fuzz-out.jsonl"  # /proc and /sys refuse new files, even to root


@pytest.mark.parametrize("kind", ["under-a-file", "proc", "sys"])
def test_an_unwritable_output_directory_is_one_error_line(kind, tmp_path, monkeypatch, capsys):
    o = run_checks(PROMPT + ["--output", _unwritable(tmp_path, kind)], monkeypatch, capsys)
    assert o.refused("--output"), o
    assert not o.started
