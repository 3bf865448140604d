"""A rank's one-line report on stderr, written in one call.

Every rank of a launch shares the launcher's stderr. Under PYTHONUNBUFFERED (common in
containers and batch scripts) print() writes its text and its newline in two calls, so two
ranks failing together would print "error: ...error: ..." on one line and a blank one after.
One write of the whole line keeps each rank's report whole."""

import sys


def report(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
