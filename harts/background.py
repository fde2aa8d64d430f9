"""Compile the next step's plan in another process while this one trains: `BackgroundCompiler`.

    with harts.BackgroundCompiler() as compiler:
        pending = compiler.submit(tokens, advantages=adv, loss_masks=masks)   # step 0's batch
        for step in range(steps):
            plan = pending.result()               # waits only if compiling took longer than training
            if step + 1 < steps:
                pending = compiler.submit(...)    # the next step's batch, compiled meanwhile
            harts.run(plan, model, loss="grpo")

`submit` takes exactly `harts.api.compile_trajectories`' arguments and
returns a `concurrent.futures.Future` whose `result()` is the same `Plan`
(`planning_seconds` aside) or raises the same error. Planning is numpy work
that holds the GIL: inside the training process it stalls the step (7.6 s
for 16,384 single-turn GRPO trajectories on a 2-core machine); in its own
process it overlaps the update, and the training process pays for sending
the batch (0.7 s there) and receiving the plan (~1 s of a background
thread's time for that step's 1.2 GB of index arrays);
`benchmarks/bench_background.py` measures it.

Invariants:
* one compiler process for the compiler's life (imports paid once), a fresh
  interpreter running `python -m harts.background` rather than a fork or
  multiprocessing's "spawn": a fork would copy the training process's threads
  and CUDA state half-way, and "spawn" re-runs the user's script's top level
  in the child unless it is guarded by `if __name__ == "__main__"`;
* plans come back in submission order, each on its own Future;
* torch tensors are turned into numpy arrays before they are sent, so the
  compiler process never receives a tensor or touches a GPU;
* the compiler process ignores Ctrl-C (the training process decides), dies
  with the training process however it ends (`harts.workers.leave_stops_to`),
  and is gone once `close` returns; if it dies, every pending Future raises.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections import deque
from concurrent.futures import Future
from multiprocessing.connection import Connection, Pipe

import numpy as np

from harts.workers import STOP_SIGNALS

__all__ = ["BackgroundCompiler"]


class BackgroundCompiler:
    """A compiler process that runs `compile_trajectories` while the caller trains (module docstring)."""

    def __init__(self) -> None:
        ours, theirs = Pipe()
        # Started with the stop signals blocked (exec keeps the mask): a Ctrl-C before the new interpreter has
        # set its handlers stays pending until `_serve` ignores it, instead of killing the compiler process.
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "harts.background", str(theirs.fileno()), str(os.getpid())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        self._connection = ours
        self._pending: deque[Future] = deque()
        self._lock = threading.Lock()   # submit and the receiver both touch _pending
        self._receiver = threading.Thread(target=self._receive, name="harts-background-compiler", daemon=True)
        self._receiver.start()

    def submit(self, tokens, **options) -> Future:
        """Start `compile_trajectories(tokens, **options)` in the compiler process; the Future holds the Plan."""
        future: Future = Future()
        request = (_portable(tokens), {name: _portable(value) for name, value in options.items()})
        with self._lock:
            if self._connection is None:
                raise RuntimeError("this BackgroundCompiler is closed; fix: create a new one")
            if not self._receiver.is_alive():
                raise RuntimeError("the background compiler's process has ended; fix: create a new one")
            self._pending.append(future)
            self._connection.send(request)
        return future

    def _receive(self) -> None:
        """Receiver thread: hand each answer to the oldest pending Future; on the process's end, fail the rest."""
        while True:
            try:
                kind, value = self._connection.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                future = self._pending.popleft()
            if kind == "plan":
                future.set_result(value)
            else:
                future.set_exception(value)
        with self._lock:
            ended = RuntimeError("the background compiler's process ended before this plan was compiled "
                                 f"(exit status {self._process.poll()}); fix: create a new BackgroundCompiler")
            while self._pending:
                self._pending.popleft().set_exception(ended)

    def close(self) -> None:
        """Stop the compiler process and wait for it: a compile in progress finishes, plans not yet started fail.
        Safe to call twice."""
        with self._lock:
            connection, self._connection = self._connection, None
        if connection is None:
            return
        try:
            connection.send(None)   # the compiler process exits after the compile it is on
        except OSError:
            pass
        self._process.wait()
        connection.close()
        self._receiver.join()

    def __enter__(self) -> "BackgroundCompiler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _portable(value):
    """`value` with torch tensors (also inside a list or tuple of per-trajectory values) as numpy arrays, and a
    generator as a list: what pickles to a process that imports no torch tensor, read as compile_trajectories
    reads the original. Integer arrays whose values fit int32 are sent as int32 (half the bytes of the usual
    int64 token ids; the plan stores int32), others as they are, so out-of-range ids meet the same check."""
    from harts.api import _as_numpy   # the API's own conversion (bfloat16 included)

    def converted(x):
        array = _as_numpy(x) if hasattr(x, "detach") and hasattr(x, "cpu") else x
        if (isinstance(array, np.ndarray) and array.dtype.kind in "iu" and array.dtype.itemsize > 4 and array.size
                and array.min() >= -2**31 and array.max() < 2**31):
            array = array.astype(np.int32)
        return array

    if isinstance(value, (list, tuple)):
        return [converted(v) for v in value]
    if hasattr(value, "__iter__") and not hasattr(value, "__len__") and not isinstance(value, (str, bytes, dict)):
        return _portable(list(value))
    return converted(value)


def _serve(descriptor: int, parent: int) -> None:
    """The compiler process: compile each request until told to stop (None) or the pipe closes."""
    from harts.workers import leave_stops_to

    leave_stops_to(parent)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)   # blocked by BackgroundCompiler until now
    from harts.api import compile_trajectories

    connection = Connection(descriptor)
    while True:
        try:
            request = connection.recv()
        except EOFError:
            return
        if request is None:
            return
        tokens, options = request
        try:
            answer = ("plan", compile_trajectories(tokens, **options))
        except Exception as err:   # handed to the caller's Future, raised there as compile_trajectories raises
            answer = ("error", err)
        connection.send(answer)


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))
