"""A learner's budget: each chapter's main line (its markdown outside the
"Going deeper" asides) is at most 3,500 words, about 30 minutes of reading.

An aside is a MyST ``dropdown`` or ``toggle`` directive (``:::{dropdown} ...``
or a backtick fence); fenced code and HTML comments are not prose. A glued
number counts as one word. ``python tests/test_reading.py`` prints the table.
"""

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BUDGET = 3500
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


def main_line_words(notebook: Path) -> int:
    cells = json.loads(notebook.read_text())["cells"]
    text = "\n".join(
        "".join(c["source"]) for c in cells if c["cell_type"] == "markdown"
    )
    text = re.sub(r"\{glue:\w+\}`[^`]*`", "N", main_line(text))
    return len(text.split())


@pytest.mark.parametrize("notebook", CHAPTERS, ids=lambda p: p.stem)
def test_main_line_fits_the_reading_budget(notebook):
    words = main_line_words(notebook)
    assert words <= BUDGET, f"{notebook.name}: {words} words outside asides"


def test_an_aside_is_left_out_and_code_is_not_prose():
    text = "one two\n:::{dropdown} Going deeper\nthree four\n:::\n```python\nx = 1\n```\nfive"
    assert main_line(text).split() == ["one", "two", "five"]


if __name__ == "__main__":
    for nb in CHAPTERS:
        n = main_line_words(nb)
        print(f"{nb.stem:40} {n:6}{'  over' if n > BUDGET else ''}")
    sys.exit(0)
