"""Drawing memory pools, and the ipywidgets viewers built on those drawings.

Every viewer is a thin shell around a pure function that returns what to draw
(tested in ``tests/``) and a matplotlib function that draws it, so each chapter
can also show the same picture as a static figure for readers of the site.
"""

from __future__ import annotations

from functools import lru_cache

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from pagedkv_lab.course.plotting import (
    COLORS,
    HATCHES,
    REQUEST_COLORS,
    request_color,
    state_legend,
)


def _legend_below(ax, handles, ncol: int) -> None:
    """A legend centred under the axes, where it hides no block."""
    ax.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, 0),
        ncol=ncol,
        fontsize=8,
    )


@lru_cache(maxsize=1)
def _viewer_class():
    import ipywidgets as w

    class Viewer(w.VBox):
        """A viewer's box whose plain-text form is one short line: what a page or
        a frontend without widgets shows in its place, instead of the widget tree."""

        name = "viewer"

        def __repr__(self) -> str:
            return (
                f"{self.name}: interactive, needs a live kernel; see its static figure"
            )

    return Viewer


def show_viewer(children: list, name: str) -> None:
    """Display a viewer's controls and output area, stacked."""
    from IPython.display import display

    box = _viewer_class()(children)
    box.name = name
    display(box)


def step_viewer(frames: list, label: str, draw, figsize: tuple, name: str) -> None:
    """A slider over precomputed ``frames``; ``draw(ax, frame)`` draws one."""
    import ipywidgets as w

    index = w.IntSlider(0, min=0, max=len(frames) - 1, description=label)
    out = w.Output()

    def redraw(*_):
        with out:
            out.clear_output(wait=True)
            fig, ax = plt.subplots(figsize=figsize)
            draw(ax, frames[index.value])
            plt.show()

    index.observe(redraw, names="value")
    redraw()
    show_viewer([index, out], name)


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
    """Draw a pool of ``capacity`` slots as rows of ``row_len`` slots (row 0 on top).

    ``segments`` are ``(start, length, state)`` runs; a run that crosses a row end
    wraps.
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
                hatch=HATCHES.get(state),
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
        drawn = [s for s in COLORS if s in shown]
        state_legend(ax, drawn, ncol=min(3, len(drawn)), y=-0.25)


@lru_cache(maxsize=32)
def contiguous_trace_frames(
    pool_rows: int,
    max_model_len: int,
    arrival_rate: float,
    policy: str,
    num_requests: int = 120,
    seed: int = 0,
    every: int = 10,
    fit: str = "buddy",
):
    """Simulate W1 through a contiguous pool of ``pool_rows x max_model_len`` slots
    (``fit``: the allocator, buddy by default as in the vLLM paper's baselines).

    One frame every ``every`` steps.

    Returns ``(capacity, frames)``; each frame is ``(step, segments, stats)`` with
    ``stats`` the running/waiting counts and the pool fractions at that step.
    """
    from pagedkv_lab.sim.contiguous import ContiguousPool
    from pagedkv_lab.sim.workloads import chat_workload, simulate

    requests = chat_workload(
        num_requests, seed=seed, arrival_rate=arrival_rate, max_model_len=max_model_len
    )
    capacity = pool_rows * max_model_len
    pool = ContiguousPool(capacity, max_model_len, policy=policy, fit=fit)
    result = simulate(requests, pool, snapshot_every=every)
    frames = []
    for snap in result.snapshots:
        segments = snap["segments"]
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
    (requests per step), reservation policy, allocator, and the time step to show.
    """
    import ipywidgets as w

    rows = w.IntSlider(8, min=2, max=24, description="pool rows")
    max_len = w.IntSlider(2048, min=512, max=4096, step=512, description="max len")
    rate = w.FloatLogSlider(
        0.5, base=2, min=-4, max=2, step=0.5, description="arrivals/step"
    )
    policy = w.Dropdown(
        options=["max", "pow2", "oracle"], value="max", description="reserve"
    )
    fit = w.Dropdown(
        options=["buddy", "first", "best"], value="buddy", description="allocator"
    )
    frame = w.IntSlider(0, min=0, max=0, description="frame")
    out = w.Output()

    def redraw(*_):
        capacity, frames = contiguous_trace_frames(
            rows.value, max_len.value, rate.value, policy.value, fit=fit.value
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
                states=("used", "reserved", "internal", "rounding", "external", "free"),
            )
            plt.show()

    for control in (rows, max_len, rate, policy, fit, frame):
        control.observe(redraw, names="value")
    redraw()
    show_viewer(
        [w.HBox([rows, max_len]), w.HBox([rate, policy, fit]), frame, out],
        "contiguous pool viewer",
    )


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
    (request id, tokens in it, tokens it will hold when the request ends);
    ``tables`` maps request id -> its block table, the allocator's own list of
    physical blocks in logical order.
    """
    from pagedkv_lab.sim.paged import PagedPool
    from pagedkv_lab.sim.workloads import chat_workload, simulate

    requests = chat_workload(
        num_requests,
        seed=seed,
        arrival_rate=arrival_rate,
        max_model_len=min(2048, num_blocks * block_size),
    )
    result = simulate(requests, PagedPool(num_blocks, block_size), snapshot_every=every)
    return tuple(
        (snap["step"], snap["layout"], snap["tables"]) for snap in result.snapshots
    )


#: Request colours for block drawings (`plotting.REQUEST_COLORS`): none is the
#: colour of a memory state.
OWNER_COLORS = REQUEST_COLORS


#: The fill of the blocks of the one request a drawing singles out: near-black,
#: unlike every request colour.
HIGHLIGHT_COLOR = "#1a1a1a"

#: The legend's swatch for "used" in block drawings, where each request has a
#: colour of its own: a neutral grey, unlike every request colour, the free
#: blocks' light grey and `HIGHLIGHT_COLOR`.
USED_SWATCH = "#8c8c8c"


def owner_color(rid: int) -> str:
    """The colour a request's blocks are drawn in."""
    return request_color(rid)


def _draw_block(
    ax,
    x,
    y,
    w,
    h,
    owner,
    filled,
    block_size,
    label=None,
    size=6,
    will_fill=None,
    color=None,
    boxed=False,
):
    """One block: grey when free; else the owner's colour over its filled slots,
    then its empty slots hatched in the states' colours: ``reserved`` up to
    ``will_fill`` (the slots the request fills before it ends; all of them when
    unknown, as a running request's tail is reserved for its next tokens) and
    ``internal`` past it. ``color`` overrides the owner's colour. The label is
    white only on a full block, dark where hatching or white shows behind it
    (``boxed``: on a white box, readable over a partly filled block)."""
    if owner is None:
        ax.add_patch(plt.Rectangle((x, y), w, h, fc=COLORS["free"], ec="white", lw=0.5))
    else:
        color = owner_color(owner) if color is None else color
        will_fill = block_size if will_fill is None else max(filled, will_fill)
        ax.add_patch(plt.Rectangle((x, y), w, h, fc="white", ec=color, lw=0.8))
        for state, a, b in (
            ("reserved", filled, will_fill),
            ("internal", will_fill, block_size),
        ):
            if b > a:
                ax.add_patch(
                    plt.Rectangle(
                        (x + w * a / block_size, y),
                        w * (b - a) / block_size,
                        h,
                        fc="none",
                        ec=COLORS[state],
                        lw=0,
                        hatch="////",
                    )
                )
        part = w * filled / block_size
        ax.add_patch(plt.Rectangle((x, y), part, h, fc=color, ec=color, lw=0.8))
    if label is not None:
        dark = owner is not None and filled >= block_size
        box = {"fc": "white", "ec": "none", "pad": 0.4, "alpha": 0.85}
        ax.text(
            x + w / 2,
            y + h / 2,
            label,
            ha="center",
            va="center",
            fontsize=size,
            color="white" if dark else "#333333",
            bbox=box if boxed and not dark and owner is not None else None,
        )


def block_legend_handles(
    highlight: bool = False, never_used: bool = True, filled_later: bool = True
) -> list:
    """Legend entries for block drawings (``never_used=False`` leaves out the
    ``internal`` state, for drawings that do not know the requests' final
    lengths; ``filled_later=False`` leaves out ``reserved``, for drawings of
    requests that have ended)."""
    handles = [
        # Neutral: a request colour here would point at one request of the drawing.
        Patch(fc=USED_SWATCH, label="used: holds K/V (colour = request)"),
        Patch(
            fc="white",
            ec=COLORS["reserved"],
            hatch="////",
            label="reserved, filled later",
        ),
        Patch(
            fc="white",
            ec=COLORS["internal"],
            hatch="////",
            label="reserved, never used (internal)",
        ),
        Patch(fc=COLORS["free"], label="free block"),
    ]
    if not never_used:
        del handles[2]
    if not filled_later:
        del handles[1]
    if highlight:
        handles.append(
            Patch(fc=HIGHLIGHT_COLOR, ec="black", lw=1.5, label="the request shown")
        )
    return handles


def draw_block_grid(
    ax,
    owners: dict[int, tuple],
    num_blocks: int,
    block_size: int,
    columns: int = 16,
    highlight: int | None = None,
    ids: bool = True,
    fontsize: float = 8,
    by_request: bool = False,
) -> None:
    """Draw physical blocks as a grid, block 0 top left, each labelled with its id.

    ``owners`` maps a block to ``(request id, tokens in it)`` or ``(request id,
    tokens in it, tokens it will hold)`` (`PagedPool.layout`). A held block is
    drawn in the request's colour over its filled slots and hatched over its
    empty ones (see `_draw_block`), each request in a colour of its own while
    there are no more of them than `REQUEST_COLORS` (`grid_colors`); free blocks
    are grey. Blocks of request ``highlight`` are drawn in `HIGHLIGHT_COLOR` with
    a black outline. ``by_request`` labels each held block with the id of the
    request that holds it instead (colours alone do not tell sixteen requests
    apart), and numbers the rows and columns: a block's id is its row's number
    plus its column's.
    """
    rows = -(-num_blocks // columns)
    colors = grid_colors({o[0] for o in owners.values()} - {highlight})
    colors[highlight] = HIGHLIGHT_COLOR
    for block in range(num_blocks):
        row, col = divmod(block, columns)
        x, y = col + 0.04, rows - 1 - row + 0.04
        owner, filled, *rest = owners.get(block, (None, 0))
        label = str(block) if ids else None
        if by_request:
            label = None if owner is None else str(owner)
        shown = highlight is not None and owner == highlight
        _draw_block(
            ax, x, y, 0.92, 0.92, owner, filled, block_size, label, fontsize,
            will_fill=rest[0] if rest else None, color=colors.get(owner),
            boxed=by_request,
        )  # fmt: skip
        if shown:
            ax.add_patch(
                plt.Rectangle((x, y), 0.92, 0.92, fill=False, ec="black", lw=1.5)
            )
    if by_request:  # block id = the row's number + the column's
        for row in range(rows):
            ax.text(-0.15, rows - 0.5 - row, str(row * columns), ha="right",
                    va="center", fontsize=fontsize, color="#666666")  # fmt: skip
        for col in range(columns):
            ax.text(col + 0.5, rows + 0.1, f"+{col}", ha="center", va="bottom",
                    fontsize=fontsize - 1, color="#666666")  # fmt: skip
    ax.set_xlim(0, columns)
    ax.set_ylim(0, rows)
    ax.set_aspect("equal")
    ax.axis("off")


def grid_colors(request_ids) -> dict[int, str]:
    """A colour per request of a drawing, `REQUEST_COLORS` in order of request id:
    no two share one while there are at most as many requests as colours (a
    colour taken from the id alone, `request_color`, repeats every 16 ids)."""
    n = len(REQUEST_COLORS)
    return {rid: REQUEST_COLORS[i % n] for i, rid in enumerate(sorted(request_ids))}


def grid_shape(num_blocks: int) -> tuple[int, bool]:
    """Columns for a block grid, and whether block ids fit in its cells: 16 columns
    with ids up to 256 blocks, 32 columns without ids beyond."""
    return (16, True) if num_blocks <= 256 else (32, False)


def draw_block_table(
    ax,
    table: list[int],
    owners: dict[int, tuple],
    block_size: int,
    rid: int,
    max_rows: int = 16,
) -> None:
    """Draw one request's block table: logical block i -> physical block, in order.

    At most ``max_rows`` entries are drawn; a last line counts the rest.
    """
    shown = table[:max_rows]
    top = max_rows
    ax.set_xlim(-0.2, 2.6)
    ax.set_ylim(-1.2, top + 3.2)
    ax.text(1.2, top + 1.9, f"block table of\nrequest {rid}", ha="center", fontsize=10)
    # one head over both columns: two words side by side would overlap
    ax.text(1.1, top + 0.3, "logical → physical", ha="center", fontsize=9,
            color="#444444")  # fmt: skip
    for i, block in enumerate(shown):
        y = top - 1 - i
        ax.add_patch(plt.Rectangle((0.1, y + 0.05), 0.8, 0.9, fc="white", ec="#999999"))
        ax.text(0.5, y + 0.5, str(i), ha="center", va="center", fontsize=8)
        _, filled, *rest = owners.get(block, (rid, block_size))
        _draw_block(
            ax, 1.3, y + 0.05, 0.8, 0.9, rid, filled, block_size, str(block), 8,
            will_fill=rest[0] if rest else None, color=HIGHLIGHT_COLOR, boxed=True,
        )  # fmt: skip
    if len(table) > max_rows:
        more = len(table) - max_rows
        ax.text(1.2, -0.6, f"... {more} more", ha="center", fontsize=8)
    ax.set_aspect("equal")
    ax.axis("off")


def draw_paging_diagram(
    ax,
    tables: dict[str, tuple[list[int], int]],
    num_blocks: int,
    block_size: int,
    finished: bool = False,
) -> None:
    """Logical blocks -> block tables -> physical blocks, from real block tables.

    ``tables`` maps a sequence name to ``(block table, tokens held)``. Left: each
    sequence's logical blocks, filled as far as its tokens reach, with its block
    table underneath; right: the physical blocks; an arrow per table entry, which
    leaves the entry's bottom edge, runs in the gap under its table and in a lane
    of its own to the physical block, so that it crosses no cell. A last block's
    empty slots are reserved, filled later, unless the sequences have
    ``finished``: then they are never used (internal).
    """
    fill = {"will_fill": 0} if finished else {}
    owners = {}
    for k, (blocks, n) in enumerate(tables.values()):
        for i, b in enumerate(blocks):
            owners[b] = (k, min(block_size, n - i * block_size))
    right = 9.5
    for b in range(num_blocks):
        owner, filled = owners.get(b, (None, 0))
        y = num_blocks - 1 - b
        _draw_block(ax, right, y + 0.1, 1.6, 0.8, owner, filled, block_size, **fill)
        ax.text(right + 1.8, y + 0.5, f"block {b}", va="center", fontsize=9)
    ax.text(right + 0.8, num_blocks + 0.2, "physical blocks", ha="center", fontsize=9)
    row_height = num_blocks / len(tables)
    widest = max(len(blocks) for blocks, _ in tables.values()) * 1.2
    entries = sum(len(blocks) for blocks, _ in tables.values())
    lane_step = (right - 0.3 - widest) / max(entries, 1)
    lane = 0
    for k, (name, (blocks, n)) in enumerate(tables.items()):
        y = num_blocks - (k + 0.5) * row_height
        ax.text(0, y + 1.3, f"{name}: {n} tokens", fontsize=9, va="bottom")
        for i, b in enumerate(blocks):
            filled = min(block_size, n - i * block_size)
            _draw_block(
                ax, i * 1.2, y, 1.0, 1.0, k, filled, block_size, f"L{i}", 9, **fill
            )
            ax.add_patch(
                plt.Rectangle((i * 1.2, y - 1.1), 1.0, 0.9, fc="white", ec="#999999")
            )
            ax.text(
                i * 1.2 + 0.5, y - 0.65, str(b), ha="center", va="center", fontsize=9
            )
        # Later entries turn right higher up and into lanes further left, so that
        # no two arrows of one table cross under it.
        for i, b in reversed(list(enumerate(blocks))):
            turn = y - 1.3 - 0.2 * (len(blocks) - 1 - i)
            x_lane = widest + 0.3 + lane_step * (lane + 0.5)
            target = num_blocks - 1 - b + 0.5
            color = owner_color(k)
            ax.plot(
                [i * 1.2 + 0.5, i * 1.2 + 0.5, x_lane, x_lane],
                [y - 1.1, turn, turn, target],
                color=color,
                lw=0.9,
            )
            ax.annotate(
                "",
                xy=(right, target),
                xytext=(x_lane, target),
                arrowprops={"arrowstyle": "->", "color": color, "lw": 0.9},
            )
            lane += 1
        for text, dy in (("logical blocks", 0.5), ("block table", -0.65)):
            ax.text(-0.2, y + dy, text, ha="right", va="center", fontsize=9)
    ax.set_xlim(-2.8, right + 3.6)
    ax.set_ylim(-0.5, num_blocks + 1)
    ax.axis("off")


def draw_slot_mapping(
    ax,
    slots: list[int],
    labels: list[str],
    num_blocks: int,
    block_size: int,
) -> None:
    """The cache's slots as one strip, block by block, and an arrow from each entry
    of a slot mapping (``slots``, tokens named by ``labels``) to the slot it writes,
    each turning at a height of its own."""
    total = num_blocks * block_size
    for b in range(num_blocks):
        ax.add_patch(
            plt.Rectangle(
                (b * block_size, 0), block_size, 1, fc="none", ec="black", lw=1
            )
        )
        first = b * block_size
        label = f"{b}\n{first}–{first + block_size - 1}"
        ax.text((b + 0.5) * block_size, -0.3, label, ha="center", va="top", fontsize=9)
    for s in range(total):
        written = s in slots
        ax.add_patch(
            plt.Rectangle(
                (s, 0.1),
                1,
                0.8,
                fc=COLORS["used"] if written else "white",
                ec="#bbbbbb",
                lw=0.3,
            )
        )
    step = total / (len(slots) + 1)
    for k, (slot, label) in enumerate(zip(slots, labels)):
        x = step * (k + 1)
        ax.add_patch(plt.Rectangle((x - 2.5, 3), 5, 1, fc="white", ec="#999999"))
        ax.text(x, 3.5, str(slot), ha="center", va="center", fontsize=9)
        ax.text(x, 4.3, label, ha="center", fontsize=9)
        # Down from the label, across at a height of its own (higher for labels
        # further right, so that no arrow crosses another while labels and slots
        # run in the same order), then straight down: neighbouring slots' arrows
        # stay apart.
        turn = 1.4 + 1.2 * k / max(len(slots) - 1, 1)
        ax.plot([x, x, slot + 0.5], [3, turn, turn], color=COLORS["used"], lw=0.9)
        ax.annotate(
            "",
            xy=(slot + 0.5, 0.95),
            xytext=(slot + 0.5, turn),
            arrowprops={
                "arrowstyle": "-|>",
                "mutation_scale": 8,
                "color": COLORS["used"],
                "lw": 0.9,
                "shrinkA": 0,
                "shrinkB": 0,
            },
        )
    ax.text(0, 4.3, "slot mapping", fontsize=9, ha="left")
    ax.text(-1, -0.3, "block\nslots", ha="right", va="top", fontsize=9)
    ax.set_xlim(-5, total + 1)
    ax.set_ylim(-1.8, 5)
    ax.axis("off")


def paged_pool_viewer():
    """An ipywidgets viewer of a paged KV pool serving W1, with one block table."""
    import ipywidgets as w

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
            columns, ids = grid_shape(blocks.value)
            rows = -(-blocks.value // columns)
            fig, (ax, ax_t) = plt.subplots(
                1,
                2,
                figsize=(9, 1.6 + 4.4 * rows / columns),
                gridspec_kw={"width_ratios": [4, 1]},
            )
            first = min(tables, default=None)
            draw_block_grid(
                ax,
                owners,
                blocks.value,
                block_size.value,
                columns=columns,
                highlight=first,
                ids=ids,
            )
            ax.set_title(
                f"step {step}: {len(tables)} requests, "
                f"{len(owners)}/{blocks.value} blocks in use",
                fontsize=10,
            )
            _legend_below(ax, block_legend_handles(highlight=True), ncol=2)
            ax_t.axis("off")
            if first is not None:
                draw_block_table(ax_t, tables[first], owners, block_size.value, first)
            plt.show()

    for control in (blocks, block_size, rate, frame):
        control.observe(redraw, names="value")
    redraw()
    show_viewer([w.HBox([blocks, block_size, rate]), frame, out], "paged pool viewer")


# Chapter 07: one prompt forking into beams ----------------------------------------


def trace_beam_search(
    prompt_len: int = 9,
    beam_width: int = 4,
    max_tokens: int = 8,
    block_size: int = 4,
    model: str = "tiny-llama",
    seed: int = 0,
) -> tuple[dict, ...]:
    """Run one real beam search step by step and record its blocks as each
    step's forward pass sees them: after the step's copies-on-write, before
    its tokens are sampled.

    Each frame is a dict: ``step``; ``beams``, a list of ``(beam, blocks,
    tokens)`` for the sequences the step computes (beams numbered in order of
    appearance; their block tables in logical order; how many tokens have K/V
    once the step ran); ``refs``, block -> reference count; ``copies``, the
    ``(src, dst)`` copies made before the forward pass; ``in_place``, the
    blocks a step writes into that others shared until this step (their last
    holder writes in place); ``dropped``, the beams of this frame that the
    step's ranking ends (pruned, or finished at the last step); ``finished``,
    how many hypotheses have ended after the step.
    """
    import torch

    from pagedkv_lab.engine.groups import BeamSearchGroup
    from pagedkv_lab.llm import LLM
    from pagedkv_lab.sampling_params import BeamSearchParams

    llm = LLM(model, block_size=block_size, kv_cache_memory=2**20, weights_seed=seed)
    sched, runner = llm.scheduler, llm.runner
    g = torch.Generator().manual_seed(seed)
    prompt = [1] + torch.randint(3, 259, (prompt_len - 1,), generator=g).tolist()
    params = BeamSearchParams(beam_width=beam_width, max_tokens=max_tokens, ignore_eos=True)
    group = BeamSearchGroup(0, prompt, params)
    sched.add(group)
    frames: list[dict] = []
    # Beams numbered 0, 1, 2... in order of appearance (sequence ids depend on
    # whatever ran before).
    names: dict[int, int] = {}
    while sched.has_unfinished:  # the engine's step, with a look between its halves
        plan = sched.schedule()
        sources = {src for src, _ in plan.block_copies}
        refs = llm.block_manager.ref_counts
        beams, in_place = [], set()
        for seq, first, n in zip(plan.seqs, plan.starts, plan.num_new_tokens):
            blocks = list(seq.block_table)
            in_place |= sources & set(blocks[first // block_size : (first + n - 1) // block_size + 1])
            name = names.setdefault(seq.seq_id, len(names))
            beams.append((name, blocks, first + n))
        frames.append({
            "step": len(frames),
            "beams": beams,
            "refs": {b: refs[b] for _, blocks, _ in beams for b in blocks},
            "copies": list(plan.block_copies),
            "in_place": in_place,
        })  # fmt: skip
        sched.postprocess(plan, runner.execute(plan).read())
        frames[-1]["finished"] = len(group.finished)
    for frame, after in zip(frames, frames[1:] + [{"beams": []}]):
        going = {b[0] for b in after["beams"]}
        frame["dropped"] = [b[0] for b in frame["beams"] if b[0] not in going]
    return tuple(frames)


def draw_beam_frame(
    ax, frame: dict, block_size: int, width: int, rows: int | None = None
) -> None:
    """One frame of `trace_beam_search`: a row per beam, its blocks left to right,
    each filled as far as it holds tokens and labelled with its block id.

    A block held by one beam is blue, one shared by several green; a block the
    step copied into has a thick black outline, a formerly shared block that
    its last holder writes in place a thick dashed orange one. Beams the step
    ends are labelled in grey. ``rows`` fixes the height in beams, so that
    frames drawn side by side share a scale.
    """
    copied = {dst for _, dst in frame["copies"]}
    top = max(1, rows or 0, len(frame["beams"]))  # the first beam on the top row
    for row, (beam, blocks, tokens) in enumerate(frame["beams"]):
        y = top - 1 - row
        for i, block in enumerate(blocks):
            filled = min(block_size, max(0, tokens - i * block_size))
            shared = frame["refs"][block] > 1
            color = COLORS["shared"] if shared else COLORS["used"]
            part = 0.92 * filled / block_size
            ax.add_patch(plt.Rectangle((i, y), 0.92, 0.8, fc="white", ec=color))
            ax.add_patch(plt.Rectangle((i, y), part, 0.8, fc=color, ec=color))
            if block in copied or block in frame["in_place"]:
                style = (
                    dict(ec="black", lw=2.2)
                    if block in copied
                    else dict(ec="#e69f00", lw=2.2, ls="--")
                )
                ax.add_patch(plt.Rectangle((i, y), 0.92, 0.8, fill=False, **style))
            # the id on a white label: readable over any fill and outline
            ax.text(
                i + 0.46, y + 0.4, str(block), ha="center", va="center", fontsize=9,
                color="#222222",
                bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none"),
            )  # fmt: skip
        ended = beam in frame["dropped"]
        ax.text(
            -0.2, y + 0.4, f"beam {beam}" + (" (ends)" if ended else ""),
            ha="right", va="center", fontsize=9,
            color="#999999" if ended else "#222222",
        )  # fmt: skip
    ax.set_xlim(-2.6, width)
    ax.set_ylim(-0.2, top)
    ax.axis("off")


def beam_legend_handles() -> list:
    """Legend entries for `draw_beam_frame`."""
    return [
        Patch(fc=COLORS["used"], label="block held by one beam"),
        Patch(fc=COLORS["shared"], label="block shared (ref > 1)"),
        Patch(fc="white", ec="black", lw=2, label="copied into this step"),
        Patch(fc="white", ec="#e69f00", lw=2, ls="--", label="written in place"),
        Patch(fc="white", ec=COLORS["used"], label="white part: slots not yet filled"),
    ]


def beam_frame_title(frame: dict, two_lines: bool = False) -> str:
    """A frame's summary: beams, blocks copied, blocks written in place, beams
    the step's ranking ends; on one line, or on two for a narrow panel."""

    def count(n: int, noun: str) -> str:
        return f"{n} {noun}{'s' * (n != 1)}"

    sep = "\n" if two_lines else "; "
    return (
        f"step {frame['step']}: {count(len(frame['beams']), 'beam')}{sep}"
        f"{count(len(frame['copies']), 'block')} copied, "
        f"{len(frame['in_place'])} written in place; "
        f"{count(len(frame['dropped']), 'beam')} "
        f"{'ends' if len(frame['dropped']) == 1 else 'end'}"
    )


def beam_search_viewer():
    """An ipywidgets viewer of `trace_beam_search`: step through the beams."""
    import ipywidgets as w

    width = w.IntSlider(4, min=2, max=8, description="beams")
    block_size = w.Dropdown(options=[2, 4, 8], value=4, description="block size")
    step = w.IntSlider(0, min=0, max=0, description="step")
    out = w.Output()

    def redraw(*_):
        frames = trace_beam_search(beam_width=width.value, block_size=block_size.value)
        step.max = len(frames) - 1
        frame = frames[min(step.value, step.max)]
        cols = max(len(b[1]) for f in frames for b in f["beams"]) + 1
        with out:
            out.clear_output(wait=True)
            fig, ax = plt.subplots(figsize=(8, 0.5 + 0.45 * width.value))
            draw_beam_frame(ax, frame, block_size.value, cols, rows=width.value)
            ax.set_title(
                beam_frame_title(frame) + f", {frame['finished']} finished",
                fontsize=10,
            )
            _legend_below(ax, beam_legend_handles(), ncol=4)
            plt.show()

    for control in (width, block_size, step):
        control.observe(redraw, names="value")
    redraw()
    show_viewer([w.HBox([width, block_size]), step, out], "beam search viewer")


# Chapter 08: what the prefix cache holds -----------------------------------------

CACHE_STATES = ("used", "shared", "cached", "free")


def trace_prefix_cache(
    requests, capacity_blocks: int, block_size: int = 16, concurrency: int = 4
) -> tuple[dict, ...]:
    """Serve ``requests`` (`workloads.TokenRequest`) through a block prefix cache
    (`experiments.prefix_cache_run`) and record, after each admission, every
    block's state: ``"used"`` (one holder), ``"shared"`` (several),
    ``"cached"`` (free but keeping its K/V for a hit) or ``"free"``; with the
    request's hit tokens and the evictions so far."""
    from pagedkv_lab.course.experiments import prefix_cache_run

    frames = []

    def observe(bm, req, hit):
        a = bm.allocator
        states = [
            "shared"
            if r > 1
            else "used"
            if r == 1
            else "cached"
            if b in a.evictable
            else "free"
            for b, r in enumerate(a.ref_counts)
        ]
        frames.append(
            {
                "request": len(frames),
                "states": states,
                "hit": hit,
                "prompt": len(req.prompt),
                "evictions": bm.stats.evictions,
            }
        )

    prefix_cache_run(
        requests,
        capacity_blocks * block_size,
        block_size=block_size,
        concurrency=concurrency,
        observe=observe,
    )
    return tuple(frames)


def draw_cache_frame(ax, frame: dict, columns: int = 16) -> None:
    """One frame of `trace_prefix_cache` as a grid of blocks."""
    colors = {s: COLORS[s] for s in CACHE_STATES}
    states = frame["states"]
    rows = -(-len(states) // columns)
    for block, state in enumerate(states):
        row, col = divmod(block, columns)
        ax.add_patch(
            plt.Rectangle(
                (col + 0.05, rows - 1 - row + 0.05),
                0.9,
                0.9,
                fc=colors[state],
                ec="white",
            )
        )
    ax.set_xlim(0, columns)
    ax.set_ylim(0, rows)
    ax.set_aspect("equal")
    ax.axis("off")


def cache_legend_handles() -> list:
    """Legend entries for `draw_cache_frame`."""
    names = {
        "used": "held by one request",
        "shared": "shared (ref > 1)",
        "cached": "cached, free (LRU)",
        "free": "free",
    }
    # an edge, so that the pale "free" swatch shows on a white legend
    return [Patch(fc=COLORS[s], ec="#888888", lw=0.6, label=names[s])
            for s in CACHE_STATES]  # fmt: skip


def prefix_cache_viewer(requests, capacity_blocks: int, block_size: int = 16):
    """An ipywidgets viewer of `trace_prefix_cache`: request by request."""

    def draw(ax, f):
        draw_cache_frame(ax, f)
        ax.set_title(
            f"request {f['request']}: {f['hit']} of {f['prompt']} prompt tokens hit; "
            f"{f['evictions']} evictions so far",
            fontsize=10,
        )
        _legend_below(ax, cache_legend_handles(), ncol=4)

    frames = trace_prefix_cache(requests, capacity_blocks, block_size)
    step_viewer(frames, "request", draw, (7, 3), "prefix cache viewer")


# Chapter 09: a preemption storm ------------------------------------------------


def trace_preemption(
    num_requests: int = 10,
    num_blocks: int = 24,
    swap_blocks: int = 16,
    block_size: int = 8,
    mode: str = "swap",
    seed: int = 0,
) -> tuple[dict, ...]:
    """Serve W1-like requests through a tiny pool, step by step; each frame
    records the queues (``running``, ``waiting``, ``swapped``: request ids),
    both pools (``device`` and ``host``: the request holding each block, or
    None) and the counts so far (``preemptions``, of which ``swap_outs`` were
    swapped and ``fallbacks`` recomputed for want of swap space).

    The pools hold exactly ``num_blocks`` and ``swap_blocks`` blocks whatever
    dtype the device loads the model in (float32 on a CPU, 16 bits on a GPU):
    the budgets are computed from the loaded model's K/V bytes per token."""
    from pagedkv_lab.course.experiments import prompts_for
    from pagedkv_lab.device import pick_device
    from pagedkv_lab.kvmath import KVSpec
    from pagedkv_lab.llm import LLM, default_dtype
    from pagedkv_lab.models import load_model
    from pagedkv_lab.sampling_params import SamplingParams
    from pagedkv_lab.sim.workloads import chat_workload

    reqs = chat_workload(
        num_requests, seed=seed, max_model_len=160, mean_prompt=40, mean_output=60
    )
    device = pick_device()
    model, tokenizer = load_model(
        "tiny-llama", dtype=default_dtype(device), device=device
    )
    per_block = (
        KVSpec.from_config(model.config, model.dtype).bytes_per_token * block_size
    )
    llm = LLM(
        (model, tokenizer),
        block_size=block_size,
        kv_cache_memory=num_blocks * per_block,
        max_model_len=160,
        preemption_mode=mode,
        swap_space=swap_blocks * per_block if mode == "swap" else 0,
    )
    assert llm.block_manager.num_blocks == num_blocks
    assert mode != "swap" or llm.swap_space.allocator.num_blocks == swap_blocks

    for p, r in zip(prompts_for([r.prompt_len for r in reqs], seed), reqs):
        llm.add_request(p, SamplingParams(temperature=0, max_tokens=r.output_len,
                                          ignore_eos=True))  # fmt: skip
    sched, frames = llm.scheduler, []
    while llm.has_unfinished_requests():
        llm.step()
        device = [None] * num_blocks
        for g in sched.running:
            for s in g.seqs:
                for b in s.block_table or []:
                    device[b] = g.request_id
        host = [None] * swap_blocks
        owner = {
            s.seq_id: g.request_id
            for g in getattr(sched, "swapped", ())
            for s in g.seqs
        }
        space = llm.swap_space
        for seq_id, (blocks, _) in space.tables.items() if space else ():
            for b in blocks:
                host[b] = owner.get(seq_id)
        frames.append(
            {
                "step": len(frames),
                "running": [g.request_id for g in sched.running],
                "waiting": [g.request_id for g in sched.waiting],
                "swapped": [g.request_id for g in getattr(sched, "swapped", ())],
                "device": device,
                "host": host,
                "preemptions": sched.num_preemptions,
                "swap_outs": getattr(sched, "num_swap_outs", 0),
                "fallbacks": getattr(sched, "num_recompute_fallbacks", 0),
            }
        )
    return tuple(frames)


def draw_pools(ax, frame: dict, columns: int = 12) -> None:
    """Device and host pools of a `trace_preemption` frame, side by side: each
    block in the colour of the request holding it, labelled with its id (grey:
    free)."""
    titles = {"device": "device pool (the KV cache)", "host": "host pool (swap space)"}
    for x0, name in ((0, "device"), (columns + 2, "host")):
        owners = frame[name]
        rows = -(-len(owners) // columns)
        for b, rid in enumerate(owners):
            r, c = divmod(b, columns)
            color = COLORS["free"] if rid is None else owner_color(rid)
            x, y = x0 + c + 0.05, rows - 1 - r + 0.05
            ax.add_patch(plt.Rectangle((x, y), 0.9, 0.9, fc=color, ec="white"))
            if rid is not None:  # the id on a white label: readable on any colour
                ax.text(
                    x + 0.45, y + 0.45, str(rid), ha="center", va="center",
                    fontsize=8, color="#222222",
                    bbox=dict(boxstyle="round,pad=0.1", fc="white", ec="none"),
                )  # fmt: skip
        ax.text(x0 + columns / 2, rows + 0.3, titles[name], ha="center", fontsize=9)
    ax.set_xlim(0, 2 * columns + 2)
    ax.set_ylim(0, max(-(-len(frame["device"]) // columns), 1) + 1)
    ax.set_aspect("equal")
    ax.axis("off")


def preemption_viewer(mode: str = "swap"):
    """An ipywidgets viewer of `trace_preemption`: pools and queues, step by step."""

    def draw(ax, f):
        draw_pools(ax, f)
        ax.set_title(
            f"step {f['step']}: running {f['running']}, waiting {f['waiting']}, "
            f"swapped {f['swapped']}",
            fontsize=9,
        )

    step_viewer(
        trace_preemption(mode=mode), "step", draw, (8, 2.6), "preemption viewer"
    )
