"""pagedkv_lab: the library that the PagedKV Lab course builds, chapter by chapter.

    from pagedkv_lab import LLM, SamplingParams
    outputs = LLM("tiny-llama").generate(["Hello"], SamplingParams(max_tokens=8))

Importing the package is cheap and never imports Triton, so that a notebook's
setup can still choose Triton's interpreter mode first; ``LLM`` and
``SamplingParams`` are loaded on first use.
"""

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "RequestOutputKind",
]


def __getattr__(name: str):
    if name in ("LLM", "RequestOutput", "CompletionOutput"):
        from . import llm

        return getattr(llm, name)
    if name in ("SamplingParams", "RequestOutputKind"):
        from . import sampling

        return getattr(sampling, name)
    raise AttributeError(f"module 'pagedkv_lab' has no attribute {name!r}")
