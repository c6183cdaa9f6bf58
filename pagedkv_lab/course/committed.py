"""The benchmark reports committed with the course, wherever the course runs.

A clone has them in ``book/reports/<machine>/`` (the GPU report an H100 run
wrote, the CPU report of ``bench all``); a pip install, which is what Colab's
first cell makes, has the same files inside the package as
``pagedkv_lab.reports`` (pyproject.toml maps the folder there). Chapters read
committed GPU figures through `report_dir`, so they show the same tables in
both places.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path


def report_dir(machine: str) -> Path:
    """The folder of the committed report for ``machine`` (``"h100"``,
    ``"cpu"``): ``book/reports/<machine>`` beside the package in a clone, else
    the copy a pip install ships. Where neither has it, the clone's path, which
    then does not exist (callers check ``.exists()``)."""
    clone = Path(__file__).resolve().parents[2] / "book" / "reports" / machine
    if clone.is_dir():
        return clone
    try:
        shipped = Path(str(importlib.resources.files("pagedkv_lab.reports") / machine))
    except ModuleNotFoundError:  # an editable install whose clone lost the folder
        return clone
    return shipped if shipped.is_dir() else clone
