"""Drawing memory pools, and the ipywidgets viewers built on those drawings.

Every viewer is a thin shell around a pure function that returns what to draw
(tested in ``tests/``) and a matplotlib function that draws it, so each chapter
can also show the same picture as a static figure for readers of the site.
"""

from __future__ import annotations

from functools import lru_cache

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from .plotting import COLORS, LABELS


def draw_pool_rows(
    ax,
    segments,
    capacity: int,
    row_len: int,
    *,
    title: str | None = None,
    legend: bool = True,
    states: tuple[str, ...] | None = None,
) -> None:
    """Draw a linear pool of ``capacity`` slots as rows of ``row_len`` slots (row 0 on top).

    ``segments`` are ``(start, length, state)`` runs; a run that crosses a row end wraps.
    """
    rows = -(-capacity // row_len)
    for start, length, state in segments:
        while length > 0:
            row, col = divmod(start, row_len)
            run = min(length, row_len - col)
            ax.broken_barh(
                [(col, run)],
                (rows - 1 - row + 0.1, 0.8),
                facecolors=COLORS[state],
                edgecolor="white",
                linewidth=0.6,
            )
            start, length = start + run, length - run
    ax.set_xlim(0, row_len)
    ax.set_ylim(0, rows)
    ax.set_yticks([])
    ax.grid(False)
    ax.set_xlabel(f"token slot within a row of {row_len}")
    if title:
        ax.set_title(title)
    if legend:
        shown = states or tuple(dict.fromkeys(s for _, _, s in segments))
        handles = [
            Patch(color=COLORS[s], label=LABELS[s]) for s in COLORS if s in shown
        ]
        ax.legend(
            handles=handles,
            loc="upper center",
            bbox_to_anchor=(0.5, -0.25),
            ncol=min(3, len(handles)),
            fontsize=8,
        )


@lru_cache(maxsize=32)
def contiguous_trace_frames(
    pool_rows: int,
    max_model_len: int,
    arrival_rate: float,
    policy: str,
    num_requests: int = 120,
    seed: int = 0,
    every: int = 10,
):
    """Simulate W1 through a contiguous pool of ``pool_rows x max_model_len`` slots; frames every ``every`` steps.

    Returns ``(capacity, frames)``; each frame is ``(step, segments, stats)`` with
    ``stats`` the running/waiting counts and the pool fractions at that step.
    """
    from .contiguous import ContiguousPool, pool_segments
    from .workloads import chat_workload, simulate

    requests = chat_workload(
        num_requests, seed=seed, arrival_rate=arrival_rate, max_model_len=max_model_len
    )
    pool = ContiguousPool(pool_rows * max_model_len, max_model_len, policy=policy)
    result = simulate(requests, pool, snapshot_every=every)
    frames = []
    for snap in result.snapshots:
        head = snap["waiting_head"]
        segments = pool_segments(
            snap["layout"],
            snap["held"],
            pool.capacity,
            pool.need(head) if head is not None else None,
        )
        i = snap["step"]
        stats = {
            "running": int(result.running[i]),
            "waiting": int(result.waiting[i]),
            **{k: float(v[i] / pool.capacity) for k, v in result.usage.items()},
        }
        frames.append((i, tuple(segments), stats))
    return pool.capacity, tuple(frames)


def contiguous_pool_viewer():
    """An ipywidgets viewer of a contiguous KV pool serving the W1 chat trace.

    Sliders: pool size (in max-length rows), maximum model length, arrival rate
    (requests per step), reservation policy, and the time step to show.
    """
    import ipywidgets as w
    from IPython.display import display

    rows = w.IntSlider(8, min=2, max=24, description="pool rows")
    max_len = w.IntSlider(2048, min=512, max=4096, step=512, description="max len")
    rate = w.FloatLogSlider(
        0.5, base=2, min=-4, max=2, step=0.5, description="arrivals/step"
    )
    policy = w.Dropdown(
        options=["max", "pow2", "oracle"], value="max", description="reserve"
    )
    frame = w.IntSlider(0, min=0, max=0, description="frame")
    out = w.Output()

    def redraw(*_):
        capacity, frames = contiguous_trace_frames(
            rows.value, max_len.value, rate.value, policy.value
        )
        frame.max = len(frames) - 1
        step, segments, stats = frames[min(frame.value, frame.max)]
        with out:
            out.clear_output(wait=True)
            fig, ax = plt.subplots(figsize=(8, 0.35 * rows.value + 1.6))
            title = (
                f"step {step}: {stats['running']} running, {stats['waiting']} waiting, "
                f"{stats['used']:.0%} of the pool holds K/V"
            )
            draw_pool_rows(
                ax,
                segments,
                capacity,
                max_len.value,
                title=title,
                states=("used", "reserved", "internal", "external", "free"),
            )
            plt.show()

    for control in (rows, max_len, rate, policy, frame):
        control.observe(redraw, names="value")
    redraw()
    display(w.VBox([w.HBox([rows, max_len]), w.HBox([rate, policy]), frame, out]))


@lru_cache(maxsize=32)
def paged_trace_frames(
    num_blocks: int = 256,
    block_size: int = 16,
    arrival_rate: float = 0.2,
    num_requests: int = 60,
    seed: int = 0,
    every: int = 10,
):
    """Simulate W1 through a paged pool; frames every ``every`` steps.

    Each frame is ``(step, owners, tables)``: ``owners`` maps physical block ->
    (request id, tokens in it), ``tables`` maps request id -> its block table.
    """
    from .paging import PagedPool
    from .workloads import chat_workload, simulate

    requests = chat_workload(
        num_requests,
        seed=seed,
        arrival_rate=arrival_rate,
        max_model_len=min(2048, num_blocks * block_size),
    )
    result = simulate(requests, PagedPool(num_blocks, block_size), snapshot_every=every)
    frames = []
    for snap in result.snapshots:
        owners = snap["layout"]
        tables: dict[int, list[int]] = {}
        for block, (rid, _) in sorted(owners.items()):
            tables.setdefault(rid, []).append(block)
        frames.append((snap["step"], owners, tables))
    return tuple(frames)


def _owner_color(rid: int):
    return plt.get_cmap("tab20")(rid % 20)


def draw_block_grid(
    ax,
    owners: dict[int, tuple[int, int]],
    num_blocks: int,
    block_size: int,
    columns: int = 16,
    highlight: int | None = None,
) -> None:
    """Draw physical blocks as a grid: coloured by owner, the filled part solid, the rest pale."""
    rows = -(-num_blocks // columns)
    for block in range(num_blocks):
        row, col = divmod(block, columns)
        y = rows - 1 - row
        ax.add_patch(plt.Rectangle((col, y), 0.92, 0.92, color=COLORS["free"]))
        if block in owners:
            rid, filled = owners[block]
            color = _owner_color(rid)
            ax.add_patch(plt.Rectangle((col, y), 0.92, 0.92, color=color, alpha=0.35))
            ax.add_patch(
                plt.Rectangle((col, y), 0.92 * filled / block_size, 0.92, color=color)
            )
            if highlight is not None and rid == highlight:
                ax.add_patch(
                    plt.Rectangle(
                        (col, y),
                        0.92,
                        0.92,
                        fill=False,
                        edgecolor="black",
                        linewidth=1.5,
                    )
                )
    ax.set_xlim(0, columns)
    ax.set_ylim(0, rows)
    ax.set_aspect("equal")
    ax.axis("off")


def paged_pool_viewer():
    """An ipywidgets viewer of a paged KV pool serving the W1 trace, with one request's block table."""
    import ipywidgets as w
    from IPython.display import display

    blocks = w.IntSlider(256, min=64, max=512, step=64, description="blocks")
    block_size = w.Dropdown(options=[8, 16, 32, 64], value=16, description="block size")
    rate = w.FloatLogSlider(
        0.2, base=2, min=-5, max=1, step=0.5, description="arrivals/step"
    )
    frame = w.IntSlider(0, min=0, max=0, description="frame")
    out = w.Output()

    def redraw(*_):
        frames = paged_trace_frames(blocks.value, block_size.value, rate.value)
        frame.max = len(frames) - 1
        step, owners, tables = frames[min(frame.value, frame.max)]
        with out:
            out.clear_output(wait=True)
            fig, (ax, ax_t) = plt.subplots(
                1, 2, figsize=(9, 4), gridspec_kw={"width_ratios": [3, 2]}
            )
            first = min(tables, default=None)
            draw_block_grid(
                ax, owners, blocks.value, block_size.value, columns=16, highlight=first
            )
            ax.set_title(
                f"step {step}: {len(tables)} requests, {len(owners)}/{blocks.value} blocks in use"
            )
            ax_t.axis("off")
            if first is not None:
                lines = [
                    f"logical {i:3} -> physical {b:3}"
                    for i, b in enumerate(tables[first][:16])
                ]
                if len(tables[first]) > 16:
                    lines.append(f"... {len(tables[first]) - 16} more")
                ax_t.text(
                    0,
                    1,
                    f"block table of request {first} (outlined):\n" + "\n".join(lines),
                    va="top",
                    family="monospace",
                    fontsize=8,
                )
            plt.show()

    for control in (blocks, block_size, rate, frame):
        control.observe(redraw, names="value")
    redraw()
    display(w.VBox([w.HBox([blocks, block_size, rate]), frame, out]))
