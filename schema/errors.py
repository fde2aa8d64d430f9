"""The one error hierarchy shared by the compiler, the executor and the tools.

Every error a user can cause prints as a single line (`str(err)`) that says
what was expected, what was found, and how to fix it; the command-line
front ends print that line and exit non-zero, never a traceback.
"""
from __future__ import annotations


class HartsError(Exception):
    """Base of every error HARTS reports to a user (exit status 2 at the CLI).

    Every subclass pickles with its message and fields, so an error raised in a worker process (a parse
    worker of `read_trees`, `harts.api.BackgroundCompiler`'s compiler) reaches the caller as it was raised.
    """

    exit_code = 2

    def __reduce__(self):
        # Pickling an exception calls its class with self.args, here the formatted message, which the
        # subclasses' __init__ (fields, not a message) do not take: rebuild it without calling __init__.
        return _rebuilt, (type(self), self.args, self.__dict__)


def _rebuilt(cls: type, args: tuple, fields: dict) -> HartsError:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(fields)
    return error


class InputError(HartsError):
    """Bad user input: names the file, the line, the field and the fix."""

    def __init__(self, path: str, line: int | None, field: str | None, problem: str, fix: str):
        self.path, self.line, self.field, self.problem, self.fix = path, line, field, problem, fix
        where = str(path) if line is None else f"{path}:{line}"
        what = f"field '{field}': " if field else ""
        super().__init__(f"{where}: {what}{problem}; fix: {fix}")


class UsageError(HartsError, ValueError):
    """A caller's argument out of range or in conflict with the input (a flag, an API argument).

    A `ValueError` for Python callers; one line and exit 2 at the command line.
    Only these are reported as the user's mistake: any other `ValueError` is a
    bug and keeps its traceback.
    """


class OutputError(HartsError):
    """An output HARTS cannot write: names the path, the reason and the fix."""

    def __init__(self, path, problem: str, fix: str):
        self.path, self.problem, self.fix = str(path), problem, fix
        super().__init__(f"cannot write {path}: {problem}; fix: {fix}")


class PlanFormatError(HartsError):
    """A plan file that cannot be read: wrong format, wrong version, truncated or corrupted."""


class VerificationError(HartsError):
    """An IR or plan invariant does not hold; names the invariant and what broke it."""

    exit_code = 1

    def __init__(self, invariant: str, detail: str):
        self.invariant, self.detail = invariant, detail
        super().__init__(f"invariant '{invariant}' violated: {detail}")


class PassFailedError(HartsError, ValueError):
    """A compiler pass could not produce a legal result (e.g. no partition fits capacity), or an option is
    out of range (reported as pass 'options').

    Always a conflict between the caller's options and the input, so a `ValueError` for Python callers
    (`harts.api.compile_trajectories`), as `UsageError` is.
    """

    def __init__(self, pass_name: str, problem: str, fix: str):
        self.pass_name = pass_name
        super().__init__(f"pass '{pass_name}' failed: {problem}; fix: {fix}")
