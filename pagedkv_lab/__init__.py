"""pagedkv_lab: the library that the PagedKV Lab course builds, chapter by chapter.

    from pagedkv_lab import LLM, SamplingParams
    outputs = LLM("tiny-llama").generate(["Hello"], SamplingParams(max_tokens=8))

Importing the package is cheap and never imports Triton, so that a notebook's
setup can still choose Triton's interpreter mode first; the names below are
loaded on first use (and listed by ``dir(pagedkv_lab)`` before that).

The modules of the API sit here: `llm` (`LLM`), `config` (`EngineArgs`),
`sampling_params`, `outputs`, `input_processor`, `output_processor`,
`tokenizing`, `models`, `device`, `kvmath` and `compare`. The packages:

* `engine`: the serving engine, one module per mechanism (chapters 03, 05a-09);
* `kernels`: paged attention and the layer ops' kernels (chapters 04a-04c, 05b);
* `sim`: the simulators of chapters 02, 03 and 08, and the workloads;
* `course`: the chapters' apparatus (setup, figures, widgets, exercises,
  experiments, claims), which the engine never imports;
* `bench`: ``python -m pagedkv_lab.bench``; `serve`: the HTTP server.

book/api.md ("How the library is organised") has one line per module.
"""

__version__ = "0.1.0"

# public name -> the module that defines it
_LAZY = {
    "LLM": "llm",
    "EngineArgs": "config",
    "SamplingParams": "sampling_params",
    "RequestOutputKind": "sampling_params",
    "RequestOutput": "outputs",
    "CompletionOutput": "outputs",
}
__all__ = list(_LAZY)


# Modules that moved when the package took its present shape: importing the old
# name fails with a message that names the new one.
MOVED = {
    "notebook": "course.notebook", "plotting": "course.plotting",
    "widgets": "course.widgets", "exercises": "course.exercises",
    "experiments": "course.experiments", "claims": "course.claims",
    "attention_plots": "course.attention_plots", "audit_plots": "course.audit_plots",
    "committed": "course.committed", "timelines": "course.timelines",
    "workloads": "sim.workloads", "contiguous": "sim.contiguous",
    "_sphinx": "course._sphinx", "_vllm_peer": "bench._vllm_peer",
    "attention": "kernels",
    "block_manager": "engine.block_manager", "paging": "engine.block_manager",
    "prefix_cache": "engine.prefix_cache", "scheduler": "engine.scheduler",
    "preemption": "engine.scheduler (and engine.swap)", "groups": "engine.groups",
    "fused": "engine.fused", "graphs": "engine.graphs", "sampling": "engine.sampler",
    "stats": "engine.core", "compare": "bench.compare",
}  # fmt: skip


class _MovedModules:
    """A finder on ``sys.meta_path`` that answers an old module name with an
    ImportError naming its new place."""

    @staticmethod
    def find_spec(fullname, path=None, target=None):
        prefix, _, rest = fullname.partition(".")
        if prefix == __name__ and rest in MOVED:
            raise ModuleNotFoundError(
                f"{fullname} moved: import pagedkv_lab.{MOVED[rest]} instead",
                name=fullname,
            )
        return None


def _install_finder() -> None:
    import sys

    if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedModules())


_install_finder()


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'pagedkv_lab' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
