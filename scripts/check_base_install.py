"""Check that this Python holds the course as Colab installs it: the package with
its base dependencies only (`make test-chapters` runs the chapters here next).

A chapter that imported something only an extra brings (myst-nb, jupyter-book,
pytest...) would pass in the developers' environment and break on Colab. This
fails, naming the module, when an extra's package is importable here, and when
`pagedkv_lab` would be imported from the source tree instead of the installed
copy (whose package data, the model configs and the C++ source, must ship).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

#: Importable only through an extra (book, lab, serve, eval); never in a Colab install.
EXTRAS_ONLY = ("myst_nb", "jupyter_book", "sphinx", "jupyterlab", "fastapi", "uvicorn",
               "lm_eval")  # fmt: skip
NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def main() -> int:
    leaked = [name for name in EXTRAS_ONLY if importlib.util.find_spec(name)]
    if leaked:
        print(f"not a base install: {', '.join(leaked)} importable (an extra's packages)")
        return 1
    # where a chapter's kernel (started in notebooks/) finds the package
    where = subprocess.run(
        [sys.executable, "-c", "import pagedkv_lab, sys; print(pagedkv_lab.__file__)"],
        cwd=NOTEBOOKS,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if "site-packages" not in where:
        print(f"pagedkv_lab is imported from {where}, not from the installed package")
        return 1
    print(f"base install: no extras importable; chapters import {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
