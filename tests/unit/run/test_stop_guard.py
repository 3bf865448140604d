"""The stop guard's rule and its reading of --timeout (issue 55); the guard itself is
tested through real torchrun launches (e2e/test_stopped_rank.py)."""

from __future__ import annotations

import signal

import pytest

from spmd_engine.run.stop_guard import should_kill, timeout_from_argv


def bit(sig) -> int:
    return 1 << (int(sig) - 1)


@pytest.mark.parametrize("state, pending, stopped_for, expected", [
    ("T", 0, 5.0, False),                       # stopped, not yet for --timeout: may be continued
    ("T", 0, 10.5, True),                       # stopped past --timeout: hung for good
    ("T", bit(signal.SIGTERM), 0.0, True),      # asked to end and cannot: SIGTERM stays pending
    ("T", bit(signal.SIGINT), 0.0, True),
    ("T", bit(signal.SIGUSR1), 0.0, False),
    ("t", bit(signal.SIGTERM), 99.0, False),    # under a debugger: never
    ("S", bit(signal.SIGTERM), 99.0, False),    # running (it handles its SIGTERM itself)
    ("R", 0, 99.0, False),
    ("D", 0, 99.0, False),
])
def test_kill_only_a_rank_stopped_past_its_timeout_or_asked_to_end(state, pending, stopped_for, expected):
    assert should_kill(state, pending, stopped_for, timeout_s=10.0) is expected


def test_timeout_read_as_the_parser_will_read_it():
    assert timeout_from_argv(["--timeout", "15", "-tp", "2"], {}) == 15.0
    assert timeout_from_argv(["--timeout=7.5"], {}) == 7.5
    assert timeout_from_argv([], {"SPMD_ENGINE_TIMEOUT_S": "42"}) == 42.0
    assert timeout_from_argv([], {}) == 300.0
    assert timeout_from_argv(["--timeout", "soon"], {}) == 300.0  # the parser refuses it itself
