"""`python -m pagedkv_lab.bench`: the kernel, serve, nanovllm, compile and all
commands."""

from __future__ import annotations

import argparse
import textwrap

import torch

from pagedkv_lab.bench.common import ALL_SYSTEMS, SYSTEMS, cpu_model, scaled_chat_trace
from pagedkv_lab.bench.compile import add_parser as add_compile_parser
from pagedkv_lab.bench.compile import compile_main
from pagedkv_lab.bench.kernel import kernel_benchmark, print_kernel_table
from pagedkv_lab.bench.online import add_online_parser, online_main
from pagedkv_lab.bench.peers import find_vllm_python
from pagedkv_lab.bench.serve import (
    plot_serve,
    print_serve_table,
    serve_benchmark,
    serve_title,
)


def _add_serve_parser(sub) -> None:
    sp = sub.add_parser(
        "serve",
        help="our engine vs transformers generate / continuous batching (and vLLM)",
    )
    sp.add_argument(
        "--model",
        default=None,
        help="model name (default: small-llama on a CPU, Qwen2.5-0.5B's shape on a GPU)",
    )
    sp.add_argument(
        "--workload",
        nargs="+",
        choices=["w1", "w2", "heavy", "fixed"],
        default=["w1"],
        help="w1 chat-like, w2 uniform 100-1024 (scaled), heavy: w1's heavy-tailed "
        "lengths at max_model_len 2048 (prompts and outputs of a few hundred "
        "tokens), fixed: equal lengths at equal batch size; several run one after "
        "another, with a summary table last",
    )
    sp.add_argument(
        "--num-requests", type=int, nargs="+", default=None,
        help="one count for every workload, or one per workload "
        "(default: 48 on a CPU, 512 on a GPU)",
    )  # fmt: skip
    sp.add_argument(
        "--max-model-len", type=int, default=None,
        help="default: 512 (2048 for the heavy workload)",
    )  # fmt: skip
    sp.add_argument(
        "--budget-requests",
        type=int,
        default=8,
        help="KV budget, in max-length requests",
    )
    sp.add_argument("--block-size", type=int, default=16)
    sp.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="per-step token budget of every continuous-batching system "
        "(default: max(512, max-model-len))",
    )
    sp.add_argument(
        "--static-policy",
        choices=["padded", "max-len"],
        default="padded",
        help="how hf-generate sizes its static batches from the KV budget",
    )
    sp.add_argument("--repeats", type=int, default=3, help="alternating rounds")
    sp.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for every system (default: torch's current count)",
    )
    sp.add_argument(
        "--systems",
        nargs="+",
        default=None,
        choices=ALL_SYSTEMS,
        help="default: every system, vllm where a vLLM python is found",
    )
    sp.add_argument(
        "--vllm-python",
        default=None,
        help="python of the environment with vLLM (or $PAGEDKV_VLLM_PYTHON)",
    )
    sp.add_argument("--vllm-block-sizes", type=int, nargs="+", default=[32, 64, 128])
    sp.add_argument(
        "--vllm-modes",
        nargs="+",
        choices=["eager", "compile"],
        default=["compile", "eager"],
        help="vLLM without torch.compile (eager) and/or with its default compile",
    )
    sp.add_argument("--plot", default=None, help="save the figure to this path")
    sp.add_argument("--device", default=None)


def _add_nanovllm_parser(sub) -> None:
    np_ = sub.add_parser(
        "nanovllm",
        help="nano-vllm's bench.py workload, as published (see bench/nanovllm.py)",
    )
    np_.add_argument("--model", default="Qwen3-0.6B",
                     help="Qwen3-0.6B (default) or Qwen2.5-0.5B: random weights at the "
                     "real shape; any other name load_model takes (small-llama on a CPU)")
    np_.add_argument("--num-requests", type=int, default=256)
    np_.add_argument("--max-input-len", type=int, default=1024)
    np_.add_argument("--max-output-len", type=int, default=1024)
    np_.add_argument("--min-len", type=int, default=100,
                     help="the shortest prompt and output drawn (nano-vllm: 100)")
    np_.add_argument("--temperature", type=float, default=0.6)
    np_.add_argument("--max-model-len", type=int, default=4096)
    np_.add_argument("--max-num-seqs", type=int, default=512)
    np_.add_argument("--max-num-batched-tokens", type=int, default=16384)
    np_.add_argument("--kv-cache-memory", type=float, default=None,
                     help="KV budget: bytes, or on a GPU a fraction of its memory "
                     "(default: 0.9 on a GPU, 256 MiB on a CPU)")
    np_.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    np_.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                     default=None, help="one step in flight (default: the engine's, "
                     "on with a GPU, off on a CPU)")
    np_.add_argument("--compare-async", action="store_true",
                     help="after the run, in this process: one untimed pass per mode, then one "
                     "step in flight against none in alternating rounds (--rounds)")
    np_.add_argument("--compare-greedy", action="store_true",
                     help="after the run, in this process: one untimed pass of each, then greedy "
                     "decoding against --temperature in alternating rounds (--rounds): "
                     "the sampler's share")
    np_.add_argument("--rounds", type=int, default=3,
                     help="rounds of each mode for --compare-async and --compare-greedy "
                     "(odd, at least 3)")
    np_.add_argument("--profile", nargs="?", const="", default=None, metavar="PATH",
                     help="after the timed run, profile 20 decode steps at full batch "
                     "with torch.profiler and write its table to PATH (default: "
                     "nanovllm-profile-MODEL.txt)")
    np_.add_argument("--no-peers", action="store_true",
                     help="skip transformers' continuous batching")
    np_.add_argument("--json", default=None, help="write the result to this file")
    np_.add_argument("--device", default=None)
    np_.add_argument("--threads", type=int, default=None)  # fmt: skip


def _nanovllm_main(args, device: torch.device) -> None:
    import json
    from pathlib import Path

    from pagedkv_lab.bench.nanovllm import nanovllm_benchmark, print_result

    if args.threads:
        torch.set_num_threads(args.threads)
    memory = args.kv_cache_memory
    if memory is not None and memory > 1:
        memory = int(memory)
    result = nanovllm_benchmark(
        args.model, device, num_requests=args.num_requests,
        max_input_len=args.max_input_len, max_output_len=args.max_output_len,
        min_len=args.min_len, temperature=args.temperature,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=memory,
        enforce_eager=args.enforce_eager, peers=not args.no_peers,
        async_scheduling=args.async_scheduling,
        compare_async=args.compare_async, compare_greedy=args.compare_greedy,
        rounds=args.rounds,
        profile=(args.profile or f"nanovllm-profile-{args.model.replace('/', '_')}.txt")
        if args.profile is not None else None,
    )  # fmt: skip
    print_result(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"results: {args.json}")


def _serve_main(args, device: torch.device) -> None:
    from pagedkv_lab.device import by_device

    counts = args.num_requests or [by_device(48, 512, device)]
    if len(counts) not in (1, len(args.workload)):
        raise SystemExit(
            f"--num-requests takes one count or one per workload "
            f"({len(args.workload)}), got {len(counts)}"
        )
    counts = counts * len(args.workload) if len(counts) == 1 else counts
    systems = args.systems
    if systems is None:
        systems = list(SYSTEMS)
        if find_vllm_python(args.vllm_python) is not None:
            systems.append("vllm")
        else:
            print("vllm: not found (set PAGEDKV_VLLM_PYTHON or --vllm-python); skipped")
    results = []
    for workload, n in zip(args.workload, counts):
        results.append(
            (workload, n, _serve_workload(args, device, workload, n, systems))
        )
    if len(results) > 1:
        print_workload_summary(results)


def print_workload_summary(results: list[tuple[str, int, list[dict]]]) -> None:
    """One line per workload: the first system's tok/s, every other system's
    ratio to it (the median over rounds, with the rounds' min-max), and whether
    every system's tokens matched the first's."""
    systems = list(dict.fromkeys(r["system"] for _, _, rows in results for r in rows))
    first, others = systems[0], systems[1:]
    width = max([18, *map(len, others)]) + 2
    print(
        f"\nsummary: {first} tok/s; the others as a ratio to it (min-max over rounds)"
    )
    head = f"{'workload':9}{'requests':>9}{first + ' tok/s':>15}"
    print(head + "".join(f"{s:>{width}}" for s in others) + "  tokens identical")
    for workload, n, rows in results:
        by_system = {r["system"]: r for r in rows}
        line = f"{workload:9}{n:9d}{by_system[first]['output_tok_per_s']:15.1f}"
        for s in others:
            r = by_system.get(s)
            cell = "-" if r is None else (
                f"{r['ratio']:.2f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})"
            )  # fmt: skip
            line += f"{cell:>{width}}"
        same = min(r.get("identical", 0) for r in rows)
        print(line + f"  {'all' if same == n else f'{same} of {n}':>16}")


def _serve_workload(
    args, device, workload: str, n: int, systems: list[str]
) -> list[dict]:
    """Run one workload of `bench serve` and print its table; return its rows."""
    from pagedkv_lab.sim.workloads import Request, uniform_workload

    length = args.max_model_len or (2048 if workload == "heavy" else 512)
    max_num_seqs = 256
    if workload in ("w1", "heavy"):
        requests = scaled_chat_trace(n, length)
    elif workload == "w2":  # nano-vllm's 100-1024 range, scaled to max_model_len
        lo, hi = max(1, 100 * length // 2048), max(2, 1024 * length // 2048)
        requests = uniform_workload(n, low=lo, high=hi)
    else:  # equal lengths; every system limited to the same batch size as static generate
        requests = [Request(i, 0.0, length // 2, length // 2) for i in range(n)]
        max_num_seqs = args.budget_requests
    # a 30M model is launch-bound on any GPU: a real shape there (random weights)
    model = args.model or ("Qwen2.5-0.5B" if device.type == "cuda" else "small-llama")
    print(
        f"\nmodel {model}, workload {workload}: {len(requests)} requests, "
        f"{sum(r.output_len for r in requests)} output tokens, max_model_len {length}, "
        f"KV budget {args.budget_requests} x {length} tokens, block size {args.block_size}, "
        f"max_num_seqs {max_num_seqs}, "
        f"max_num_batched_tokens {args.max_num_batched_tokens or max(512, length)}"
    )
    from pagedkv_lab.bench.common import _prompt_ids
    from pagedkv_lab.bench.report import judge_outputs

    prompts = _prompt_ids(requests)
    rows, outputs = serve_benchmark(
        model,
        requests,
        prompts=prompts,
        device=device,
        max_model_len=length,
        budget_requests=args.budget_requests,
        block_size=args.block_size,
        systems=tuple(systems),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        repeats=args.repeats,
        threads=args.threads,
        static_policy=args.static_policy,
        vllm_python=args.vllm_python,
        vllm_block_sizes_to_try=tuple(args.vllm_block_sizes),
        vllm_modes=tuple(args.vllm_modes),
    )
    title = serve_title(rows) + f", workload {workload} ({len(requests)} requests)"
    print_serve_table(rows, title)
    startup = "; ".join(f"{r['system']} {r['startup_s']:.1f}" for r in rows)
    print(textwrap.fill(f"startup s (load, pack or compile, warm-up; not in "
                        f"tok/s): {startup}", 88))  # fmt: skip
    # identical in float32; in 16 bits every position against float32 (bench.compare)
    judged = judge_outputs(outputs, [r.output_len for r in requests], prompts, model, device)
    print(f"tokens against {rows[0]['system']}'s:")
    for r in rows:
        agree = judged[r["system"]]
        r["identical"], r["sound"] = agree.identical, agree.sound
        print(textwrap.fill(f"{r['system']}: {agree.summary()}", 88, subsequent_indent="  "))
    if args.plot:
        plot = args.plot
        if len(args.workload) > 1:  # one figure per workload
            stem, dot, ext = plot.rpartition(".")
            plot = f"{stem}-{workload}.{ext}" if dot else f"{plot}-{workload}"
        plot_serve(rows, title, plot)
        print(f"figure: {plot}")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m pagedkv_lab.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    kp = sub.add_parser("kernel", help="paged vs contiguous decode attention")
    kp.add_argument(
        "--batch", type=int, nargs="+", help="batch sizes (default: by device)"
    )
    kp.add_argument(
        "--context", type=int, nargs="+", help="context lengths (default: by device)"
    )
    kp.add_argument(
        "--block-size",
        type=int,
        nargs="+",
        default=None,
        help="block sizes (default: 16 on a CPU; 16 and 32 on a GPU)",
    )
    kp.add_argument(
        "--dtype",
        nargs="+",
        default=None,
        help="float32 float16 bfloat16 (default: float32 on a CPU; float16 and bfloat16 on a GPU)",
    )
    kp.add_argument("--repeats", type=int, default=15)
    kp.add_argument(
        "--threads", type=int, default=None, help="CPU threads (default: torch's)"
    )
    kp.add_argument("--device", default=None)
    _add_serve_parser(sub)
    add_online_parser(sub)
    _add_nanovllm_parser(sub)
    ap = sub.add_parser(
        "all", help="every benchmark, written to a report folder (see report.py)"
    )
    ap.add_argument("--out", default="report", help="report folder (default: report/)")
    ap.add_argument(
        "--sections",
        nargs="+",
        default=None,
        help="kernel serve sampling rate blocks (default: all)",
    )
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default=None)
    add_compile_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "compile":  # before the kernels are defined (see compile.py)
        compile_main(args)
        return

    from pagedkv_lab import kernels  # noqa: F401  (chooses Triton's mode: see its docstring)
    from pagedkv_lab.device import by_device, device_report, pick_device

    device = pick_device(args.device)
    print(" | ".join(f"{k} {v}" for k, v in device_report(device).items()))
    print(f"cpu model: {cpu_model()}")
    if args.command == "kernel":
        if args.threads:
            torch.set_num_threads(args.threads)
        print(f"{torch.get_num_threads()} CPU threads")
        batches = args.batch or by_device((1, 8, 32), (1, 8, 64, 256), device)
        contexts = args.context or by_device(
            (128, 1024, 4096), (512, 1024, 4096, 16384), device
        )
        block_sizes = args.block_size or by_device((16,), (16, 32), device)
        dtypes = (
            [getattr(torch, d) for d in args.dtype]
            if args.dtype
            else by_device((torch.float32,), (torch.float16, torch.bfloat16), device)
        )
        for dtype in dtypes:
            for block_size in block_sizes:
                print(f"\nblock size {block_size}")
                rows = kernel_benchmark(
                    device, batches, contexts, block_size=block_size,
                    dtype=dtype, repeats=args.repeats,
                )  # fmt: skip
                print_kernel_table(rows)
        if device.type != "cuda":
            print("Kernel bandwidth against a plain copy needs a CUDA GPU.")
    elif args.command == "serve":
        _serve_main(args, device)
    elif args.command == "online":
        online_main(args)
    elif args.command == "nanovllm":
        _nanovllm_main(args, device)
    elif args.command == "all":
        import sys

        from pagedkv_lab.bench.report import SECTIONS, run_all

        if args.threads:
            torch.set_num_threads(args.threads)
        run_all(
            args.out,
            device,
            sections=tuple(args.sections or SECTIONS),
            vllm_python=args.vllm_python,
            command="python -m pagedkv_lab.bench " + " ".join(sys.argv[1:]),
            quick=args.quick,
        )
        print(f"report: {args.out}/report.md")
