"""A rank's error file is whole or absent, so torchrun's agent can always parse it.

CI saw the agent itself die with a JSONDecodeError (and `--max-restarts` with it): a rank
was stopped by the agent's SIGTERM between torch's handler opening the file and writing
it. These tests stop the write the same way (SystemExit, as our SIGTERM handler raises)
and read the result with the agent's own parser (ProcessFailure).
"""

from __future__ import annotations

import json

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.elastic.multiprocessing.errors import error_handler as torch_error_handler

from spmd_engine.run.error_file import ERROR_FILE_ENV, AtomicErrorHandler, record_for_torchrun


def _agent_reads(path) -> ProcessFailure:
    return ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(path))


def test_the_record_is_torchs_format_and_the_agent_reads_it(tmp_path, monkeypatch):
    target = tmp_path / "error.json"
    monkeypatch.setenv(ERROR_FILE_ENV, str(target))
    record_for_torchrun(RuntimeError("peer rank 2 died"))
    assert _agent_reads(target).message["message"] == "RuntimeError: peer rank 2 died"
    assert [p.name for p in tmp_path.iterdir()] == ["error.json"]  # no staging file left


def test_a_write_stopped_midway_leaves_no_file_the_agent_cannot_parse(tmp_path, monkeypatch):
    target = tmp_path / "error.json"
    monkeypatch.setenv(ERROR_FILE_ENV, str(target))

    def sigterm_midway(data, fp):
        fp.write(json.dumps(data)[:10])
        raise SystemExit(143)  # what our SIGTERM handler raises

    monkeypatch.setattr(torch_error_handler.json, "dump", sigterm_midway)
    with pytest.raises(SystemExit):
        AtomicErrorHandler().record_exception(RuntimeError("peer rank 2 died"))
    assert list(tmp_path.iterdir()) == []
    _agent_reads(target)  # no file: the agent makes its own message instead of crashing

