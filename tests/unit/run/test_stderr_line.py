"""Every rank's error line reaches the shared stderr in one write, so ranks failing together
under PYTHONUNBUFFERED (print() then writes text and newline apart) keep their lines whole."""

import io
import sys

import pytest

from spmd_engine.run import main as run_main


class Writes(io.StringIO):
    """A stderr that records each write call."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def write(self, text):
        self.calls.append(text)
        return super().write(text)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("argv", [["--no-such-flag"], ["--tensor-parallel-size", "0"]])
def test_usage_error_is_one_write_of_one_line(monkeypatch, argv):
    stderr = Writes()
    monkeypatch.setattr(sys, "stderr", stderr)
    try:
        code = run_main.main(argv)
    except SystemExit as exc:  # argparse's own errors leave through SystemExit
        code = exc.code
    assert code == 2
    lines = [c for c in stderr.calls if c.startswith("error:")]
    assert lines and all(c.endswith("\n") and c.count("\n") == 1 for c in lines), stderr.calls
