"""How `harts` and `hartsc` end: one line on stderr and an exit status, never a traceback.

* Ctrl-C is a request, not a crash: exit 130. Every output is renamed into
  place only when complete (`harts.schema.atomic`), so an interrupt never
  leaves a half-written file.
* A reader that leaves early (`harts stats PLAN | head`) is not an error: the
  rest of the output is discarded and the command still returns its own
  status (`harts diff --exit-code A B | head` exits 1 for different plans).
* A write to standard output that fails for another reason (a full disk
  behind `> stats.json`) is an `OutputError` naming standard output, exit 2,
  like any other output HARTS cannot write.
"""
from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable

from harts.schema.errors import OutputError

INTERRUPTED = "interrupted; no output is left half-written"


def run_command(prog: str, command: Callable[[list[str] | None], int], argv: list[str] | None) -> int:
    """`command(argv)`'s status, with standard output guarded and an interrupt reported as above."""
    try:
        with _guarded_stdout():
            return command(argv)
    except KeyboardInterrupt:
        print(f"{prog}: {INTERRUPTED}", file=sys.stderr)
        return 130
    except OutputError as err:   # standard output's (commands report their files' themselves)
        print(f"{prog}: {err}", file=sys.stderr)
        return err.exit_code


class _GuardedStdout:
    """The real stream, except that a closed pipe silences the rest of the output and any other
    failed write raises an OutputError naming standard output."""

    def __init__(self, stream):
        self._stream = stream
        self.reader_left = False

    def write(self, text: str) -> int:
        if self.reader_left:
            return len(text)
        written = self._call(self._stream.write, text)
        return len(text) if written is None else written

    def flush(self) -> None:
        if not self.reader_left:
            self._call(self._stream.flush)

    def _call(self, method, *args):
        try:
            return method(*args)
        except BrokenPipeError:
            self.reader_left = True
            _discard_the_rest(self._stream)
            return None
        except OSError as err:
            _discard_the_rest(self._stream)
            raise OutputError("standard output", err.strerror or str(err),
                              "free disk space, or send the output somewhere else") from None

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _discard_the_rest(stream) -> None:
    """Point the stream's descriptor at /dev/null: what its buffer still holds then goes nowhere when
    Python flushes standard output on exit, instead of failing a second time there."""
    try:
        descriptor = stream.fileno()
    except (OSError, ValueError, AttributeError):   # a stream without a descriptor (pytest's capture)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, descriptor)
    os.close(devnull)


@contextlib.contextmanager
def _guarded_stdout():
    stream = sys.stdout
    guard = _GuardedStdout(stream)
    sys.stdout = guard
    try:
        yield guard
        guard.flush()   # inside the guard: a full disk is reported here, not as Python exits
    finally:
        sys.stdout = stream
