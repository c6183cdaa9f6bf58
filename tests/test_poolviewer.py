"""The pool viewer's trace format, its replay, its live widget and its way into the book.

The replay runs the viewer's own JavaScript under node (where node is
installed): it must give, at every step, the numbers the chapter's simulator
recorded. tests/test_site_viewers.py checks the same pages in a real browser.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from pagedkv_lab.course import poolviewer, traces, viewers
from pagedkv_lab.sim.contiguous import ContiguousPool
from pagedkv_lab.sim.paged import PagedPool
from pagedkv_lab.sim.workloads import simulate

ROOT = Path(__file__).resolve().parent.parent
MODULE = ROOT / "pagedkv_lab" / "course" / "static" / "poolviewer.js"
NODE = shutil.which("node")

# Replays every step of every run of a trace read from stdin; prints the values.
REPLAY_ALL = """
require(process.argv[1]);
const trace = JSON.parse(require("fs").readFileSync(0, "utf8"));
const out = trace.views.map((view) => Object.fromEntries(Object.entries(view.runs).map(
  ([key, run]) => [key, Array.from({ length: run.steps + 1 },
    (_, s) => Object.assign(globalThis.PagedKVViewer.replay(view, run, s).values,
      view.kind === "slots" ? { states: states(globalThis.PagedKVViewer.replay(view, run, s)) } : {}))])));
function states(state) {
  const totals = {};
  for (const [, n, s] of state.segments) totals[s] = (totals[s] || 0) + n;
  return totals;
}
process.stdout.write(JSON.stringify(out));
"""


def replay_in_node(trace: dict) -> list[dict]:
    """Every view's runs replayed step by step by poolviewer.js, under node."""
    done = subprocess.run(
        [NODE, "-e", REPLAY_ALL, str(MODULE)],
        input=json.dumps(trace),
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout)


def small_viewer() -> poolviewer.Viewer:
    """Chapter 03's viewer on a short W1 trace: both event kinds, few settings."""

    def slots(policy):
        return traces.contiguous_run(policy, "buddy", 4, num_requests=30)

    def blocks(block_size):
        return traces.paged_run(block_size, 4 * 2048, num_requests=30)

    full = viewers.paging_viewer()
    return poolviewer.Viewer(
        name="test viewer",
        title="t",
        caption="c",
        controls=(
            poolviewer.Control("policy", "reservation", ("max", "oracle")),
            poolviewer.Control("block_size", "block size", (16, 8), live=(32,)),
        ),
        views=(
            poolviewer.View("slots", "c", ("policy",), slots, (), full.views[0].legend),
            poolviewer.View("blocks", "p", ("block_size",), blocks, (), ()),
        ),
    )


def test_runs_hold_only_integers_and_strings():
    """So that a chapter's output is the same on every machine (strict nbval)."""

    def leaves(value):
        if isinstance(value, dict):
            return [x for v in value.values() for x in leaves(v)]
        if isinstance(value, list | tuple):
            return [x for v in value for x in leaves(v)]
        return [value]

    trace = small_viewer().trace()
    assert trace["format"] == "pagedkv-trace/1"
    assert {type(x) for x in leaves(trace)} <= {int, str, bool}
    assert sorted(trace["views"][0]["runs"]) == ["max", "oracle"]
    assert sorted(trace["views"][1]["runs"]) == ["16", "8"]
    live = small_viewer().trace(live=True)
    assert [list(v["runs"]) for v in live["views"]] == [["max"], ["16"]]
    assert live["controls"][1]["options"] == [8, 16, 32]


@pytest.mark.skipif(
    NODE is None, reason="node is not installed: the replay check needs it"
)
def test_the_javascript_replay_gives_the_simulators_numbers_at_every_step():
    trace = small_viewer().trace()
    replayed = replay_in_node(trace)
    requests = traces.w1_requests(num_requests=30)
    for k, view in enumerate(trace["views"]):
        for key, steps in replayed[k].items():
            if view["kind"] == "slots":
                pool = ContiguousPool(4 * 2048, 2048, policy=key, fit="buddy")
            else:
                pool = PagedPool(4 * 2048 // int(key), int(key), 2048)
            result = simulate(requests, pool)
            assert len(steps) == result.steps + 1
            for s, got in enumerate(steps[:-1]):
                finished = sum(f < s for f in result.finish_step.values())
                want = {
                    "used": int(result.usage["used"][s]),
                    "running": int(result.running[s]),
                    "waiting": int(result.waiting[s]),
                    "finished": finished,
                }
                assert {k2: got[k2] for k2 in want} == want, (key, s)
                if view["kind"] == "slots":  # every state's slots, as drawn
                    drawn = {st: got["states"].get(st, 0) for st in result.usage}
                    assert drawn == {st: int(v[s]) for st, v in result.usage.items()}
                else:
                    free_blocks = int(result.usage["free"][s]) // int(key)
                    assert got["blocks_used"] == pool.allocator.num_blocks - free_blocks
            assert steps[-1]["finished"] == len(requests)  # past the end: all served
        if view["kind"] == "blocks":
            assert any(len(r) > 3 for r in view["runs"]["8"]["requests"]), (
                "the check should cover a preempted request (several spells)"
            )


def test_cells_runs_repeat_frames_and_code_columns():
    assert traces.rle([0, 0, 0, 2, 2, 5]) == [0, 3, 2, 2, 5, 1]
    run = traces._cells_run([["ab"], ["ab"], ["ba"]], {"x": [1, 1, 4]}, extra=1)
    assert run == {
        "steps": 3,
        "extra": 1,
        "frames": [["ab"], 0, ["ba"]],
        "values": {"x": [1, 2, 4, 1]},
    }


@pytest.mark.skipif(
    NODE is None, reason="node is not installed: the replay check needs it"
)
def test_the_javascript_decodes_cells_runs_and_headlines():
    frames = [["uuf"], ["uuf"], ["ucc"]]
    run = traces._cells_run(frames, {"hit": [0, 16, 32], "prompt": [40, 40, 40]})
    view = {
        "kind": "cells",
        "params": [],
        "codes": {},
        "runs": {"": run},
        "headline": [
            {"key": "hit", "den": "prompt", "label": "now"},
            {"key": "hit", "den": "prompt", "cumulative": True, "label": "so far"},
            {"key": "count_c", "label": "cached"},
        ],
    }
    script = (
        "require(process.argv[1]); const v = JSON.parse(process.argv[2]);"
        "const out = [0, 1, 2].map((s) => globalThis.PagedKVViewer.headline(v, v.runs[''], s));"
        "process.stdout.write(JSON.stringify(out));"
    )
    done = subprocess.run(
        [NODE, "-e", script, str(MODULE), json.dumps(view)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(done.stdout) == [
        {"now": [0, 40], "so far": [0, 40], "cached": [0, None]},
        {"now": [16, 40], "so far": [16, 80], "cached": [0, None]},
        {"now": [32, 40], "so far": [48, 120], "cached": [2, None]},
    ]


def test_the_live_widget_simulates_the_setting_the_page_asks_for():
    widget = poolviewer.viewer_widget(small_viewer(), site=False)
    assert set(widget.runs[1]) == {"16"}
    widget.wanted = "1|32"  # a live-only setting
    run = widget.runs[1]["32"]
    assert run == traces.paged_run(32, 4 * 2048, num_requests=30)
    assert widget.error == ""
    widget.wanted = "1|99"  # no such option: an error in the page, not a traceback
    assert widget.error.startswith("cannot simulate '1|99'") and widget.wanted == ""


def test_a_viewer_output_carries_the_page_and_a_short_plain_line():
    widget = poolviewer.viewer_widget(small_viewer())
    data, metadata = widget._repr_mimebundle_()
    assert metadata == {poolviewer.VIEWER_OUTPUT: "test viewer"}
    steps = sorted(
        r["steps"] for v in widget._site["views"] for r in v["runs"].values()
    )
    assert data["text/plain"] == (
        f"test viewer: 4 runs of {steps[0]:,} to {steps[-1]:,} steps, replayed in the page"
    )
    page = data["text/html"]
    assert page.startswith('<div class="pkv-viewer"') and "</script></div>" in page
    trace = json.loads(page.split('class="pkv-trace">')[1].split("</script>")[0])
    assert len(trace["views"][0]["runs"]) == 2
    assert "application/vnd.jupyter.widget-view+json" in data


def test_trace_json_cannot_close_its_script_tag():
    assert "</script>" not in poolviewer.trace_json({"x": "</script><b>"})


def test_legends_are_the_static_figures():
    from pagedkv_lab.course.plotting import COLORS, HATCHES, LABELS

    legend = viewers.contiguous_viewer().views[0].legend
    assert [e["state"] for e in legend] == list(ContiguousPool.STATES)
    for entry in legend:
        state = entry["state"]
        assert entry["fill"].lower() == COLORS[state].lower()
        assert entry["label"] == LABELS[state]
        assert entry.get("hatch") == HATCHES.get(state)
    blocks = viewers.paging_viewer().views[1].legend
    reserved = next(e for e in blocks if e["state"] == "reserved")
    assert (
        reserved["hatch"] == "////" and reserved["edge"] == COLORS["reserved"].lower()
    )
    beams = {e["label"]: e for e in viewers.beam_viewer().views[0].legend}
    assert (
        beams["written in place"]["dash"] and not beams["copied into this step"]["dash"]
    )


def test_the_module_ships_and_ends_with_the_global_that_anywidget_exports():
    source = poolviewer.module_source()
    assert source == MODULE.read_text()
    assert "globalThis.PagedKVViewer = api" in source
    assert "://" not in source  # nothing to fetch


def test_the_book_shows_a_viewers_page_part_and_no_saved_widget_state():
    from pagedkv_lab.course._sphinx import WIDGET_VIEW, site_notebook
    from pagedkv_lab.course.notebook import LIVE_ONLY

    viewer_output = {
        "output_type": "display_data",
        "metadata": {poolviewer.VIEWER_OUTPUT: "v"},
        "data": {
            WIDGET_VIEW: {"model_id": "x"},
            "text/html": "<div>",
            "text/plain": "v",
        },
    }
    live_only = {
        "output_type": "display_data",
        "metadata": {LIVE_ONLY: True},
        "data": {},
    }
    old_widget = {
        "output_type": "display_data",
        "metadata": {},
        "data": {WIDGET_VIEW: {}},
    }
    notebook = {
        "metadata": {"widgets": {"state": {}}},
        "cells": [
            {"cell_type": "code", "outputs": [viewer_output, live_only, old_widget]}
        ],
    }
    shown = json.loads(site_notebook(json.dumps(notebook)))
    assert (
        "widgets" not in shown["metadata"]
    )  # myst-nb would load its manager from a CDN
    first, second = shown["cells"][0]["outputs"]
    assert set(first["data"]) == {"text/html", "text/plain"}
    assert second == old_widget


def test_an_inline_script_registered_twice_is_written_once():
    assets = pytest.importorskip("sphinx.builders.html._assets")
    _JavaScript = assets._JavaScript

    from pagedkv_lab.course._sphinx import unique_scripts

    body = "const THEBE_JS_URL = 1"
    scripts = [
        _JavaScript("a.js"),
        _JavaScript(None, body=body),
        _JavaScript("", body=body),
    ]
    kept = unique_scripts(scripts)
    assert len(kept) == 2 and kept[0].filename == "a.js"
