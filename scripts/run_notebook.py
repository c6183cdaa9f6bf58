"""Execute a chapter top to bottom, printing each code cell's time as it ends.

`jupyter nbconvert --execute` writes nothing until the last cell is done, so a
run cut off by a time limit says neither where it stopped nor where the time
went. This prints one line per cell as it finishes (and the cell's error, if
any) and writes the executed notebook at the end::

    python scripts/run_notebook.py notebooks/04c_climbing_to_the_copy_bandwidth.ipynb --out report/nb

The slowest cells are listed last. Exit status 1 when a cell raised.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError


def first_line(cell) -> str:
    for line in cell.source.splitlines():
        if line.strip() and not line.startswith("#|"):
            return line.strip()[:60]
    return ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebook", type=Path)
    parser.add_argument("--out", type=Path, help="folder for the executed copy")
    parser.add_argument("--cell-timeout", type=int, default=600)
    args = parser.parse_args()

    nb = nbformat.read(args.notebook, as_version=4)
    client = NotebookClient(
        nb,
        timeout=args.cell_timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(args.notebook.parent)}},
    )
    times: list[tuple[float, int, str]] = []
    failed = False
    start = time.perf_counter()
    with client.setup_kernel():
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            t0 = time.perf_counter()
            try:
                client.execute_cell(cell, index)
            except CellExecutionError as error:
                failed = True
                print(f"[{index:3d}] FAILED after {time.perf_counter() - t0:.1f} s")
                print(str(error)[-3000:])
                break
            elapsed = time.perf_counter() - t0
            times.append((elapsed, index, first_line(cell)))
            print(f"[{index:3d}] {elapsed:7.1f} s  {first_line(cell)}", flush=True)
    total = time.perf_counter() - start
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, args.out / args.notebook.name)
    print(f"\n{args.notebook.name}: {'FAILED' if failed else 'ok'} in {total:.0f} s")
    print("slowest cells:")
    for elapsed, index, line in sorted(times, reverse=True)[:5]:
        print(f"  [{index:3d}] {elapsed:7.1f} s  {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
