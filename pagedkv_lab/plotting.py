"""One figure style for the whole course.

Every chapter colours memory the same way, so a reader learns the legend once:
tokens that hold K/V, space reserved for tokens still to come, space reserved
that no token will ever use, free gaps nobody can use, plain free space, blocks
shared by several sequences, and freed blocks kept for the prefix cache. The
palette is Okabe & Ito's colour-blind-safe set.
"""

from __future__ import annotations

import matplotlib as mpl

#: Memory states and their colours (Okabe-Ito palette).
COLORS: dict[str, str] = {
    "used": "#0072B2",  # holds a token's K/V
    "reserved": "#56B4E9",  # reserved for tokens the request will still produce
    "internal": "#E69F00",  # reserved but never used: internal fragmentation
    "external": "#D55E00",  # free but unusable by the waiting request: external fragmentation
    "free": "#E8E8E8",  # free and usable
    "shared": "#009E73",  # a block referenced by more than one sequence
    "cached": "#CC79A7",  # freed but kept for a prefix-cache hit
}

#: Human-readable names for the legend.
LABELS: dict[str, str] = {
    "used": "holds K/V",
    "reserved": "reserved, used later",
    "internal": "reserved, never used (internal)",
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
        }
    )
