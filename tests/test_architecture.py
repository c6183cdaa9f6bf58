"""The library's shape (issue 50): whole classes, an engine of collaborating
objects, one module per mechanism, runtime apart from the course."""

import ast
import importlib
import inspect
import pkgutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import pagedkv_lab

PACKAGE = Path(pagedkv_lab.__file__).resolve().parent
# The runtime: what serves a model. Course scaffolding (course/), simulators
# (sim/) and the benchmarks (bench/) may use it; it never uses them.
RUNTIME = ["engine", "kernels", "serve", "llm.py", "config.py", "input_processor.py",
           "output_processor.py", "sampling_params.py", "outputs.py", "tokenizing.py",
           "device.py", "kvmath.py", "models.py", "__init__.py"]  # fmt: skip
# (cli.py, the `pagedkv-lab` command, routes to serve/ and bench/: not runtime.)
SCAFFOLDING = ("pagedkv_lab.course", "pagedkv_lab.sim", "pagedkv_lab.bench")


def runtime_files() -> list[Path]:
    files = []
    for name in RUNTIME:
        path = PACKAGE / name
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return files


def project_classes() -> list[type]:
    """Every class defined in the package's modules (Triton's interpreter mode
    set first, as the chapters do, so the kernel modules import on a CPU)."""
    found = []
    for info in pkgutil.walk_packages([str(PACKAGE)], "pagedkv_lab."):
        if info.name.endswith(("__main__", "_vllm_peer")):
            continue
        module = importlib.import_module(info.name)
        found += [c for _, c in inspect.getmembers(module, inspect.isclass)
                  if c.__module__ == module.__name__]  # fmt: skip
    return found


def own_bases(cls: type) -> list[type]:
    return [c for c in cls.__mro__ if c.__module__.startswith("pagedkv_lab")]


def test_llm_holds_its_parts_and_inherits_nothing_of_ours():
    from pagedkv_lab.llm import LLM

    assert len(own_bases(LLM)) <= 3
    assert [c.__name__ for c in own_bases(LLM)] == ["LLM"]


def test_no_chain_of_project_classes_is_longer_than_three():
    long = {c.__qualname__: [b.__name__ for b in own_bases(c)] for c in project_classes()
            if len(own_bases(c)) > 3}  # fmt: skip
    assert not long, long


def test_no_runtime_module_is_over_600_lines():
    sizes = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines())
             for p in runtime_files()}  # fmt: skip
    assert max(sizes.values()) <= 600, {k: v for k, v in sizes.items() if v > 600}


def test_the_runtime_imports_no_course_simulator_or_benchmark_code():
    offending = []
    for path in runtime_files():
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            offending += [f"{path.relative_to(PACKAGE)}: {n}" for n in names
                          if n.startswith(SCAFFOLDING)]  # fmt: skip
    assert not offending, offending


@pytest.mark.parametrize("module", ["pagedkv_lab.engine.block_manager",
                                    "pagedkv_lab.engine.scheduler",
                                    "pagedkv_lab.engine.sequence"])  # fmt: skip
def test_the_block_manager_scheduler_and_sequences_load_no_model_stack(module):
    code = (f"import sys, {module}; "
            "print(sorted(m for m in ('torch', 'transformers', 'triton') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)  # fmt: skip
    assert done.stdout.strip() == "[]"


# Comprehensions run as code objects of their own in Python 3.11 and are inlined
# into their function from 3.12 on (PEP 709): not functions a reader follows.
COMPREHENSIONS = ("<listcomp>", "<genexpr>", "<dictcomp>", "<setcomp>")


def traced_decode_step(llm) -> Counter:
    """The project functions one ``llm.step()`` calls, each counted once per
    call (``sys.setprofile``, as issue 50 counted them; comprehensions left out)."""
    calls: Counter = Counter()
    root = str(PACKAGE)

    def profile(frame, event, arg):
        code = frame.f_code
        if (event == "call" and code.co_filename.startswith(root)
                and code.co_name not in COMPREHENSIONS):  # fmt: skip
            calls[(code.co_filename, code.co_qualname)] += 1

    sys.setprofile(profile)
    try:
        llm.step()
    finally:
        sys.setprofile(None)
    return calls


def test_one_decode_step_calls_few_functions_in_few_modules():
    """A steady decode step of tiny-llama, batch 8, greedy: at most 50
    distinct project functions in at most 10 modules."""
    from pagedkv_lab import LLM, SamplingParams

    llm = LLM("tiny-llama", dtype="float32", seed=0)
    for i in range(8):
        llm.add_request(f"r{i}", [1, 5 + i, 7, 9], SamplingParams(temperature=0, max_tokens=64,
                                                                  ignore_eos=True))  # fmt: skip
    for _ in range(4):  # prefill, then decode steps
        llm.step()
    assert llm.last_plan.decode_only and len(llm.last_plan.seqs) == 8
    calls = traced_decode_step(llm)
    assert llm.last_plan.decode_only
    functions = sorted(f"{Path(f).relative_to(PACKAGE)}:{q}" for f, q in calls)
    modules = sorted({f.split(":")[0] for f in functions})
    assert len(functions) <= 50, "\n".join(functions)
    assert len(modules) <= 10, modules
