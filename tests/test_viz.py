"""`harts viz`: the report is one well-formed, self-contained page with every plot.

Run: `python -m pytest tests/test_viz.py -q`. Plans are compiled from a small
tree-step workload: L1 plans with dp=1 and dp=4, and a two-level plan with
dp=4 whose sharing window has a producer on every replica.
The last test renders the page in headless Chromium and is skipped when no
browser is on PATH (`apt-get install chromium` to run it).
"""
from __future__ import annotations

import re
import shutil
import subprocess
from html.parser import HTMLParser

import numpy as np
import pytest

from harts.cli import main as harts_main
from harts.compiler.cli import main as hartsc_main
from harts.schema.plan import read_plan, write_plan
from harts.tools import gen
from harts.tools.viz import PLOT_IDS, render_report, slot_parts, tree_view

WORKLOAD = gen.GenConfig(kind="treestep", tasks=6, group_size=3, system_prompt_tokens=128, task_tokens_min=32,
                         task_tokens_max=64, turns_min=2, turns_max=4, action_tokens_median=16.0,
                         tool_tokens_median=32.0, tool_tokens_max=128, context_limit=512, vocab_size=1000,
                         seed=0, branch_prob=0.4)
VOID = {"meta", "br", "img", "input", "link", "hr", "col", "area", "base", "wbr", "source", "path", "rect", "line"}


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    folder = tmp_path_factory.mktemp("viz")
    trees = folder / "trees.jsonl"
    gen.write_jsonl(gen.generate(WORKLOAD), trees)
    paths = {"l1": folder / "l1.plan", "dp4": folder / "dp4.plan", "l2": folder / "l2.plan"}
    assert hartsc_main([str(trees), "-o", str(paths["l1"]), "--chunk-size", "16", "--capacity", "2048",
                        "--levels", "l1"]) == 0
    assert hartsc_main([str(trees), "-o", str(paths["dp4"]), "--dp", "4", "--capacity", "700",
                        "--chunk-size", "16", "--levels", "l1"]) == 0
    assert hartsc_main([str(trees), "-o", str(paths["l2"]), "--dp", "4", "--capacity", "700",
                        "--chunk-size", "16", "--levels", "l1+l2"]) == 0
    return paths


class Structure(HTMLParser):
    """Checks that every element closes in order; collects svg ids and attribute values."""

    def __init__(self):
        super().__init__()
        self.stack, self.svg_ids, self.values, self.errors = [], [], [], []

    def handle_starttag(self, tag, attrs):
        self.values += [v for _, v in attrs if v]
        if tag == "svg":
            self.svg_ids.append(dict(attrs).get("id"))
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.values += [v for _, v in attrs if v]

    def handle_endtag(self, tag):
        if tag in VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes <{self.stack[-1] if self.stack else None}>")
        else:
            self.stack.pop()


def assert_self_contained_page(page: str) -> Structure:
    assert page.startswith("<!DOCTYPE html>")
    parser = Structure()
    parser.feed(page)
    parser.close()
    assert not parser.errors and not parser.stack, (parser.errors, parser.stack)
    assert sorted(i for i in parser.svg_ids if i) == sorted(PLOT_IDS)
    assert not re.search(r"https?:", page), "the page must not reach the network"
    assert "<script" not in page and "<link" not in page and "@import" not in page and "url(" not in page
    assert 'id="stats"' in page
    return parser


def test_l1_page_is_self_contained_with_every_plot(plans, tmp_path):
    out = tmp_path / "sub" / "report.html"
    assert harts_main(["viz", str(plans["l1"]), "-o", str(out)]) == 0
    page = out.read_text()
    assert_self_contained_page(page)
    assert "no sharing windows: L1 plan" in page
    assert not list(out.parent.glob(".*tmp")), "written atomically: no temporary file left"


def test_dp4_page_draws_every_replica(plans, tmp_path):
    out = tmp_path / "report.html"
    assert harts_main(["viz", str(plans["dp4"]), "-o", str(out)]) == 0
    page = out.read_text()
    assert_self_contained_page(page)
    plan = read_plan(plans["dp4"])
    _, decoder, _ = slot_parts(plan)
    assert decoder.shape == (4, len(plan.microbatches) // 4)
    assert decoder.sum() == sum(len(mb["row_token"]) for mb in plan.microbatches)
    for d in range(4):
        assert f"replica {d}, slot 0:" in page


def test_tree_segments_follow_the_plan_arrays(plans):
    plan = read_plan(plans["l1"])
    view = tree_view(plan, None)
    mb = plan.microbatches[view.microbatch]
    assert view.segments, "the default tree has segments"
    lane = {b.index: k for k, b in enumerate(view.segments)}
    for k, b in enumerate(view.segments):
        assert b.parent == -1 or lane[b.parent] < k, "parents are drawn above their children"
        if b.parent >= 0:
            parent = view.segments[lane[b.parent]]
            assert b.start == parent.end, "a child starts where its parent segment ends"
        for anchor, first in b.replays:
            assert anchor % view.chunk_size == 0 and 0 < first - anchor < view.chunk_size
        assert set(b.rounds) <= set(mb["sequence_round"].tolist())
    assert any(b.replays for b in view.segments), "the workload forks inside chunks, so replay is drawn"


def test_tree_flag_picks_a_tree_and_rejects_unknown_ids(plans, tmp_path, capsys):
    plan = read_plan(plans["dp4"])
    wanted = plan.step["trees"][-1]
    view = tree_view(plan, str(wanted))
    assert view.label == f"tree {wanted}"
    assert harts_main(["viz", str(plans["dp4"]), "-o", str(tmp_path / "r.html"), "--tree", "no-such<tree>"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tree 'no-such<tree>' is not in the plan; fix:" in err[0]
    assert not (tmp_path / "r.html").exists()


def test_unreadable_plan_is_one_line(tmp_path, capsys):
    assert harts_main(["viz", str(tmp_path / "missing.plan"), "-o", str(tmp_path / "r.html")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_plan_breaking_an_invariant_is_one_line(plans, tmp_path, capsys):
    """A plan that reads but breaks an invariant is refused, not drawn from tables that index wrongly."""
    plan = read_plan(plans["l2"])
    mb = plan.microbatches[0]
    mb["sequence_row_start"] = mb["sequence_row_start"].copy()
    mb["sequence_row_start"][0] += 1   # the first sequence one row late: row 0 is computed by nobody
    broken = tmp_path / "broken.plan"
    write_plan(plan, broken)
    assert harts_main(["viz", str(broken), "-o", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sequences tile the rows" in err[0] and "fix:" in err[0], err
    assert not (tmp_path / "r.html").exists()


def test_windows_are_drawn_when_present(plans):
    plan = read_plan(plans["l2"])
    slots = 1 + max(int(mb["slot"]) for mb in plan.microbatches)
    assert {int(p["window"]) for p in plan.producers} == {0} and slots > 1
    producer, decoder, cached = slot_parts(plan)
    assert (producer[:, 0] > 0).all() and producer[:, 1:].sum() == 0, "a producer is charged to its window's first slot"
    assert producer[:, 0].tolist() == [len(p["row_token"]) for p in sorted(plan.producers, key=lambda p: p["replica"])]
    assert cached.sum() == sum(int(np.count_nonzero(mb["row_cached_by"] >= 0)) for mb in plan.microbatches) > 0
    assert decoder.sum() + cached.sum() == sum(len(mb["row_token"]) for mb in plan.microbatches)
    page = render_report(plan, plans["l2"].name)
    assert_self_contained_page(page)
    assert "no sharing windows" not in page
    assert "producer of window 0 on replica 0" in page and f"W0 (slots 0-{slots - 1})" in page
    assert "producer rows" in page, "the work plot stacks the producer part"


@pytest.mark.skipif(shutil.which("chromium") is None, reason="no chromium on PATH")
def test_headless_chromium_renders_the_page(plans, tmp_path):
    out, shot = tmp_path / "report.html", tmp_path / "shot.png"
    assert harts_main(["viz", str(plans["dp4"]), "-o", str(out)]) == 0
    run = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                          "--window-size=1100,1600", f"--screenshot={shot}", out.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000, "a real, non-blank screenshot"
