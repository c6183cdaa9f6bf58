"""The library modules that notebooks export must equal what the notebooks say today."""

import json
import re

import pytest

from pagedkv_lab._export import (
    LIB,
    ROOT,
    assemble,
    chapter_notebooks,
    export_all,
    exporting_notebooks,
    module_path,
)

MODULES = exporting_notebooks()


def test_every_chapter_exports_a_module():
    assert {"device", "kvmath", "sim.contiguous"} <= set(MODULES)


@pytest.fixture(scope="module")
def fresh_export(tmp_path_factory):
    lib = (
        tmp_path_factory.mktemp("export") / "pagedkv_lab"
    )  # nbdev makes imports relative to the package name
    export_all(lib=lib)
    return lib


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_matches_its_notebooks(module, fresh_export):
    committed = module_path(module).read_text()
    regenerated = module_path(module, fresh_export).read_text()
    names = ", ".join(nb.name for nb in MODULES[module])
    assert committed == regenerated, (
        f"{module_path(module).relative_to(ROOT)} differs from what {names} export: "
        "edit the notebook, then run `make export`"
    )


@pytest.mark.parametrize("module", sorted(MODULES))
def test_generated_module_says_do_not_edit(module):
    first = module_path(module).read_text().splitlines()[0]
    assert "DO NOT EDIT" in first
    assert all(f"notebooks/{nb.name}" in first for nb in MODULES[module])


def _piece(source: str, name: str = "01_x.ipynb"):
    from pagedkv_lab._export import Piece

    return Piece(source, ROOT / "notebooks" / name)


def test_add_to_class_builds_one_whole_class():
    """A class begun in one cell and grown by ``@add_to_class`` cells (of this
    chapter or a later one) is written as one class: a method of the same name
    replaced in place, a new one appended, imports moved up, no decorator left."""
    first = '"""Doc."""\n\nimport math\n\n\nclass Pool:\n    def a(self):\n        return 1\n'
    later = (
        "import os\n\n"
        "@add_to_class(Pool)\n"
        "def a(self):\n    return 2\n\n"
        "# a comment that travels\n"
        "@add_to_class(Pool)\n"
        "@property\n"
        "def b(self):\n    return os.sep\n"
    )
    text = assemble([_piece(first), _piece(later, "02_y.ipynb")], LIB / "x.py")
    assert "add_to_class" not in text
    assert "notebooks/01_x.ipynb, notebooks/02_y.ipynb" in text.splitlines()[0]
    namespace: dict = {}
    exec(compile(text, "x.py", "exec"), namespace)
    pool = namespace["Pool"]()
    assert pool.a() == 2 and pool.b == namespace["os"].sep
    assert text.count("def a(") == 1 and "    # a comment that travels" in text
    assert text.index("import os") < text.index("class Pool")


def test_add_to_class_needs_the_class_first():
    with pytest.raises(ValueError, match="add_to_class"):
        assemble([_piece("x = 1\n"), _piece("@add_to_class(Pool)\ndef a(self):\n    pass\n")],
                 LIB / "x.py")  # fmt: skip


def test_add_to_class_in_a_notebook_attaches_the_method():
    from pagedkv_lab.course.notebook import add_to_class

    class Pool:
        pass

    @add_to_class(Pool)
    def size(self):
        return 3

    @add_to_class(Pool)
    @property
    def double(self):
        return 2 * self.size()

    assert Pool().size() == 3 and Pool().double == 6


def test_an_import_from_the_module_itself_is_dropped():
    """A later chapter imports names an earlier one defined (a notebook needs
    them); in the module they are its own, so the import is not written."""
    first = "class Pool:\n    pass\n"
    later = "from pagedkv_lab.x import Pool\n\n@add_to_class(Pool)\ndef a(self):\n    return 1\n"
    text = assemble([_piece(first), _piece(later, "02_y.ipynb")], LIB / "x.py", "x")
    assert "import Pool" not in text and "def a(self)" in text


def test_chapter_class_is_a_copy_that_leaves_the_library_class_alone():
    from pagedkv_lab.course.notebook import add_to_class, chapter_class

    class Pool:
        def size(self):
            return 3

    mine = chapter_class(Pool)

    @add_to_class(mine)
    def size(self):
        return 4

    assert mine().size() == 4 and Pool().size() == 3 and mine.__name__ == "Pool"


def _cells(nb_path):
    return json.loads(nb_path.read_text())["cells"]


CHAPTERS = chapter_notebooks()


@pytest.mark.parametrize("nb_path", CHAPTERS, ids=lambda p: p.name)
def test_chapter_shape(nb_path):
    cells = _cells(nb_path)
    setup = "".join(cells[0]["source"])
    assert (
        cells[0]["cell_type"] == "code"
        and re.search(r"from pagedkv_lab.course.notebook import (add_to_class, )?setup", setup)
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
        number = nb_path.name.split("_")[0]
        assert (ROOT / "solutions" / f"ch{number}.py").exists()
