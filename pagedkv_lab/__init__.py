"""pagedkv_lab: the library that the PagedKV Lab course builds, chapter by chapter.

    from pagedkv_lab import LLM, SamplingParams
    outputs = LLM("tiny-llama").generate(["Hello"], SamplingParams(max_tokens=8))

Importing the package is cheap and never imports Triton, so that a notebook's
setup can still choose Triton's interpreter mode first; the names below are
loaded on first use (and listed by ``dir(pagedkv_lab)`` before that).
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


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'pagedkv_lab' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
