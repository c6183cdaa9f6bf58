"""Benchmarks that compare side by side, in one run, on the machine at hand.

    python -m pagedkv_lab.bench kernel      # paged vs contiguous decode attention

Results are ratios measured in the same process, never absolute targets: a
laptop and an H100 give different times but comparable ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F


def time_call(fn: Callable[[], object], device: torch.device, repeats: int = 20, warmup: int = 3) -> float:
    """Median seconds per call (CUDA events on a GPU, perf_counter on a CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _contiguous_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool) -> torch.Tensor:
    return F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=gqa)[:, :, 0]


def _paged_copy(k: torch.Tensor, v: torch.Tensor, block_size: int, gen: torch.Generator):
    """Scatter contiguous ``[seqs, kv_heads, ctx, D]`` K/V into shuffled blocks; return caches and tables."""
    seqs, kv_heads, ctx, head_dim = k.shape
    per_seq = -(-ctx // block_size)
    num_blocks = seqs * per_seq
    tables = torch.randperm(num_blocks, generator=gen).reshape(seqs, per_seq).to(torch.int32)
    caches = []
    for x in (k, v):
        padded = F.pad(x, (0, 0, 0, per_seq * block_size - ctx))  # [seqs, kvh, per_seq*bs, D]
        blocks = padded.reshape(seqs, kv_heads, per_seq, block_size, head_dim).permute(0, 2, 3, 1, 4)
        cache = torch.empty(num_blocks, block_size, kv_heads, head_dim, dtype=x.dtype, device=x.device)
        cache[tables.long().to(x.device).reshape(-1)] = blocks.reshape(-1, block_size, kv_heads, head_dim)
        caches.append(cache)
    return caches[0], caches[1], tables.to(k.device)


def kernel_benchmark(
    device: torch.device,
    batch_sizes=(1, 8, 32),
    context_lens=(256, 1024, 4096),
    *,
    heads: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    block_size: int = 16,
    dtype: torch.dtype | None = None,
    repeats: int = 10,
    seed: int = 0,
) -> list[dict]:
    """Decode attention over the same K/V, stored paged and contiguously; one row per (batch, context).

    On CUDA the paged path is the Triton kernel and each row also reports its
    achieved bandwidth against a device-to-device copy of the same bytes; on a
    CPU the paged path is PyTorch's gather + SDPA.
    """
    from .attention import paged_decode, paged_decode_torch

    cuda = device.type == "cuda"
    heads = heads or (32 if cuda else 8)
    kv_heads = kv_heads or (8 if cuda else 2)
    head_dim = head_dim or (128 if cuda else 64)
    dtype = dtype or (torch.float16 if cuda else torch.float32)
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for batch in batch_sizes:
        for ctx in context_lens:
            q = torch.randn(batch, heads, head_dim, generator=gen).to(device, dtype)
            k = torch.randn(batch, kv_heads, ctx, head_dim, generator=gen).to(device, dtype)
            v = torch.randn(batch, kv_heads, ctx, head_dim, generator=gen).to(device, dtype)
            k_cache, v_cache, tables = _paged_copy(k, v, block_size, gen)
            lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
            workspace: dict = {}
            gqa = heads != kv_heads
            contiguous = partial(_contiguous_decode, q, k, v, gqa)
            if cuda:
                paged = partial(paged_decode, q, k_cache, v_cache, tables, lens)
            else:
                paged = partial(paged_decode_torch, q, k_cache, v_cache, tables, lens, workspace=workspace)

            error = (paged().float() - contiguous().float()).abs().max().item()
            t_contig = time_call(contiguous, device, repeats)
            t_paged = time_call(paged, device, repeats)
            kv_bytes = 2 * k.numel() * k.element_size()
            row = {"batch": batch, "context_len": ctx, "contiguous_ms": t_contig * 1e3, "paged_ms": t_paged * 1e3,
                   "paged_over_contiguous": t_paged / t_contig, "max_error": error,
                   "paged_GBps": kv_bytes / t_paged / 1e9}
            if cuda:
                src = torch.empty(kv_bytes, dtype=torch.uint8, device=device)
                dst = torch.empty_like(src)
                t_copy = time_call(partial(dst.copy_, src), device, repeats)
                row["copy_GBps"] = 2 * kv_bytes / t_copy / 1e9  # read + write
                row["fraction_of_copy"] = row["paged_GBps"] / row["copy_GBps"]
            rows.append(row)
            del k_cache, v_cache, k, v
    return rows


def print_kernel_table(rows: list[dict]) -> None:
    """Print `kernel_benchmark` rows as a table."""
    has_copy = "copy_GBps" in rows[0]
    header = f"{'batch':>5} {'context':>7} {'contig ms':>10} {'paged ms':>9} {'paged/contig':>12} {'paged GB/s':>10}"
    print(header + (f" {'copy GB/s':>9} {'of copy':>7}" if has_copy else ""))
    for r in rows:
        line = (f"{r['batch']:5} {r['context_len']:7} {r['contiguous_ms']:10.3f} {r['paged_ms']:9.3f} "
                f"{r['paged_over_contiguous']:12.2f} {r['paged_GBps']:10.1f}")
        if has_copy:
            line += f" {r['copy_GBps']:9.1f} {r['fraction_of_copy']:7.0%}"
        print(line)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pagedkv_lab.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    kp = sub.add_parser("kernel", help="paged vs contiguous decode attention")
    kp.add_argument("--batch", type=int, nargs="+", help="batch sizes (default: by device)")
    kp.add_argument("--context", type=int, nargs="+", help="context lengths (default: by device)")
    kp.add_argument("--block-size", type=int, default=16)
    kp.add_argument("--repeats", type=int, default=10)
    kp.add_argument("--device", default=None)
    args = parser.parse_args(argv)

    from . import attention  # noqa: F401  (sets Triton's interpreter mode when there is no GPU)
    from .device import by_device, device_report, pick_device

    device = pick_device(args.device)
    print(" | ".join(f"{k} {v}" for k, v in device_report(device).items()))
    if args.command == "kernel":
        batches = args.batch or by_device((1, 8, 32), (1, 8, 64, 256), device)
        contexts = args.context or by_device((256, 1024, 4096), (128, 512, 1024, 4096), device)
        rows = kernel_benchmark(device, batches, contexts, block_size=args.block_size, repeats=args.repeats)
        print_kernel_table(rows)
        if device.type != "cuda":
            print("CPU run: the paged path is PyTorch gather + SDPA. Kernel bandwidth figures need a CUDA GPU.")


if __name__ == "__main__":
    main()
