"""The pool viewers on the built site, operated in headless Chromium.

The book is built (`jupyter-book build`, incremental into ``_build/``), then each
chapter page with a viewer is opened from ``file://`` with every other request
blocked. Each control is operated; after each, the drawing must have changed
and every headline number must be the one the chapter's simulator gives for
that setting and step (computed here, from the simulators, not from the page's
trace). The page must log no JavaScript error and ask for nothing from the
network.

Needs Chromium (``apt-get install chromium``, or ``PAGEDKV_CHROMIUM=/path``),
Playwright for Python (the ``dev`` extra; its own browsers are not used) and
jupyter-book (the ``book`` extra); skips, saying which is missing, without them.
``PAGEDKV_SCREENSHOTS=dir`` also saves a screenshot of each viewer.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

from pagedkv_lab.course import traces
from pagedkv_lab.sim.contiguous import ContiguousPool
from pagedkv_lab.sim.paged import PagedPool
from pagedkv_lab.sim.workloads import chat_workload, simulate

ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / "_build" / "html"
CHAPTERS = ("02_contiguous", "03_paging", "07_copy_on_write", "08_prefix_caching",
            "09_preemption")  # fmt: skip
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]  # fmt: skip


def chromium() -> str | None:
    names = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
    found = os.environ.get("PAGEDKV_CHROMIUM") or next(
        (path for path in map(shutil.which, names) if path), None
    )
    return found if found and Path(found).exists() else None


def _needs() -> str | None:
    """Why this machine cannot run the check, or None."""
    if chromium() is None:
        return "Chromium is not installed (apt-get install chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright for Python is not installed (pip install -e '.[dev]')"
    if not (Path(sys.executable).parent / "jupyter-book").exists():
        return "jupyter-book is not installed (pip install -e '.[book]')"
    return None


pytestmark = pytest.mark.skipif(
    _needs() is not None,
    reason=f"SKIPPED the site's viewers in a browser: {_needs()}",
)


# What the chapters' simulators give, for the settings and step on the page ------------

W1 = traces.W1_VIEW


@lru_cache(maxsize=64)
def _contiguous(policy: str, fit: str, rows: int):
    requests = chat_workload(W1["num_requests"], seed=W1["seed"],
                             arrival_rate=W1["arrival_rate"],
                             max_model_len=W1["max_model_len"])  # fmt: skip
    pool = ContiguousPool(rows * W1["max_model_len"], W1["max_model_len"], policy, fit)
    return requests, simulate(requests, pool)


@lru_cache(maxsize=16)
def _paged(block_size: int):
    requests, _ = _contiguous("max", "buddy", 8)
    slots = 8 * W1["max_model_len"]
    return requests, simulate(requests, PagedPool(slots // block_size, block_size))


def _queues(requests, result, step: int) -> dict:
    if step >= result.steps:
        return {
            "running": (0, None),
            "waiting": (0, None),
            "finished": (len(requests), None),
        }
    finished = sum(f < step for f in result.finish_step.values())
    return {
        "running": (int(result.running[step]), None),
        "waiting": (int(result.waiting[step]), None),
        "finished": (finished, None),
    }


def expect_slots(settings: dict, step: int) -> dict:
    requests, result = _contiguous(
        settings["policy"], settings.get("fit", "buddy"), int(settings.get("rows", 8))
    )
    used = int(result.usage["used"][step]) if step < result.steps else 0
    share = {"of the pool holds K/V": (used, result.capacity)}
    return share | _queues(requests, result, step)


def expect_blocks(settings: dict, step: int) -> dict:
    bs = int(settings["block_size"])
    requests, result = _paged(bs)
    if step < result.steps:
        used, free = int(result.usage["used"][step]), int(result.usage["free"][step])
    else:
        used, free = 0, result.capacity
    return {
        "of the pool holds K/V": (used, result.capacity),
        "blocks in use": ((result.capacity - free) // bs, None),
    } | _queues(requests, result, step)


@lru_cache(maxsize=16)
def _beams(beams: int, block_size: int):
    from pagedkv_lab.course.widgets import trace_beam_search

    return trace_beam_search(beam_width=beams, block_size=block_size)


def expect_beams(settings: dict, step: int) -> dict:
    frames = _beams(int(settings["beams"]), int(settings["block_size"]))
    f = frames[min(step, len(frames) - 1)]
    tables = [blocks for _, blocks, _ in f["beams"]]
    return {
        "blocks hold the beams' K/V": (len({b for t in tables for b in t}), None),
        "block-table entries": (sum(map(len, tables)), None),
        "copied this step": (len(f["copies"]), None),
        "written in place": (len(f["in_place"]), None),
        "hypotheses finished": (f["finished"], None),
    }


@lru_cache(maxsize=16)
def _cache(workload: str, capacity: int):
    from pagedkv_lab.course.widgets import trace_prefix_cache
    from pagedkv_lab.sim.workloads import multi_turn_workload, system_prompt_workload

    # the workloads scripts/viewer_cells.py gives chapter 08's viewer
    requests = {
        "multi-turn chat": multi_turn_workload(6, 3, system_len=64, seed=11),
        "one system prompt": system_prompt_workload(18, system_len=64, seed=11),
    }[workload]
    return trace_prefix_cache(requests, capacity)


def expect_cache(settings: dict, step: int) -> dict:
    frames = _cache(settings["workload"], int(settings["capacity"]))
    upto = frames[: step + 1]
    f = upto[-1]
    return {
        "of this request's prompt hit": (f["hit"], f["prompt"]),
        "of all prompt tokens so far hit": (
            sum(g["hit"] for g in upto),
            sum(g["prompt"] for g in upto),
        ),
        "blocks cached, free": (f["states"].count("cached"), None),
        "evictions so far": (f["evictions"], None),
    }


@lru_cache(maxsize=16)
def _storm(mode: str, num_blocks: int):
    from pagedkv_lab.course.viewers import PREEMPTION_MODES
    from pagedkv_lab.course.widgets import trace_preemption

    how, swap_blocks = PREEMPTION_MODES[mode]
    return trace_preemption(mode=how, num_blocks=num_blocks, swap_blocks=swap_blocks)


def expect_storm(settings: dict, step: int) -> dict:
    frames = _storm(settings["mode"], int(settings["num_blocks"]))
    f = frames[min(step, len(frames) - 1)]
    queued = sum(len(f[q]) for q in ("running", "waiting", "swapped"))
    return {
        "running": (len(f["running"]), None),
        "waiting": (len(f["waiting"]), None),
        "swapped out": (len(f["swapped"]), None),
        "finished": (10 - queued, None),  # trace_preemption serves 10 requests
        "preemptions so far": (f["preemptions"], None),
        "recomputed for want of swap space": (f["fallbacks"], None),
    }


#: Per chapter, per view: the function that gives its headline numbers.
EXPECT = {
    "02_contiguous": [expect_slots],
    "03_paging": [expect_slots, expect_blocks],
    "07_copy_on_write": [expect_beams],
    "08_prefix_caching": [expect_cache],
    "09_preemption": [expect_storm],
}


def arrivals() -> list[int]:
    requests, _ = _contiguous("max", "buddy", 8)
    return sorted(max(0, math.ceil(r.arrival)) for r in requests)


# The browser ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def site():
    """The built book (an incremental build: quick when `make book` ran)."""
    done = subprocess.run(
        [str(Path(sys.executable).parent / "jupyter-book"), "build", str(ROOT), "-W",
         "--keep-going"],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return SITE


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium(), args=CHROMIUM_ARGS)
        yield b
        b.close()


def open_page(browser, path: Path):
    """``path`` opened offline: every request that is not a file is blocked and
    recorded, every console error and uncaught exception recorded."""
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    page.blocked, page.errors = [], []

    def route(r):
        if r.request.url.startswith("file://"):
            r.continue_()
        else:
            page.blocked.append(r.request.url)
            r.abort()

    page.route("**/*", route)
    page.on("pageerror", lambda e: page.errors.append(f"uncaught: {e}"))
    page.on(
        "console",
        lambda m: (
            page.errors.append(f"console: {m.text}") if m.type == "error" else None
        ),
    )
    page.goto(path.as_uri())
    page.wait_for_selector(".pkv-viewer.pkv-mounted canvas", timeout=10_000)
    return page


def settings(viewer) -> dict:
    return {
        s.get_attribute("data-control"): s.input_value()
        for s in viewer.query_selector_all("select[data-control]")
    }


def shown(viewer) -> list[dict]:
    """Every view's headline: label -> (numerator, denominator)."""
    out = []
    for view in viewer.query_selector_all(".pkv-view"):
        numbers = {}
        for span in view.query_selector_all(".pkv-headline [data-key]"):
            den = span.get_attribute("data-den")
            numbers[span.get_attribute("data-label")] = (
                int(span.get_attribute("data-num")),
                None if den is None else int(den),
            )
        out.append(numbers)
    return out


def drawing(viewer) -> list[str]:
    return viewer.eval_on_selector_all("canvas", "cs => cs.map(c => c.toDataURL())")


def step_of(viewer) -> int:
    return int(viewer.get_attribute("data-step"))


def check_numbers(viewer, chapter: str, what: str) -> None:
    step, now = step_of(viewer), settings(viewer)
    want = [expect(now, step) for expect in EXPECT[chapter]]
    assert shown(viewer) == want, f"{chapter}, after {what}: {now}, step {step}"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_each_control_redraws_the_pool_and_agrees_with_the_simulator(
    site, browser, chapter
):
    page = open_page(browser, site / "notebooks" / f"{chapter}.html")
    (viewer,) = page.query_selector_all(".pkv-viewer.pkv-mounted")
    scrub = viewer.query_selector("input[type=range]")
    check_numbers(viewer, chapter, "loading")

    # Time: one step on and back, the start, the slider, play.
    for act in ("next", "back", "first"):
        before, at = drawing(viewer), step_of(viewer)
        viewer.query_selector(f"button[data-act={act}]").click()
        assert step_of(viewer) == {"next": at + 1, "back": at - 1, "first": 0}[act]
        check_numbers(viewer, chapter, act)
    arrival = viewer.query_selector("button[data-act=arrival]")
    for _ in range(3 if arrival else 0):  # chapters 02-03: the next request arrives
        at = step_of(viewer)
        arrival.click()
        assert step_of(viewer) == next(a for a in arrivals() if a > at)
        check_numbers(viewer, chapter, "next request")
    last = int(scrub.get_attribute("max"))
    middle = max(1, last * 2 // 5)
    before = drawing(viewer)
    scrub.fill(str(middle))
    assert step_of(viewer) == middle and drawing(viewer) != before
    check_numbers(viewer, chapter, "the slider")
    if arrival is not None:  # every request has arrived by then
        assert arrival.is_disabled() == (max(arrivals()) <= middle)
    before, at = drawing(viewer), step_of(viewer)
    viewer.query_selector("button[data-act=play]").click()
    page.wait_for_function(
        f"el => Number(el.dataset.step) > {at}", arg=viewer, timeout=5_000
    )
    viewer.query_selector("button[data-act=play]").click()  # pause
    now = step_of(viewer)
    assert now > at
    if drawing(viewer) == before:  # a pool can stay the same for a few steps
        expect = EXPECT[chapter]
        assert [e(settings(viewer), now) for e in expect] == [
            e(settings(viewer), at) for e in expect
        ]
    check_numbers(viewer, chapter, "play and pause")
    scrub.fill(str(middle))

    # Every option of every control: the drawing changes, the numbers follow. Each
    # control stays at its last option (under "max" reservation, say, every
    # allocator draws the same pool; under "oracle" each draws its own).
    for select in viewer.query_selector_all("select[data-control]"):
        options = [
            o.get_attribute("value") for o in select.query_selector_all("option")
        ]
        for value in [o for o in options if o != select.input_value()]:
            before = drawing(viewer)
            select.select_option(value)
            assert drawing(viewer) != before, f"{chapter}: {value} drew nothing new"
            check_numbers(viewer, chapter, f"choosing {value}")

    directory = os.environ.get("PAGEDKV_SCREENSHOTS")
    if directory:
        Path(directory).mkdir(parents=True, exist_ok=True)
        page.set_viewport_size({"width": 1280, "height": 2400})  # the whole viewer
        viewer.screenshot(path=str(Path(directory) / f"{chapter}.png"))
    assert page.errors == [], page.errors
    assert page.blocked == [], f"the page asked the network for {page.blocked}"
    page.close()


def test_pages_load_no_script_twice_and_no_viewer_where_there_is_none(site, browser):
    page = open_page(browser, site / "notebooks" / "03_paging.html")
    scripts = page.eval_on_selector_all("script", "ss => ss.map(s => s.src || s.text)")
    assert len(scripts) == len(set(scripts)), "a script is included twice"
    assert sum("poolviewer.js" in s for s in scripts) == 1
    assert not page.query_selector_all(".pkv-fallback")  # replaced by the viewer
    page.close()
    html = (site / "notebooks" / "04a_attention_over_blocks.html").read_text()
    assert "poolviewer.js" not in html and "widget-state" not in html
