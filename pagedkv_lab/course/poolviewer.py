"""The pool viewer: one JavaScript module (``static/poolviewer.js``) that draws a
chapter's simulation, in two homes.

* **On the site** the chapter's cell output carries a ``text/html`` part: a
  ``<div class="pkv-viewer">`` holding the whole *trace*, every run of a grid of
  settings precomputed by the chapter's simulator (`traces`). The book copies
  the module into ``_static/`` and loads it on the pages that have a viewer
  (`pagedkv_lab.course._sphinx`); it replays the trace with no kernel and no network.
* **In JupyterLab, Notebook or Colab** the same output is a live widget
  (anywidget, which loads the same module): it starts with the default run,
  and each setting the reader picks is simulated by the kernel and sent to the
  page; its controls offer more settings than the site's grid.

A trace (format ``pagedkv-trace/1``) is a JSON object::

    {"format": "pagedkv-trace/1", "name", "title", "caption",
     "time": "step", "start": 0,           # what the time slider counts; shown first
     "controls": [{"name", "label", "options": [...], "value"}],
     "views": [{"kind": "slots" | "blocks" | "cells", "label",
                "params": [control names],  # a run's key: their values joined by "|"
                "headline": [{"key", "label", "den"?, "percent"?, "cumulative"?}],
                "legend": [{"label", "fill", "hatch"?, "edge"?, "dash"?}],
                "runs": {key: run}, ...kind-specific fields}]}

The runs' kinds are documented in `traces`. A headline item shows the value
``key`` of the step shown (a percentage of ``den`` with ``percent``; summed over
the frames so far with ``cumulative``): the viewer computes ``slots`` and
``blocks`` values by replaying the run (``used``, ``capacity``, ``running``,
``waiting``, ``finished``, ``blocks_used``), ``cells`` values from the run's
``values`` and its drawn cells (``held``: distinct blocks drawn; ``table_entries``:
cells drawn; ``count_X``: cells of code ``X``).
"""

from __future__ import annotations

import html
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources

FORMAT = "pagedkv-trace/1"

#: Key of a viewer output's metadata: the book drops the live widget's part of
#: such an output and shows its ``text/html`` part (`pagedkv_lab.course._sphinx`).
VIEWER_OUTPUT = "pagedkv_lab_viewer"


def module_source() -> str:
    """The viewer's JavaScript, as the site's ``_static/poolviewer.js`` has it."""
    return resources.files(__package__).joinpath("static/poolviewer.js").read_text()


@dataclass(frozen=True)
class Control:
    """A setting the reader picks: ``site`` are the values the page precomputes
    (the first is the default), ``live`` the values a kernel offers (at least
    ``site``'s)."""

    name: str
    label: str
    site: tuple
    live: tuple = ()

    @property
    def options(self) -> tuple:
        """Every value the control takes live (numbers in order)."""
        return _ordered(self.live + self.site)

    def spec(self, live: bool) -> dict:
        options = self.options if live else _ordered(self.site)
        return {"name": self.name, "label": self.label, "options": list(options),
                "value": self.site[0]}  # fmt: skip


def _ordered(values: tuple) -> tuple:
    """``values`` without repeats, sorted when they are all numbers."""
    values = tuple(dict.fromkeys(values))
    if all(isinstance(v, int | float) for v in values):
        return tuple(sorted(values))
    return values


@dataclass(frozen=True)
class View:
    """One drawn pool: ``run(**settings)`` simulates it at the settings of its
    ``params`` (control names) and returns a run of ``kind`` (`traces`)."""

    kind: str
    label: str
    params: tuple[str, ...]
    run: Callable[..., dict]
    headline: tuple[dict, ...]
    legend: tuple[dict, ...]
    extra: dict = field(default_factory=dict)


def run_key(values) -> str:
    """A run's key in a view's ``runs``: its settings joined by ``|``."""
    return "|".join(str(v) for v in values)


@dataclass(frozen=True)
class Viewer:
    """A viewer: controls, the views they drive, and the words around them."""

    name: str
    title: str
    caption: str
    controls: tuple[Control, ...]
    views: tuple[View, ...]
    time: str = "step"
    start: int = 0  # the step shown first

    def control(self, name: str) -> Control:
        return next(c for c in self.controls if c.name == name)

    def compute(self, view: View, values) -> dict:
        """``view``'s run at ``values`` (one per param, in order)."""
        return view.run(**dict(zip(view.params, values)))

    def trace(self, live: bool = False) -> dict:
        """The trace: on the site (``live=False``) with a run for every setting of
        the site's grid; live, with the default run only (the kernel computes the
        others on request)."""
        views = []
        for view in self.views:
            grids = [self.control(p).site for p in view.params]
            keys = [tuple(g[0] for g in grids)] if live else itertools.product(*grids)
            runs = {run_key(k): self.compute(view, k) for k in keys}
            views.append({
                "kind": view.kind, "label": view.label, "params": list(view.params),
                "headline": list(view.headline), "legend": list(view.legend),
                "runs": runs, **view.extra,
            })  # fmt: skip
        return {
            "format": FORMAT,
            "name": self.name,
            "title": self.title,
            "caption": self.caption,
            "time": self.time,
            "start": self.start,
            "controls": [c.spec(live) for c in self.controls],
            "views": views,
        }


def trace_json(trace: dict) -> str:
    """``trace`` as compact JSON that is safe inside an HTML ``<script>``."""
    text = json.dumps(trace, separators=(",", ":"), ensure_ascii=True)
    return text.replace("</", "<\\/")


FALLBACK = "a static figure of the same simulation is in this chapter."


def site_html(trace: dict, fallback: str | None = None) -> str:
    """The page's part of a viewer output: the trace, in a ``div`` that
    ``poolviewer.js`` mounts (and a line for a page without JavaScript, ending in
    ``fallback``: where the chapter's static figure is)."""
    name = html.escape(trace["name"])
    return (
        f'<div class="pkv-viewer" data-viewer="{name}">'
        '<p class="pkv-fallback">This viewer needs JavaScript; '
        f"{html.escape(fallback or FALLBACK)}</p>"
        f'<script type="application/json" class="pkv-trace">{trace_json(trace)}'
        "</script></div>"
    )


def summary(trace: dict) -> str:
    """One line that says what a viewer holds (its output's plain text)."""
    runs = [r for v in trace["views"] for r in v["runs"].values()]
    steps = [r["steps"] for r in runs]
    span = f"{min(steps):,}" + (
        f" to {max(steps):,}" if max(steps) > min(steps) else ""
    )
    return f"{trace['name']}: {len(runs)} runs of {span} {trace['time']}s, replayed in the page"


@lru_cache(maxsize=1)
def _widget_class():
    import anywidget
    import traitlets

    class PoolViewerWidget(anywidget.AnyWidget):
        """The live viewer. ``trace`` (JSON) holds the runs computed so far; the page
        sets ``wanted`` to ``"view index|run key"`` when the reader picks a
        setting it has no run for, and the kernel adds that run."""

        _esm = module_source() + "\nexport default globalThis.PagedKVViewer;\n"
        # JSON text, not a dict: a notebook's saved widget state keeps it on one line
        trace = traitlets.Unicode("{}").tag(sync=True)
        wanted = traitlets.Unicode("").tag(sync=True)
        error = traitlets.Unicode("").tag(sync=True)

        def __init__(
            self, viewer: Viewer, site: dict | None = None, fallback: str | None = None
        ):
            super().__init__(trace=trace_json(viewer.trace(live=True)))
            self._viewer, self._site, self._fallback = viewer, site, fallback

        @property
        def runs(self) -> list[dict]:
            """Each view's runs computed so far (key -> run)."""
            return [v["runs"] for v in json.loads(self.trace)["views"]]

        @traitlets.observe("wanted")
        def _run_wanted(self, change) -> None:
            if not change["new"]:
                return
            try:
                index, key, run = self._simulate(change["new"])
            except Exception as exc:  # shown in the page, not lost in a log
                self.error = f"cannot simulate {change['new']!r}: {exc!r}"
            else:
                trace = json.loads(self.trace)
                trace["views"][index]["runs"][key] = run
                self.trace = trace_json(trace)
                self.error = ""
            self.wanted = ""  # the same setting may be asked for again

        def _simulate(self, wanted: str):
            """The run ``wanted`` (``"view index|run key"``) names, simulated."""
            index, key = wanted.split("|", 1)
            view = self._viewer.views[int(index)]
            asked = dict(zip(view.params, key.split("|")))
            values = [
                next(o for o in self._viewer.control(p).options if str(o) == asked[p])
                for p in view.params
            ]
            return int(index), key, self._viewer.compute(view, values)

        def _repr_mimebundle_(self, **kwargs):
            data = super()._repr_mimebundle_(**kwargs)
            data = data[0] if isinstance(data, tuple) else data
            data["text/plain"] = repr(self)
            if self._site is not None:
                data["text/html"] = site_html(self._site, self._fallback)
            return data, {VIEWER_OUTPUT: self._viewer.name}

        def __repr__(self) -> str:
            if self._site is not None:
                return summary(self._site)
            return f"{self._viewer.name}: live"

    return PoolViewerWidget


def viewer_widget(viewer: Viewer, site: bool = True, fallback: str | None = None):
    """The live widget of ``viewer``; with ``site``, its output also carries the
    page's trace (every setting of the site's grid, computed now) and, for a page
    without JavaScript, ``fallback``: where the chapter's static figure is."""
    return _widget_class()(viewer, viewer.trace() if site else None, fallback)


def show(viewer: Viewer, fallback: str | None = None) -> None:
    """Display ``viewer``: live in a notebook, replayed on the site."""
    from IPython.display import display

    display(viewer_widget(viewer, fallback=fallback))
