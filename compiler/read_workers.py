"""`--read-workers`, the flag of every command that reads a trees file (hartsc, harts check).

`add_read_workers_argument` declares it with one help text; `read_workers`
turns its value into the process count `read_trees(workers=...)` takes,
refusing a bad value in one line before anything is read.
"""
from __future__ import annotations

import argparse

from harts.schema.errors import PassFailedError
from harts.workers import AUTO_MAX_WORKERS, AUTO_MIN_BYTES, auto_workers

# More parse processes than this only add start-up time and memory (`auto` picks at most 8).
MAX_READ_WORKERS = 256


def add_read_workers_argument(parser: argparse.ArgumentParser, command: str, same: str) -> None:
    """Declare `--read-workers` on `command`'s parser; `same` says what does not depend on the count."""
    parser.add_argument("--read-workers", default="auto", metavar="N",
                        help=f"forked processes that parse the trees file's lines while {command} reads it; {same} "
                             f"for any N. auto (default): min(usable CPUs, {AUTO_MAX_WORKERS}), or 1 for a file under "
                             f"{AUTO_MIN_BYTES >> 20} MB on disk, where starting processes costs about what it saves; "
                             f"1: parse in {command}'s own process")


def read_workers(value: str, trees: str) -> int:
    """`--read-workers` as a process count: "auto" is `auto_workers(trees)`, else an int in [1, 256];
    one `PassFailedError` line naming the flag otherwise, like the other flags' (`check_options`)."""
    if value == "auto":
        return auto_workers(trees)
    fix = "pass a number of processes, e.g. --read-workers 4, or auto (the default); 1 reads in one process"
    try:
        count = int(value)
    except ValueError:
        raise PassFailedError("options", f"--read-workers must be an integer or auto, got {value!r}", fix) from None
    if count < 1:
        raise PassFailedError("options", f"--read-workers must be >= 1, got {count}", fix)
    if count > MAX_READ_WORKERS:
        raise PassFailedError("options", f"--read-workers must be <= {MAX_READ_WORKERS}, got {count}", fix)
    return count
