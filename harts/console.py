"""How `harts` and `hartsc` end: one line on stderr and an exit status, never a traceback.

* Ctrl-C is a request, not a crash: exit 130. Every output is renamed into
  place only when complete (`harts.schema.atomic`), so an interrupt never
  leaves a half-written file.
* SIGTERM (`kill`, `timeout`, Slurm, Kubernetes) and SIGHUP are handled the
  same way, exit 128 + the signal's number, so the temporary file beside a
  target is removed too (by default Python dies at once and leaves it). Not
  under torchrun with more than one process: its agent stops the other ranks
  with SIGTERM, and a rank waiting inside a collective would run a Python
  handler only when the wait ends, so those keep dying at once.
* A reader that leaves early (`harts stats PLAN | head`, `harts run ... 2>&1 |
  head`) is not an error: the rest of that stream's output is discarded and
  the command still returns its own status (`harts diff --exit-code A B |
  head` exits 1 for different plans).
* A write to standard output that fails for another reason (a full disk
  behind `> stats.json`) is an `OutputError` naming standard output, exit 2,
  like any other output HARTS cannot write. Standard error has nowhere to
  report its own failure: its output is then discarded.
* A stream closed at startup (`>&-`: Python's `sys.stdout` is None) stays as
  Python leaves it: printing to it does nothing.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable

from harts.schema.errors import OutputError

INTERRUPTED = "interrupted; no output is left half-written"


class Terminated(KeyboardInterrupt):
    """A stop signal other than Ctrl-C, raised where the program is so that clean-up runs as for Ctrl-C."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def run_command(prog: str, command: Callable[[list[str] | None], int], argv: list[str] | None) -> int:
    """`command(argv)`'s status, with both streams guarded and an interrupt reported as above."""
    try:
        with _guarded_streams(), _stop_signals_raise():
            return command(argv)
    except Terminated as err:
        print(f"{prog}: {signal.Signals(err.signum).name}: {INTERRUPTED}", file=sys.stderr)
        return 128 + err.signum
    except KeyboardInterrupt:
        print(f"{prog}: {INTERRUPTED}", file=sys.stderr)
        return 130
    except OutputError as err:   # standard output's (commands report their files' themselves)
        print(f"{prog}: {err}", file=sys.stderr)
        return err.exit_code


@contextlib.contextmanager
def _stop_signals_raise():
    """While the command runs, SIGTERM and SIGHUP raise `Terminated`; the previous handlers come back after
    (the tests call the front ends in-process). Only the main thread may set handlers, and a second signal
    of either kind finds the default action again, so a stuck clean-up can still be stopped."""
    wanted = (signal.SIGTERM, signal.SIGHUP)
    if os.environ.get("WORLD_SIZE", "1").strip() not in ("", "0", "1"):
        yield
        return
    previous = {}

    def raise_terminated(signum, frame):
        for number in previous:
            signal.signal(number, signal.SIG_DFL)
        raise Terminated(signum)

    def restore():
        for number, handler in previous.items():
            # None: a handler set outside Python, which cannot be put back; the default is the nearest.
            signal.signal(number, signal.SIG_DFL if handler is None else handler)

    try:
        for number in wanted:
            previous[number] = signal.signal(number, raise_terminated)
    except ValueError:   # not the main thread: leave the process's handlers alone
        restore()
        previous = {}
    try:
        yield
    finally:
        restore()


class _GuardedStream:
    """The real stream, except that a closed pipe silences the rest of its output, and any other failed
    write raises an OutputError naming standard output (`report`) or is dropped (standard error)."""

    def __init__(self, stream, report: bool):
        self._stream = stream
        self._report = report
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
        except OSError as err:
            self.reader_left = True   # from here on this stream's output goes nowhere
            _discard_the_rest(self._stream)
            if self._report and not isinstance(err, BrokenPipeError):
                raise OutputError("standard output", err.strerror or str(err),
                                  "free disk space, or send the output somewhere else") from None
            return None

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _discard_the_rest(stream) -> None:
    """Point the stream's descriptor at /dev/null: what its buffer still holds then goes nowhere when
    Python flushes it on exit, instead of failing a second time there."""
    try:
        descriptor = stream.fileno()
    except (OSError, ValueError, AttributeError):   # a stream without a descriptor (pytest's capture)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, descriptor)
    os.close(devnull)


@contextlib.contextmanager
def _guarded_streams():
    streams = sys.stdout, sys.stderr
    # A stream closed at startup is None: left so, as printing to None does nothing.
    guards = [None if stream is None else _GuardedStream(stream, report=stream is streams[0]) for stream in streams]
    sys.stdout, sys.stderr = guards
    try:
        yield
        for guard in guards:   # inside the guard: a full disk is reported here, not as Python exits
            if guard is not None:
                guard.flush()
    finally:
        sys.stdout, sys.stderr = streams
