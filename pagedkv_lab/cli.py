"""The ``pagedkv-lab`` command: ``pagedkv-lab serve MODEL ...`` and ``pagedkv-lab bench ...``.

``serve`` is ``python -m pagedkv_lab.serve`` (it needs the ``serve`` extra);
``bench`` is ``python -m pagedkv_lab.bench``.
"""

from __future__ import annotations

import sys

USAGE = """usage: pagedkv-lab {serve,bench} ...

  serve MODEL [options]   serve MODEL over HTTP with OpenAI's API (python -m pagedkv_lab.serve)
  bench {kernel,serve,online,all} ...   benchmarks (python -m pagedkv_lab.bench)

`pagedkv-lab serve --help` and `pagedkv-lab bench --help` list the options."""


def main(argv: list[str] | None = None) -> None:
    """Dispatch to the subcommand's own command line."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return
    command, rest = argv[0], argv[1:]
    if command == "serve":
        from pagedkv_lab.serve.__main__ import main as serve

        serve(rest)
    elif command == "bench":
        from pagedkv_lab.bench.cli import main as bench

        bench(rest)
    else:
        raise SystemExit(f"unknown command {command!r}\n{USAGE}")


if __name__ == "__main__":
    main()
