"""Outputs that appear only when complete: write to a temporary file beside the target, then rename.

Every file HARTS writes (plans, timing sidecars, generated workloads, reports,
log-probabilities, gradients) goes through `atomic_output`, so a failure or an
interrupt never leaves a half-written file under the target name.
"""
from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike):
    """Yield a binary file; on success it is fsynced and renamed to `path`, on error removed.

    The temporary file is created with mode 0o666 (less the umask), as any new
    file would be, rather than mkstemp's 0600, because the mode survives the rename.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as out:
            yield out
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_output(path) as out:
        out.write(data)
