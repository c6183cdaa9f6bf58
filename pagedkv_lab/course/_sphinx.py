"""A Sphinx extension for the book: what the site shows of the notebooks' outputs.

* `pagedkv_lab.course.notebook.glue` shows each glued value under its cell as
  ``name = value`` so that a live notebook, where ``{glue:text}`` roles stay raw,
  still tells the reader the number. On the site the roles render, so those
  lines are removed before myst-nb reads the notebook (Sphinx's ``source-read``
  event hands it the file's text).
* The pool viewers (`pagedkv_lab.course.poolviewer`) reach the site as their
  ``text/html`` part: the live widget's part of their outputs is dropped, their
  module is copied into ``_static/`` and loaded on the pages that have one.
* No page loads anything from the network: the notebooks' saved widget state,
  which makes myst-nb load require.js and the widget manager from a CDN, is
  dropped (a widget without its kernel can only show a frozen picture).
* Sphinx 7 writes an inline script that an extension adds after the builder
  starts twice (once registered as ``None``, once as ``""``): sphinx-thebe's
  configuration twice declares ``const THEBE_JS_URL``, an error in every page's
  console. Each page keeps one copy of each inline script. And the theme gets
  a default colour mode, without which a first visit logs an error too.
"""

from __future__ import annotations

import json
from importlib import resources

from pagedkv_lab.course.notebook import LIVE_ONLY
from pagedkv_lab.course.poolviewer import VIEWER_OUTPUT

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def site_notebook(text: str) -> str:
    """The notebook JSON ``text`` as the site shows it: without the outputs
    marked `LIVE_ONLY`, without saved widget state, and with each pool viewer's
    output reduced to its page part."""
    notebook = json.loads(text)
    notebook.get("metadata", {}).pop("widgets", None)
    for cell in notebook.get("cells", []):
        if "outputs" not in cell:
            continue
        cell["outputs"] = [
            out for out in cell["outputs"] if LIVE_ONLY not in out.get("metadata", {})
        ]
        for out in cell["outputs"]:
            if VIEWER_OUTPUT in out.get("metadata", {}):
                out.get("data", {}).pop(WIDGET_VIEW, None)
    return json.dumps(notebook)


def _on_source_read(app, docname: str, source: list[str]) -> None:
    if str(app.env.doc2path(docname)).endswith(".ipynb"):
        source[0] = site_notebook(source[0])


def _configure(app, config) -> None:
    static = resources.files("pagedkv_lab.course").joinpath("static")
    config.html_static_path = [*config.html_static_path, str(static)]
    # Without a default, the theme's first visit logs "Got invalid theme mode"
    # as an error; "auto" is what it then falls back to.
    config.html_context = {"default_mode": "auto", **config.html_context}


def unique_scripts(scripts: list) -> list:
    """``scripts`` (Sphinx's ``_JavaScript`` assets) without a second copy of an
    inline script (one registered with ``filename=None``, one with ``""``)."""
    seen, kept = set(), []
    for js in scripts:
        key = (js.filename or "", tuple(sorted(js.attributes.items())))
        if key not in seen:
            seen.add(key)
            kept.append(js)
    return kept


def _on_page(app, pagename, templatename, context, doctree) -> None:
    if "script_files" in context:
        context["script_files"][:] = unique_scripts(context["script_files"])
    if "pkv-viewer" in context.get("body", ""):
        app.add_js_file("poolviewer.js", loading_method="defer")


def setup(app):
    app.connect("source-read", _on_source_read)
    app.connect("config-inited", _configure)
    app.connect("html-page-context", _on_page)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
