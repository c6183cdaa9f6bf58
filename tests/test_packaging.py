"""What a pip install ships: every folder of the package and of the committed
reports, so that a chapter run from Colab's install reads the files a clone has."""

from __future__ import annotations

import tomllib
from pathlib import Path

from pagedkv_lab.course import committed

ROOT = Path(__file__).resolve().parent.parent


def listed_packages() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return set(config["packages"])


def folders(base: Path, name: str) -> set[str]:
    found = {name}
    for path in base.rglob("*"):
        if path.is_dir() and "__pycache__" not in path.parts:
            found.add(".".join([name, *path.relative_to(base).parts]))
    return found


def test_every_package_folder_is_listed():
    assert folders(ROOT / "pagedkv_lab", "pagedkv_lab") <= listed_packages()


def test_every_committed_report_folder_ships():
    """A new report folder (a GPU run's book/reports/<gpu>/) must be added to
    pyproject.toml's packages and package-data, or a pip install lacks it."""
    reports = folders(ROOT / "book" / "reports", "pagedkv_lab.reports")
    assert reports <= listed_packages()
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert reports <= set(data["package-data"])


def test_report_dir_finds_the_clone_and_falls_back_to_the_installed_copy(
    tmp_path, monkeypatch
):
    assert committed.report_dir("h100") == ROOT / "book" / "reports" / "h100"
    assert (committed.report_dir("h100") / "kernel_decode_after.txt").exists()
    # installed: no book/ beside the package, the copy inside it instead
    fake = tmp_path / "site-packages" / "pagedkv_lab" / "committed.py"
    fake.parent.mkdir(parents=True)
    monkeypatch.setattr(committed, "__file__", str(fake))
    shipped = tmp_path / "shipped"
    (shipped / "h100").mkdir(parents=True)
    monkeypatch.setattr(committed.importlib.resources, "files", lambda name: shipped)
    assert committed.report_dir("h100") == shipped / "h100"
    assert not committed.report_dir("a100").exists()
