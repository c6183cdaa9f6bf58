"""A learner's budget: each chapter's main line (its markdown outside the
"Going deeper" asides) is at most 3,500 words, about 30 minutes of reading.

Words are not the whole load: a newcomer also reads the visible code, its outputs
and the figures. `reading_load` counts them as the site shows them (cells tagged
``hide-input``/``hide-output`` fold; glue outputs and live-only outputs do not
show) and estimates minutes with rates fitted to newcomer readers' own reports
(2026-11-29): prose 150 words, code 22 lines and output 15 lines a minute, 1.5
minutes a figure. The readers' estimates scatter by about a third around it, so
the test holds each chapter to `LOAD_BUDGET` estimated minutes, below the 30 the
course promises.

An aside is a MyST ``dropdown`` or ``toggle`` directive (``:::{dropdown} ...``
or a backtick fence); fenced code and HTML comments are not prose. A glued
number counts as its glued text (a number is one word, a glued sentence all its words). ``python tests/test_reading.py`` prints the table.
"""

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BUDGET = 3500
LOAD_BUDGET = 25.0  # estimated minutes; see the module docstring
_HIDE_INPUT = {"hide-input", "remove-input", "hide-cell", "remove-cell"}
_HIDE_OUTPUT = {"hide-output", "remove-output", "hide-cell", "remove-cell"}
CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9][0-9]*_*.ipynb"))
_OPEN = re.compile(r"^(:{3,}|`{3,})\{(dropdown|toggle)\}")
_FENCE = re.compile(r"^(:{3,}|`{3,})")


def main_line(markdown: str) -> str:
    """``markdown`` without its asides, fenced code blocks and HTML comments."""
    markdown = re.sub(r"<!--.*?-->", "", markdown, flags=re.S)
    kept, stack = [], []  # stack: the fences of the open asides and code blocks
    for line in markdown.split("\n"):
        s = line.strip()
        opening = _FENCE.match(s)
        if stack and opening and s == stack[-1][0]:  # a bare fence closes the innermost
            stack.pop()
            continue
        if opening and (_OPEN.match(s) or s.startswith("```")):
            stack.append((opening.group(1), bool(_OPEN.match(s))))
            continue
        if not stack:
            kept.append(line)
    return "\n".join(kept)


def glued_text(cells: list[dict]) -> dict[str, str]:
    """Each glued value's text as the page shows it (``{glue:md}`` sentences
    are whole sentences a reader reads, not one word)."""
    values = {}
    for cell in cells:
        for output in cell.get("outputs", []):
            record = output.get("metadata", {}).get("scrapbook")
            if not record:
                continue
            data = output.get("data", {})
            text = [v for k, v in data.items() if k.endswith(("markdown", "plain"))]
            value = "".join(text[0]) if text else ""
            values[record["name"]] = value.strip("'\"")
    return values


def main_line_words(notebook: Path) -> int:
    cells = json.loads(notebook.read_text())["cells"]
    text = "\n".join(
        "".join(c["source"]) for c in cells if c["cell_type"] == "markdown"
    )
    values = glued_text(cells)

    def value(match: re.Match) -> str:
        return values.get(match.group(1), "N")

    # a fenced {glue:md} block in the main line is prose too
    text = re.sub(
        r"^```\{glue(?::md)?\}\s*(\w+)[^`]*?^```", value, text, flags=re.M | re.S
    )
    text = re.sub(r"\{glue:\w+\}`([^`]*)`", value, main_line(text))
    return len(text.split())


def _visible_output_lines(output: dict) -> tuple[int, int]:
    """(text lines, figures) that ``output`` shows on the site."""
    meta = output.get("metadata", {})
    if "scrapbook" in meta or "pagedkv_lab_live_only" in meta:
        return 0, 0  # a glued value, or a widget only a live notebook shows
    if output["output_type"] == "stream":
        return len("".join(output["text"]).rstrip("\n").splitlines()), 0
    data = output.get("data", {})
    if "application/vnd.jupyter.widget-view+json" in data or not data:
        return 0, 0
    if "image/png" in data or "image/svg+xml" in data:
        return 0, 1
    if "text/html" in data:
        html = "".join(data["text/html"])
        return html.count("<tr") or len(html.splitlines()), 0
    text = "".join(data.get("text/markdown", data.get("text/plain", "")))
    return len(text.splitlines()), 0


def reading_load(notebook: Path) -> dict:
    """What a site reader reads in ``notebook``'s main line, and the minutes."""
    cells = json.loads(notebook.read_text())["cells"]
    code = output = figures = 0
    for cell in cells:
        if cell["cell_type"] != "code":
            continue
        tags = set(cell.get("metadata", {}).get("tags", []))
        if not tags & _HIDE_INPUT:
            code += len("".join(cell["source"]).rstrip("\n").splitlines())
        if not tags & _HIDE_OUTPUT:
            for o in cell.get("outputs", []):
                lines, figs = _visible_output_lines(o)
                output, figures = output + lines, figures + figs
    words = main_line_words(notebook)
    minutes = words / 150 + code / 22 + output / 15 + 1.5 * figures
    return {"words": words, "code": code, "output": output, "figures": figures,
            "minutes": minutes}  # fmt: skip


@pytest.mark.parametrize("notebook", CHAPTERS, ids=lambda p: p.stem)
def test_main_line_reads_in_the_time_budget(notebook):
    load = reading_load(notebook)
    assert load["minutes"] <= LOAD_BUDGET, f"{notebook.name}: {load}"


def test_reading_load_counts_what_the_site_shows(tmp_path):
    cell = {"cell_type": "code", "metadata": {"tags": []}, "source": ["a = 1\n", "b"],
            "outputs": [{"output_type": "stream", "text": ["x\n", "y\n"]},
                        {"output_type": "display_data", "data": {"text/plain": "9"},
                         "metadata": {"scrapbook": {"name": "n"}}}]}  # fmt: skip
    folded = {**cell, "metadata": {"tags": ["hide-input", "hide-output"]}}
    prose = {"cell_type": "markdown", "metadata": {}, "source": ["one two three"]}
    nb = tmp_path / "00_x.ipynb"
    nb.write_text(json.dumps({"cells": [prose, cell, folded]}))
    load = reading_load(nb)
    assert (load["words"], load["code"], load["output"], load["figures"]) == (
        3,
        2,
        2,
        0,
    )


@pytest.mark.parametrize("notebook", CHAPTERS, ids=lambda p: p.stem)
def test_main_line_fits_the_reading_budget(notebook):
    words = main_line_words(notebook)
    assert words <= BUDGET, f"{notebook.name}: {words} words outside asides"


def test_an_aside_is_left_out_and_code_is_not_prose():
    text = "one two\n:::{dropdown} Going deeper\nthree four\n:::\n```python\nx = 1\n```\nfive"
    assert main_line(text).split() == ["one", "two", "five"]


if __name__ == "__main__":
    print(f"{'chapter':40} {'words':>6} {'code':>5} {'out':>5} {'figs':>4} {'min':>5}")
    for nb in CHAPTERS:
        r = reading_load(nb)
        over = "  over" if r["words"] > BUDGET or r["minutes"] > LOAD_BUDGET else ""
        print(
            f"{nb.stem:40} {r['words']:6} {r['code']:5} {r['output']:5} "
            f"{r['figures']:4} {r['minutes']:5.1f}{over}"
        )
    sys.exit(0)
