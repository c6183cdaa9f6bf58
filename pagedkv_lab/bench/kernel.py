"""Decode attention, paged against contiguous over the same K/V: the kernel
benchmark (`python -m pagedkv_lab.bench kernel`) and its tables."""

from __future__ import annotations

import contextlib
import json
import math
import re
from functools import partial

import torch
import torch.nn.functional as F

from pagedkv_lab.bench.timing import time_call, time_calls


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
    """Which kernel `kernels.paged_attention` runs on ``device`` (for tables and plots)."""
    from pagedkv_lab.kernels import cpu, triton_tiled

    if device.type == "cuda" and triton_tiled.triton is not None:
        return "Triton kernel"
    if device.type == "cpu" and head_dim % 16 == 0 and cpu.load_cpu_kernel():
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
    from pagedkv_lab.device import memory_budget

    budget = memory_budget(device, ROW_MEMORY_FRACTION)
    if budget is None:
        return None
    return min(ROW_KV_CAP, budget // row_peak_bytes(1, in_order))


GRAPHED_CALLS = ("contiguous", "paged", "paged_in_order", "first_triton")


#: The largest difference from contiguous SDPA a paged path may show, by the
#: storage type of its K/V: about two units in the last place of that type for
#: outputs of order one (the GPU tests' tolerance; chapters 10 and 11 assert it).
ERROR_BOUND = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 1.6e-2}


def within_error_bound(rows: list[dict]) -> bool:
    """Whether every `kernel_benchmark` row's paged paths (the kernel, and the
    PyTorch path) agree with contiguous SDPA within `ERROR_BOUND` for the row's
    dtype (a ``torch.dtype`` or its name)."""
    def bound(row: dict) -> float:
        return ERROR_BOUND[str(row["dtype"]).removeprefix("torch.")]

    return all(max(r["max_error"], r["torch_max_error"]) < bound(r) for r in rows)


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
    `kernels.paged_attention` as the engine calls it (``check=False``, a reused
    workspace, int32 tables, int64 lengths): the Triton kernel on CUDA, the C++
    kernel on a CPU; and the PyTorch gather + SDPA path. On CUDA, contiguous SDPA, the
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
    from pagedkv_lab.kernels import AttentionMetadata, paged_attention
    from pagedkv_lab.kernels.reference import paged_attention_torch
    from pagedkv_lab.kernels.triton_decode import paged_attention_triton

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
            paged_args = (q, k_cache, v_cache, AttentionMetadata(tables, lens))
            if in_order:
                ordered = _paged_copy(k, v, block_size, gen, shuffle=False)
            row_calls = {
                "contiguous": partial(_contiguous_decode, q, k, v, heads != kv_heads),
                "paged": partial(paged_attention, *paged_args, check=False),
                "torch": partial(paged_attention_torch, *paged_args, check=False),
            }
            if in_order:
                in_order_meta = AttentionMetadata(ordered[2], lens)
                row_calls["paged_in_order"] = partial(
                    paged_attention, q, *ordered[:2], in_order_meta, check=False
                )
            if cuda:  # the rung below the tiled kernel: one program per sequence
                row_calls["first_triton"] = partial(
                    paged_attention_triton, *paged_args, check=False
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
        + ("ratios: time / contiguous SDPA's, except paged/in order"
           if has_order else "ratios: time / contiguous SDPA's"),
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


# ---- the ladders: every rung of chapters 04c and 04d at fixed shapes -------

#: Decode shapes (batch, context) every rung is timed at: a small batch whose
#: programs are few (segments and the merge matter), a long context, a batch
#: that fills an H100 with segments, and one that fills it without.
LADDER_DECODE_SHAPES = ((8, 1024), (8, 16384), (64, 4096), (256, 4096))
#: Prefill steps of 4,096 prompt tokens split three ways (prompts x tokens).
LADDER_PREFILL_SHAPES = ((4, 1024), (16, 256), (2, 2048))
#: Llama-3-8B's attention heads (query heads, KV heads, head_dim): the report's.
LADDER_HEADS = (32, 8, 128)


def _rung_row(index: int, rung, kind: str) -> dict:
    return {"kind": kind, "rung": index, "name": rung.name, "change": rung.change,
            "prediction": rung.predicts, "traffic": rung.traffic,
            "kernel": rung.kernel}  # fmt: skip


#: The Triton kernels of `pagedkv_lab.kernels` whose compiled form a rung reports,
#: by the module that launches them.
_KERNELS = {"triton_tiled": ("_tiled_attention_kernel", "_merge_segments_kernel"),
            "triton_decode": ("_paged_decode_kernel",)}  # fmt: skip


@contextlib.contextmanager
def recorded_launches():
    """The Triton launches `pagedkv_lab.kernels` makes inside the block, as
    ``(kernel name, compiled kernel)`` pairs (None in the interpreter, which
    compiles nothing): each launch returns Triton's `CompiledKernel`."""
    import importlib

    seen: list[tuple[str, object]] = []
    modules = {m: importlib.import_module(f"pagedkv_lab.kernels.{m}") for m in _KERNELS}
    saved = {(m, name): getattr(modules[m], name)
             for m, names in _KERNELS.items() for name in names
             if hasattr(modules[m], name)}  # fmt: skip

    class Recorded:
        def __init__(self, name, fn):
            self.name, self.fn = name, fn

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                compiled = self.fn[grid](*args, **kwargs)
                seen.append((self.name, compiled))
                return compiled

            return launch

    try:
        for (module, name), fn in saved.items():
            setattr(modules[module], name, Recorded(name, fn))
        yield seen
    finally:
        for (module, name), fn in saved.items():
            setattr(modules[module], name, fn)


def compiled_resources(compiled) -> dict:
    """Registers a thread, spilled 32-bit words a thread and shared memory (bytes)
    of a compiled Triton kernel (`CompiledKernel.n_regs`, ``n_spills``,
    ``metadata.shared``, filled when the kernel is loaded), with its warps and
    stages; ``{}`` for the interpreter's None."""
    if compiled is None:
        return {}
    meta = compiled.metadata
    return {"n_regs": getattr(compiled, "n_regs", None),
            "n_spills": getattr(compiled, "n_spills", None),
            "shared": getattr(meta, "shared", None),
            "num_warps": getattr(meta, "num_warps", None),
            "num_stages": getattr(meta, "num_stages", None)}  # fmt: skip


def _time_rungs(rows: dict, calls: dict, device, repeats: int, warmup: int = 3) -> dict:
    """Time ``calls`` (a baseline, then one call per rung row) side by side: on a
    GPU the PyTorch rungs, which read lengths back to the host, as launched and
    every other call as CUDA-graph replays. A rung that raises (a variant that
    does not compile on this card) gets its error in its row; the rest run.
    Each rung's first call records its attention kernel's compiled resources
    (``resources``: `compiled_resources`; ``{}`` in the interpreter)."""
    ok = {}
    for name, call in calls.items():
        try:
            with recorded_launches() as seen:
                call()
            ok[name] = call
        except Exception as err:
            if name not in rows:
                raise
            rows[name]["error"] = f"{type(err).__name__}: {err}"[:300]
            continue
        if name in rows:
            main = [c for n, c in seen if n != "_merge_segments_kernel"]
            rows[name]["resources"] = compiled_resources(main[0] if main else None)
            rows[name]["launches"] = len(seen)
    cuda = device.type == "cuda"
    graphs = [n for n in ok if n not in rows or rows[n]["kernel"] != "torch"]
    for name, row in rows.items():
        row["timed"] = "graph replays" if cuda and name in graphs else "launched"
    return time_calls(ok, device, repeats, warmup, graphs=graphs if cuda else ())


def _predict(row: dict, rung, kind: str, shape, heads, bar_ms: float | None) -> None:
    """Add the chapter's model's prediction for ``rung`` (`course.ladder.predict_rung`,
    on an H100 SXM, with the compiled resources where recorded) to ``row``."""
    from pagedkv_lab.course.ladder import H100_SXM, predict_rung

    got = predict_rung(rung, kind, shape, heads, H100_SXM, row.get("resources"))
    row.update(predicted_ms=got["ms"], predicted_bound=got["bound"],
               predicted_occupancy=got.get("occupancy"), model_card=H100_SXM.name)  # fmt: skip
    if bar_ms:
        row["predicted_over_bar"] = got["ms"] / bar_ms


def decode_ladder_benchmark(
    device: torch.device, rungs, shapes=LADDER_DECODE_SHAPES, *, heads=LADDER_HEADS,
    block_size: int = 16, dtype: torch.dtype | None = None, repeats: int = 20,
    seed: int = 0, max_kv_bytes: int | None = None, warmup: int = 3,
) -> list[dict]:  # fmt: skip
    """Every decode rung at every shape, beside contiguous SDPA over the same K/V
    (`kernel_benchmark`'s setup): time over SDPA's, GB/s of K/V, and the share
    of a device-to-device copy's bandwidth; each with the compiled kernel's
    resources and the chapter's model's prediction (`_predict`). Rows over
    ``max_kv_bytes`` (default `max_row_kv_bytes`) are left out."""
    from pagedkv_lab.device import default_dtype
    from pagedkv_lab.kernels import AttentionMetadata

    num_heads, kv_heads, head_dim = heads
    dtype = dtype or default_dtype(device)
    cap = max_row_kv_bytes(device) if max_kv_bytes is None else max_kv_bytes
    gen = torch.Generator().manual_seed(seed)
    draw_gen = torch.Generator(device).manual_seed(seed) if device.type == "cuda" else gen
    out = []
    for batch, ctx in shapes:
        kv_bytes = 2 * batch * kv_heads * ctx * head_dim * dtype.itemsize
        if cap and kv_bytes > cap:
            continue
        q = random_normal((batch, num_heads, head_dim), dtype, device, draw_gen)
        k, v = (random_normal((batch, kv_heads, ctx, head_dim), dtype, device, draw_gen)
                for _ in range(2))  # fmt: skip
        kc, vc, tables = _paged_copy(k, v, block_size, gen)
        lens = torch.full((batch,), ctx, dtype=torch.int64, device=device)
        meta = AttentionMetadata(tables, lens)  # one per shape: a step's metadata
        rows = {}
        calls = {"contiguous": partial(_contiguous_decode, q, k, v, num_heads != kv_heads)}
        for i, rung in enumerate(rungs):
            rows[i] = _rung_row(i, rung, "decode") | {
                "batch": batch, "context_len": ctx, "dtype": str(dtype)[6:],
                "block_size": block_size, "kv_bytes": kv_bytes}  # fmt: skip
            calls[i] = partial(rung, q, kc, vc, meta)
        expected = calls["contiguous"]().float()
        t = _time_rungs(rows, calls, device, repeats, warmup)
        src = torch.empty(kv_bytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        copy_GBps = 2 * kv_bytes / time_call(partial(dst.copy_, src), device, repeats) / 1e9
        for i, row in rows.items():
            if i in t:
                err = (calls[i]().float() - expected).abs().max().item()
                row.update(ms=1e3 * t[i], contiguous_ms=1e3 * t["contiguous"],
                           over_contiguous=t[i] / t["contiguous"], max_error=err,
                           GBps=kv_bytes / t[i] / 1e9, copy_GBps=copy_GBps,
                           fraction_of_copy=kv_bytes / t[i] / 1e9 / copy_GBps)  # fmt: skip
            _predict(row, rungs[i], "decode", (batch, ctx), heads,
                     1e3 * t["contiguous"])  # fmt: skip
            out.append(row)
        del q, k, v, kc, vc, calls, src, dst
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def causal_attention_flops(seqs: int, length: int, heads: int, head_dim: int) -> int:
    """Multiply-adds x 2 of causal attention over ``seqs`` prompts of ``length``
    tokens: scores and weighted values, each 2 x head_dim per visible pair."""
    return 4 * head_dim * heads * seqs * length * (length + 1) // 2


#: PyTorch's SDPA backends (`torch.nn.attention.SDPBackend`), by what each is.
SDPA_LABELS = {"CUDNN_ATTENTION": "cuDNN attention",
               "FLASH_ATTENTION": "FlashAttention-2 (PyTorch's build)",
               "EFFICIENT_ATTENTION": "memory-efficient attention (xFormers')",
               "MATH": "PyTorch's math path", "OVERRIDEABLE": "a backend's override"}  # fmt: skip


def sdpa_backend(q, k, v, **kwargs) -> str | None:
    """The backend `scaled_dot_product_attention` picks for these inputs, as its
    dispatcher answers (`torch._fused_sdp_choice`, private: None if absent)."""
    from torch.nn.attention import SDPBackend

    try:
        return SDPBackend(torch._fused_sdp_choice(q, k, v, **kwargs)).name
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None


def _pinned_sdpa(backend: str, fn):
    """``fn`` run with SDPA limited to one backend (`torch.nn.attention.sdpa_kernel`)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def call():
        with sdpa_kernel([SDPBackend[backend]]):
            return fn()

    return call


def prefill_ladder_benchmark(
    device: torch.device, rungs, shapes=LADDER_PREFILL_SHAPES, *, heads=LADDER_HEADS,
    block_size: int = 16, dtype: torch.dtype | None = None, repeats: int = 10,
    seed: int = 0, warmup: int = 3,
) -> list[dict]:  # fmt: skip
    """Every prefill rung at every (prompts, tokens) shape, the prompts stored in
    shuffled blocks, beside causal SDPA over the same prompts stored
    contiguously: time over SDPA's and the rung's TFLOPS, with the compiled
    kernel's resources and the model's prediction. SDPA runs as dispatched (the
    bar; ``sdpa_backend`` names what the dispatcher picked) and, on a GPU,
    pinned to each backend that takes the inputs (``sdpa_ms_by_backend``;
    ``over_best_sdpa``: time over the fastest of them)."""
    from pagedkv_lab.device import default_dtype
    from pagedkv_lab.kernels import AttentionMetadata

    num_heads, kv_heads, head_dim = heads
    dtype = dtype or default_dtype(device)
    gen = torch.Generator().manual_seed(seed)
    draw_gen = torch.Generator(device).manual_seed(seed) if device.type == "cuda" else gen
    out = []
    for seqs, length in shapes:
        q4 = random_normal((seqs, num_heads, length, head_dim), dtype, device, draw_gen)
        k, v = (random_normal((seqs, kv_heads, length, head_dim), dtype, device, draw_gen)
                for _ in range(2))  # fmt: skip
        kc, vc, tables = _paged_copy(k, v, block_size, gen)
        lens = torch.full((seqs,), length, dtype=torch.int64, device=device)
        starts = torch.arange(seqs + 1, device=device) * length
        q = q4.transpose(1, 2).reshape(seqs * length, num_heads, head_dim).contiguous()
        gqa = dict(is_causal=True, enable_gqa=num_heads != kv_heads)
        sdpa = partial(F.scaled_dot_product_attention, q4, k, v, **gqa)
        calls = {"sdpa": sdpa}
        for backend in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"):
            pinned = _pinned_sdpa(backend, sdpa)
            try:  # a backend that does not take these inputs raises: left out
                pinned() if device.type == "cuda" else None
            except RuntimeError:
                continue
            if device.type == "cuda":
                calls[f"sdpa:{backend}"] = pinned
        flops = causal_attention_flops(seqs, length, num_heads, head_dim)
        meta = AttentionMetadata(tables, lens, starts)  # one per shape: a step's
        rows = {}
        for i, rung in enumerate(rungs):
            rows[i] = _rung_row(i, rung, "prefill") | {
                "seqs": seqs, "length": length, "dtype": str(dtype)[6:],
                "block_size": block_size,
                "sdpa_backend": sdpa_backend(q4, k, v, **gqa)}  # fmt: skip
            calls[i] = partial(rung, q, kc, vc, meta)
        expected = calls["sdpa"]().float().transpose(1, 2).reshape(q.shape)
        t = _time_rungs(rows, calls, device, repeats, warmup)
        by_backend = {n.split(":")[1]: 1e3 * x for n, x in t.items()
                      if isinstance(n, str) and n.startswith("sdpa:")}  # fmt: skip
        best = min([1e3 * t["sdpa"], *by_backend.values()])
        for i, row in rows.items():
            if i in t:
                err = (calls[i]().float() - expected).abs().max().item()
                row.update(ms=1e3 * t[i], sdpa_ms=1e3 * t["sdpa"], max_error=err,
                           over_causal_sdpa=t[i] / t["sdpa"],
                           sdpa_ms_by_backend=by_backend,
                           over_best_sdpa=1e3 * t[i] / best,
                           TFLOPS=flops / t[i] / 1e12)  # fmt: skip
            _predict(row, rungs[i], "prefill", (seqs, length), heads, 1e3 * t["sdpa"])
            out.append(row)
        del q, q4, k, v, kc, vc, calls
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def ceilings(device: torch.device, repeats: int = 20) -> dict:
    """The card's ceilings, measured once, for the model (`CardModel.with_measured`):
    ``hbm_Bps`` (a 1 GiB device-to-device copy, bytes read plus written),
    ``l2_Bps`` (a copy of 8 MiB, which L2 holds, 50 times back to back, no
    flush) and ``tensor_flops`` (a bf16 8,192-square matrix product). ``{}``
    without a GPU: nothing is measured."""
    if device.type != "cuda":
        return {}
    big = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(big)
    hbm = 2 * big.numel() / time_call(partial(dst.copy_, big), device, repeats)
    del big, dst
    small = torch.empty(8 << 20, dtype=torch.uint8, device=device)
    out = torch.empty_like(small)

    def copies():
        for _ in range(50):
            out.copy_(small)

    l2 = 2 * small.numel() * 50 / time_call(copies, device, repeats)
    a, b = (torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) for _ in range(2))
    gemm = 2 * 8192**3 / time_call(partial(torch.mm, a, b), device, repeats)
    return {"hbm_Bps": hbm, "l2_Bps": l2, "tensor_flops": gemm}


def geometric_mean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(x) for x in values) / len(values))


def print_ladder_table(rows: list[dict]) -> None:
    """Print `ladder_table_lines` (one print call)."""
    print("\n".join(ladder_table_lines(rows)))


def ladder_table_lines(rows: list[dict]) -> list[str]:
    """The per-rung table of `decode_ladder_benchmark` and
    `prefill_ladder_benchmark` rows: one line per rung and shape, with the
    model's predicted time and the compiled kernel's registers a thread,
    spilled words and shared memory (KiB) where they were recorded."""
    lines = []
    for kind in ("decode", "prefill"):
        mine = [r for r in rows if r["kind"] == kind]
        if not mine:
            continue
        shape = f"{'batch':>5} {'context':>7}" if kind == "decode" else \
            f"{'prompts':>5} {'tokens':>7}"  # fmt: skip
        ratio = "x SDPA" if kind == "decode" else "x causal"
        lines.append(f"{'rung':38} {shape} {'ms':>8} {'model ms':>8} {ratio:>8} "
                     f"{'regs':>4} {'spill':>5} {'smem':>4}")  # fmt: skip
        for r in mine:
            name = f"{r['rung']} {r['name']}"[:38]
            size = (r.get("batch", r.get("seqs")), r.get("context_len", r.get("length")))
            if "error" in r or "ms" not in r:
                lines.append(f"{name:38} {size[0]:5} {size[1]:7} "
                             f"{r.get('error', 'not run')[:60]}")  # fmt: skip
                continue
            x = r["over_contiguous"] if kind == "decode" else r["over_causal_sdpa"]
            res = r.get("resources") or {}
            kib = f"{res['shared'] / 1024:4.0f}" if res.get("shared") is not None else "   -"
            lines.append(f"{name:38} {size[0]:5} {size[1]:7} {r['ms']:8.3f} "
                         f"{r.get('predicted_ms', math.nan):8.3f} {x:8.2f} "
                         f"{res.get('n_regs') or '-':>4} {res.get('n_spills', '-'):>5} "
                         f"{kib}")  # fmt: skip
        if kind == "prefill" and mine[0].get("sdpa_backend"):
            label = SDPA_LABELS.get(mine[0]["sdpa_backend"], mine[0]["sdpa_backend"])
            lines.append(f"causal SDPA ran {label} ({mine[0]['sdpa_backend']})")
        lines.append("")
    return lines


# ---- reading a committed report folder back ---------------------------------

_SETTING = r"\(([^)]*)\)"


def _setting(text: str) -> tuple:
    """``"128, 2, 4, None"`` -> ``(128, 2, 4, None)``."""
    return tuple(None if x.strip() == "None" else int(x) for x in text.split(","))


def parse_tune_lines(text: str) -> list[dict]:
    """The per-shape lines of ``kernel_ladder.py --sections tune`` (decode):
    ``batch B context C: contiguous X ms, default Dx, best Bx (tile, programs
    per SM, warps, stages)``; the sweep prints only each shape's default and best."""
    pattern = (r"batch\s+(\d+) context\s+(\d+): contiguous ([0-9.]+) ms, default "
               rf"([0-9.]+)x, best ([0-9.]+)x {_SETTING}")  # fmt: skip
    return [
        {"batch": int(b), "context_len": int(c), "contiguous_ms": float(ms),
         "default_over_contiguous": float(d), "best_over_contiguous": float(best),
         "best_setting": _setting(key)}  # fmt: skip
        for b, c, ms, d, best, key in re.findall(pattern, text)
    ]


def parse_tune_prefill_lines(text: str) -> dict:
    """``kernel_ladder.py --sections tune-prefill``'s output: per shape the SDPA
    time and the current and best settings' ratios, and the settings' geometric
    means over the grid ((rows, keys, warps, stages) -> ratio)."""
    pattern = (r"(\d+) x (\d+): SDPA ([0-9.]+) ms, current ([0-9.]+)x, best "
               rf"([0-9.]+)x {_SETTING}")  # fmt: skip
    shapes = [
        {"seqs": int(s), "length": int(n), "sdpa_ms": float(ms),
         "current_over_causal_sdpa": float(cur), "best_over_causal_sdpa": float(b),
         "best_setting": _setting(key)}  # fmt: skip
        for s, n, ms, cur, b, key in re.findall(pattern, text)
    ]
    means = {}
    mean_pattern = (r"geometric mean ([0-9.]+)x causal SDPA: (\d+) rows, (\d+) keys "
                    r"per tile, (\d+) warps, stages (\w+)")  # fmt: skip
    for ratio, rows_m, keys, warps, stages in re.findall(mean_pattern, text):
        setting = _setting(f"{rows_m}, {keys}, {warps}, {stages}")
        means[setting] = float(ratio)
    return {"shapes": shapes, "geometric_means": means}


#: Where the H100 report measured decode rungs before `kernel_ladder.py` had a
#: ladder section: rung name -> (file, what to read). The tables' columns are
#: `parse_kernel_tables`' fields; a tuple is a setting of ``--sections tune``
#: (keys per tile, programs per SM, warps, stages), found only at the shapes
#: where it was the sweep's best (the only setting besides the default printed).
REPORT_DECODE_SOURCES = {
    "PyTorch gather + SDPA": ("kernel_decode_after.txt", "torch_over_contiguous"),
    "first kernel": ("kernel_decode_after.txt", "first_triton_over_contiguous"),
    "tiled kernel": ("kernel_decode_before.txt", "paged_over_contiguous"),
    "128-key tiles": ("kernel_tune.txt", (128, 2, 4, None)),
    "one fused merge": ("kernel_decode_after.txt", "paged_over_contiguous"),
}
#: The same for prefill: the sweep's "current" setting, the kernel as it was then;
#: and the run of 2026-11-26's default launch, which, with no committed tuning,
#: was the block-runs rung's (64 rows, 64 keys, 4 warps, Triton's stages).
REPORT_PREFILL_SOURCES = {
    "Q-blocks, every tile masked": ("kernel_tune_prefill.txt", "current"),
    "block runs": ("run_20261126/kernels_results.json", "prefill_kernel"),
    "tuned (the library's default)": ("run_20261126/kernels_results.json",
                                      "prefill_kernel"),
}


def committed_ladder(report, decode_rungs, prefill_rungs, *,
                     decode_shapes=LADDER_DECODE_SHAPES,
                     prefill_shapes=LADDER_PREFILL_SHAPES,
                     heads=LADDER_HEADS, itemsize: int = 2,
                     multiprocessors: int = 132) -> list[dict]:  # fmt: skip
    """Every rung at every ladder shape, with the figure a committed report
    folder holds for it, or ``measured=False`` where none does.

    A ladder run's own rows (``kernel_ladder.json``: ``kernel_ladder.py``'s
    results.json "ladder") come first; for the rest, `REPORT_DECODE_SOURCES`
    and `REPORT_PREFILL_SOURCES`. GB/s is the K/V bytes (``heads``' KV heads and
    head_dim, ``itemsize`` bytes each) over time / SDPA x SDPA's milliseconds,
    and the copy bandwidth the "after" table's GB/s over its share of copy:
    arithmetic on the files' figures (``derived``). A sweep's setting also
    counts where the sweep's best differs from it only in programs per
    multiprocessor and both gave one segment (the same launch; ``multiprocessors``
    is the H100's); where the setting is not found, ``at_least`` is the sweep's
    best at that shape, which no setting beat."""
    from pathlib import Path

    report = Path(report)
    ladder = report / "kernel_ladder.json"
    own = {}
    if ladder.exists():
        found = json.loads(ladder.read_text())  # the ladder's rows, or its section
        for r in found["rows"] if isinstance(found, dict) else found:
            shape = (r.get("batch"), r.get("context_len")) if r["kind"] == "decode" \
                else (r.get("seqs"), r.get("length"))  # fmt: skip
            if "ms" in r:
                own[(r["kind"], r["name"], shape)] = r
    read = _report_readers(report, kv_heads=heads[1], multiprocessors=multiprocessors)
    _, kv_heads, head_dim = heads
    rows = []
    for kind, rungs, shapes in (("decode", decode_rungs, decode_shapes),
                                ("prefill", prefill_rungs, prefill_shapes)):  # fmt: skip
        for i, rung in enumerate(rungs):
            for shape in shapes:
                row = _rung_row(i, rung, kind) | {"shape": shape, "measured": False}
                found = own.get((kind, rung.name, shape))
                if found is not None:
                    row.update(found, measured=True, source="kernel_ladder.json",
                               derived=False)  # fmt: skip
                else:
                    row.update(read(kind, rung.name, shape))
                if kind == "decode" and row.get("over_contiguous") and not row.get("GBps"):
                    kv_bytes = 2 * shape[0] * kv_heads * shape[1] * head_dim * itemsize
                    ms = row["over_contiguous"] * row["contiguous_ms"]
                    row.update(GBps=kv_bytes / ms / 1e6, derived=True)
                rows.append(row)
    return rows


def _same_launch(best: tuple, wanted: tuple, batch: int, kv_heads: int, sms: int) -> bool:
    """Two ``--sections tune`` settings launch the same kernel at this batch:
    equal but for programs per SM, and both give one segment there (the sweep
    counted ``batch x kv_heads x 2`` programs)."""
    if best == wanted:
        return True
    alike = (best[0], best[2], best[3]) == (wanted[0], wanted[2], wanted[3])
    return alike and batch * kv_heads * 2 >= max(best[1], wanted[1]) * sms


def _report_readers(report, kv_heads: int, multiprocessors: int):
    """``read(kind, rung name, shape)``: a dict of what the report's older files
    hold for that rung at that shape (empty when nothing)."""
    files = {}

    def text(name):
        if name not in files:
            path = report / name
            files[name] = path.read_text() if path.exists() else None
        return files[name]

    def table(name):
        found = text(name)
        rows = parse_kernel_tables(found) if found else []
        return {(r["batch"], r["context_len"]): r for r in rows
                if r["dtype"] in (None, "bfloat16") and r["block_size"] in (None, 16)}  # fmt: skip

    def read(kind, name, shape):
        sources = REPORT_DECODE_SOURCES if kind == "decode" else REPORT_PREFILL_SOURCES
        if name not in sources or text(sources[name][0]) is None:
            return {}
        file, what = sources[name]
        after = table("kernel_decode_after.txt").get(shape) if kind == "decode" else None
        copy = {}
        if after:
            copy = {"copy_GBps": after["paged_GBps"] / after["fraction_of_copy"]}
        if kind == "prefill" and file.endswith(".json"):  # a run's results.json
            section = json.loads(text(file)).get(what) or {}
            got = [r for r in section.get("rows", [])
                   if (r["seqs"], r["length"]) == shape and "ms" in r]  # fmt: skip
            if not got:
                return {}
            keep = ("ms", "sdpa_ms", "over_causal_sdpa", "TFLOPS", "timed")
            return {"measured": True, "source": file, "derived": False,
                    **{k: got[0][k] for k in keep if k in got[0]}}  # fmt: skip
        if kind == "prefill":
            got = [s for s in parse_tune_prefill_lines(text(file))["shapes"]
                   if (s["seqs"], s["length"]) == shape]  # fmt: skip
            if not got:
                return {}
            return {"measured": True, "source": file, "derived": False,
                    "over_causal_sdpa": got[0]["current_over_causal_sdpa"],
                    "sdpa_ms": got[0]["sdpa_ms"], "timed": "graph replays"}  # fmt: skip
        if isinstance(what, tuple):  # a sweep's setting, where it was the best
            at = [r for r in parse_tune_lines(text(file))
                  if (r["batch"], r["context_len"]) == shape]  # fmt: skip
            got = [r for r in at if _same_launch(r["best_setting"], what, shape[0],
                                                 kv_heads, multiprocessors)]  # fmt: skip
            if not got:
                return {"at_least": at[0]["best_over_contiguous"], "source": file} if at else {}
            return {"measured": True, "source": file, "derived": True, **copy,
                    "over_contiguous": got[0]["best_over_contiguous"],
                    "contiguous_ms": got[0]["contiguous_ms"], "timed": "graph replays"}  # fmt: skip
        row = table(file).get(shape)
        if row is None:
            return {}
        got = {"measured": True, "source": file, "over_contiguous": row[what],
               "contiguous_ms": row["contiguous_ms"], "derived": what != "paged_over_contiguous",
               "timed": "launched" if what == "torch_over_contiguous" else "graph replays", **copy}  # fmt: skip
        if what == "paged_over_contiguous":
            got.update(GBps=row["paged_GBps"], fraction_of_copy=row["fraction_of_copy"])
        return got

    return read
