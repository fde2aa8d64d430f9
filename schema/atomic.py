"""Outputs that appear only when complete: write to a temporary file beside the target, then rename.

Every file HARTS writes (plans, timing sidecars, generated workloads, reports,
log-probabilities, gradients) goes through `atomic_output` or
`atomic_write_files`, so a failure or an interrupt never leaves a half-written
file under the target name. A target that cannot be written (a folder, a path
under a file, a read-only folder, a full disk) raises `OutputError`, one line
the command-line front ends print; `check_output_path` finds most of these
before any work is done.
"""
from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import stat
from pathlib import Path

from harts.schema.errors import OutputError


def _reason(err: OSError) -> str:
    return err.strerror or type(err).__name__


def _special_kind(path: Path) -> str | None:
    """What an existing non-regular, non-folder file is ('a character device', ...); None otherwise."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    for test, kind in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return None


def check_output_path(path: str | os.PathLike, *, inputs=()) -> Path:
    """Refuse, before any work, an output path that cannot become a file; returns the Path to replace.

    Refused: an empty path; one naming a folder (an existing folder, or a
    trailing separator); one naming a device, a named pipe or a socket (the
    rename that makes an output appear would replace the node itself: run
    as root, `-o /dev/null` would turn the system's null device into a
    file); one under an existing file; one in a folder that exists but
    cannot be written; one that is the same file as any of `inputs` (it
    would be replaced by the output); `-` (standard output); a name the file
    system cannot hold, or whose temporary file beside it would be too long
    (`_check_name_length`). Missing folders are fine:
    `atomic_output` creates them. A symbolic link is written through: the
    returned path is the file it points to, so the link stays.
    """
    text = os.fspath(path)
    if not text:
        raise OutputError("''", "the output path is empty", "give a file name")
    if text == "-":   # not standard output: outputs are written whole and renamed into place
        raise OutputError(text, "writing to standard output is not supported", "give a file name")
    try:
        return _checked_target(text, inputs)
    except OSError as err:   # a path the file system refuses outright, e.g. a folder name over its limit
        raise OutputError(text, _reason(err), _fix_for(err)) from None


def _fix_for(err: OSError) -> str:
    if err.errno == errno.ENAMETOOLONG:
        return "shorten the file and folder names (each at most 255 bytes on most file systems)"
    return "check that the folder exists as a folder and is writable"


def _checked_target(text: str, inputs) -> Path:
    if stat.S_ISFIFO(_mode_or_zero(text)):   # `-o /dev/stdout` into a pipe: the link leads to no path
        raise OutputError(text, "it is a named pipe, not a regular file", "give the path of a regular file")
    target = Path(os.path.realpath(text)) if Path(text).is_symlink() else Path(text)
    if text.endswith(("/", os.sep)) or target.is_dir():
        raise OutputError(text, "it names a folder, not a file", f"give a file name, e.g. {Path(text) / 'out'}")
    kind = _special_kind(target)
    if kind is not None:
        raise OutputError(text, f"it is {kind}, not a regular file", "give the path of a regular file")
    for source in inputs:
        with contextlib.suppress(OSError):
            if target.exists() and os.path.samefile(target, source):
                raise OutputError(text, "it is also an input and would be overwritten", "write to another file")
    check_can_create_under(text, target.parent)
    _check_name_length(text, target)
    return target


def _mode_or_zero(text: str) -> int:
    try:
        return os.stat(text).st_mode
    except OSError:
        return 0


def _temporary_name(name: str, pid: int | None = None) -> str:
    """The name of the temporary file an output is first written to, beside it."""
    return f".{name}.{os.getpid() if pid is None else pid}.{secrets.token_hex(4)}.tmp"


# Linux's largest pid_max: names are measured with the longest pid, so whether one passes does not depend on
# the process that writes it.
_LONGEST_PID = 4194304


def _check_name_length(label: str, target: Path) -> None:
    """Refuse a file name that fits the file system but whose temporary name beside it would not."""
    try:
        limit = os.pathconf(_nearest_existing(target.parent), "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    name = len(os.fsencode(target.name))
    temporary = len(os.fsencode(_temporary_name(target.name, _LONGEST_PID)))
    if temporary > limit:
        raise OutputError(label, f"its file name is {name} bytes, and the temporary file written beside it first "
                                 f"would need {temporary}, over this file system's {limit}",
                          f"shorten the file name to at most {limit - (temporary - name)} bytes")


def refuse_one_file(targets, problem: str, fix: str) -> None:
    """Refuse (an OutputError about the later path) two outputs that would write one file.

    `targets` holds (output path as given, the target `check_output_path`
    returned for it) pairs; one path given twice, a link and its target, or two
    spellings of one path are one file, and the second write would replace the first.
    """
    seen: set[str] = set()
    for given, target in targets:
        key = os.path.realpath(target)
        if key in seen:
            raise OutputError(given, problem, fix)
        seen.add(key)


def check_can_create_under(label: str, folder: Path) -> None:
    """Refuse (OutputError about `label`) a folder whose nearest existing ancestor, itself included,
    is a file or a folder this process cannot write: nothing could be created below it."""
    folder = _nearest_existing(folder)
    if folder.exists() and not folder.is_dir():
        raise OutputError(label, f"{folder} is a file, not a folder", "choose a path whose folders are folders")
    if folder.is_dir() and not os.access(folder, os.W_OK | os.X_OK):
        raise OutputError(label, f"folder {folder} is not writable", "choose a folder you can write to")


def _nearest_existing(folder: Path) -> Path:
    """`folder` or its nearest ancestor that exists (a link, even a dangling one, counts)."""
    while not folder.exists() and not folder.is_symlink() and folder != folder.parent:
        folder = folder.parent
    return folder


def _temporary_beside(path: Path):
    """Create the parent folders and an exclusive temporary file next to `path`, a target
    `check_output_path` returned; (fd, temp path, path, the folders created, deepest first)."""
    created = []
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        created.append(folder)
        folder = folder.parent
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / _temporary_name(path.name)
        # Mode 0o666 (less the umask), as any new file gets, rather than mkstemp's
        # 0600: the mode survives the rename.
        return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp, path, created
    except OSError as err:
        _remove_empty(created)
        raise OutputError(path, _reason(err), _fix_for(err)) from err


def _remove_empty(folders: list[Path]) -> None:
    """Remove folders an output created, deepest first, as long as they are empty: a failed write leaves
    no trace, and a folder something else has written into since stays."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


class _ReportingFile:
    """A temporary output file whose failed writes (a full disk, a file-size limit) raise `OutputError`
    naming the output, not a bare OSError; everything else is the file's own."""

    def __init__(self, file, path: Path):
        self._file, self._path = file, path

    def write(self, data) -> int:
        try:
            return self._file.write(data)
        except OSError as err:
            raise OutputError(self._path, _reason(err), "free disk space or choose another folder") from err

    def __getattr__(self, name: str):
        return getattr(self._file, name)


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike):
    """Yield a binary file; on success it is fsynced and renamed to `path`, on error removed.

    Failures of creating, writing, syncing or renaming the file raise `OutputError`;
    any other exception raised by the caller's writing passes through unchanged.
    """
    fd, tmp, path, created = _temporary_beside(check_output_path(path))
    try:
        with os.fdopen(fd, "wb") as out:
            yield _ReportingFile(out, path)
            try:
                out.flush()
                os.fsync(out.fileno())
            except OSError as err:
                raise OutputError(path, _reason(err), "free disk space or choose another folder") from err
        try:
            os.replace(tmp, path)
        except OSError as err:
            raise OutputError(path, _reason(err), "check that the target is not a folder and is writable") from err
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        _remove_empty(created)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_output(path) as out:
        out.write(data)


def atomic_write_files(files: dict) -> None:
    """Write several files as one output: either all of them appear or none does.

    Each is written to a temporary file first (`atomic_output`'s guarantees);
    only when every one is complete are they renamed into place. A target
    that already exists is first kept under a hard link beside it (a copy
    where the file system has none). Should a rename fail, every target
    already renamed is put back as it was (the kept file restored, a new one
    removed), so no partial set is left behind and no earlier output is lost.
    """
    staged: list[tuple[Path, Path]] = []
    kept: dict[Path, Path | None] = {}      # target -> its earlier file's keeping place (None: it had none)
    created: list[Path] = []                # folders made for the outputs, deepest first per output
    try:
        targets = {path: check_output_path(path) for path in files}
        refuse_one_file(targets.items(), "two of the outputs are the same file", "give each its own file")
        for path, data in files.items():
            fd, tmp, path, made = _temporary_beside(targets[path])
            created = made + created          # later outputs' folders may sit inside earlier ones'
            staged.append((path, tmp))
            try:
                with os.fdopen(fd, "wb") as out:
                    out.write(data)
                    out.flush()
                    os.fsync(out.fileno())
            except OSError as err:
                raise OutputError(path, _reason(err), "free disk space or choose another folder") from err
        for path, tmp in staged:
            kept[path] = _keep_earlier(path)
            try:
                os.replace(tmp, path)
            except OSError as err:
                raise OutputError(path, _reason(err), "check that the target is not a folder and is writable") from err
    except BaseException:
        for path, earlier in kept.items():   # put every target back as it was
            with contextlib.suppress(OSError):
                if earlier is None:
                    os.unlink(path)
                    continue
                os.replace(earlier, path)
                # Renaming a hard link onto its own file (the target never replaced) does nothing.
                os.unlink(earlier)
        for _, tmp in staged:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        for folder in created:
            _remove_empty([folder])
        raise
    for earlier in kept.values():
        if earlier is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(earlier)


def _keep_earlier(path: Path) -> Path | None:
    """A second name for the file at `path`, if any, so that it can be restored: a hard link, or a copy."""
    if not path.is_file():
        return None
    keep = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.keep"
    try:
        try:
            os.link(path, keep)
        except OSError:
            shutil.copy2(path, keep)
    except OSError as err:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(keep)
        raise OutputError(path, f"cannot keep the earlier file while replacing it ({_reason(err)})",
                          "free disk space (without hard links, replacing a file needs room for a copy of the "
                          "earlier one) and check that the folder is writable") from err
    return keep
