"""Pages a reader can read: nothing wider than the book's code column, tables in one block.

The rendered site (sphinx-book-theme with ``_static/pagedkv.css``) shows code
and printed output at 13px in a column that holds 88 characters in any window
from 1366 px wide up (measured with headless Chromium; at the theme's default
14px it held 87). A longer line is cut off at the right edge behind a scroll
bar, so every committed code line and every printed text line must fit in
``PAGE_COLUMNS``. A table printed by one cell must also reach the page as one
output block: nbconvert splits a cell's prints into several stream outputs
when they arrive at different times, and each becomes a separate box: print a
table with one call, and execute with `make execute`, whose CoalesceStreams
preprocessor merges a cell's consecutive prints into one output.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE_COLUMNS = 88
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]*_*.ipynb"))
PAGES = sorted((ROOT / "book").glob("*.md"))
SOLUTIONS = sorted((ROOT / "solutions").glob("ch*.py"))
# Outputs the site shows instead of their text/plain fallback.
RICH = ("image/", "text/html", "text/latex", "application/vnd.jupyter.widget-view")
FENCE = re.compile(r"^(```+|~~~+)\s*(\S*)")
# Fenced blocks a page shows as code: plain or language fences, and code directives.
CODE_FENCES = ("", "{code-block}", "{code}", "{code-cell}")


def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else value


def _fenced_lines(markdown: str):
    """Lines inside fenced code blocks of a markdown text (what the page shows as code)."""
    fence, is_code = None, False
    for line in markdown.splitlines():
        match = FENCE.match(line.strip())
        if fence is None and match:
            fence, info = match.group(1), match.group(2)
            is_code = not info.startswith("{") or info in CODE_FENCES
            continue
        if fence is not None and line.strip() == fence:
            fence = None
            continue
        if fence is not None and is_code and not line.lstrip().startswith(":"):
            yield line


def _shown_text(output: dict) -> str:
    """The text a page prints for one output, or "" when it shows something richer."""
    if output["output_type"] == "stream":
        return _text(output["text"])
    if output["output_type"] == "error":
        return "\n".join(output.get("traceback", []))
    data = output.get("data", {})
    if any(key.startswith(RICH) for key in data):
        return ""
    return _text(data.get("text/plain", ""))


def wide_lines(notebook: Path, limit: int = PAGE_COLUMNS) -> list[str]:
    """Every code, fenced-markdown or printed line of ``notebook`` wider than ``limit``."""
    nb = json.loads(notebook.read_text())
    found = []
    for index, cell in enumerate(nb["cells"]):
        source = _text(cell["source"])
        if cell["cell_type"] == "code":
            sources = [("code", source.splitlines())]
            sources += [
                (f"output {k}", _shown_text(out).splitlines())
                for k, out in enumerate(cell.get("outputs", []))
            ]
        else:
            sources = [("markdown code", list(_fenced_lines(source)))]
        for where, lines in sources:
            for line in lines:
                if len(line) > limit:
                    found.append(f"cell {index} {where} ({len(line)}): {line[:60]}...")
    return found


def split_tables(notebook: Path) -> list[str]:
    """Cells whose printed text reaches the page as several consecutive stream blocks."""
    nb = json.loads(notebook.read_text())
    found = []
    for index, cell in enumerate(nb["cells"]):
        outputs = cell.get("outputs", [])
        for a, b in zip(outputs, outputs[1:]):
            if (
                a["output_type"] == b["output_type"] == "stream"
                and a["name"] == b["name"]
            ):
                first = _text(b["text"]).splitlines()[:1]
                found.append(f"cell {index}: a new {b['name']} block starts at {first}")
    return found


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_no_notebook_line_is_wider_than_the_page(notebook):
    wide = wide_lines(notebook)
    assert not wide, f"{len(wide)} lines wider than {PAGE_COLUMNS}:\n" + "\n".join(wide)


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_each_cell_prints_one_block(notebook):
    split = split_tables(notebook)
    assert not split, "print a table once (join its lines):\n" + "\n".join(split)


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_cell_has_its_own_id(notebook):
    """nbformat 4.5 cells carry an id (a cell inserted by hand may lack one, which
    nbformat warns about and the book build reports); ids must not repeat."""
    ids = [cell.get("id") for cell in json.loads(notebook.read_text())["cells"]]
    missing = [i for i, cell_id in enumerate(ids) if not cell_id]
    assert not missing, f"cells without an id: {missing}"
    assert len(set(ids)) == len(ids), "two cells share an id"


MAX_CELL_LINES = 60  # a longer cell is split, or its class built method by method


def long_cells(notebook: Path, limit: int = MAX_CELL_LINES) -> list[str]:
    """Every code cell of ``notebook`` with more than ``limit`` source lines."""
    cells = json.loads(notebook.read_text())["cells"]
    return [f"cell {i} ({n} lines)" for i, cell in enumerate(cells)
            if cell["cell_type"] == "code"
            and (n := len(_text(cell["source"]).splitlines())) > limit]


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_no_code_cell_is_longer_than_a_screen(notebook):
    long = long_cells(notebook)
    assert not long, f"code cells over {MAX_CELL_LINES} lines: " + ", ".join(long)


@pytest.mark.parametrize(
    "path",
    PAGES + SOLUTIONS,
    ids=[p.relative_to(ROOT).as_posix() for p in PAGES + SOLUTIONS],
)
def test_no_book_page_or_solution_line_is_wider_than_the_page(path):
    text = path.read_text()
    lines = text.splitlines() if path.suffix == ".py" else list(_fenced_lines(text))
    wide = [f"({len(x)}): {x[:60]}..." for x in lines if len(x) > PAGE_COLUMNS]
    assert not wide, f"{path.name}: lines wider than {PAGE_COLUMNS}:\n" + "\n".join(
        wide
    )


def test_the_checks_catch_what_they_are_for(tmp_path):
    cell = {
        "cell_type": "code",
        "source": ["x = 1\n", "y = '" + "a" * 90 + "'\n"],
        "outputs": [
            {"output_type": "stream", "name": "stdout", "text": ["row 1\n"]},
            {"output_type": "stream", "name": "stdout", "text": ["row 2\n"]},
            {
                "output_type": "display_data",
                "data": {"image/png": "", "text/plain": ["<Figure " + "." * 99 + ">"]},
            },
            {"output_type": "execute_result", "data": {"text/plain": ["b" * 89]}},
        ],
    }
    path = tmp_path / "00_x.ipynb"
    path.write_text(json.dumps({"cells": [cell]}))
    wide = wide_lines(path)
    assert len(wide) == 2 and "code" in wide[0] and "output 3" in wide[1]
    assert len(split_tables(path)) == 1
    assert long_cells(path) == [] and long_cells(path, limit=1) == ["cell 0 (2 lines)"]


# ---- cross-references between pages ------------------------------------------------

DOC_ROLE = re.compile(r"\{doc\}`(?:[^`<]*<)?([^`>]+)>?`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
COLAB = re.compile(r"https://colab\.research\.google\.com/github/([^/\s]+/[^/\s]+)/blob/[^/\s]+/([^)\s]+)")


def _sources():
    """Every text a reader follows links from: the book's pages, the README, and
    the chapters' markdown cells, with the folder their relative links start in."""
    for page in [*PAGES, ROOT / "README.md"]:
        yield page, page.read_text()
    for nb in NOTEBOOKS:
        cells = json.loads(nb.read_text())["cells"]
        yield nb, "\n".join(_text(c["source"]) for c in cells if c["cell_type"] == "markdown")


def _page_exists(target: Path) -> bool:
    """A Sphinx document (no suffix: a .md page or a notebook) or a file."""
    if target.suffix in (".md", ".ipynb", ".py", ".txt", ".json", ".bib"):
        return target.exists()
    return any(target.with_suffix(s).exists() for s in (".md", ".ipynb")) or target.exists()


def broken_links(sources) -> list[str]:
    """Links between pages that point nowhere: {doc} roles, relative markdown
    links (to pages, notebooks or files) and Colab links to notebooks."""
    repo = re.search(r"^\s+url:\s*https://github\.com/(\S+)", (ROOT / "_config.yml").read_text(),
                     re.M).group(1)  # fmt: skip
    found = []
    for path, text in sources:
        for target in DOC_ROLE.findall(text):
            base = ROOT if target.startswith("/") else path.parent
            if not _page_exists(base / target.lstrip("/")):
                found.append(f"{path.name}: {{doc}} {target}")
        for url in LINK.findall(text):
            if url.startswith(("http://", "https://", "mailto:", "#")):
                continue
            if not _page_exists(path.parent / url.split("#")[0]):
                found.append(f"{path.name}: link {url}")
        for where, notebook in COLAB.findall(text):
            if where != repo or not (ROOT / notebook).exists():
                found.append(f"{path.name}: Colab {where}/{notebook}")
    return found


def test_every_cross_reference_and_colab_link_resolves():
    broken = broken_links(_sources())
    assert not broken, "links to pages or notebooks that do not exist:\n" + "\n".join(broken)
    toc = (ROOT / "_toc.yml").read_text()
    for entry in re.findall(r"file:\s*(\S+)", toc):
        assert _page_exists(ROOT / entry), f"_toc.yml names {entry}, which does not exist"


def test_the_link_check_catches_a_dangling_link(tmp_path):
    page = ROOT / "book" / "x.md"
    text = ("{doc}`../notebooks/04_attention` [a](../notebooks/99_none) [b](setup) "
            "[c](https://colab.research.google.com/github/pagedkv-lab/pagedkv-lab/blob/"
            "main/notebooks/04_attention.ipynb)")
    assert len(broken_links([(page, text)])) == 3
