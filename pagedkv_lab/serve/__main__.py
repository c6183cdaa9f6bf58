"""``python -m pagedkv_lab.serve MODEL [options]``: serve MODEL over HTTP.

MODEL is what `LLM` takes: an offline name (``tiny-llama``, ``small-llama``...),
a Hugging Face name or a local path. The engine options carry vLLM's flag
names where `LLM` has the setting (``--dtype``, ``--max-model-len``,
``--block-size``, ``--max-num-seqs``, ``--max-num-batched-tokens``,
``--enable-prefix-caching``, ``--seed``, ``--served-model-name``,
``--enforce-eager``); ``--kv-cache-memory`` is `LLM`'s ``kv_cache_memory``
(bytes, with an optional KiB/MiB/GiB suffix, or a fraction of the GPU).
``--max-waiting`` bounds the requests waiting for the engine: past it the
server answers 503.

``--enable-tokenizer-info-endpoint`` adds ``GET /tokenizer_info``, as in vLLM
(``/tokenize`` and ``/detokenize`` are always served).

SIGTERM (or Ctrl-C) stops it gracefully: it stops accepting connections, lets
the requests in flight finish for up to ``--shutdown-timeout`` seconds, aborts
the rest, and exits with status 0.
"""

from __future__ import annotations

import argparse
import logging
import re
import signal
import sys

_UNITS = {
    "": 1,
    "k": 2**10,
    "kib": 2**10,
    "m": 2**20,
    "mib": 2**20,
    "g": 2**30,
    "gib": 2**30,
}


def parse_memory(text: str) -> int | float:
    """``--kv-cache-memory``: ``"268435456"``, ``"256MiB"``, ``"1GiB"`` (bytes,
    an int) or ``"0.5"`` (a fraction of the GPU, a float)."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"expected bytes (e.g. 268435456, 256MiB, 1GiB) or a fraction, got {text!r}"
        )
    number = match.group(1)
    if unit == "" and "." in number:
        return float(number)
    return int(float(number) * _UNITS[unit])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pagedkv_lab.serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", help="offline name, Hugging Face name or local path")
    p.add_argument("--host", default="127.0.0.1", help="0.0.0.0: every interface")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--served-model-name", nargs="+", default=None,
        help="the name(s) clients use (default: MODEL)",
    )  # fmt: skip
    engine = p.add_argument_group("engine (pagedkv_lab.LLM)")
    engine.add_argument("--dtype", default="auto")
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument("--block-size", type=int, default=16)
    engine.add_argument("--kv-cache-memory", type=parse_memory, default=None)
    engine.add_argument("--max-num-seqs", type=int, default=256)
    engine.add_argument("--max-num-batched-tokens", type=int, default=None)
    engine.add_argument("--enable-prefix-caching", action="store_true")
    engine.add_argument(
        "--seed", type=int, default=0, help="sampling seed (vLLM's default 0)"
    )
    engine.add_argument("--device", default=None)
    engine.add_argument("--enforce-eager", action="store_true")
    engine.add_argument(
        "--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
        help="schedule each step before the last one's tokens are read "
        "(default: on with a GPU, off on a CPU; see EngineArgs.async_scheduling)",
    )  # fmt: skip
    server = p.add_argument_group("server")
    server.add_argument(
        "--max-waiting", type=int, default=None,
        help="answer 503 when this many requests wait for the engine (default: no bound)",
    )  # fmt: skip
    server.add_argument(
        "--shutdown-timeout", type=float, default=30.0,
        help="on SIGTERM, seconds to let requests in flight finish before aborting them",
    )  # fmt: skip
    server.add_argument(
        "--log-level", default="info",
        choices=["critical", "error", "warning", "info", "debug"],
    )  # fmt: skip
    server.add_argument("--disable-access-log", action="store_true")
    server.add_argument(
        "--enable-tokenizer-info-endpoint", action="store_true",
        help="answer GET /tokenizer_info (the tokenizer's settings and chat "
        "template), as vLLM's flag does; evaluation clients such as "
        "lm-evaluation-harness read the model's tokenizer there",
    )  # fmt: skip
    return p


def _exit_cleanly(signum, frame) -> None:
    """SIGTERM outside uvicorn's graceful shutdown (while loading, or the
    signal uvicorn raises again once it has shut down): exit with status 0."""
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> None:
    """Parse the command line, load the model, serve until SIGTERM."""
    args = build_parser().parse_args(argv)
    if args.max_waiting is not None and args.max_waiting < 1:
        raise SystemExit("--max-waiting must be at least 1")
    signal.signal(signal.SIGTERM, _exit_cleanly)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s"
    )
    import uvicorn

    from pagedkv_lab.llm import LLM
    from pagedkv_lab.serve.app import build_app

    try:
        llm = LLM(
            args.model,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            block_size=args.block_size,
            kv_cache_memory=args.kv_cache_memory,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=args.enable_prefix_caching,
            seed=args.seed,
            device=args.device,
            enforce_eager=args.enforce_eager,
            async_scheduling=args.async_scheduling,
        )
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    names = args.served_model_name or [args.model]
    bm = llm.block_manager
    logging.getLogger("pagedkv_lab.serve").info(
        "serving %s as %s: max_model_len %d, %d KV blocks of %d tokens, on %s",
        args.model, ", ".join(names), llm.max_model_len, bm.num_blocks,
        bm.block_size, next(llm.model.parameters()).device,
    )  # fmt: skip
    app = build_app(llm, names, args.max_waiting, args.enable_tokenizer_info_endpoint)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=not args.disable_access_log,
        timeout_graceful_shutdown=args.shutdown_timeout,
    )
    try:
        uvicorn.Server(config).run()
    except KeyboardInterrupt:
        pass
    sys.exit(0)


if __name__ == "__main__":
    main()
