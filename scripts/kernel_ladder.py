"""Chapters 04b-04d's attention kernels in one run: every kernel checked, then timed.

    python scripts/kernel_ladder.py --out kernel-report      # on a CUDA GPU
    python scripts/kernel_ladder.py --smoke                  # tiny sizes: checks the script itself
    TRITON_INTERPRET=1 python scripts/kernel_ladder.py --smoke --sections checks ladder tune-prefill

Default sections, in order (``--sections`` picks others):

1. ``checks``, correctness, compiled: every rung of the ladder
   (`course.ladder.DECODE_LADDER`, `PREFILL_LADDER`: the PyTorch paths, the
   first Triton kernel and each variant of the tiled one) against float64 on odd
   shapes, fp16 and bf16, decode and prefill, output buffers poisoned with NaN.
2. Decode: `bench.kernel_benchmark` for fp16 and bf16, blocks of 16 and 32, batch
   1-256, context 512-16384 (rows whose peak would pass half the card's memory, or
   over 4 GiB of K/V, left out; bf16 only from sm_80): each kernel's time
   against contiguous SDPA over the same K/V, and its bandwidth against a copy.
3. Prefill: the largest real shape whose weights fit half the card
   (`models.largest_real_shape`: Llama-3-8B from 40 GB, Llama-3.2-1B on a T4 or
   an L4; random weights, in `device.default_dtype`), 128 prompts of 1,000
   tokens: the engine's prefill (`LLM.generate`, one new token) against
   transformers' own SDPA forward of the same prompts, in the same run.
4. ``ladder``: every rung at fixed shapes (`bench.kernel.LADDER_DECODE_SHAPES`,
   `LADDER_PREFILL_SHAPES`, Llama-3-8B's heads, blocks of 16 in shuffled order):
   time over contiguous SDPA (decode) or causal SDPA (prefill), GB/s and share
   of the copy bandwidth (decode), TFLOPS (prefill). results.json "ladder": one
   row per rung and shape; copy it into the report folder as
   ``kernel_ladder.json`` and chapters 04c and 04d read it.
5. ``prefill-kernel``: the tiled kernel's default prefill against causal SDPA
   over 4 x 1024, 16 x 256 and 2 x 2048 prompt tokens; results.json
   "prefill_kernel": {"over_causal_sdpa": the geometric mean, ...}.
A table of the issue's targets comes last: decode paged/contiguous <= 1.15 at
batch >= 8 and context >= 1024; >= 80% of the copy bandwidth at batch >= 64 and
context >= 4096; engine prefill >= transformers' forward; the prefill kernel's
geometric mean over causal SDPA (<= 1.10), and over the fastest SDPA backend.

On an H100 ``--sections ladder prefill-kernel`` takes about two minutes by our
estimate (an estimate, not a measurement: some 25 kernel variants compiled at a
few seconds each, every timing a few milliseconds of graph replays); with
``--save-tuning`` the best prefill rung becomes the card's default in
``configs/tuned_tiles.json`` before ``prefill-kernel`` measures the default.

Sweeps, not default: ``tune`` (decode tiles, programs per SM, warps, stages) and
``tune-prefill`` (prefill rows, keys, warps, stages); with ``--save-tuning`` the
winner goes into ``pagedkv_lab/configs/tuned_tiles.json`` under this GPU's name,
where `kernels.triton_tiled.tuned_launch` reads it (commit that file with the report).

Every section runs even when an earlier one failed; results go to
``--out``/results.json and the tables to ``--out``/summary.txt.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch

from pagedkv_lab.bench import kernel_benchmark, print_kernel_table
from pagedkv_lab.bench.kernel import (
    LADDER_DECODE_SHAPES,
    LADDER_HEADS,
    LADDER_PREFILL_SHAPES,
    ceilings,
    decode_ladder_benchmark,
    geometric_mean,
    ladder_table_lines,
    prefill_ladder_benchmark,
    print_ladder_table,
)
from pagedkv_lab.course.attention_plots import PREFILL_GOAL_OVER_SDPA as PREFILL_GOAL
from pagedkv_lab.course.kernel_checks import on, packed_problem, poisoned_buffers
from pagedkv_lab.course.ladder import DECODE_LADDER, PREFILL_LADDER
from pagedkv_lab.device import default_dtype, device_report, gpu_spec, supports_bf16
from pagedkv_lab.kernels import AttentionMetadata, triton_tiled
from pagedkv_lab.kernels.reference import reference_paged_attention
from pagedkv_lab.kernels.triton_tiled import paged_attention_tiled
from pagedkv_lab.models import largest_real_shape

TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def paged_problem(seed, ctx, new, heads, kv_heads, head_dim, block_size, dtype, device):
    """`kernel_checks.packed_problem` on ``device``, and its float64 reference."""
    q, k, v, meta = packed_problem(seed, ctx, new, heads, kv_heads, head_dim, block_size,
                                   dtype)  # fmt: skip
    ref = reference_paged_attention(q, k, v, meta)
    return [q.to(device), k.to(device), v.to(device), on(device, meta)], ref


def check_kernels(device, smoke: bool) -> list[dict]:
    """Every rung against float64, with output buffers poisoned with NaN; the
    tiled default also with its keys forced into 8 segments."""
    dtypes = [torch.float32] if device.type != "cuda" else [torch.float16, torch.bfloat16]
    decode = [([1, 17, 1000, 4097], 32, 8, 128, 16), ([5, 300], 6, 1, 80, 32)]
    prefill = [([1000, 40, 7], [1000, 1, 7], 32, 8, 128, 16), ([45, 90], [40, 2], 4, 2, 64, 32)]
    if smoke:  # odd and tiny: head_dim 24, a group of 3, chunks after cached prefixes
        decode = [([1, 17, 40], 6, 2, 24, 8)]
        prefill = [([20, 3, 9], [20, 1, 5], 6, 2, 24, 8)]
    segmented = dict(options={"num_segments": 8})
    rows = []
    with poisoned_buffers():
        for dtype in dtypes:
            for shape in decode:
                args, ref = paged_problem(0, *shape[:1], None, *shape[1:], dtype, device)
                kernels = {r.name: r for r in DECODE_LADDER}
                kernels["default, 8 segments"] = replace(DECODE_LADDER[-1], **segmented)
                rows += _compare(kernels, args, ref, dtype, "decode", shape)
            for shape in prefill:
                args, ref = paged_problem(1, *shape[:2], *shape[2:], dtype, device)
                kernels = {r.name: r for r in PREFILL_LADDER}
                kernels["default, 8 segments"] = replace(PREFILL_LADDER[-1], **segmented)
                rows += _compare(kernels, args, ref, dtype, "prefill", shape)
    return rows


def _compare(kernels, args, ref, dtype, kind, shape) -> list[dict]:
    rows = []
    scale = max(1.0, ref.abs().max().item())
    for name, fn in kernels.items():
        out = fn(*args)
        err = (out.double().cpu() - ref).abs().max().item()
        ok = bool(out.isfinite().all()) and err < TOLERANCE[dtype] * scale
        rows.append(
            {"kind": kind, "kernel": name, "dtype": str(dtype)[6:], "shape": str(shape),
             "max_error": err, "ok": ok}
        )  # fmt: skip
        print(f"  {kind:7} {name[:34]:34} {str(dtype)[6:]:8} {'ok' if ok else 'FAIL'} {err:.1e}")
    return rows


DECODE_DTYPES = ("float16", "bfloat16")
BLOCK_SIZES = (16, 32)


def decode_grid(device, smoke: bool) -> list[dict]:
    cuda = device.type == "cuda"
    wanted = [getattr(torch, d) for d in DECODE_DTYPES]
    dtypes = [d for d in wanted if d != torch.bfloat16 or supports_bf16(device)]
    dtypes = dtypes if cuda else (torch.float32,)
    batches = (1, 8, 64, 256) if not smoke else (1, 4)
    contexts = (512, 1024, 4096, 16384) if not smoke else (64, 256)
    rows = []
    for dtype in dtypes:
        for block_size in BLOCK_SIZES:
            print(f"\n{str(dtype)[6:]}, block size {block_size}")
            part = kernel_benchmark(
                device, batches, contexts, block_size=block_size, dtype=dtype,
                repeats=20 if not smoke else 3,
            )  # fmt: skip
            print_kernel_table(part)
            for r in part:
                r["dtype"], r["block_size"] = str(dtype)[6:], block_size
            rows += part
    return rows


def prefill_comparison(device, smoke: bool) -> dict:
    """Engine prefill against transformers' SDPA forward of the same prompts."""
    from pagedkv_lab import LLM, SamplingParams
    from pagedkv_lab.models import load_model

    name, num, length = (largest_real_shape(device), 128, 1000)
    if smoke:
        name, num, length = "tiny-llama", 4, 40
    t0 = time.perf_counter()
    model, tokenizer = load_model(name, device=device)
    model.config._attn_implementation = "sdpa"
    built = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = torch.randint(3, vocab, (num, length), generator=g)
    chunk = 16 if not smoke else num  # transformers' forward, 16 prompts at a time

    def hf_forward():
        with torch.inference_mode():
            for i in range(0, num, chunk):
                ids = prompts[i : i + chunk].to(device)
                model(input_ids=ids, logits_to_keep=1, use_cache=False)
        _sync(device)

    hf_forward()  # warm-up
    t0 = time.perf_counter()
    hf_forward()
    hf_seconds = time.perf_counter() - t0

    llm = LLM((model, tokenizer), kv_cache_memory=0.85 if device.type == "cuda" else 2**26)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    ids = prompts.tolist()
    llm.generate(ids[:chunk], params, use_tqdm=False)  # warm-up: compiles the kernels
    _sync(device)
    t0 = time.perf_counter()
    llm.generate(ids, params, use_tqdm=False)
    _sync(device)
    engine_seconds = time.perf_counter() - t0
    tokens = num * length
    result = {
        "model": name, "dtype": str(model.dtype)[6:], "prompts": num, "length": length,
        "build_seconds": built,
        "hf_sdpa_tokens_per_s": tokens / hf_seconds,
        "engine_tokens_per_s": tokens / engine_seconds,
        "engine_over_hf": hf_seconds / engine_seconds,
    }  # fmt: skip
    print(json.dumps(result, indent=1))
    return result


def _ladder_heads(device, smoke: bool):
    """Llama-3-8B's attention on a GPU; on a CPU (--smoke, the interpreter) a
    group of 3 query heads per KV head and head_dim 24, tiny and odd."""
    return (6, 2, 24) if smoke else LADDER_HEADS


def ladder(device, smoke: bool) -> dict:
    """Every rung of chapters 04c and 04d's ladders (decode, prefill) at fixed shapes,
    each beside its bar (contiguous SDPA; causal SDPA) in the same run, with
    the compiled kernels' registers, spills and shared memory, the SDPA backend
    that ran, the model's predictions, and the card's measured ceilings.
    ``--smoke``: one tiny shape each, one timed round: every rung runs once
    (in the interpreter on a CPU). With ``--save-tuning`` on a GPU the best
    prefill rung (geometric mean over the shapes) becomes this card's default
    (`save_tuning`), where it beats the current default."""
    heads = _ladder_heads(device, smoke)
    decode_shapes = LADDER_DECODE_SHAPES if not smoke else ((3, 19),)
    prefill_shapes = LADDER_PREFILL_SHAPES if not smoke else ((2, 40),)
    timing = dict(repeats=1, warmup=0) if smoke else {}
    rows = decode_ladder_benchmark(device, DECODE_LADDER, decode_shapes, heads=heads,
                                   **(timing or dict(repeats=20)))  # fmt: skip
    rows += prefill_ladder_benchmark(device, PREFILL_LADDER, prefill_shapes,
                                     heads=heads, **(timing or dict(repeats=10)))  # fmt: skip
    print_ladder_table(rows)
    found = {"rows": rows, "ceilings": ceilings(device), "heads": heads}
    print("ceilings:", {k: f"{v:.4g}" for k, v in found["ceilings"].items()} or "not measured")
    winner = best_prefill_rung(rows)
    if winner is not None:
        found["best_prefill_rung"] = winner
        print(f"  best prefill rung: {winner['rung']} {winner['name']}, "
              f"{winner['over_causal_sdpa']:.3f}x causal SDPA (geometric mean)")
        if SAVE_TUNING and device.type == "cuda" and winner["beats_default"]:
            rung = PREFILL_LADDER[winner["rung"]]
            save_tuning(torch.cuda.get_device_name(device), "prefill",
                        rung.options, winner["over_causal_sdpa"], f"ladder rung {rung.name}")
    return found


def best_prefill_rung(rows: list[dict]) -> dict | None:
    """The tiled prefill rung with the least geometric mean of time over causal
    SDPA across the shapes (every shape timed), and whether it beats the
    library's default (the ladder's last entry)."""
    means = {}
    for i in range(len(PREFILL_LADDER)):
        mine = [r for r in rows if r["kind"] == "prefill" and r["rung"] == i]
        if mine and all("over_causal_sdpa" in r for r in mine):
            means[i] = geometric_mean(r["over_causal_sdpa"] for r in mine)
    tiled = {i: m for i, m in means.items()
             if PREFILL_LADDER[i].kernel == "tiled" and i < len(PREFILL_LADDER) - 1}  # fmt: skip
    if not tiled:
        return None
    best = min(tiled, key=tiled.get)
    default = means.get(len(PREFILL_LADDER) - 1, math.inf)
    return {"rung": best, "name": PREFILL_LADDER[best].name,
            "over_causal_sdpa": tiled[best], "default_over_causal_sdpa": default,
            "beats_default": tiled[best] < default}  # fmt: skip


def prefill_kernel(device, smoke: bool) -> dict:
    """The tiled kernel's default prefill (the last rung, as `paged_prefill`
    runs it) against causal SDPA over the ladder's prefill grid: the geometric
    mean of time / SDPA's is the target issue 46 holds to 1.10 (`PREFILL_GOAL`)."""
    shapes = LADDER_PREFILL_SHAPES if not smoke else ((2, 24), (3, 9))
    rows = prefill_ladder_benchmark(device, PREFILL_LADDER[-1:], shapes,
                                    heads=_ladder_heads(device, smoke),
                                    repeats=10 if not smoke else 2)  # fmt: skip
    print_ladder_table(rows)
    timed = [r for r in rows if "over_causal_sdpa" in r]
    result = {
        "over_causal_sdpa": geometric_mean(r["over_causal_sdpa"] for r in timed)
        if len(timed) == len(rows) else None,
        "over_best_sdpa": geometric_mean(r["over_best_sdpa"] for r in timed)
        if len(timed) == len(rows) else None,
        "sdpa_backend": rows[0].get("sdpa_backend") if rows else None,
        "grid": [[r["seqs"], r["length"]] for r in rows],
        "config": _prefill_config(device),
        "rows": rows,
    }  # fmt: skip
    gm = result["over_causal_sdpa"]
    print(f"  geometric mean over the grid: {gm:.3f}x causal SDPA" if gm else "  no mean")
    return result


def _prefill_config(device) -> dict:
    """The settings `paged_attention_tiled` launches prefill with on ``device``
    (`triton_tiled.tiled_settings`: the defaults, then a committed winner)."""
    if device.type != "cuda":
        return {"tile_sizes": triton_tiled.TILE_SIZES["prefill"], "interpreter": True}
    card = gpu_spec(device)  # an emulated card's rules, if PAGEDKV_EMULATE names one
    tiles, _ = triton_tiled.tiled_launch(default_dtype(device), card.capability, False)
    tuned = triton_tiled.tuned_launch(card.name, "prefill")
    return triton_tiled.tiled_settings("prefill", tiles, tuned, {})


def geometric_means(rows: list[dict], fields: tuple[str, ...], ratio: str) -> dict:
    """Per setting (the values of ``fields``), the geometric mean of ``ratio``
    over the grid's shapes: the score a sweep ranks its settings by."""
    logs: dict[tuple, list[float]] = {}
    for r in rows:
        logs.setdefault(tuple(r[f] for f in fields), []).append(math.log(r[ratio]))
    return {key: math.exp(statistics.mean(xs)) for key, xs in logs.items()}


def tune(device, smoke: bool) -> list[dict]:
    """The tiled decode kernel's launch settings swept on Llama-3-8B's attention
    shape (32 heads, 8 KV heads, head_dim 128), bf16, blocks of 16: keys per
    tile, programs per multiprocessor (which sets the KV segments), warps and
    pipeline stages. Every variant is timed as CUDA-graph replays beside
    contiguous SDPA over the same K/V."""
    import itertools
    from functools import partial

    from pagedkv_lab.bench.kernel import (
        _contiguous_decode,
        _paged_copy,
        max_row_kv_bytes,
        random_normal,
    )
    from pagedkv_lab.bench.timing import time_calls

    grid = [(8, 1024), (8, 4096), (8, 16384), (64, 4096), (64, 16384), (256, 4096)]
    tiles, per_sm, warps, stages = (32, 64, 128), (2, 4, 8), (4, 8), (None, 2)
    if smoke:
        grid, tiles, per_sm, warps, stages = [(2, 64)], (64,), (2,), (4,), (None,)
    heads, kv_heads, dim = 32, 8, 128
    dtype = default_dtype(device)  # bf16 from sm_80, fp16 before, fp32 on a CPU
    gen = torch.Generator().manual_seed(0)
    draw_gen = torch.Generator(device).manual_seed(0)
    cap = max_row_kv_bytes(device)
    grid = [(b, c) for b, c in grid if not cap or 2 * b * kv_heads * c * dim * dtype.itemsize <= cap]
    rows = []
    saved = triton_tiled.PROGRAMS_PER_SM
    for batch, ctx in grid:
        q = random_normal((batch, heads, dim), dtype, device, draw_gen)
        k, v = (random_normal((batch, kv_heads, ctx, dim), dtype, device, draw_gen)
                for _ in range(2))  # fmt: skip
        kc, vc, tables = _paged_copy(k, v, 16, gen)
        lens = torch.full((batch,), ctx, dtype=torch.int64, device=device)
        meta = AttentionMetadata(tables, lens)
        calls = {"contiguous": partial(_contiguous_decode, q, k, v, True)}
        variants = list(itertools.product(tiles, per_sm, warps, stages))
        for tile, sm, w, st in variants:
            triton_tiled.PROGRAMS_PER_SM = sm
            segments = triton_tiled.tiled_segments(
                batch * kv_heads * 2, -(-ctx // tile), device
            )  # what the kernel computes for this grid
            calls[(tile, sm, w, st)] = partial(
                paged_attention_tiled, q, kc, vc, meta, check=False, tuned=False,
                num_segments=segments, tile_sizes=(16, tile), num_warps=w, num_stages=st,
            )  # fmt: skip
        triton_tiled.PROGRAMS_PER_SM = saved
        t = time_calls(calls, device, repeats=10 if not smoke else 2, graphs=list(calls))
        base = t.pop("contiguous")
        current = (triton_tiled.TILE_SIZES["decode"][1], saved, 4, None)  # the library's
        default = t.get(current, math.nan)
        best = min(t, key=t.get)
        for key, sec in t.items():
            rows.append({"batch": batch, "context_len": ctx, "tile_n": key[0],
                         "programs_per_sm": key[1], "num_warps": key[2],
                         "num_stages": key[3], "over_contiguous": sec / base,
                         "ms": 1e3 * sec})  # fmt: skip
        print(f"  batch {batch:4} context {ctx:6}: contiguous {1e3 * base:.3f} ms, "
              f"default {default / base:.2f}x, best {t[best] / base:.2f}x {best}")  # fmt: skip
        del q, k, v, kc, vc, calls
        torch.cuda.empty_cache() if device.type == "cuda" else None
    fields = ("tile_n", "programs_per_sm", "num_warps", "num_stages")
    score = geometric_means(rows, fields, "over_contiguous")
    for key in sorted(score, key=score.get)[:5]:
        print(f"  geometric mean over the grid {score[key]:.3f}x contiguous: "
              f"tile {key[0]}, {key[1]} programs/SM, {key[2]} warps, stages {key[3]}")  # fmt: skip
    return rows


def tune_prefill(device, smoke: bool) -> list[dict]:
    """The tiled kernel's prefill launch swept on Llama-3-8B's attention (bf16):
    (query rows per program, keys per tile, warps, stages), each timed as a step
    of the engine's size (4,096 prompt tokens) against causal SDPA over the same
    prompts stored contiguously, beside the library's current default. With
    ``--save-tuning`` the winner (the least geometric mean over the grid) is
    committed to `triton_tiled.TUNED_TILES` under this GPU's name. Every variant
    runs with the ladder's levers on (`LEVERS`)."""
    import itertools
    from functools import partial

    from pagedkv_lab.bench.kernel import _paged_copy, random_normal
    from pagedkv_lab.bench.timing import time_calls

    grid = list(LADDER_PREFILL_SHAPES) if not smoke else [(2, 24)]
    rows_m, tiles, warps, stages = (64, 128), (32, 64, 128), (4, 8), (None, 2, 3)
    if smoke:
        rows_m, tiles, warps, stages = (16, 32), (16,), (4,), (None,)
    heads, kv_heads, dim = _ladder_heads(device, smoke)
    dtype = default_dtype(device)  # bf16 from sm_80, fp16 before, fp32 on a CPU
    gen = torch.Generator().manual_seed(0)
    draw_gen = torch.Generator(device).manual_seed(0)
    out = []
    for seqs, length in grid:
        q4 = random_normal((seqs, heads, length, dim), dtype, device, draw_gen)
        k, v = (random_normal((seqs, kv_heads, length, dim), dtype, device, draw_gen)
                for _ in range(2))  # fmt: skip
        kc, vc, tables = _paged_copy(k, v, 16, gen)
        lens = torch.full((seqs,), length, dtype=torch.int64, device=device)
        starts = torch.arange(seqs + 1, device=device) * length
        q = q4.transpose(1, 2).reshape(seqs * length, heads, dim).contiguous()
        sdpa = partial(torch.nn.functional.scaled_dot_product_attention, q4, k, v,
                       is_causal=True, enable_gqa=True)  # fmt: skip
        args = (q, kc, vc, AttentionMetadata(tables, lens, starts))
        calls = {"sdpa": sdpa, "current": partial(paged_attention_tiled, *args, check=False)}
        for key in itertools.product(rows_m, tiles, warps, stages):
            calls[key] = partial(
                paged_attention_tiled, *args, check=False, tuned=False,
                tile_sizes=key[:2], num_warps=key[2], num_stages=key[3], **LEVERS,
            )  # fmt: skip
        expected = sdpa().float().transpose(1, 2).reshape(q.shape)
        error = {}
        for key, call in list(calls.items())[1:]:
            try:
                error[key] = (call().float() - expected).abs().max().item()
            except Exception as err:  # a tile too large for this card
                print(f"  {key}: {type(err).__name__}: {str(err)[:120]}")
                del calls[key]
        t = time_calls(calls, device, repeats=10 if not smoke else 2, graphs=list(calls))
        base, current = t.pop("sdpa"), t.pop("current")
        for key, sec in t.items():
            out.append({"seqs": seqs, "length": length, "block_m": key[0],
                        "tile_n": key[1], "num_warps": key[2], "num_stages": key[3],
                        "over_sdpa": sec / base, "ms": 1e3 * sec,
                        "max_error": error[key]})  # fmt: skip
        print(f"  {seqs} x {length}: largest difference from SDPA over the variants "
              f"{max(error.values()):.1e}")
        best = min(t, key=t.get)
        print(f"  {seqs} x {length}: SDPA {1e3 * base:.3f} ms, current "
              f"{current / base:.2f}x, best {t[best] / base:.2f}x {best}")  # fmt: skip
        del q, q4, k, v, kc, vc, calls
    score = geometric_means(out, ("block_m", "tile_n", "num_warps", "num_stages"),
                            "over_sdpa")  # fmt: skip
    for key in sorted(score, key=score.get)[:5]:
        print(f"  geometric mean {score[key]:.3f}x causal SDPA: {key[0]} rows, "
              f"{key[1]} keys per tile, {key[2]} warps, stages {key[3]}")  # fmt: skip
    if SAVE_TUNING and device.type == "cuda" and score:
        winner = min(score, key=score.get)
        save_tuning(torch.cuda.get_device_name(device), "prefill", (*winner, LEVERS),
                    score[winner])  # fmt: skip
    return out


SAVE_TUNING = False
#: The prefill ladder's levers (its last rung's switches) that ``tune-prefill``
#: sweeps the launch under: tiles, warps and stages are what it varies.
LEVERS = {k: v for k, v in PREFILL_LADDER[-2].options.items()
          if k not in ("tile_sizes", "num_warps", "num_stages")}  # fmt: skip


def save_tuning(device_name: str, kind: str, setting, score: float,
                source: str = "") -> None:  # fmt: skip
    """Merge a winner into `triton_tiled.TUNED_TILES` (commit the file): a sweep's
    ``(rows, keys, warps, stages)``, or a rung's `paged_attention_tiled`
    options (tiles, warps, stages and switches)."""
    path = triton_tiled.TUNED_TILES
    data = json.loads(path.read_text()) if path.exists() else {"devices": {}}
    if isinstance(setting, dict):
        options = dict(setting)
        entry = {k: options.pop(k) for k in ("tile_sizes", "num_warps", "num_stages")
                 if k in options}  # fmt: skip
        if "tile_sizes" in entry:
            entry["tile_sizes"] = list(entry["tile_sizes"])
        entry["switches"] = options
    else:
        rows, keys, warps, stages = setting[:4]
        entry = {"tile_sizes": [rows, keys], "num_warps": warps, "num_stages": stages}
        if len(setting) > 4:
            entry["switches"] = setting[4]
    entry.update(geometric_mean_over_sdpa=round(score, 4),
                 source=f"scripts/kernel_ladder.py --save-tuning ({source or 'tune-' + kind})")
    data.setdefault("devices", {}).setdefault(device_name, {})[kind] = entry
    path.write_text(json.dumps(data, indent=1) + "\n")
    triton_tiled.tuned_launch.cache_clear()  # the next launch reads the new winner
    print(f"  saved {entry} for {device_name} ({kind}) to {path}")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def summary(results: dict) -> list[str]:
    lines = []
    if results.get("ladder"):
        lines += ["the ladder: every rung at fixed shapes",
                  *ladder_table_lines(results["ladder"]["rows"])]  # fmt: skip
    lines += ["", f"{'target':68} {'measured':>12}  verdict"]

    def line(what, value, ok):
        shown = "n/a" if value is None else value
        verdict = "n/a" if ok is None else ("meets" if ok else "MISSES")
        lines.append(f"{what:68} {shown:>12}  {verdict}")

    checks = results.get("checks") or []
    line("every kernel within tolerance of float64",
         f"{sum(r['ok'] for r in checks)}/{len(checks)}" if checks else None,
         all(r["ok"] for r in checks) if checks else None)  # fmt: skip
    rows = results.get("decode") or []
    for dtype in sorted({r["dtype"] for r in rows}):
        for bs in sorted({r["block_size"] for r in rows}):
            mine = [r for r in rows if r["dtype"] == dtype and r["block_size"] == bs]
            ratio = [r["paged_over_contiguous"] for r in mine
                     if r["batch"] >= 8 and r["context_len"] >= 1024]  # fmt: skip
            first = [r.get("first_triton_over_contiguous", math.nan) for r in mine
                     if r["batch"] >= 8 and r["context_len"] >= 1024]  # fmt: skip
            bw = [r["fraction_of_copy"] for r in mine
                  if r["batch"] >= 64 and r["context_len"] >= 4096 and "fraction_of_copy" in r]  # fmt: skip
            tag = f"{dtype}, block {bs}"
            line(f"decode {tag}: worst tiled/contiguous (<= 1.15)",
                 f"{max(ratio):.2f}" if ratio else None, max(ratio) <= 1.15 if ratio else None)  # fmt: skip
            line(f"decode {tag}: worst first-kernel/contiguous (before)",
                 f"{max(first):.2f}" if first else None, None)  # fmt: skip
            line(f"decode {tag}: least fraction of copy bandwidth (>= 80%)",
                 f"{min(bw):.0%}" if bw else None, min(bw) >= 0.8 if bw else None)  # fmt: skip
    kernel = results.get("prefill_kernel") or {}
    gm = kernel.get("over_causal_sdpa")
    line(f"prefill kernel: default / causal SDPA, geometric mean (<= {PREFILL_GOAL})",
         f"{gm:.2f}" if gm else None, gm <= PREFILL_GOAL if gm else None)  # fmt: skip
    best = kernel.get("over_best_sdpa")
    line("prefill kernel: default / fastest SDPA backend, geometric mean",
         f"{best:.2f}" if best else None, None)  # fmt: skip
    pre = results.get("prefill")
    line("prefill: engine / transformers SDPA tokens per second (>= 1)",
         f"{pre['engine_over_hf']:.2f}" if pre else None, pre["engine_over_hf"] >= 1 if pre else None)  # fmt: skip
    return lines


SECTIONS = {"checks": check_kernels, "decode": decode_grid, "ladder": ladder,
            "prefill-kernel": prefill_kernel, "prefill": prefill_comparison,
            "tune": tune, "tune-prefill": tune_prefill}  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="kernel-report")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, any device")
    parser.add_argument("--sections", nargs="+", choices=list(SECTIONS),
                        default=["checks", "decode", "ladder", "prefill-kernel", "prefill"])
    parser.add_argument("--save-tuning", action="store_true",
                        help="tune/tune-prefill: commit the winner to configs/tuned_tiles.json")
    parser.add_argument("--decode-dtypes", nargs="+", default=list(DECODE_DTYPES))
    parser.add_argument("--block-sizes", nargs="+", type=int, default=list(BLOCK_SIZES))
    args = parser.parse_args(argv)
    globals().update(DECODE_DTYPES=args.decode_dtypes, BLOCK_SIZES=args.block_sizes,
                     SAVE_TUNING=args.save_tuning)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        print("no CUDA GPU: run with --smoke to check the script on this machine")
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"device": device_report(device), "failed": []}
    print(" | ".join(f"{k} {v}" for k, v in results["device"].items()))
    for name in args.sections:
        print(f"\n== {name}")
        t0 = time.perf_counter()
        try:
            # results.json keys: the section's name ("prefill-kernel": "prefill_kernel")
            key = "prefill_kernel" if name == "prefill-kernel" else name
            results[key] = SECTIONS[name](device, args.smoke)
        except Exception:  # every section runs; the failure is reported
            traceback.print_exc()
            results["failed"].append(name)
        print(f"({name}: {time.perf_counter() - t0:.0f} s)")
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    if results.get("ladder"):  # the file chapters 04c and 04d read (copy it into the report)
        section = {"device": results["device"], **results["ladder"]}
        (out / "kernel_ladder.json").write_text(json.dumps(section, indent=1, default=str))
    table = summary(results)
    if results["failed"]:
        table.append(f"sections that raised: {', '.join(results['failed'])}")
    (out / "summary.txt").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    return 1 if results["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
