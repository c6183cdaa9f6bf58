"""The figure of chapter 11's claims audit: each claim's figure against what was
measured, a dot coloured by that row's own result (or by its claim's verdict).
Drawing only; the rows and their results come from the chapter's records."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.lines import Line2D
from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

from pagedkv_lab.course.plotting import SERIES, use_style

#: The verdicts, in the order the chapter lists them, and one colour each.
VERDICT_COLORS = {
    "holds": SERIES[2],
    "holds only when": SERIES[4],
    "wrong": SERIES[1],
    "misattributed": SERIES[3],
    "needs a GPU": SERIES[0],
    "undecided": "#666666",
    "unmeasured": "#999999",
}

#: A row's own result: does this one measurement land on the claimed figure?
ROW_COLORS = {
    "on the claimed figure": SERIES[2],
    "off the claimed figure": SERIES[1],
    "not judged here": SERIES[0],
}
_COLORS = {**VERDICT_COLORS, **ROW_COLORS}


def _claimed(ax, y: int, lo: float, hi: float) -> None:
    """The claimed figure: a grey band for a range, a tick for one value."""
    if hi > lo:
        ax.plot([lo, hi], [y, y], color="#BBBBBB", lw=8, solid_capstyle="butt")
    else:
        ax.plot([lo], [y], marker="|", color="#888888", ms=16, mew=3)


def plot_claims(shares, multiples, verdict_of, *, title: str, multiple_label: str):
    """Two panels, shares (%) above and multiples (log scale) below. A row is
    ``(label, claim id, (claimed low, claimed high), measured)``, with an
    optional fifth item, True when ``measured`` is only a lower bound (drawn
    as a right-pointing triangle: at least this much); ``measured`` may be
    None (nothing measured: the claimed figure alone is drawn). ``verdict_of``
    maps a row's label, or failing that its claim id, to what colours the dot:
    a verdict (`VERDICT_COLORS`) or a row's own result (`ROW_COLORS`)."""

    def colour_key(row) -> str:
        return verdict_of.get(row[0], verdict_of.get(row[1]))

    use_style()
    fig, axes = plt.subplots(
        2, 1, figsize=(8, 6.2), gridspec_kw={"height_ratios": [len(shares), len(multiples)]}
    )
    for ax, rows in ((axes[0], shares), (axes[1], multiples)):
        for y, row in enumerate(rows):
            _, _, (lo, hi), value, *bound = row
            _claimed(ax, y, lo, hi)
            if value is not None:
                marker = ">" if bound and bound[0] else "o"
                ax.plot([value], [y], marker, color=_COLORS[colour_key(row)], ms=8)
        ax.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=8)
        ax.invert_yaxis()
    axes[0].set_xlim(0, 100)
    axes[0].set_xlabel("share (%)")
    axes[1].set_xscale("log")
    axes[1].xaxis.set_major_locator(FixedLocator([1, 2, 3, 5, 10, 20, 40]))
    axes[1].xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}x"))
    axes[1].xaxis.set_minor_formatter(NullFormatter())
    axes[1].set_xlabel(multiple_label)
    shown = {colour_key(r) for r in [*shares, *multiples] if r[3] is not None}
    handles = [Line2D([], [], color="#BBBBBB", lw=6, label="claimed")]
    handles += [
        Line2D([], [], marker="o", ls="", color=color, label=kind)
        for kind, color in _COLORS.items()
        if kind in shown
    ]
    if any(len(r) > 4 and r[4] and r[3] is not None for r in [*shares, *multiples]):
        handles.append(Line2D([], [], marker=">", ls="", color="#444444",
                              label="a lower bound (at least)"))  # fmt: skip
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8)
    fig.suptitle(title, fontsize=10)
    top = 0.95 - 0.035 * title.count("\n")  # room for each line of the title
    fig.tight_layout(rect=(0, 0.08, 1, top))
    return fig
