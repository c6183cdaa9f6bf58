import numpy as np
import pytest

from pagedkv_lab.course.widgets import contiguous_trace_frames
from pagedkv_lab.sim.workloads import (
    SHAREGPT_MEAN_OUTPUT,
    SHAREGPT_MEAN_PROMPT,
    chat_workload,
    uniform_workload,
)


def test_chat_workload_matches_its_published_means_and_limits():
    reqs = chat_workload(4000, seed=0, max_model_len=2048)
    prompts = np.array([r.prompt_len for r in reqs])
    outputs = np.array([r.output_len for r in reqs])
    assert abs(prompts.mean() / SHAREGPT_MEAN_PROMPT - 1) < 0.15
    assert abs(outputs.mean() / SHAREGPT_MEAN_OUTPUT - 1) < 0.1
    assert (
        max(r.total_len for r in reqs) <= 2048
        and min(prompts.min(), outputs.min()) >= 1
    )
    assert np.median(outputs) < outputs.mean()  # heavy right tail


def test_workloads_are_seeded_and_arrivals_increase():
    a = chat_workload(50, seed=7, arrival_rate=0.3)
    assert a == chat_workload(50, seed=7, arrival_rate=0.3) and a != chat_workload(
        50, seed=8, arrival_rate=0.3
    )
    times = [r.arrival for r in a]
    assert times == sorted(times) and times[0] > 0
    assert all(r.arrival == 0 for r in uniform_workload(10, seed=0))
    assert (
        abs(
            np.mean(
                np.diff(
                    [r.arrival for r in chat_workload(3000, seed=1, arrival_rate=0.5)]
                )
            )
            - 2
        )
        < 0.2
    )


def test_bad_workload_arguments():
    with pytest.raises(ValueError):
        chat_workload(0)
    with pytest.raises(ValueError, match="arrival rate"):
        chat_workload(5, arrival_rate=-1.0)
    with pytest.raises(ValueError):
        uniform_workload(5, low=10, high=5)


def test_viewer_frames_cover_the_pool_and_follow_the_simulation():
    capacity, frames = contiguous_trace_frames(
        4, 1024, 0.5, "oracle", num_requests=40, every=25
    )
    assert capacity == 4 * 1024 and len(frames) > 3
    for _step, segments, stats in frames:
        assert sum(n for _, n, _ in segments) == capacity
        starts = [s for s, _, _ in segments]
        assert starts == sorted(starts) and starts[0] == 0
        used = sum(n for _, n, state in segments if state == "used")
        assert used / capacity == pytest.approx(stats["used"])
    assert [f[0] for f in frames] == list(range(0, 25 * len(frames), 25))


def test_paged_viewer_draws_the_allocators_own_block_tables():
    """The viewer's tables are the allocator's lists, in logical order, not sorted."""
    from pagedkv_lab.course.widgets import paged_trace_frames
    from pagedkv_lab.sim.paged import PagedPool
    from pagedkv_lab.sim.workloads import simulate

    recorded = {}

    class RecordingPool(PagedPool):
        def usage(self, held, waiting_head):
            recorded[len(recorded)] = {
                rid: list(t.blocks) for rid, t in self.tables.items()
            }
            return super().usage(held, waiting_head)

    frames = paged_trace_frames(128, 16, 0.2, num_requests=30, every=5)
    requests = chat_workload(30, seed=0, arrival_rate=0.2, max_model_len=2048)
    simulate(requests, RecordingPool(128, 16))
    unsorted = 0
    for step, owners, tables in frames:
        assert tables == recorded[step]
        for rid, table in tables.items():
            assert all(owners[b][0] == rid for b in table)
            unsorted += table != sorted(table)
    assert unsorted > 0  # logical order differs from physical order somewhere


def test_block_drawings_render(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pagedkv_lab.course.widgets import (
        draw_block_grid,
        draw_block_table,
        draw_paging_diagram,
        draw_slot_mapping,
    )

    fig, axes = plt.subplots(1, 4)
    owners = {0: (1, 16), 3: (1, 5), 2: (2, 16)}
    draw_block_grid(axes[0], owners, 16, 16, columns=4, highlight=1)
    draw_block_table(axes[1], [0, 3], owners, 16, 1)
    draw_paging_diagram(axes[2], {"A": ([0, 3], 21), "B": ([2], 16)}, 4, 16)
    draw_slot_mapping(axes[3], [20, 35], ["A 20", "B 15"], 4, 16)
    fig.savefig(tmp_path / "blocks.png")
    plt.close(fig)


def test_finished_requests_tails_are_never_used_and_grids_colour_apart(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_hex

    from pagedkv_lab.course.plotting import COLORS, REQUEST_COLORS
    from pagedkv_lab.course.widgets import (
        block_legend_handles,
        draw_block_grid,
        draw_paging_diagram,
        grid_colors,
    )

    def hatch_colors(ax):
        return {to_hex(p.get_edgecolor()) for p in ax.patches if p.get_hatch()}

    fig, axes = plt.subplots(1, 3)
    tables = {"A": ([0, 3], 21), "B": ([2], 5)}
    draw_paging_diagram(axes[0], tables, 4, 16)
    draw_paging_diagram(axes[1], tables, 4, 16, finished=True)
    assert hatch_colors(axes[0]) == {COLORS["reserved"].lower()}
    assert hatch_colors(axes[1]) == {COLORS["internal"].lower()}
    labels = [h.get_label() for h in block_legend_handles(filled_later=False)]
    assert not any("filled later" in label for label in labels)
    # Requests 23 and 39 (ids 16 apart) get colours of their own.
    colors = grid_colors([23, 39, 40])
    assert len(set(colors.values())) == 3
    assert len(set(grid_colors(range(100, 116)).values())) == len(REQUEST_COLORS)
    owners = {0: (23, 16), 1: (39, 16), 2: (40, 4)}
    draw_block_grid(axes[2], owners, 4, 16, columns=2)
    faces = {to_hex(p.get_facecolor()) for p in axes[2].patches if p.get_fill()}
    assert {colors[23], colors[39]} <= faces
    fig.savefig(tmp_path / "finished.png")
    plt.close(fig)


def _sliders(box):
    """Every slider in a viewer's widget tree."""
    import ipywidgets as w

    if isinstance(box, w.IntSlider):
        return [box]
    return [s for child in getattr(box, "children", ()) for s in _sliders(child)]


@pytest.mark.parametrize(
    "make",
    [
        "contiguous_pool_viewer",
        "paged_pool_viewer",
        "beam_search_viewer",
        "prefix_cache_viewer",
        "preemption_viewer",
    ],
)
def test_each_viewer_draws_its_first_and_last_frames(make, monkeypatch):
    """Build the viewer as a chapter does, move each slider to its end, and
    count the figures drawn: each must have something on its axes."""
    import IPython.display
    import matplotlib.pyplot as plt

    from pagedkv_lab.course import widgets
    from pagedkv_lab.sim.workloads import multi_turn_workload

    shown, drawn = [], []
    monkeypatch.setattr(IPython.display, "display", shown.append)

    def show(*_, **__):
        drawn.append(
            sum(
                len(part)
                for ax in plt.gcf().axes
                for part in (ax.patches, ax.lines, ax.texts, ax.collections)
            )
        )
        plt.close("all")

    monkeypatch.setattr(plt, "show", show)
    if make == "prefix_cache_viewer":
        widgets.prefix_cache_viewer(multi_turn_workload(3, 2, seed=1), 32)
    else:
        getattr(widgets, make)()
    (box,) = shown
    assert "needs a live kernel" in repr(box)
    for slider in _sliders(box):
        slider.value = slider.max
    assert len(drawn) >= 2 and all(n > 0 for n in drawn)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_preemption_trace_pools_have_the_asked_sizes_in_any_dtype(dtype, monkeypatch):
    """On a GPU the model loads in 16 bits, so a byte budget sized for float32
    holds twice the blocks; the trace's pools must still have exactly the
    asked number of blocks (chapter 09 raised IndexError on an H100)."""
    import torch

    from pagedkv_lab import llm
    from pagedkv_lab.course.widgets import trace_preemption

    monkeypatch.setattr(llm, "default_dtype", lambda device: getattr(torch, dtype))
    frames = trace_preemption(num_requests=6, num_blocks=20, swap_blocks=12)
    assert all(len(f["device"]) == 20 and len(f["host"]) == 12 for f in frames)
    assert frames[-1]["preemptions"] > 0
    used = max(sum(o is not None for o in f["device"]) for f in frames)
    assert used > 10  # the pool is filled, not a quarter of a bigger one


def test_request_colours_are_never_a_memory_states_colour():
    from matplotlib.colors import to_rgb

    from pagedkv_lab.course.plotting import COLORS, REQUEST_COLORS, request_color

    assert len(set(REQUEST_COLORS)) == len(REQUEST_COLORS) >= 16
    states = {to_rgb(c) for c in COLORS.values()} | {to_rgb("white")}
    for color in REQUEST_COLORS:
        rgb = to_rgb(color)
        assert (
            min(sum((a - b) ** 2 for a, b in zip(rgb, s)) ** 0.5 for s in states) > 0.1
        )
    assert (
        request_color(3) == REQUEST_COLORS[3] and request_color(16) == REQUEST_COLORS[0]
    )


def test_block_grids_drop_ids_when_they_would_overlap(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pagedkv_lab.course.widgets import draw_block_grid, grid_shape

    assert grid_shape(256) == (16, True) and grid_shape(512) == (32, False)
    owners = {0: (1, 16, 16), 3: (1, 5, 9), 2: (2, 3, 3)}  # held, will hold
    fig, ax = plt.subplots()
    columns, ids = grid_shape(512)
    draw_block_grid(ax, owners, 512, 16, columns=columns, ids=ids)
    assert not ax.texts
    fig.savefig(tmp_path / "grid.png")
    plt.close(fig)
