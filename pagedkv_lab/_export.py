"""Regenerate the library modules that the chapter notebooks define.

Every notebook that starts with ``#| default_exp <module>`` owns
``pagedkv_lab/<module>.py``: the cells marked ``#| export`` are written there, in
order, under a DO-NOT-EDIT header. Run ``python -m pagedkv_lab._export`` (or
``make export``) after editing a notebook; ``tests/test_sync.py`` fails when a
module and its notebook disagree.

Uses nbdev's exporter only (``nb_export(..., solo_nb=True)``); none of nbdev's
other tools (its notebook cleaner would break nbval) are involved.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
LIB = ROOT / "pagedkv_lab"


def exporting_notebooks(notebooks: Path = NOTEBOOKS) -> dict[str, Path]:
    """Map module name -> the notebook that exports it."""
    found: dict[str, Path] = {}
    for nb in sorted(notebooks.glob("[0-9][0-9]_*.ipynb")):
        match = re.search(r"#\|\s*default_exp\s+(\w+)", nb.read_text())
        if match:
            module = match.group(1)
            if module in found:
                raise ValueError(f"{nb.name} and {found[module].name} both export pagedkv_lab/{module}.py")
            found[module] = nb
    return found


def export_all(lib: Path = LIB, notebooks: Path = NOTEBOOKS) -> list[Path]:
    """Export every notebook's ``#| export`` cells into ``lib``; return the written modules."""
    from nbdev.export import nb_export

    lib.mkdir(parents=True, exist_ok=True)
    written = []
    for module, nb in exporting_notebooks(notebooks).items():
        target = lib / f"{module}.py"
        target.unlink(missing_ok=True)
        nb_export(str(nb), lib_path=str(lib), solo_nb=True)
        # nbdev names the notebook relative to the library folder; name it from the repository root.
        text = re.sub(r"File to edit: \S+\.ipynb", f"File to edit: notebooks/{nb.name}", target.read_text())
        target.write_text(re.sub(r"^# %% \S+\.ipynb", f"# %% notebooks/{nb.name}", text, flags=re.M))
        written.append(target)
    return written


if __name__ == "__main__":
    for path in export_all():
        print("exported", path.relative_to(ROOT), file=sys.stderr)
