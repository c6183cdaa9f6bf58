"""The chapters' pool viewers (`poolviewer`): what each one simulates, the
settings a reader picks, the headline it shows and its legend, which is the
legend of the chapter's static figure (`pagedkv_lab.course.plotting`, `course.widgets`)."""

from __future__ import annotations

from functools import partial

from matplotlib.colors import to_hex

from pagedkv_lab.course import traces
from pagedkv_lab.course.plotting import COLORS, REQUEST_COLORS, state_patch
from pagedkv_lab.course.poolviewer import Control, View, Viewer, show
from pagedkv_lab.course.widgets import (
    USED_SWATCH,
    beam_legend_handles,
    block_legend_handles,
    cache_legend_handles,
)
from pagedkv_lab.sim.contiguous import ContiguousPool


def legend_entry(patch, state: str | None = None) -> dict:
    """A matplotlib legend patch as the viewer draws it: fill, hatch, edge; with
    the memory ``state`` it stands for, where the viewer fills cells with it."""
    fill, edge = patch.get_facecolor(), patch.get_edgecolor()
    entry = {"label": patch.get_label(), "fill": to_hex(fill, keep_alpha=False)}
    if state:
        entry["state"] = state
    if patch.get_hatch():
        entry["hatch"] = patch.get_hatch()
        entry["edge"] = to_hex(edge, keep_alpha=False)
    elif fill[3] > 0 and fill[:3] == (1.0, 1.0, 1.0) and edge[3] > 0:
        entry["edge"] = to_hex(edge, keep_alpha=False)  # an outline's entry
        entry["dash"] = patch.get_linestyle() not in ("solid", "-")
    return entry


POOL_SHARE = {"key": "used", "den": "capacity", "percent": True,
              "label": "of the pool holds K/V"}  # fmt: skip
QUEUES = tuple({"key": k, "label": k} for k in ("running", "waiting", "finished"))


def _w1_caption(pool: str) -> str:
    w = traces.W1_VIEW
    return (
        f"The W1 trace: {w['num_requests']} chat requests arriving "
        f"{w['arrival_rate']} a step, at most {w['max_model_len']:,} tokens each, "
        f"through {pool}. The same simulator and colours as the chapter's static figures."
    )


def _slots_view(label: str, params: tuple[str, ...], **fixed) -> View:
    return View(
        kind="slots",
        label=label,
        params=params,
        run=partial(traces.contiguous_run, **fixed),
        headline=(POOL_SHARE, *QUEUES),
        legend=tuple(legend_entry(state_patch(s), s) for s in ContiguousPool.STATES),
    )


def contiguous_viewer() -> Viewer:
    """Chapter 02: W1 through a contiguous pool; policy, allocator, pool size."""
    return Viewer(
        name="contiguous pool viewer",
        title="A contiguous KV pool serving W1, step by step",
        caption=_w1_caption(
            f"a pool of rows of {traces.W1_VIEW['max_model_len']:,} slots"
        ),
        controls=(
            Control("policy", "reservation", ("max", "pow2", "oracle")),
            Control("fit", "allocator", ("buddy", "first", "best")),
            Control("rows", "pool rows", (8, 4, 16), live=tuple(range(2, 25))),
        ),
        views=(_slots_view("contiguous pool", ("policy", "fit", "rows")),),
    )


def paging_viewer() -> Viewer:
    """Chapter 03: the same trace and memory, contiguous beside paged."""
    slots = 8 * traces.W1_VIEW["max_model_len"]
    paged = View(
        kind="blocks",
        label="paged pool",
        params=("block_size",),
        run=traces.paged_run,
        headline=(
            POOL_SHARE,
            {"key": "blocks_used", "label": "blocks in use"},
            *QUEUES,
        ),
        legend=tuple(
            legend_entry(p, s)
            for p, s in zip(
                block_legend_handles(), ("used", "reserved", "internal", "free")
            )
        ),
        extra={"owners": REQUEST_COLORS, "free": COLORS["free"]},
    )
    return Viewer(
        name="contiguous vs paged viewer",
        title="One trace, one memory: contiguous reservation beside paging",
        caption=_w1_caption(f"two pools of {slots:,} token slots each"),
        controls=(
            Control("policy", "contiguous: reservation", ("max", "pow2", "oracle")),
            Control(
                "block_size", "paged: block size", (16, 8, 32, 64), live=(4, 128, 256)
            ),
        ),  # fmt: skip
        views=(
            _slots_view(
                "contiguous pool (buddy allocator)", ("policy",), fit="buddy", rows=8
            ),
            paged,
        ),  # fmt: skip
    )


def beam_viewer() -> Viewer:
    """Chapter 07: one real beam search, its blocks step by step."""
    view = View(
        kind="cells",
        label="each beam's block table",
        params=("beams", "block_size"),
        run=traces.beam_run,
        headline=(
            {"key": "held", "label": "blocks hold the beams' K/V"},
            {"key": "table_entries", "label": "block-table entries"},
            {"key": "copies", "label": "copied this step"},
            {"key": "in_place", "label": "written in place"},
            {"key": "finished", "label": "hypotheses finished"},
        ),
        legend=tuple(legend_entry(p) for p in beam_legend_handles()),
        extra={
            "codes": {"o": COLORS["used"], "s": COLORS["shared"]},
            "layout": "rows",
            "cell": 40,
        },  # fmt: skip
    )
    return Viewer(
        name="beam search viewer",
        title="Beam search in a paged cache: blocks shared, copied on write",
        caption="A real beam search (the offline tiny-llama, a 9-token prompt, "
        "8 new tokens), each step as its forward pass sees the blocks.",
        controls=(
            Control("beams", "beams", (4, 2, 8), live=(3, 5, 6, 7)),
            Control("block_size", "block size", (4, 2, 8), live=(1, 16)),
        ),
        views=(view,),
        start=1,  # the first decode step: the prompt's blocks shared by every beam
    )


def prefix_cache_viewer(workloads: dict, capacities=(64, 32, 128)) -> Viewer:
    """Chapter 08: token workloads (name -> `TokenRequest` list) through a prefix
    cache of ``capacities`` blocks, request by request."""

    def run(workload: str, capacity: int) -> dict:
        return traces.prefix_cache_run(workloads[workload], capacity)

    view = View(
        kind="cells",
        label="the cache's blocks",
        params=("workload", "capacity"),
        run=run,
        headline=(
            {
                "key": "hit",
                "den": "prompt",
                "percent": True,
                "label": "of this request's prompt hit",
            },
            {
                "key": "hit",
                "den": "prompt",
                "percent": True,
                "cumulative": True,
                "label": "of all prompt tokens so far hit",
            },
            {"key": "count_c", "label": "blocks cached, free"},
            {"key": "evictions", "label": "evictions so far"},
        ),  # fmt: skip
        legend=tuple(legend_entry(p) for p in cache_legend_handles()),
        extra={
            "codes": {c: COLORS[s] for s, c in traces.CACHE_CODES.items()},
            "groups": [{"columns": 16}],
            "cell": 22,
        },  # fmt: skip
    )
    sizes = ", ".join(
        f"{name}: {len(reqs)} requests" for name, reqs in workloads.items()
    )
    return Viewer(
        name="prefix cache viewer",
        title="What a prefix cache keeps, request by request",
        caption=f"Workloads ({sizes}) served four at a time through a cache of "
        "16-token blocks.",
        controls=(
            Control("workload", "workload", tuple(workloads)),
            Control("capacity", "cache blocks", tuple(capacities), live=(16, 48, 96)),
        ),
        views=(view,),
        time="request",
    )


#: Chapter 09's preemption settings: label -> (mode, swap blocks).
PREEMPTION_MODES = {
    "swap, 16 host blocks": ("swap", 16),
    "swap, 8 host blocks": ("swap", 8),
    "recompute": ("recompute", 16),
}


def _preemption_run(mode: str, num_blocks: int) -> dict:
    how, swap_blocks = PREEMPTION_MODES[mode]
    return traces.preemption_run(how, num_blocks, swap_blocks)


def preemption_viewer() -> Viewer:
    """Chapter 09: ten requests through a tiny pool, preempted by swap or
    recompute."""
    view = View(
        kind="cells",
        label="device and host pools (a colour per request)",
        params=("mode", "num_blocks"),
        run=_preemption_run,
        headline=(
            *({"key": k, "label": k} for k in ("running", "waiting")),
            {"key": "swapped", "label": "swapped out"},
            {"key": "finished", "label": "finished"},
            {"key": "preemptions", "label": "preemptions so far"},
            {"key": "fallbacks", "label": "recomputed for want of swap space"},
        ),
        legend=(
            {
                "label": "held: a colour per request",
                "fill": USED_SWATCH,
                "stripes": REQUEST_COLORS[:4],
            },
            {"label": "free", "fill": COLORS["free"]},
        ),  # fmt: skip
        extra={
            "owners": REQUEST_COLORS,
            "free": COLORS["free"],
            "cell": 22,
            "groups": [
                {"label": "device pool", "columns": 12},
                {"label": "host (swap) pool", "columns": 12},
            ],
        },  # fmt: skip
    )
    return Viewer(
        name="preemption viewer",
        title="A preemption storm: ten requests, a pool for less than two",
        caption="Ten W1-like requests through a device pool of 8-token blocks "
        "(the offline tiny-llama, greedy), step by step.",
        controls=(
            Control("mode", "preemption", tuple(PREEMPTION_MODES)),
            Control("num_blocks", "device blocks", (24, 32), live=(16, 20, 28, 40)),
        ),
        views=(view,),
    )


def show_contiguous_viewer() -> None:
    """Chapter 02's viewer, live in a notebook and replayed on the site."""
    where = 'one moment of it, frozen, is in the "Going deeper" aside below.'
    show(contiguous_viewer(), fallback=where)


def show_paging_viewer() -> None:
    """Chapter 03's viewer: contiguous beside paged, on one trace."""
    where = (
        "one moment of a smaller paged trace, frozen, is in the "
        '"Going deeper" aside below.'
    )
    show(paging_viewer(), fallback=where)


def show_beam_viewer() -> None:
    """Chapter 07's viewer: a beam search's blocks."""
    show(beam_viewer())


def show_prefix_cache_viewer(workloads: dict, capacities=(64, 32, 128)) -> None:
    """Chapter 08's viewer over ``workloads`` (name -> requests)."""
    show(prefix_cache_viewer(workloads, capacities))


def show_preemption_viewer() -> None:
    """Chapter 09's viewer: a preemption storm."""
    show(preemption_viewer())
