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
* each Future gets the answer to its own request: a request is pickled before
  it is queued (one that cannot be pickled raises in `submit` and queues
  nothing), requests and answers travel whole and in order (one sender and
  one receiver thread), and an answer that cannot cross (an exception that
  does not pickle, a request the compiler process cannot unpickle) arrives
  as a RuntimeError naming it, never as a shifted queue;
* `submit` never waits for a compile: a sender thread writes the request;
* torch tensors are turned into numpy arrays before they are sent, so the
  compiler process never receives a tensor or touches a GPU;
* the compiler process ignores Ctrl-C (the training process decides), exits
  within a second once its parent has ended, however it ended and whichever
  thread started it; `close` stops it at once (a compile in progress is
  abandoned) and every Future not yet answered then raises; if the process
  dies, likewise.
"""
from __future__ import annotations

import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import time
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
        self._pending: deque[Future] = deque()   # one per request sent or queued, oldest first
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()   # pickled requests for the sender; None: stop
        self._lock = threading.Lock()            # guards _pending, _closed and _ended
        self._closed = False
        self._ended: str | None = None           # why no more answers will come, once none will
        self._sender = threading.Thread(target=self._send, name="harts-compiler-sender", daemon=True)
        self._receiver = threading.Thread(target=self._receive, name="harts-compiler-receiver", daemon=True)
        self._sender.start()
        self._receiver.start()

    def submit(self, tokens, **options) -> Future:
        """Queue `compile_trajectories(tokens, **options)` for the compiler process; the Future holds the Plan.

        Returns at once (the request is pickled here, written by a sender thread). Arguments that cannot be
        pickled raise TypeError here, and nothing is queued.
        """
        try:
            request = pickle.dumps((_portable(tokens), {name: _portable(value) for name, value in options.items()}),
                                   protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as err:   # pickling raises PicklingError, TypeError, AttributeError, ...
            raise TypeError(f"cannot send this batch to the compiler process ({type(err).__name__}: {err}); fix: "
                            "pass lists, numpy arrays or torch tensors, and options as compile_trajectories "
                            "takes them") from err
        future: Future = Future()
        future.set_running_or_notify_cancel()   # the compile cannot be called off once queued: cancel() says so
        with self._lock:
            if self._closed:
                raise RuntimeError("this BackgroundCompiler is closed; fix: create a new one")
            if self._ended is not None:
                raise RuntimeError(f"{self._ended}; fix: create a new BackgroundCompiler")
            self._pending.append(future)
            self._outbox.put(request)
        return future

    def _send(self) -> None:
        """Sender thread: write each queued request whole, in order, until told to stop or the pipe breaks."""
        while (request := self._outbox.get()) is not None:
            try:
                self._connection.send_bytes(request)
            except OSError:   # the process has ended: the receiver fails the Futures
                return

    def _receive(self) -> None:
        """Receiver thread: hand each answer to the oldest pending Future; once none can come, fail the rest."""
        connection = self._connection
        while True:
            try:
                answer = connection.recv_bytes()
            except (EOFError, OSError):
                break
            try:
                kind, value = pickle.loads(answer)
            except Exception as err:   # e.g. an exception class whose __init__ unpickling cannot call
                kind, value = "error", RuntimeError(f"the compiler process's answer could not be read here "
                                                    f"({type(err).__name__}: {err})")
            with self._lock:
                future = self._pending.popleft()
            if kind == "plan":
                future.set_result(value)
            else:
                future.set_exception(value)
        try:
            status = self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            status = None
        with self._lock:
            self._ended = ("the BackgroundCompiler was closed before this plan was compiled" if self._closed else
                           f"the background compiler's process ended (exit status {status})")
            failed = list(self._pending)
            self._pending.clear()
        for future in failed:
            future.set_exception(RuntimeError(f"{self._ended}; fix: create a new BackgroundCompiler"))

    def close(self) -> None:
        """Stop the compiler process now and wait for it: a compile in progress is abandoned, and every plan not
        yet received raises RuntimeError. Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._outbox.put(None)
        self._process.terminate()   # SIGTERM: the process dies at once (no Python handler there)
        self._process.wait()
        self._receiver.join()
        self._sender.join()
        self._connection.close()

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
    """The compiler process: answer each request, in order, until the pipe closes."""
    from harts.workers import leave_stops_to

    leave_stops_to(parent, die_with_thread=False)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)   # blocked by BackgroundCompiler until now
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    from harts.api import compile_trajectories

    connection = Connection(descriptor)
    while True:
        try:
            request = connection.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            tokens, options = pickle.loads(request)
        except Exception as err:   # e.g. an object of a class defined in the caller's script
            answer = ("error", RuntimeError(f"the compiler process could not read this batch "
                                            f"({type(err).__name__}: {err}); fix: pass lists, numpy arrays or "
                                            "torch tensors, not objects of classes of your own"))
        else:
            try:
                answer = ("plan", compile_trajectories(tokens, **options))
            except Exception as err:   # handed to the caller's Future, raised there as compile_trajectories raises
                answer = ("error", err)
        try:
            payload = pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:   # an exception that does not pickle: its type and text still reach the caller
            error = answer[1]
            payload = pickle.dumps(("error", RuntimeError(f"{type(error).__name__}: {error}")))
        try:
            connection.send_bytes(payload)
        except OSError:   # the caller has gone
            return


def _watch_parent(parent: int) -> None:
    """Exit once the process that started this one has ended (this process is then re-parented)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))
