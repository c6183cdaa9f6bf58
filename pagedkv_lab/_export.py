"""Regenerate the library modules that the chapter notebooks define.

A notebook that starts with ``#| default_exp <module>`` owns
``pagedkv_lab/<module>.py``: its cells marked ``#| export`` are written there, in
order, under a DO-NOT-EDIT header. A cell marked ``#| export <other>`` goes to
``pagedkv_lab/<other>.py`` instead, for a chapter that adds two modules. Run
``python -m pagedkv_lab._export`` (or ``make export``) after editing a notebook;
``tests/test_sync.py`` fails when a module and its notebook disagree.

Uses nbdev's exporter only (``nb_export(..., solo_nb=True)``), one module at a
time; none of nbdev's other tools (its notebook cleaner would break nbval) are involved.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
LIB = ROOT / "pagedkv_lab"

_EXPORT = re.compile(r"^#\|\s*export(?:\s+(\w+))?\s*$")
_DEFAULT = re.compile(r"#\|\s*default_exp\s+(\w+)")


def _cell_target(cell: dict, default: str) -> str | None:
    """The module a code cell exports to, or None."""
    if cell["cell_type"] != "code" or not cell["source"]:
        return None
    first = "".join(cell["source"]).splitlines()[0]
    match = _EXPORT.match(first)
    return (match.group(1) or default) if match else None


def exporting_notebooks(notebooks: Path = NOTEBOOKS) -> dict[str, Path]:
    """Map module name -> the notebook that exports it."""
    found: dict[str, Path] = {}
    for nb in sorted(notebooks.glob("[0-9][0-9]_*.ipynb")):
        text = nb.read_text()
        match = _DEFAULT.search(text)
        if not match:
            continue
        cells = json.loads(text)["cells"]
        for module in {match.group(1)} | {
            t for c in cells if (t := _cell_target(c, match.group(1)))
        }:
            if module in found:
                raise ValueError(
                    f"{nb.name} and {found[module].name} both export pagedkv_lab/{module}.py"
                )
            found[module] = nb
    return found


def _single_module_notebook(nb: Path, module: str, folder: Path) -> Path:
    """A copy of ``nb`` whose exported cells are exactly those for ``module`` (nbdev's solo export wants one)."""
    data = json.loads(nb.read_text())
    default = _DEFAULT.search(nb.read_text()).group(1)
    cells = [
        {
            "cell_type": "code",
            "source": f"#| default_exp {module}",
            "metadata": {},
            "outputs": [],
            "execution_count": None,
        }
    ]
    for cell in data["cells"]:
        target = _cell_target(cell, default)
        if target == module:
            lines = "".join(cell["source"]).splitlines(keepends=True)
            cells.append({**cell, "source": "#| export\n" + "".join(lines[1:])})
    data["cells"] = cells
    path = folder / nb.name
    path.write_text(json.dumps(data))
    return path


def export_all(lib: Path = LIB, notebooks: Path = NOTEBOOKS) -> list[Path]:
    """Export every notebook's ``#| export`` cells into ``lib``; return the written modules."""
    from nbdev.export import nb_export

    lib.mkdir(parents=True, exist_ok=True)
    written = []
    for module, nb in exporting_notebooks(notebooks).items():
        target = lib / f"{module}.py"
        target.unlink(missing_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            nb_export(
                str(_single_module_notebook(nb, module, Path(tmp))),
                lib_path=str(lib),
                solo_nb=True,
            )
        # nbdev names the (temporary) notebook relative to the library; name the real one from the repository root.
        text = re.sub(
            r"File to edit: \S+\.ipynb",
            f"File to edit: notebooks/{nb.name}",
            target.read_text(),
        )
        text = re.sub(r"^# %% \S+\.ipynb #\S+\n", "", text, flags=re.M)
        # nbdev makes one-line package imports relative; do the same for wrapped ones.
        text = re.sub(
            r"^from pagedkv_lab\.(\w+) import", r"from .\1 import", text, flags=re.M
        )
        target.write_text(text)
        written.append(target)
    return written


if __name__ == "__main__":
    for path in export_all():
        print("exported", path.relative_to(ROOT), file=sys.stderr)
