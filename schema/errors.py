"""The one error hierarchy shared by the compiler, the executor and the tools.

Every error a user can cause prints as a single line (`str(err)`) that says
what was expected, what was found, and how to fix it; the command-line
front ends print that line and exit non-zero, never a traceback.
"""
from __future__ import annotations


class HartsError(Exception):
    """Base of every error HARTS reports to a user (exit status 2 at the CLI)."""

    exit_code = 2


class InputError(HartsError):
    """Bad user input: names the file, the line, the field and the fix."""

    def __init__(self, path: str, line: int | None, field: str | None, problem: str, fix: str):
        self.path, self.line, self.field, self.problem, self.fix = path, line, field, problem, fix
        where = str(path) if line is None else f"{path}:{line}"
        what = f"field '{field}': " if field else ""
        super().__init__(f"{where}: {what}{problem}; fix: {fix}")

    def __reduce__(self):
        # Pickling an exception re-creates it from self.args, here the one formatted message, which __init__
        # does not take; rebuild it from its fields instead (read_trees' worker processes send these back).
        return type(self), (self.path, self.line, self.field, self.problem, self.fix), self.__dict__


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
