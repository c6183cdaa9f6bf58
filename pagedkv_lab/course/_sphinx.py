"""A Sphinx extension for the book: drop the notebook outputs meant for live readers.

`pagedkv_lab.course.notebook.glue` shows each glued value under its cell as
``name = value`` so that a live notebook, where ``{glue:text}`` roles stay raw,
still tells the reader the number. On the site the roles render, so those lines
are removed before myst-nb reads the notebook (Sphinx's ``source-read`` event
hands it the file's text).
"""

from __future__ import annotations

import json

from pagedkv_lab.course.notebook import LIVE_ONLY


def drop_live_only_outputs(text: str) -> str:
    """The notebook JSON ``text`` without the outputs marked `LIVE_ONLY`."""
    notebook = json.loads(text)
    for cell in notebook.get("cells", []):
        if "outputs" in cell:
            cell["outputs"] = [
                out for out in cell["outputs"] if LIVE_ONLY not in out.get("metadata", {})
            ]
    return json.dumps(notebook)


def _on_source_read(app, docname: str, source: list[str]) -> None:
    if str(app.env.doc2path(docname)).endswith(".ipynb"):
        source[0] = drop_live_only_outputs(source[0])


def setup(app):
    app.connect("source-read", _on_source_read)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
