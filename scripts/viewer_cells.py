"""Put the page viewers' cells into the chapters, after each chapter's live viewer.

    python scripts/viewer_cells.py                  # every chapter that has a viewer
    python scripts/viewer_cells.py notebooks/03_paging.ipynb

Each chapter gets a markdown cell and a code cell, both tagged ``pool-viewer``,
right after its existing widget cell (the cell that calls the chapter's
ipywidgets viewer). Running it again updates the code cell in place (and moves
both back after the widget cell), so it can be re-run on rewritten chapters; a
markdown cell already there is kept as it is, since chapters rewrite their
viewer's introduction by hand (the generated one is only a first draft).
The code cells' outputs are cleared: execute the chapter afterwards
(``jupyter nbconvert`` with the Makefile's EXECUTE options, or ``make execute``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TAG = "pool-viewer"

INTRO = (
    "On the book's site the viewer below runs without a kernel: it replays the runs "
    "its cell computed with the chapter's simulator, one for every setting of its "
    "menus. Play it, step it or drag its slider{extra}. In a live notebook its "
    "menus offer more settings, and the kernel simulates each one you pick."
)
ADD_REQUEST = "; *+ next request* jumps to the next request's arrival"

#: Chapter file prefix -> (the old widget cell's call, the new cell's code, intro extra).
CHAPTERS = {
    "02": (
        "contiguous_pool_viewer()",
        "from pagedkv_lab.course.viewers import show_contiguous_viewer\n\n"
        "show_contiguous_viewer()",
        ADD_REQUEST,
    ),
    "03": (
        "paged_pool_viewer()",
        "from pagedkv_lab.course.viewers import show_paging_viewer\n\n"
        "show_paging_viewer()  # the same trace and memory, contiguous beside paged",
        ADD_REQUEST + " in both pools at once",
    ),
    "07": (
        "beam_search_viewer()",
        "from pagedkv_lab.course.viewers import show_beam_viewer\n\nshow_beam_viewer()",
        "",
    ),
    "08": (
        "prefix_cache_viewer(",
        "from pagedkv_lab.course.viewers import show_prefix_cache_viewer\n"
        "from pagedkv_lab.sim.workloads import system_prompt_workload\n\n"
        "show_prefix_cache_viewer({\n"
        '    "multi-turn chat": small_chat,  # the workload of the viewer above\n'
        '    "one system prompt": system_prompt_workload(18, system_len=64, seed=11),\n'
        "})",
        "",
    ),
    "09": (
        "preemption_viewer()",
        "from pagedkv_lab.course.viewers import show_preemption_viewer\n\n"
        "show_preemption_viewer()",
        "",
    ),
}


def _lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def viewer_cells(chapter: str) -> list[dict]:
    """The markdown and code cells of ``chapter``'s page viewer."""
    _, code, extra = CHAPTERS[chapter]
    meta = {"tags": [TAG]}
    return [
        {"cell_type": "markdown", "metadata": meta, "source": _lines(INTRO.format(extra=extra))},
        {"cell_type": "code", "execution_count": None, "metadata": meta, "outputs": [],
         "source": _lines(code)},
    ]  # fmt: skip


def _tagged(cell: dict) -> bool:
    return TAG in cell.get("metadata", {}).get("tags", [])


def update(notebook: dict, chapter: str) -> dict:
    """``notebook`` with its page-viewer cells (re)placed after its widget cell."""
    call = CHAPTERS[chapter][0]
    cells = [c for c in notebook["cells"] if not _tagged(c)]
    anchors = [
        i
        for i, c in enumerate(cells)
        if c["cell_type"] == "code" and call in "".join(c["source"])
    ]
    if len(anchors) != 1:
        raise SystemExit(
            f"chapter {chapter}: expected one cell calling {call}, found {len(anchors)}"
        )
    old = [c for c in notebook["cells"] if _tagged(c)]
    new = viewer_cells(chapter)
    for k, cell in enumerate(new):
        same = [c for c in old if c["cell_type"] == cell["cell_type"]]
        if same and cell["cell_type"] == "markdown":
            new[k] = same[0]  # the chapter's own words about its viewer
        elif same and "".join(same[0]["source"]) == "".join(cell["source"]):
            new[k] = same[0]  # unchanged: keep its id, and its outputs
        else:
            cell["id"] = (
                same[0].get("id", f"{chapter}-{TAG}-{k}")
                if same
                else f"{chapter}-{TAG}-{k}"
            )
    at = anchors[0] + 1
    notebook["cells"] = cells[:at] + new + cells[at:]
    return notebook


def main(paths: list[str]) -> None:
    if not paths:
        paths = [
            str(p)
            for p in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
            if p.name[:2] in CHAPTERS
        ]
    for path in map(Path, paths):
        notebook = update(json.loads(path.read_text()), path.name[:2])
        path.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n")
        print(f"{path.name}: page viewer cells after the widget cell")


if __name__ == "__main__":
    main(sys.argv[1:])
