"""Serve a model over HTTP with OpenAI's API, as ``vllm serve`` does.

    python -m pagedkv_lab.serve tiny-llama --port 8000     # or: pagedkv-lab serve tiny-llama
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "tiny-llama", "prompt": "Hello", "max_tokens": 8}'

Needs the ``serve`` extra (FastAPI and uvicorn, the stack vLLM's server runs
on): ``pip install 'pagedkv-lab[serve]'``. ``import pagedkv_lab`` never
imports this package. The modules, one job each:

* `protocol`: the request bodies and OpenAI's response shapes;
* `tokenization`: vLLM's ``/tokenize``, ``/detokenize``, ``/tokenizer_info``;
* `engine_loop`: the one loop that owns the `LLM` and steps it;
* `metrics`: ``/metrics`` in Prometheus's text format, with vLLM's names;
* `app`: the FastAPI routes (`build_app`);
* ``__main__``: the command line (`main`).
"""

try:
    import fastapi  # noqa: F401
    import uvicorn  # noqa: F401
except ImportError as err:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "pagedkv_lab.serve needs the 'serve' extra (FastAPI and uvicorn): "
        "pip install 'pagedkv-lab[serve]' (in a clone: pip install -e '.[serve]'); "
        f"missing: {err.name}"
    ) from err

from pagedkv_lab.serve.app import build_app
from pagedkv_lab.serve.engine_loop import EngineLoop, RequestStream
from pagedkv_lab.serve.protocol import RequestError

__all__ = ["EngineLoop", "RequestError", "RequestStream", "build_app", "main"]


def main(argv: list[str] | None = None) -> None:
    """``python -m pagedkv_lab.serve``'s command line (see ``__main__``)."""
    from pagedkv_lab.serve.__main__ import main as _main

    _main(argv)
