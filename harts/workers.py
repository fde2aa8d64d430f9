"""Worker processes that leave Ctrl-C to their caller and die with it.

Used by `read_trees(workers=N)` / `hartsc --read-workers` (forked parse
processes: they inherit the parser, nothing is re-imported) and by
`harts.api.BackgroundCompiler` (one compiler process started as a fresh
interpreter: a training process holds threads and maybe CUDA, which a fork
would copy half-way; `leave_stops_to` is its first call).
`start_workers(n)` returns a `ProcessPoolExecutor` whose n forked processes
are already running; `stop_workers` ends them and waits. Invariants, tested
in `tests/test_read_parallel.py` and `tests/test_api.py`:

* no stop signal reaches a worker before its handlers are set: Ctrl-C (sent
  to the whole terminal's process group) is ignored there and handled by the
  caller's process alone; SIGTERM and SIGHUP kill a worker at once;
* a worker dies with the process that started it, however that one ends:
  the parse workers by Linux's parent-death signal (their starting thread
  waits for them), the compiler process by watching its parent (any thread
  may start it, and the signal follows the starting thread);
* a worker that dies fails the pending results (BrokenProcessPool) instead of
  leaving the caller waiting forever.

`auto_workers(path)` is what a front end's "auto" means for an input file.
"""
from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import stat
from concurrent.futures import ProcessPoolExecutor

__all__ = ["AUTO_MAX_WORKERS", "AUTO_MIN_BYTES", "STOP_SIGNALS", "auto_workers", "can_fork", "leave_stops_to",
           "start_workers", "stop_workers"]

# `auto_workers`: below this many bytes on disk, starting processes costs about what parallel parsing saves.
AUTO_MIN_BYTES = 16 << 20
AUTO_MAX_WORKERS = 8
# Stop signals are blocked while workers are forked (`start_workers`), so none reaches a worker before its
# own handlers are in place; then the main process alone acts on them.
STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
_PR_SET_PDEATHSIG = 1   # linux/prctl.h


def can_fork() -> bool:
    """Whether this platform forks processes (not Windows); elsewhere `read_trees` parses in its own process."""
    return "fork" in multiprocessing.get_all_start_methods()


def auto_workers(path: str | os.PathLike) -> int:
    """The `workers` a front end's "auto" means for `path`: min(usable CPUs, 8), or 1 for a regular file under
    16 MB on disk (a .zst counts its compressed size), where starting processes costs about what it saves.

    A pipe's size is unknown and taken as large; a path that cannot be read gets 1 (`read_trees` then says why).
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:   # not on Linux
        cpus = os.cpu_count() or 1
    try:
        info = os.stat(path)
    except (OSError, ValueError):
        return 1
    if stat.S_ISDIR(info.st_mode) or (stat.S_ISREG(info.st_mode) and info.st_size < AUTO_MIN_BYTES):
        return 1
    return max(1, min(cpus, AUTO_MAX_WORKERS))


def start_workers(count: int) -> ProcessPoolExecutor:
    """`count` forked worker processes, all started, that leave Ctrl-C to the main process and die on SIGTERM.

    A ProcessPoolExecutor rather than a multiprocessing.Pool: when a worker dies (killed for memory, or by
    a SIGTERM sent to the whole process group) the executor fails every pending result with
    BrokenProcessPool, where a Pool replaces the process and waits forever for the lost chunk (and its
    terminate() takes the task queue's lock, which a worker killed while waiting for a task never
    releases). With "fork" the executor starts every process on the first task, which is submitted here
    while the stop signals are blocked: a worker inherits the mask, so no signal reaches it before
    `_init_worker` has set its handlers (the parent's may raise, see `harts.console`); a signal the main
    process got meanwhile is raised when the mask is restored.
    """
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    executor = None
    try:
        executor = ProcessPoolExecutor(count, mp_context=multiprocessing.get_context("fork"),
                                       initializer=_init_worker, initargs=(previous, os.getpid()))
        executor.submit(int)
    finally:
        try:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        except BaseException:   # the stop signal that came while blocked: the caller never sees the executor
            stop_workers(executor)
            raise
    return executor


def _init_worker(mask, parent: int) -> None:
    """First thing in a worker: Ctrl-C (sent to the whole terminal's process group) is ignored, since the main
    process handles it by stopping the pool; SIGTERM and SIGHUP kill at once, with no Python handler between;
    on Linux, the kernel kills the worker if the main process dies without stopping it (SIGKILL, a crash),
    where it would otherwise wait for its next chunk forever. Then the parent's signal mask comes back."""
    leave_stops_to(parent)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def leave_stops_to(parent: int, *, die_with_thread: bool = True) -> None:
    """In a worker process: ignore Ctrl-C, die at once on SIGTERM and SIGHUP, and exit now if the process `parent`
    that started it has already ended.

    `die_with_thread`: also have the kernel kill this process when the thread that started it ends (Linux's
    parent-death signal follows the starting *thread*, not its process). Right for the parse workers, whose
    starting thread waits in `read_trees` until they are done; wrong for `BackgroundCompiler`'s process, which
    any thread may start and which watches its parent itself.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    if die_with_thread:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):   # no prctl: not Linux
            pass
    if os.getppid() != parent:   # the parent died before prctl took effect
        os._exit(1)


def stop_workers(executor: ProcessPoolExecutor | None) -> None:
    """End the worker processes and wait for them; chunks not yet started are dropped, and the ones being
    parsed (a few MB each) are finished first. Safe to call again, or with None."""
    if executor is not None:
        executor.shutdown(wait=True, cancel_futures=True)
