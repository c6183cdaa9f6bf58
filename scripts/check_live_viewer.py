"""Check a pool viewer live in JupyterLab: its menus re-run the simulation.

    python scripts/check_live_viewer.py [--screenshot live.png]

Starts JupyterLab on 127.0.0.1 with a one-cell notebook that shows chapter 02's
viewer, runs the cell in headless Chromium, picks a pool size the site does not
precompute (12 rows) and waits for the kernel to simulate it: the viewer must
then show the simulator's numbers for that setting. Needs the ``lab`` extra
(JupyterLab), the ``dev`` extra (Playwright) and Chromium (``apt-get install
chromium``); not part of `make test`.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CELL = "from pagedkv_lab.course.viewers import show_contiguous_viewer\n\nshow_contiguous_viewer()"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def expected(rows: int, step: int) -> tuple[int, int]:
    """The simulator's K/V slots and pool size for chapter 02's trace."""
    from pagedkv_lab.course.traces import w1_requests
    from pagedkv_lab.sim.contiguous import ContiguousPool
    from pagedkv_lab.sim.workloads import simulate

    result = simulate(w1_requests(), ContiguousPool(rows * 2048, 2048, "max", "buddy"))
    return int(result.usage["used"][step]), result.capacity


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--screenshot", type=Path)
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    work = Path(tempfile.mkdtemp())
    notebook = {"cells": [{"cell_type": "code", "execution_count": None, "id": "v",
                           "metadata": {}, "outputs": [], "source": CELL}],
                "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                            "language": "python"}},
                "nbformat": 4, "nbformat_minor": 5}  # fmt: skip
    (work / "viewer.ipynb").write_text(json.dumps(notebook))
    port, token = free_port(), secrets.token_hex(16)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen(
        [shutil.which("jupyter-lab", path=str(Path(sys.executable).parent)) or "jupyter-lab",
         "--no-browser", f"--port={port}", "--ip=127.0.0.1", f"--IdentityProvider.token={token}",
         f"--ServerApp.root_dir={work}", *(["--allow-root"] if os.geteuid() == 0 else [])],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    errors: list[str] = []
    try:
        for _ in range(60):
            try:
                socket.create_connection(("127.0.0.1", port), 1).close()
                break
            except OSError:
                time.sleep(1)
        with sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=shutil.which("chromium"), args=ARGS
            )
            page = browser.new_page(viewport={"width": 1300, "height": 1100})
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"http://127.0.0.1:{port}/lab/tree/viewer.ipynb?token={token}")
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
            page.wait_for_timeout(4000)  # the kernel starts
            page.click(".jp-Cell .jp-InputArea-editor")
            page.keyboard.press("Shift+Enter")
            viewer = page.wait_for_selector(".pkv-viewer.pkv-mounted", timeout=120_000)
            viewer.query_selector("input[type=range]").fill("300")  # a busy step
            rows = viewer.query_selector("select[data-control=rows]")
            options = [
                o.get_attribute("value") for o in rows.query_selector_all("option")
            ]
            assert "12" in options, f"live options should go past the site's: {options}"
            rows.select_option("12")
            page.wait_for_function(
                "el => (el.querySelector('[data-den]') || {dataset: {}}).dataset.den === String(12 * 2048)",
                arg=viewer,
                timeout=60_000,
            )
            step = int(viewer.get_attribute("data-step"))
            span = viewer.query_selector("[data-den]")
            shown = (
                int(span.get_attribute("data-num")),
                int(span.get_attribute("data-den")),
            )
            want = expected(12, step)
            print(f"live: 12 rows, step {step}: page {shown}, simulator {want}")
            if args.screenshot:
                viewer.screenshot(path=str(args.screenshot))
            browser.close()
        ok = shown == want and not errors
    finally:
        server.terminate()
        server.wait(timeout=30)
    print("errors:", errors or "none")
    print("live viewer: OK" if ok else "live viewer: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
