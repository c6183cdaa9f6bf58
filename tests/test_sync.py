"""The library modules that notebooks export must equal what the notebooks say today."""

import json
import re

import pytest

from pagedkv_lab._export import LIB, NOTEBOOKS, ROOT, export_all, exporting_notebooks

MODULES = exporting_notebooks()


def test_every_chapter_exports_a_module():
    assert {"device", "kvmath", "contiguous"} <= set(MODULES)


@pytest.fixture(scope="module")
def fresh_export(tmp_path_factory):
    lib = (
        tmp_path_factory.mktemp("export") / "pagedkv_lab"
    )  # nbdev makes imports relative to the package name
    export_all(lib=lib)
    return lib


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_matches_its_notebook(module, fresh_export):
    committed = (LIB / f"{module}.py").read_text()
    regenerated = (fresh_export / f"{module}.py").read_text()
    assert committed == regenerated, (
        f"pagedkv_lab/{module}.py differs from notebooks/{MODULES[module].name}: "
        "edit the notebook, then run `make export`"
    )


@pytest.mark.parametrize("module", sorted(MODULES))
def test_generated_module_says_do_not_edit(module):
    first = (LIB / f"{module}.py").read_text().splitlines()[0]
    assert "DO NOT EDIT" in first and MODULES[module].name in first


def _cells(nb_path):
    return json.loads(nb_path.read_text())["cells"]


CHAPTERS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("nb_path", CHAPTERS, ids=lambda p: p.name)
def test_chapter_shape(nb_path):
    cells = _cells(nb_path)
    setup = "".join(cells[0]["source"])
    assert (
        cells[0]["cell_type"] == "code"
        and "from pagedkv_lab.notebook import setup" in setup
    )
    assert cells[1]["cell_type"] == "markdown" and "".join(
        cells[1]["source"]
    ).startswith("# ")
    text = "\n".join(
        "".join(c["source"]) for c in cells if c["cell_type"] == "markdown"
    )
    assert "## Summary" in text and "## Exercises" in text
    code = [c for c in cells if c["cell_type"] == "code"]
    assert all(c["execution_count"] is not None for c in code), (
        "execute the notebook before committing"
    )
    assert not any(o["output_type"] == "error" for c in code for o in c["outputs"])


@pytest.mark.parametrize("nb_path", CHAPTERS, ids=lambda p: p.name)
def test_exported_cells_have_no_magics(nb_path):
    for cell in _cells(nb_path):
        src = "".join(cell["source"])
        if cell["cell_type"] == "code" and src.startswith("#| export"):
            assert not re.search(r"^\s*[%!]", src, re.M), src[:80]


def test_colab_install_url_is_the_books_repository():
    config = (ROOT / "_config.yml").read_text()
    url = re.search(r"^\s+url:\s*(\S+)", config, re.M).group(1)
    for nb_path in CHAPTERS:
        setup = "".join(_cells(nb_path)[0]["source"])
        assert f"git+{url}" in setup, (
            f"{nb_path.name} installs from another repository than _config.yml names"
        )


def test_every_chapter_is_in_the_toc():
    toc = (ROOT / "_toc.yml").read_text()
    for nb_path in CHAPTERS:
        assert f"notebooks/{nb_path.stem}" in toc


def test_solutions_exist_for_each_chapter():
    for nb_path in CHAPTERS:
        assert (ROOT / "solutions" / f"ch{nb_path.name[:2]}.py").exists()
