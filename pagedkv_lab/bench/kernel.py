"""Decode attention, paged against contiguous over the same K/V: the kernel
benchmark (`python -m pagedkv_lab.bench kernel`) and its tables."""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F

from .timing import time_call, time_calls


def _contiguous_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool
) -> torch.Tensor:
    return F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=gqa)[:, :, 0]


def _paged_copy(
    k: torch.Tensor,
    v: torch.Tensor,
    block_size: int,
    gen: torch.Generator,
    shuffle: bool = True,
):
    """Scatter contiguous ``[seqs, kv_heads, ctx, D]`` K/V into shuffled blocks
    (with ``shuffle=False``, into blocks in order, each sequence's in a row).

    Returns the two caches and the block tables (int32, as the engine builds them).
    """
    seqs, kv_heads, ctx, head_dim = k.shape
    per_seq = -(-ctx // block_size)
    num_blocks = seqs * per_seq
    if shuffle:
        order = torch.randperm(num_blocks, generator=gen)
    else:
        order = torch.arange(num_blocks)
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


def random_normal(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    gen: torch.Generator,
) -> torch.Tensor:
    """Standard normal values in ``dtype`` on ``device``, drawn where ``gen``
    lives: with a GPU generator on the GPU itself (a benchmark row's gigabytes
    of K/V drawn on the host took longer than timing the row), with a CPU one
    in fp32 on the host, then cast and moved."""
    if gen.device.type == "cuda":
        return torch.randn(shape, generator=gen, device=gen.device, dtype=dtype)
    return torch.randn(shape, generator=gen).to(device, dtype)


def decode_path_name(device: torch.device, head_dim: int = 64) -> str:
    """Which kernel `paged_decode` runs on ``device`` (for tables and plots)."""
    from .. import attention

    if device.type == "cuda" and attention.triton is not None:
        return "Triton kernel"
    if device.type == "cpu" and head_dim % 16 == 0 and attention.load_cpu_kernel():
        return "C++ kernel"
    return "PyTorch"


#: The share of a GPU's memory one kernel-benchmark row may hold at its peak.
ROW_MEMORY_FRACTION = 0.5
#: No row over this much K/V even on a large card: the H100 report's rows.
ROW_KV_CAP = 4 << 30


def row_peak_bytes(kv_bytes: int, in_order: bool = False) -> int:
    """What one row holds at once: its K/V contiguous, paged, gathered by the
    PyTorch path, and as the source and destination of the bandwidth copy (and
    paged in order with ``in_order``)."""
    return kv_bytes * (6 if in_order else 5)


def max_row_kv_bytes(device, in_order: bool = False) -> int | None:
    """The largest K/V a row may have on ``device`` (a `torch.device` or a
    `GPUSpec`): its peak under `ROW_MEMORY_FRACTION` of the card's memory, and
    at most `ROW_KV_CAP`; None (no cap) on a CPU."""
    from ..device import memory_budget

    budget = memory_budget(device, ROW_MEMORY_FRACTION)
    if budget is None:
        return None
    return min(ROW_KV_CAP, budget // row_peak_bytes(1, in_order))


GRAPHED_CALLS = ("contiguous", "paged", "paged_in_order", "first_triton")


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
    max_kv_bytes: int | None = None,
    in_order: bool = False,
) -> list[dict]:
    """Decode attention over the same K/V, stored paged and contiguously.

    One row per (batch, context). Times, in alternation: contiguous SDPA;
    `paged_decode` as the engine calls it (``check=False``, a reused workspace,
    int32 tables, int64 lengths): the Triton kernel on CUDA, the C++ kernel on a
    CPU; and the PyTorch gather + SDPA path. On CUDA, contiguous SDPA, the
    paged kernel and the first Triton kernel (the rung below) are timed as
    CUDA-graph replays, as a graphed decode step runs them; the PyTorch path,
    which reads lengths back to the host, as launched. On a CPU the grid is timed in three
    passes of ``repeats // 3`` rounds each and every time is the best of the
    passes, so that a burst of load from other processes spoils one pass of a
    row, not the row. On CUDA each row is timed once, on its own (the whole grid
    need not fit in GPU memory), and also reports the paged path's bandwidth
    against a device-to-device copy of the same bytes.

    With ``in_order`` the paged kernel is also timed over a third copy of the
    K/V whose blocks lie in order, each sequence's in a row: the same kernel
    and the same tables' indirection, with only the scattering of blocks
    removed (``shuffled_over_in_order``: what scattered blocks cost the kernel).

    A row holds its K/V five times at once (`row_peak_bytes`: contiguous,
    paged, the PyTorch path's gather, and a copy's source and destination; six
    with ``in_order``), so rows whose K/V exceed ``max_kv_bytes`` (default:
    `max_row_kv_bytes`, a peak under half the card's memory and at most 4 GiB of
    K/V; no cap on a CPU) are left out rather than run out of device memory.
    """
    from ..attention import paged_decode, paged_decode_torch, paged_decode_triton

    cuda = device.type == "cuda"
    heads = heads or (32 if cuda else 8)
    kv_heads = kv_heads or (8 if cuda else 2)
    head_dim = head_dim or (128 if cuda else 64)
    dtype = dtype or (torch.float16 if cuda else torch.float32)
    path = decode_path_name(device, head_dim)
    if max_kv_bytes is None:
        max_kv_bytes = max_row_kv_bytes(device, in_order)
    gen = torch.Generator().manual_seed(seed)
    draw_gen = torch.Generator(device).manual_seed(seed) if cuda else gen

    def draw(*shape: int) -> torch.Tensor:
        return random_normal(shape, dtype, device, draw_gen)

    rows, calls = [], []
    for batch in batch_sizes:
        for ctx in context_lens:
            shape = (batch, kv_heads, ctx, head_dim)
            if max_kv_bytes and 2 * math.prod(shape) * dtype.itemsize > max_kv_bytes:
                continue
            q, k, v = draw(batch, heads, head_dim), draw(*shape), draw(*shape)
            k_cache, v_cache, tables = _paged_copy(k, v, block_size, gen)
            lens = torch.full((batch,), ctx, dtype=torch.int64, device=device)
            paged_args = (q, k_cache, v_cache, tables, lens)
            if in_order:
                ordered = _paged_copy(k, v, block_size, gen, shuffle=False)
            row_calls = {
                "contiguous": partial(_contiguous_decode, q, k, v, heads != kv_heads),
                "paged": partial(paged_decode, *paged_args, workspace={}, check=False),
                "torch": partial(
                    paged_decode_torch, *paged_args, workspace={}, check=False
                ),
            }
            if in_order:
                row_calls["paged_in_order"] = partial(
                    paged_decode, q, *ordered, lens, workspace={}, check=False
                )
            if cuda:  # the rung below the tiled kernel: one program per sequence
                row_calls["first_triton"] = partial(
                    paged_decode_triton, *paged_args, check=False
                )
            expected = row_calls["contiguous"]().float()
            errors = {
                name: (call().float() - expected).abs().max().item()
                for name, call in row_calls.items()
                if name != "contiguous"
            }
            row = {
                "batch": batch,
                "context_len": ctx,
                "path": path,
                "dtype": dtype,
                "max_error": max(errors[n] for n in errors if n != "torch"),
                "torch_max_error": errors["torch"],
                "kv_bytes": 2 * k.numel() * k.element_size(),
            }
            rows.append(row)
            if cuda:  # time this row now and free its tensors
                # the kernels as a graphed decode step runs them: replays (the
                # PyTorch path reads lengths back to the host and cannot be captured)
                t = time_calls(row_calls, device, repeats, graphs=GRAPHED_CALLS)
                _fill_kernel_row(row, t)
                kv_bytes = row["kv_bytes"]
                src = torch.empty(kv_bytes, dtype=torch.uint8, device=device)
                dst = torch.empty_like(src)
                t_copy = time_call(partial(dst.copy_, src), device, repeats)
                row["copy_GBps"] = 2 * kv_bytes / t_copy / 1e9  # read + write
                row["fraction_of_copy"] = row["paged_GBps"] / row["copy_GBps"]
                del src, dst
            else:
                calls.append(row_calls)
            # on CUDA nothing of this row outlives it (the next row's tensors may be larger)
            del k_cache, v_cache, k, v, q, paged_args, row_calls
            ordered = None
            if cuda:
                torch.cuda.empty_cache()
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
    if "paged_in_order" in t:
        row.update(
            in_order_ms=t["paged_in_order"] * 1e3,
            shuffled_over_in_order=t["paged"] / t["paged_in_order"],
        )
    if "first_triton" in t:
        row.update(
            first_triton_ms=t["first_triton"] * 1e3,
            first_triton_over_contiguous=t["first_triton"] / t["contiguous"],
        )


def print_kernel_table(rows: list[dict]) -> None:
    """Print `kernel_benchmark` rows as one table (one print call)."""
    has_copy = "copy_GBps" in rows[0]
    has_first = "first_triton_ms" in rows[0]
    has_order = "in_order_ms" in rows[0]
    lines = [
        f"paged = {rows[0]['path']}, torch = PyTorch gather + SDPA"
        + (", first = the first Triton kernel" if has_first else ""),
        f"{str(rows[0]['dtype']).removeprefix('torch.')}; "
        "ratios: time / contiguous SDPA's",
        f"{'batch':>5} {'context':>7} {'contig ms':>10} {'paged ms':>9} "
        f"{'paged/contig':>12} {'torch/contig':>12}"
        + (f" {'first/contig':>12}" if has_first else "")
        + (f" {'paged/in order':>14}" if has_order else "")
        + (f" {'paged GB/s':>10} {'of copy':>7}" if has_copy else ""),
    ]
    if has_order:
        lines.insert(1, "paged/in order = the paged kernel over the same blocks laid out in order")
    for r in rows:
        line = (
            f"{r['batch']:5} {r['context_len']:7} {r['contiguous_ms']:10.3f} "
            f"{r['paged_ms']:9.3f} {r['paged_over_contiguous']:12.2f} "
            f"{r['torch_over_contiguous']:12.2f}"
        )
        if has_first:
            line += f" {r['first_triton_over_contiguous']:12.2f}"
        if has_order:
            line += f" {r['shuffled_over_in_order']:14.2f}"
        if has_copy:
            line += f" {r['paged_GBps']:10.1f} {r['fraction_of_copy']:7.0%}"
        lines.append(line)
    print("\n".join(lines))


def parse_kernel_tables(text: str) -> list[dict]:
    """The rows of the GPU tables `print_kernel_table` printed into ``text`` (a
    log of ``scripts/kernel_ladder.py``), each with the ``dtype`` and
    ``block_size`` of the ``"<dtype>, block size <n>"`` line above its table;
    for reading a committed report back."""
    rows, dtype, block_size = [], None, None
    for line in text.splitlines():
        words = line.split()
        if len(words) == 4 and words[1:3] == ["block", "size"]:
            dtype, block_size = words[0].rstrip(","), int(words[3])
            continue
        if len(words) != 9 or not words[0].isdigit() or not words[8].endswith("%"):
            continue
        rows.append({
            "dtype": dtype, "block_size": block_size,
            "batch": int(words[0]), "context_len": int(words[1]),
            "contiguous_ms": float(words[2]), "paged_ms": float(words[3]),
            "paged_over_contiguous": float(words[4]),
            "torch_over_contiguous": float(words[5]),
            "first_triton_over_contiguous": float(words[6]),
            "paged_GBps": float(words[7]),
            "fraction_of_copy": float(words[8][:-1]) / 100,
        })  # fmt: skip
    return rows
