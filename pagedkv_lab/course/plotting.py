"""One figure style for the whole course, and the figures chapters 01-03 draw.

Every chapter colours memory the same way, so a reader learns the legend once.
The waste taxonomy (chapters 02 and 03, the glossary, the viewers) has one
colour per category:

* ``used``: slots holding a token's K/V;
* ``reserved``: reserved, filled later (a request's slots for tokens it will
  still produce: a contiguous region's future, a paged block's unfilled tail);
* ``internal``: reserved, never used (internal fragmentation: slots a
  reservation policy or a paged block holds for tokens the request will never
  produce);
* ``external``: free but unusable (external fragmentation: enough slots are
  free, but no gap holds the waiting request). ``rounding`` is the same
  category, drawn hatched: slots a buddy allocator adds when it rounds a region
  up to a power of two. The course books them as external fragmentation, waste
  the allocator makes, reading the vLLM paper's §3.1 so (chapter 02);
* ``free``: free, and nobody waits for it.

Blocks shared by several sequences and freed blocks kept for the prefix cache
have their own colours. The palette is Okabe & Ito's colour-blind-safe set.
Requests are drawn in `REQUEST_COLORS`, none of which is a category colour.
"""

from __future__ import annotations

import matplotlib as mpl
import numpy as np
from matplotlib.colors import LogNorm
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

#: Memory states and their colours (Okabe-Ito palette).
COLORS: dict[str, str] = {
    "used": "#0072B2",  # holds a token's K/V
    "reserved": "#56B4E9",  # reserved for tokens the request will still produce
    "internal": "#E69F00",  # reserved but never used: internal fragmentation
    "rounding": "#D55E00",  # the allocator's rounding, booked as external (hatched)
    "external": "#D55E00",  # free but unusable by the waiting request
    "free": "#E8E8E8",  # free and usable
    "shared": "#009E73",  # a block referenced by more than one sequence
    "cached": "#CC79A7",  # freed but kept for a prefix-cache hit
}

#: Hatching that sets a state apart from another of the same colour.
HATCHES: dict[str, str] = {"rounding": "xxx"}

#: Width and height, in points, of a legend's state patch: large enough to show
#: the rounding's hatch (`state_legend`).
PATCH_POINTS = (22.0, 8.0)

#: Human-readable names for the legend.
LABELS: dict[str, str] = {
    "used": "used: holds K/V",
    "reserved": "reserved, filled later",
    "internal": "reserved, never used (internal)",
    "rounding": "allocator's rounding (external)",
    "external": "free but unusable (external)",
    "free": "free",
    "shared": "shared (ref > 1)",
    "cached": "cached, free",
}

#: Colours for comparing systems or settings side by side.
SERIES = [
    "#0072B2",
    "#D55E00",
    "#009E73",
    "#CC79A7",
    "#E69F00",
    "#56B4E9",
    "#F0E442",
    "#000000",
]

#: Colours of requests in block drawings: 16 colours at least 36 CIELAB units
#: (ΔE76) apart and at least 20 from every colour in `COLORS` and from white,
#: picked greedily from the xkcd colour survey's named colours; consecutive
#: request ids get distant hues. Sixteen colours cannot all stay apart for
#: colour-blind readers: drawings also label blocks with ids.
REQUEST_COLORS = [
    "#017b92",
    "#ff69af",
    "#c9ae74",
    "#3e82fc",
    "#ca0147",
    "#a8b504",
    "#78d1b6",
    "#952e8f",
    "#8b3103",
    "#01b44c",
    "#4e518b",
    "#ffd700",
    "#544e03",
    "#0a5f38",
    "#000080",
    "#ff964f",
]


def request_color(rid: int) -> str:
    """The colour request ``rid`` is drawn in (ids beyond 16 reuse colours)."""
    return REQUEST_COLORS[rid % len(REQUEST_COLORS)]


def use_style() -> None:
    """Apply the course's matplotlib defaults (sizes, grid, colour cycle)."""
    mpl.rcParams.update(
        {
            "figure.figsize": (7.5, 3.6),
            "figure.dpi": 96,
            "axes.grid": True,
            "grid.alpha": 0.3,
            "axes.spines.top": False,
            "axes.spines.right": False,
            "axes.titleweight": "bold",
            "axes.titlesize": 11,
            "axes.prop_cycle": mpl.cycler(color=SERIES),
            "legend.frameon": False,
            "svg.hashsalt": "pagedkv-lab",
            "hatch.linewidth": 0.6,
        }
    )


# The waste taxonomy -------------------------------------------------------------


def state_patch(state: str, label: str | None = None) -> Patch:
    """A legend patch for one memory state, hatched where the state is."""
    return Patch(
        fc=COLORS[state],
        ec="white" if state in HATCHES else COLORS[state],
        hatch=HATCHES.get(state),
        label=LABELS[state] if label is None else label,
    )


def state_legend(target, states, *, ncol: int = 3, y: float = -0.2, **kwargs):
    """A legend of ``states`` centred under ``target`` (an Axes, or a Figure when
    ``y`` is a figure fraction), where it hides nothing. Its patches are the same
    size in points whatever the font size, large enough to show a hatch."""
    handles = [state_patch(s) for s in states]
    kwargs.setdefault("fontsize", 8)
    size = kwargs["fontsize"] if isinstance(kwargs["fontsize"], (int, float)) else 10
    kwargs.setdefault("handlelength", max(2.0, PATCH_POINTS[0] / size))
    kwargs.setdefault("handleheight", max(0.7, PATCH_POINTS[1] / size))
    if hasattr(target, "transAxes"):
        return target.legend(
            handles=handles,
            loc="upper center",
            bbox_to_anchor=(0.5, y),
            ncol=ncol,
            **kwargs,
        )
    return target.legend(handles, [h.get_label() for h in handles], ncol=ncol, **kwargs)


def usage_stack(ax, result, *, title: str = "", xmax: int | None = None) -> list[str]:
    """Stack a simulation's pool states over its steps, as fractions of the pool;
    return the states drawn (those that are ever non-zero), for the legend."""
    states = [s for s in COLORS if s in result.usage and result.usage[s].any()]
    layers = ax.stackplot(
        np.arange(result.steps),
        [result.usage[s] / result.capacity for s in states],
        colors=[COLORS[s] for s in states],
        linewidth=0,
    )
    for layer, state in zip(layers, states):
        if state in HATCHES:
            layer.set_hatch(HATCHES[state])
            layer.set_edgecolor("white")
    ax.set_xlim(0, xmax or result.steps)
    ax.set_ylim(0, 1)
    ax.set_xlabel("step")
    ax.set_ylabel("fraction of the pool")
    if title:
        ax.set_title(title)
    return states


def split_bars(ax, rows, kinds, colors, *, hatches=None) -> None:
    """Horizontal stacked bars, one per ``(label, shares, spread)`` row: shares in
    percent per kind; ``spread``, a ``(lowest, highest)`` pair or None, draws a
    whisker over that range of the first share (an error bar, say)."""
    hatches = hatches or [None] * len(kinds)
    for y, (_, shares, spread) in enumerate(rows):
        left = 0.0
        for k, (value, color, hatch) in enumerate(zip(shares, colors, hatches)):
            ax.barh(
                y,
                value,
                left=left,
                color=color,
                hatch=hatch,
                edgecolor="white",
                linewidth=0.5,
                label=kinds[k] if y == 0 else None,
            )
            left += value
        if spread is not None:
            ax.plot(spread, [y, y], color="black", lw=1.5, marker="|", ms=8)
    ax.set_yticks(range(len(rows)), [label for label, _, _ in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, 100)


# Chapter 01 -------------------------------------------------------------------


def _fit_xlim_to_texts(ax, *, right: float) -> None:
    """Set the right x limit to the larger of ``right`` and the right edge of the
    axis's texts (measured after layout; twice, as the limit moves the texts)."""
    ax.set_xlim(right=right)
    renderer = ax.figure.canvas.get_renderer()
    for _ in range(2):
        to_data = ax.transData.inverted()
        edges = [
            to_data.transform((t.get_window_extent(renderer).x1, 0))[0]
            for t in ax.texts
        ]
        ax.set_xlim(right=max([right, *edges]) * 1.05)


def gqa_bars(ax, names, actual_kib, mha_kib, group) -> None:
    """Each model's KV bytes per token as shipped and as it would be with one KV
    head per query head, on a linear axis (a bar's length is its bill, so a GQA
    factor of 8 shows as a bar an eighth as long), every bar labelled with its
    value and the GQA factor; legend below. A grey bar more than twice as long as
    every other bar is cut at the axis's edge, its value written on it, so that
    the small bars stay visible."""
    y = np.arange(len(names))
    others = max([*sorted(mha_kib)[:-1], *actual_kib])
    cap = 1.5 * others if max(mha_kib) > 2 * others else max(mha_kib)
    grey = ax.barh(
        y - 0.2,
        [min(m, cap) for m in mha_kib],
        height=0.4,
        color="#9E9E9E",
        label="if every query head had its own KV head",
    )
    ax.barh(y + 0.2, actual_kib, height=0.4, color=COLORS["used"], label="as shipped")
    pad = 0.01 * cap
    for i, (v, m, g) in enumerate(zip(actual_kib, mha_kib, group)):
        note = f"{v:.0f} KiB" + (f", {g}x less" if g > 1 else ", no GQA")
        ax.text(v + pad, i + 0.2, note, va="center", fontsize=9)
        if g > 1 and m <= cap:
            ax.text(m + pad, i - 0.2, f"{m:,.0f} KiB", va="center", fontsize=8,
                    color="#616161")  # fmt: skip
    ax.set_yticks(list(y), names)
    ax.set_xlim(left=0)
    _fit_xlim_to_texts(ax, right=cap * 1.02)
    right = ax.get_xlim()[1]
    for i, m in enumerate(mha_kib):
        if m > cap:  # cut at the edge, its value on it
            grey[i].set_width(right)
            ax.text(right - pad, i - 0.2, f"{m:,.0f} KiB (bar cut)", ha="right",
                    va="center", fontsize=8, color="white")  # fmt: skip
    ax.invert_yaxis()
    ax.set_xlabel("KV cache per token, fp16 (KiB)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, fontsize=9)


def capacity_heatmap(ax, fit, rows, cols, *, no_fit: int = -1):
    """Full-length requests per (model, GPU), log colour scale; cells where the
    weights exceed the share of the card kept for them are grey, zeros red.
    Returns the image, for a colour bar."""
    ax.imshow(
        np.where(fit == no_fit, 1, 0), cmap="Greys", vmin=0, vmax=4, aspect="auto"
    )
    positive = np.ma.masked_less(fit, 1)
    image = ax.imshow(
        positive, cmap="Blues", norm=LogNorm(0.5, max(2, fit.max())), aspect="auto"
    )
    for i in range(fit.shape[0]):
        for j in range(fit.shape[1]):
            v = fit[i, j]
            label = "weights\n> 90%" if v == no_fit else f"{v:,}"
            color = "white" if v > 300 else ("#B00000" if v == 0 else "black")
            ax.text(j, i, label, ha="center", va="center", fontsize=10, color=color)
    ax.set_xticks(range(len(cols)), cols)
    ax.set_yticks(range(len(rows)), rows)
    ax.grid(False)
    handles = [Patch(fc="#d9d9d9", label="fp16 weights exceed 90% of the card")]
    if (fit == 0).any():
        handles.append(
            Patch(fc="white", ec="#999999", label="0: weights fit, no request")
        )
    ax.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.16),
        ncol=2,
        fontsize=9,
    )
    return image


# Chapter 02 -------------------------------------------------------------------


def length_histograms(axes, traces: dict, max_len: int) -> None:
    """Prompt and output length histograms of several traces, one axis each."""
    bins = np.linspace(0, max_len, 41)
    for ax, attr in zip(axes, ("prompt_len", "output_len")):
        for k, (name, trace) in enumerate(traces.items()):
            ax.hist(
                [getattr(r, attr) for r in trace],
                bins=bins,
                color=SERIES[k],
                alpha=0.8 if k == 0 else 0.5,
                label=name,
            )
        ax.set_xlabel(f"{attr.split('_')[0]} length (tokens)")
    axes[0].set_ylabel("requests")
    axes[-1].legend()


def sigma_figure(ax, sigmas, measured: dict, paper: dict, predicted=None) -> None:
    """The share of the pool holding K/V against the output-length spread: per
    policy the mean over seeds with a band of two standard errors either side
    (``measured`` maps a policy to ``(means, standard errors)``, fractions), the
    paper's figure as a dotted line, and (for max reservation) the closed form."""
    for k, (policy, (mean, se)) in enumerate(measured.items()):
        color = SERIES[k]
        mean, se = 100 * np.asarray(mean), 100 * np.asarray(se)
        ax.plot(sigmas, mean, "o-", color=color, label=policy)
        ax.fill_between(sigmas, mean - 2 * se, mean + 2 * se, color=color, alpha=0.2)
        ax.axhline(100 * paper[policy], color=color, ls=":", lw=1)
    if predicted is not None:
        ax.plot(
            sigmas, 100 * np.asarray(predicted), "k--", lw=1, label="max: closed form"
        )
    ax.set_xlabel("σ of log output length (W1 uses 0.8)")
    ax.set_ylabel("pool holding K/V (%)")
    handles, _ = ax.get_legend_handles_labels()
    handles.append(
        Line2D(
            [], [], color="#555555", ls=":", lw=1, label="paper (Fig. 2), per policy"
        )
    )
    handles.append(
        Patch(fc="#555555", alpha=0.2, label="band: mean ± 2 standard errors")
    )
    ax.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.22),
        ncol=3,
        fontsize=9,
    )


def recompute_steps(
    ax, results: dict, rates, crossovers: dict | None = None, logy: bool = False
) -> None:
    """Steps to serve a trace once recompute is charged, against how many prefill
    tokens cost one decode step's time (log scale; ``logy`` for the steps too);
    the simulator's own step count is the curve's right end. ``crossovers`` maps
    a label to a rate at which two curves cross, drawn as a dotted vertical line
    with its value."""
    for k, (name, res) in enumerate(results.items()):
        steps = [res.steps_with_recompute(r) for r in rates]
        ax.plot(rates, steps, "o-", color=SERIES[k], label=name, ms=3)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prefill tokens that take one decode step's time, r")
    ax.set_ylabel("steps, recompute included" + " (log)" * logy)
    if logy:
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    for k, (label, rate) in enumerate((crossovers or {}).items()):
        ax.axvline(rate, color="#555555", ls=":", lw=1)
        ax.text(
            rate * 1.08,
            0.97 - 0.08 * k,
            f"{label}: r = {rate:.1f}",
            fontsize=8,
            va="top",
            transform=ax.get_xaxis_transform(),
        )
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=4, fontsize=8)


# Chapter 03 -------------------------------------------------------------------


def block_size_sweep(ax, sizes, used, reserved, never_used, entries) -> None:
    """Against block size: the share holding K/V and the two parts of the unfilled
    tails, in their states' colours, with the block-table entries per request on a
    second axis."""
    ax.plot(sizes, used, "o-", color=COLORS["used"], label=LABELS["used"])
    ax.plot(sizes, reserved, "s--", color=COLORS["reserved"], label=LABELS["reserved"])
    ax.plot(
        sizes, never_used, "d--", color=COLORS["internal"], label=LABELS["internal"]
    )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("fraction of the pool")
    ax2 = ax.twinx()
    ax2.plot(
        sizes, entries, "^:", color=SERIES[7], label="block-table entries per request"
    )
    ax2.set_yscale("log")
    ax2.set_ylabel("entries per request (log)")
    ax2.grid(False)
    lines = ax.get_lines() + ax2.get_lines()
    ax.legend(
        lines,
        [line.get_label() for line in lines],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.2),
        ncol=2,
        fontsize=8,
    )
