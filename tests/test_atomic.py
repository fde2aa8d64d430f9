"""`harts.schema.atomic`: several outputs appear together or not at all, and a failure never costs an earlier file.

Run: `python -m pytest tests/test_atomic.py -q`.
"""
from __future__ import annotations

import os

import pytest

import harts.schema.atomic as atomic
from harts.schema.errors import OutputError


def failing_replace_of(target_name: str, monkeypatch):
    """os.replace that fails (as on an immutable file) when renaming onto `target_name`."""
    real = os.replace

    def replace(src, dst):
        if os.path.basename(dst) == target_name and str(src).endswith(".tmp"):
            raise PermissionError(1, "Operation not permitted")
        return real(src, dst)
    monkeypatch.setattr(atomic.os, "replace", replace)


@pytest.mark.parametrize("earlier", [["lp.npz", "g.safetensors"], ["lp.npz"], []],
                         ids=["both-existed", "first-existed", "both-new"])
def test_a_failed_rename_puts_every_target_back(tmp_path, monkeypatch, earlier):
    """Found by a user audit: the first output was renamed over the previous run's file, the second failed,
    and the rollback deleted the first target, losing the earlier file."""
    for name in earlier:
        (tmp_path / name).write_text(f"old {name}")
    failing_replace_of("g.safetensors", monkeypatch)
    with pytest.raises(OutputError, match="Operation not permitted"):
        atomic.atomic_write_files({tmp_path / "lp.npz": b"new lp", tmp_path / "g.safetensors": b"new g"})
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(earlier)
    for name in earlier:
        assert (tmp_path / name).read_text() == f"old {name}"


def test_success_replaces_and_leaves_nothing_else(tmp_path):
    (tmp_path / "a").write_text("old")
    link = tmp_path / "a-too"
    os.link(tmp_path / "a", link)     # another name for the earlier file keeps its content
    atomic.atomic_write_files({tmp_path / "a": b"new a", tmp_path / "b": b"new b"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "a-too", "b"]
    assert (tmp_path / "a").read_bytes() == b"new a" and (tmp_path / "b").read_bytes() == b"new b"
    assert link.read_text() == "old"


def test_without_hard_links_the_earlier_file_is_copied(tmp_path, monkeypatch):
    (tmp_path / "lp.npz").write_text("old")
    monkeypatch.setattr(atomic.os, "link", lambda *_: (_ for _ in ()).throw(OSError(95, "Operation not supported")))
    failing_replace_of("g.safetensors", monkeypatch)
    with pytest.raises(OutputError):
        atomic.atomic_write_files({tmp_path / "lp.npz": b"new", tmp_path / "g.safetensors": b"new"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lp.npz"]
    assert (tmp_path / "lp.npz").read_text() == "old"


def test_a_failed_write_removes_the_folders_it_created(tmp_path, monkeypatch):
    """Found by a user audit: a failed run left the empty output folders it had made."""
    (tmp_path / "kept").mkdir()
    failing_replace_of("g.safetensors", monkeypatch)
    with pytest.raises(OutputError):
        atomic.atomic_write_files({tmp_path / "new" / "a" / "lp.npz": b"lp",
                                   tmp_path / "new" / "b" / "g.safetensors": b"g",
                                   tmp_path / "kept" / "x": b"x"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"] and not any((tmp_path / "kept").iterdir())
    with pytest.raises(ValueError):
        with atomic.atomic_output(tmp_path / "one" / "two" / "f") as out:
            out.write(b"partial")
            raise ValueError("the writer failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]


def test_two_outputs_that_are_one_file_through_a_link_are_refused(tmp_path):
    (tmp_path / "b").symlink_to("a")
    with pytest.raises(OutputError, match="two of the outputs are the same file"):
        atomic.atomic_write_files({tmp_path / "a": b"1", tmp_path / "b": b"2"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


@pytest.mark.parametrize("name, words", [
    ("w" * 250 + ".plan", "would need"),   # fits alone; its temporary name beside it would not
    ("w" * 300 + ".plan", "File name too long"),   # over the limit itself: the file system's own words
])
def test_a_file_name_too_long_for_its_temporary_is_one_line_before_any_work(tmp_path, name, words):
    """Found by a tools audit: `hartsc -o <255-character name>` ended in an OSError traceback."""
    with pytest.raises(OutputError, match=words) as info:
        atomic.check_output_path(tmp_path / name)
    assert "; fix: shorten the file" in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_a_folder_name_too_long_is_one_line(tmp_path):
    with pytest.raises(OutputError, match="File name too long; fix: shorten the file and folder names"):
        atomic.check_output_path(tmp_path / ("d" * 300) / "x.plan")


def test_standard_output_and_a_pipe_behind_a_link_are_refused(tmp_path):
    with pytest.raises(OutputError, match="writing to standard output is not supported"):
        atomic.check_output_path("-")
    read_end, write_end = os.pipe()   # what `-o /dev/stdout | cat` names: a link to a pipe with no path
    try:
        with pytest.raises(OutputError, match="it is a named pipe, not a regular file"):
            atomic.check_output_path(f"/proc/self/fd/{write_end}")
    finally:
        os.close(read_end)
        os.close(write_end)


def test_whether_a_long_name_passes_does_not_depend_on_the_writers_pid(tmp_path, monkeypatch):
    """Found by a review: names were measured with this process's pid, so one run could accept a name the next
    refused. They are measured with the longest pid Linux gives."""
    outcomes = []
    for pid in (1, 4194303):
        monkeypatch.setattr(os, "getpid", lambda pid=pid: pid)
        outcomes.append([_accepted(tmp_path / ("n" * length)) for length in range(225, 240)])
    assert outcomes[0] == outcomes[1] and True in outcomes[0] and False in outcomes[0]


def _accepted(path) -> bool:
    try:
        atomic.check_output_path(path)
        return True
    except OutputError:
        return False
