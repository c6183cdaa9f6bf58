"""Benchmarks that compare side by side, in one run, on the machine at hand.

    python -m pagedkv_lab.bench kernel      # paged vs contiguous decode attention
    python -m pagedkv_lab.bench serve       # our engine vs transformers, one trace, one KV budget

Results are ratios measured in the same process, never absolute targets: a
laptop and an H100 give different times but comparable ratios.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F


@functools.cache
def _l2_flush_buffer(device: torch.device) -> torch.Tensor:
    """256 MiB to overwrite before each timed GPU call: larger than any L2 cache."""
    return torch.empty(256 * 2**20, dtype=torch.int8, device=device)


def time_calls(
    fns: dict[str, Callable[[], object]],
    device: torch.device,
    repeats: int = 20,
    warmup: int = 3,
) -> dict[str, float]:
    """Seconds per call of each function, timed in alternation.

    Every round calls each function once, so drift in the machine's load (other
    processes, clock changes) falls on all of them alike. On a GPU each call is
    timed with CUDA events after an L2 flush, as ``triton.testing.do_bench``
    does, and the median is returned. On a CPU calls are timed with
    ``perf_counter`` and the minimum is returned: other processes on a shared
    machine only ever add time (a thread of a parallel region that loses its
    core stalls the whole region), so the fastest round is the least disturbed.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    cuda = device.type == "cuda"
    for _ in range(repeats):
        for name, fn in fns.items():
            if cuda:
                _l2_flush_buffer(device).zero_()
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times[name].append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    pick = statistics.median if cuda else min
    return {name: pick(t) for name, t in times.items()}


def time_call(
    fn: Callable[[], object], device: torch.device, repeats: int = 20, warmup: int = 3
) -> float:
    """Seconds per call of one function (see `time_calls`)."""
    return time_calls({"fn": fn}, device, repeats, warmup)["fn"]


def _contiguous_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool
) -> torch.Tensor:
    return F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=gqa)[:, :, 0]


def _paged_copy(
    k: torch.Tensor, v: torch.Tensor, block_size: int, gen: torch.Generator
):
    """Scatter contiguous ``[seqs, kv_heads, ctx, D]`` K/V into shuffled blocks.

    Returns the two caches and the block tables (int32, as the engine builds them).
    """
    seqs, kv_heads, ctx, head_dim = k.shape
    per_seq = -(-ctx // block_size)
    num_blocks = seqs * per_seq
    order = torch.randperm(num_blocks, generator=gen)
    tables = order.reshape(seqs, per_seq).to(torch.int32)
    caches = []
    for x in (k, v):
        # [seqs, kv_heads, per_seq * block_size, D] -> blocks of block_size slots
        padded = F.pad(x, (0, 0, 0, per_seq * block_size - ctx))
        blocks = padded.reshape(seqs, kv_heads, per_seq, block_size, head_dim)
        blocks = blocks.permute(0, 2, 3, 1, 4).flatten(0, 1)
        cache = x.new_empty(num_blocks, block_size, kv_heads, head_dim)
        cache[tables.long().to(x.device).reshape(-1)] = blocks
        caches.append(cache)
    return caches[0], caches[1], tables.to(k.device)


def decode_path_name(device: torch.device, head_dim: int = 64) -> str:
    """Which kernel `paged_decode` runs on ``device`` (for tables and plots)."""
    from . import attention

    if device.type == "cuda" and attention.triton is not None:
        return "Triton kernel"
    if device.type == "cpu" and head_dim % 16 == 0 and attention.load_cpu_kernel():
        return "C++ kernel"
    return "PyTorch"


def kernel_benchmark(
    device: torch.device,
    batch_sizes=(1, 8, 32),
    context_lens=(128, 1024, 4096),
    *,
    heads: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    block_size: int = 16,
    dtype: torch.dtype | None = None,
    repeats: int = 10,
    seed: int = 0,
) -> list[dict]:
    """Decode attention over the same K/V, stored paged and contiguously.

    One row per (batch, context). Times, in alternation: contiguous SDPA;
    `paged_decode` as the engine calls it (``check=False``, a reused workspace,
    int32 tables, int64 lengths): the Triton kernel on CUDA, the C++ kernel on a
    CPU; and the PyTorch gather + SDPA path. On a CPU the grid is timed in three
    passes of ``repeats // 3`` rounds each and every time is the best of the
    passes, so that a burst of load from other processes spoils one pass of a
    row, not the row. On CUDA each row is timed once, on its own (the whole grid
    need not fit in GPU memory), and also reports the paged path's bandwidth
    against a device-to-device copy of the same bytes.
    """
    from .attention import paged_decode, paged_decode_torch

    cuda = device.type == "cuda"
    heads = heads or (32 if cuda else 8)
    kv_heads = kv_heads or (8 if cuda else 2)
    head_dim = head_dim or (128 if cuda else 64)
    dtype = dtype or (torch.float16 if cuda else torch.float32)
    path = decode_path_name(device, head_dim)
    gen = torch.Generator().manual_seed(seed)
    rows, calls = [], []
    for batch in batch_sizes:
        for ctx in context_lens:
            shape = (batch, kv_heads, ctx, head_dim)
            q = torch.randn(batch, heads, head_dim, generator=gen).to(device, dtype)
            k = torch.randn(shape, generator=gen).to(device, dtype)
            v = torch.randn(shape, generator=gen).to(device, dtype)
            k_cache, v_cache, tables = _paged_copy(k, v, block_size, gen)
            lens = torch.full((batch,), ctx, dtype=torch.int64, device=device)
            paged_args = (q, k_cache, v_cache, tables, lens)
            row_calls = {
                "contiguous": partial(_contiguous_decode, q, k, v, heads != kv_heads),
                "paged": partial(paged_decode, *paged_args, workspace={}, check=False),
                "torch": partial(
                    paged_decode_torch, *paged_args, workspace={}, check=False
                ),
            }
            expected = row_calls["contiguous"]().float()
            errors = {
                name: (row_calls[name]().float() - expected).abs().max().item()
                for name in ("paged", "torch")
            }
            row = {
                "batch": batch,
                "context_len": ctx,
                "path": path,
                "max_error": errors["paged"],
                "torch_max_error": errors["torch"],
                "kv_bytes": 2 * k.numel() * k.element_size(),
            }
            rows.append(row)
            if cuda:  # time this row now and free its tensors
                _fill_kernel_row(row, time_calls(row_calls, device, repeats))
                kv_bytes = row["kv_bytes"]
                src = torch.empty(kv_bytes, dtype=torch.uint8, device=device)
                dst = torch.empty_like(src)
                t_copy = time_call(partial(dst.copy_, src), device, repeats)
                row["copy_GBps"] = 2 * kv_bytes / t_copy / 1e9  # read + write
                row["fraction_of_copy"] = row["paged_GBps"] / row["copy_GBps"]
                del src, dst
            else:
                calls.append(row_calls)
            del k_cache, v_cache, k, v, paged_args
    best: list[dict] = [{} for _ in calls]
    for _ in range(3 if calls else 0):
        for b, row_calls in zip(best, calls):
            t = time_calls(row_calls, device, max(1, repeats // 3))
            b.update({n: min(b.get(n, math.inf), x) for n, x in t.items()})
    for row, t in zip(rows, best):
        _fill_kernel_row(row, t)
    return rows


def _fill_kernel_row(row: dict, t: dict) -> None:
    """Add one `kernel_benchmark` row's times (seconds, by name) and ratios."""
    row.update(
        contiguous_ms=t["contiguous"] * 1e3,
        paged_ms=t["paged"] * 1e3,
        torch_ms=t["torch"] * 1e3,
        paged_over_contiguous=t["paged"] / t["contiguous"],
        torch_over_contiguous=t["torch"] / t["contiguous"],
        paged_GBps=row["kv_bytes"] / t["paged"] / 1e9,
    )


def print_kernel_table(rows: list[dict]) -> None:
    """Print `kernel_benchmark` rows as one table (one print call)."""
    has_copy = "copy_GBps" in rows[0]
    lines = [
        f"paged = {rows[0]['path']}, torch = PyTorch gather + SDPA; "
        "ratios: time / contiguous SDPA's",
        f"{'batch':>5} {'context':>7} {'contig ms':>10} {'paged ms':>9} "
        f"{'paged/contig':>12} {'torch/contig':>12}"
        + (f" {'paged GB/s':>10} {'of copy':>7}" if has_copy else ""),
    ]
    for r in rows:
        line = (
            f"{r['batch']:5} {r['context_len']:7} {r['contiguous_ms']:10.3f} "
            f"{r['paged_ms']:9.3f} {r['paged_over_contiguous']:12.2f} "
            f"{r['torch_over_contiguous']:12.2f}"
        )
        if has_copy:
            line += f" {r['paged_GBps']:10.1f} {r['fraction_of_copy']:7.0%}"
        lines.append(line)
    print("\n".join(lines))


# ----------------------------------------------------------------------------------------------------------
# Serving: our engine against transformers, same model, same trace, same KV budget.

SYSTEMS = ("pagedkv", "contiguous", "hf-generate", "hf-continuous")


def scaled_chat_trace(num_requests: int, max_model_len: int, seed: int = 0) -> list:
    """W1 with lengths scaled to ``max_model_len`` (means 161 and 338 at 2048, proportionally less below)."""
    from .workloads import SHAREGPT_MEAN_OUTPUT, SHAREGPT_MEAN_PROMPT, chat_workload

    f = max_model_len / 2048
    return chat_workload(
        num_requests,
        seed=seed,
        max_model_len=max_model_len,
        mean_prompt=SHAREGPT_MEAN_PROMPT * f,
        mean_output=SHAREGPT_MEAN_OUTPUT * f,
    )


def _prompt_ids(requests, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        [1] + torch.randint(3, 259, (r.prompt_len - 1,), generator=g).tolist()
        for r in requests
    ]


def _summary(
    name: str,
    wall: float,
    out_tokens: int,
    n: int,
    ttft: list[float] | None,
    tpot: list[float] | None,
    peak_kv_bytes: int,
) -> dict:
    def pct(xs, q):
        return float(torch.tensor(xs).quantile(q)) if xs else float("nan")

    return {
        "system": name,
        "seconds": wall,
        "output_tok_per_s": out_tokens / wall,
        "req_per_s": n / wall,
        "ttft_p50": pct(ttft, 0.5),
        "ttft_p90": pct(ttft, 0.9),
        "tpot_p50": pct(tpot, 0.5),
        "tpot_p90": pct(tpot, 0.9),
        "peak_kv_MiB": peak_kv_bytes / 2**20,
        "output_tokens": out_tokens,
    }


def _run_ours(
    model_name,
    requests,
    prompts,
    device,
    budget_bytes,
    block_size,
    max_model_len,
    reserve,
    max_num_seqs,
):
    from .engine import SamplingParams
    from .kvmath import KVSpec
    from .llm import LLM

    llm = LLM(
        model_name,
        block_size=block_size,
        kv_cache_memory=budget_bytes,
        max_model_len=max_model_len,
        device=device,
        reserve_max_len=reserve,
        max_num_seqs=max_num_seqs,
    )
    params = [
        SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
        for r in requests
    ]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    llm.stats.peak_blocks_used = 0
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    bytes_per_block = (
        KVSpec.from_config(llm.model.config, llm.model.dtype).bytes_per_token
        * block_size
    )
    name = "contiguous" if reserve else "pagedkv"
    return _summary(
        name,
        wall,
        sum(len(o.token_ids) for o in outs),
        len(outs),
        [o.metrics.time_to_first_token for o in outs],
        [o.metrics.time_per_output_token for o in outs],
        llm.stats.peak_blocks_used * bytes_per_block,
    ), outs


def _run_hf_static(model_name, requests, prompts, device, batch_size):
    from .kvmath import KVSpec
    from .models import load_model

    model, tok = load_model(model_name, device=device)
    spec = KVSpec.from_config(model.config, model.dtype)
    outputs, peak = [], 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            batch, reqs = prompts[i : i + batch_size], requests[i : i + batch_size]
            width = max(map(len, batch))
            ids = torch.tensor(
                [[0] * (width - len(p)) + p for p in batch], device=device
            )
            mask = torch.tensor(
                [[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device
            )
            new = max(
                r.output_len for r in reqs
            )  # a static batch runs until its longest request is done
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            peak = max(peak, spec.bytes_for(len(batch) * (width + new - 1)))
            outputs += [
                out[j, width : width + r.output_len].tolist()
                for j, r in enumerate(reqs)
            ]
    wall = time.perf_counter() - t0
    return _summary(
        "hf-generate", wall, sum(map(len, outputs)), len(outputs), None, None, peak
    ), outputs


def _run_hf_continuous(
    model_name, requests, prompts, device, budget_tokens, block_size
):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from .kvmath import KVSpec
    from .models import load_model

    model, _ = load_model(model_name, device=device)
    spec = KVSpec.from_config(model.config, model.dtype)
    gen = GenerationConfig(
        max_new_tokens=max(r.output_len for r in requests),
        do_sample=False,
        eos_token_id=-1,
        pad_token_id=0,
    )
    cb = ContinuousBatchingConfig(
        page_size=block_size,
        num_blocks=budget_tokens // block_size,
        max_batch_tokens=max(512, max(map(len, prompts))),
        allow_block_sharing=False,
    )
    manager = model.init_continuous_batching(gen, cb)
    manager.start()
    try:
        t0 = time.perf_counter()
        ids = {
            manager.add_request(
                p, max_new_tokens=r.output_len, record_timestamps=True
            ): i
            for i, (p, r) in enumerate(zip(prompts, requests))
        }
        results = {}
        while len(results) < len(ids):
            res = manager.get_result(timeout=60)
            if res is None:
                raise RuntimeError(
                    "transformers' continuous batching stopped before finishing every request"
                )
            if res.is_finished():
                results[ids[res.request_id]] = res
        wall = time.perf_counter() - t0
    finally:
        manager.stop(block=True)
    outputs = [results[i].generated_tokens for i in range(len(prompts))]
    ttft, tpot = [], []
    for res in results.values():
        stamps = res.timestamps or []
        if stamps:
            ttft.append(stamps[0] - res.created_time)
            tpot.append((stamps[-1] - stamps[0]) / max(1, len(stamps) - 1))
    return _summary(
        "hf-continuous",
        wall,
        sum(map(len, outputs)),
        len(outputs),
        ttft or None,
        tpot or None,
        spec.bytes_for(budget_tokens),
    ), outputs


def _kv_spec(model_name: str):
    """KV bytes per token of the model as `load_model` will load it (offline models in fp32)."""
    from transformers import AutoConfig

    from .kvmath import KVSpec
    from .models import OFFLINE_MODELS, offline_config

    if model_name in OFFLINE_MODELS:
        return KVSpec.from_config(offline_config(model_name), torch.float32)
    config = AutoConfig.from_pretrained(model_name)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype or torch.float32
    return KVSpec.from_config(config, dtype)


def serve_benchmark(
    model_name: str = "small-llama",
    requests=None,
    *,
    device: torch.device | None = None,
    max_model_len: int = 512,
    budget_requests: int = 8,
    block_size: int = 16,
    systems: tuple[str, ...] = SYSTEMS,
    max_num_seqs: int = 256,
) -> tuple[list[dict], dict]:
    """Serve the same requests with each system under one KV budget; return summary rows and outputs.

    The budget holds ``budget_requests`` requests of ``max_model_len`` tokens: exactly what static batching
    with max-length reservation can run at once.
    """
    from .device import pick_device

    device = device or pick_device()
    requests = (
        requests if requests is not None else scaled_chat_trace(64, max_model_len)
    )
    prompts = _prompt_ids(requests)
    spec = _kv_spec(model_name)
    budget_tokens = budget_requests * max_model_len
    rows, outputs = [], {}
    for system in systems:
        if system in ("pagedkv", "contiguous"):
            row, outs = _run_ours(
                model_name,
                requests,
                prompts,
                device,
                spec.bytes_for(budget_tokens),
                block_size,
                max_model_len,
                system == "contiguous",
                max_num_seqs,
            )
            outputs[system] = [o.token_ids for o in outs]
        elif system == "hf-generate":
            row, outputs[system] = _run_hf_static(
                model_name, requests, prompts, device, budget_requests
            )
        elif system == "hf-continuous":
            row, outputs[system] = _run_hf_continuous(
                model_name, requests, prompts, device, budget_tokens, block_size
            )
        else:
            raise ValueError(f"unknown system {system!r}; choose from {SYSTEMS}")
        rows.append(row)
    return rows, outputs


def print_serve_table(rows: list[dict]) -> None:
    """Print `serve_benchmark` rows, with throughput relative to the first row."""
    base = rows[0]["output_tok_per_s"]
    print(
        f"{'system':14} {'tok/s':>8} {'vs ' + rows[0]['system']:>15} {'req/s':>6} {'TTFT p50':>9} {'TTFT p90':>9} "
        f"{'TPOT p50':>9} {'TPOT p90':>9} {'peak KV MiB':>11}"
    )
    for r in rows:
        print(
            f"{r['system']:14} {r['output_tok_per_s']:8.1f} {r['output_tok_per_s'] / base:15.2f} "
            f"{r['req_per_s']:6.2f} {r['ttft_p50']:9.3f} {r['ttft_p90']:9.3f} {r['tpot_p50']:9.4f} "
            f"{r['tpot_p90']:9.4f} {r['peak_kv_MiB']:11.1f}"
        )


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
    kp.add_argument("--block-size", type=int, default=16)
    kp.add_argument("--repeats", type=int, default=15)
    kp.add_argument(
        "--threads", type=int, default=None, help="CPU threads (default: torch's)"
    )
    kp.add_argument("--device", default=None)
    sp = sub.add_parser(
        "serve", help="our engine vs transformers generate / continuous batching"
    )
    sp.add_argument(
        "--model", default=None, help="offline model name (default: small-llama)"
    )
    sp.add_argument(
        "--workload",
        choices=["w1", "w2", "fixed"],
        default="w1",
        help="w1 chat-like, w2 uniform 100-1024 (scaled), fixed: equal lengths at equal batch size",
    )
    sp.add_argument("--num-requests", type=int, default=None)
    sp.add_argument("--max-model-len", type=int, default=512)
    sp.add_argument(
        "--budget-requests",
        type=int,
        default=8,
        help="KV budget, in max-length requests",
    )
    sp.add_argument("--block-size", type=int, default=16)
    sp.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    sp.add_argument("--device", default=None)
    args = parser.parse_args(argv)

    from . import attention  # noqa: F401  (sets Triton's interpreter mode when there is no GPU)
    from .device import by_device, device_report, pick_device

    device = pick_device(args.device)
    print(" | ".join(f"{k} {v}" for k, v in device_report(device).items()))
    if args.command == "kernel":
        if args.threads:
            torch.set_num_threads(args.threads)
        print(f"{torch.get_num_threads()} CPU threads")
        batches = args.batch or by_device((1, 8, 32), (1, 8, 64, 256), device)
        contexts = args.context or by_device(
            (128, 1024, 4096), (128, 512, 1024, 4096), device
        )
        rows = kernel_benchmark(
            device, batches, contexts, block_size=args.block_size, repeats=args.repeats
        )
        print_kernel_table(rows)
        if device.type != "cuda":
            print("Kernel bandwidth against a plain copy needs a CUDA GPU.")
    elif args.command == "serve":
        from .workloads import Request, uniform_workload

        n = args.num_requests or by_device(48, 512, device)
        length = args.max_model_len
        max_num_seqs = 256
        if args.workload == "w1":
            requests = scaled_chat_trace(n, length)
        elif (
            args.workload == "w2"
        ):  # nano-vllm's 100-1024 range, scaled to max_model_len
            lo, hi = max(1, 100 * length // 2048), max(2, 1024 * length // 2048)
            requests = uniform_workload(n, low=lo, high=hi)
        else:  # equal lengths; our engine limited to the same batch size as static generate
            requests = [Request(i, 0.0, length // 2, length // 2) for i in range(n)]
            max_num_seqs = args.budget_requests
        model = args.model or "small-llama"
        print(
            f"model {model}, workload {args.workload}: {len(requests)} requests, "
            f"{sum(r.output_len for r in requests)} output tokens, max_model_len {length}, "
            f"KV budget {args.budget_requests} x {length} tokens, block size {args.block_size}"
        )
        rows, outputs = serve_benchmark(
            model,
            requests,
            device=device,
            max_model_len=length,
            budget_requests=args.budget_requests,
            block_size=args.block_size,
            systems=tuple(args.systems),
            max_num_seqs=max_num_seqs,
        )
        print_serve_table(rows)
        first = outputs[rows[0]["system"]]
        same = {k: sum(a == b for a, b in zip(v, first)) for k, v in outputs.items()}
        print(f"requests with tokens identical to {rows[0]['system']}'s: {same}")


if __name__ == "__main__":
    main()
