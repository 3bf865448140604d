"""torchrun's error file, written so that its agent can always read it.

When a rank exits non-zero, torchrun's agent parses that rank's error file
(TORCHELASTIC_ERROR_FILE) with json.load and lets any parse error escape: the
agent itself dies with a JSONDecodeError, taking `--max-restarts` with it. torch's
own handler opens the file with "w" and then dumps, so a rank stopped between the
two (the agent SIGTERMs every rank as soon as one fails, and ours unwind on
SIGTERM) leaves an empty file behind. Seen in CI: a killed rank's peers were
recording their "peer died" errors when the agent's SIGTERM arrived. Here the
record is written to a temporary file beside the target and renamed over it, so
the agent sees the whole record or none.
"""

from __future__ import annotations

import os
import tempfile

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"


class AtomicErrorHandler(ErrorHandler):
    """torch's ErrorHandler (same record, same format) with an all-or-nothing write."""

    _staging: str | None = None

    def _get_error_file_path(self) -> str | None:
        return self._staging

    def record_exception(self, e: BaseException) -> None:
        target = os.environ.get(ERROR_FILE_ENV)
        if not target:
            return
        fd, staging = tempfile.mkstemp(dir=os.path.dirname(target) or ".", prefix=".error.", suffix=".tmp")
        os.close(fd)
        self._staging = staging
        try:
            super().record_exception(e)
            os.replace(staging, target)
        finally:
            self._staging = None
            if os.path.exists(staging):
                os.unlink(staging)


def record_for_torchrun(exc: BaseException) -> None:
    """Write torchrun's error file, so its summary names this rank's root cause (nothing
    without torchrun)."""
    try:
        AtomicErrorHandler().record_exception(exc)
    except Exception:  # the error line already went out; never mask it
        pass
