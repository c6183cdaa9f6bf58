"""`python -m pagedkv_lab.bench all --out report/`: every benchmark of the
course on the device at hand, written to one folder.

Each section measures its systems side by side in one run and reports ratios:

* ``kernel``: paged against contiguous decode attention over a grid of batch
  sizes and context lengths (claim S1), the bandwidth each reaches against the
  device's measured copy bandwidth, and kernel time by block size;
* ``serve``: this engine, transformers' ``generate`` and continuous batching, and
  vLLM where a vLLM python is found, on W1 (chat-like), W2 (uniform), W3 (a
  shared system prompt, prefix caching on everywhere it exists) and W1 under
  memory pressure (a quarter of the KV budget);
* ``sampling``: parallel sampling with and without shared blocks (chapter 07);
* ``rate``: latency against request rate under Poisson arrivals, the vLLM
  paper's Figure 12 shape, for this engine paged and with max-length
  reservation;
* ``blocks``: block size 8-128 end to end (claim S4): throughput, memory
  waste, kernel time.

``report.md`` collects the tables, with the device, model, dtype and versions;
``results.json`` holds every number; each section adds a figure. Sizes follow
the device (`device.by_device`); ``quick=True`` shrinks them for a CPU smoke run
(chapter 10 calls the sections itself, at its own sizes).
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from pagedkv_lab.bench.common import SYSTEMS, _prompt_ids, cpu_model, scaled_chat_trace
from pagedkv_lab.bench.compare import engine_logprobs
from pagedkv_lab.bench.kernel import kernel_benchmark
from pagedkv_lab.bench.peers import find_vllm_python
from pagedkv_lab.bench.serve import Outputs, serve_benchmark
from pagedkv_lab.bench.timing import time_call, time_rounds, trace
from pagedkv_lab.device import by_device, device_report
from pagedkv_lab.sampling_params import SamplingParams

SECTIONS = ("kernel", "serve", "sampling", "rate", "blocks")
BLOCK_SIZES = (8, 16, 32, 64, 128)


def copy_bandwidth(device: torch.device, nbytes: int = 256 * 2**20) -> float:
    """Bytes per second of a plain tensor copy (read + write counted), the
    ceiling a memory-bound kernel can approach on this device."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = time_call(partial(dst.copy_, src), device, 5)
    return 2 * nbytes / seconds


def kernel_section(
    device: torch.device,
    batch_sizes=None,
    context_lens=None,
    block_sizes=BLOCK_SIZES,
    repeats: int | None = None,
    dtypes=None,
    grid_block_size: int = 16,
) -> dict:
    """S1 and the bandwidth ceiling: `bench.kernel_benchmark` over the grid in
    each of ``dtypes`` (default: fp32 on a CPU, fp16 and bf16 on a GPU), paged
    in blocks of ``grid_block_size`` tokens, each row's achieved bandwidth beside
    the copy bandwidth; then one shape timed at every block size, in the first
    of ``dtypes``."""
    batch_sizes = batch_sizes or by_device((1, 8, 32), (1, 8, 64, 256), device)
    context_lens = context_lens or by_device(
        (128, 512, 2048, 4096), (128, 1024, 4096, 16384, 32768), device
    )
    repeats = repeats or by_device(9, 30, device)
    dtypes = dtypes or by_device((torch.float32,), (torch.float16, torch.bfloat16), device)
    rows = []
    for dtype in dtypes:
        for row in kernel_benchmark(
            device, batch_sizes, context_lens, dtype=dtype, repeats=repeats,
            block_size=grid_block_size,
        ):
            row["dtype"] = str(dtype).removeprefix("torch.")
            row["block_size"] = grid_block_size
            rows.append(row)
    copy = copy_bandwidth(device)
    for row in rows:
        row["contiguous_GBps"] = row["kv_bytes"] / row["contiguous_ms"] * 1e-6
        row.setdefault("copy_GBps", copy / 1e9)
        row.setdefault("fraction_of_copy", row["paged_GBps"] / row["copy_GBps"])
    shape = dict(batch_sizes=(batch_sizes[len(batch_sizes) // 2],))
    shape["context_lens"] = (context_lens[-2] if len(context_lens) > 1 else 1024,)
    by_block = []
    for bs in block_sizes:
        (r,) = kernel_benchmark(device, block_size=bs, repeats=repeats, dtype=dtypes[0],
                                **shape)  # fmt: skip
        by_block.append({"block_size": bs, **r})
    return {"rows": rows, "copy_GBps": copy / 1e9, "by_block": by_block}


def plot_kernel_bandwidth(kernel: dict, path: str | None = None):
    """Achieved K/V bandwidth of paged and contiguous decode against context
    length, one panel per batch size, under the device's copy bandwidth.

    Not a roofline: every row has the same arithmetic intensity (decode
    attention does ``2G/b`` FLOPs per K/V byte for ``G`` query heads per KV
    head and ``b``-byte elements, whatever the batch or context), so on a
    roofline's intensity axis they would all sit at one point, far left of
    any device's ridge point. What varies is how much of the bandwidth
    ceiling each shape reaches."""
    import matplotlib.pyplot as plt

    from pagedkv_lab.course.plotting import SERIES, use_style

    use_style()
    rows = [r for r in kernel["rows"] if r["dtype"] == kernel["rows"][0]["dtype"]]
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(
        1, len(batches), figsize=(2.6 * len(batches) + 1, 3.2), sharey=True
    )
    axes = [axes] if len(batches) == 1 else list(axes)
    for ax, b in zip(axes, batches):
        mine = [r for r in rows if r["batch"] == b]
        ctx = [r["context_len"] for r in mine]
        ax.plot(ctx, [r["paged_GBps"] for r in mine], "o-", color=SERIES[0])
        ax.plot(ctx, [r["contiguous_GBps"] for r in mine], "s--", color=SERIES[1])
        ax.axhline(kernel["copy_GBps"], color="black", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_title(f"batch {b}", fontsize=9)
        ax.set_xlabel("context (tokens)")
    axes[0].set_ylabel("K/V read (GB/s)")
    fig.legend(
        axes[0].get_lines()[:3],
        [f"paged ({rows[0]['path']})", "contiguous SDPA", "copy bandwidth (ceiling)"],
        fontsize=8,
        loc="lower center",
        ncol=3,
    )
    blocks = {r.get("block_size") for r in rows} - {None}
    paging = f", blocks of {blocks.pop()}" if len(blocks) == 1 else ""
    fig.suptitle(
        f"Decode attention: K/V bandwidth reached against the copy ceiling "
        f"({rows[0]['dtype']}{paging})"
    )
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    if path:
        fig.savefig(path, dpi=120)
        plt.close(fig)
    return fig


def _prefix_workload(n: int, max_model_len: int, seed: int = 3):
    """W3 scaled to ``max_model_len``: one system prompt of a quarter of it."""
    from pagedkv_lab.sim.workloads import Request, system_prompt_workload

    system_len = max(16, max_model_len // 4)
    token_requests = system_prompt_workload(
        n,
        system_len=system_len,
        user_len=(4, 32),
        output_len=(8, max(9, max_model_len // 8)),
        seed=seed,
    )
    requests = [
        Request(i, 0.0, len(t.prompt), len(t.output))
        for i, t in enumerate(token_requests)
    ]
    return requests, [t.prompt for t in token_requests]


def serve_workload(
    name: str, n: int, max_model_len: int, budget_requests: int, systems
) -> dict:
    """One workload of `serve_section`: its requests (and prompts, where they
    share a prefix), its KV budget in full-length requests, the systems that
    serve it and whether prefix caching is on."""
    from pagedkv_lab.sim.workloads import uniform_workload

    lo, hi = max(1, 100 * max_model_len // 2048), max(2, 1024 * max_model_len // 2048)
    w = dict(prompts=None, budget_requests=budget_requests, systems=tuple(systems))
    w["prefix_caching"] = False
    if name == "w1":
        w["requests"] = scaled_chat_trace(n, max_model_len)
    elif name == "w2":
        w["requests"] = uniform_workload(n, low=lo, high=hi)
    elif name == "w3-prefix":
        w["requests"], w["prompts"] = _prefix_workload(n, max_model_len)
        # generate has no prefix cache; the others turn theirs on
        w["systems"] = tuple(s for s in systems if s not in ("contiguous", "hf-generate"))
        w["prefix_caching"] = True
    elif name == "w1-pressure":
        w["requests"] = scaled_chat_trace(n, max_model_len, seed=1)
        w["budget_requests"] = max(1, budget_requests // 4)
    else:
        raise ValueError(f"unknown workload {name!r}")
    return w


def serve_section(
    device: torch.device,
    model: str | None = None,
    num_requests: int | None = None,
    max_model_len: int = 512,
    budget_requests: int = 8,
    repeats: int = 3,
    vllm_python: str | None = None,
    workloads=("w1", "w2", "w3-prefix", "w1-pressure"),
    progress: Callable | None = None,
    include_vllm: bool = True,
    dtype: torch.dtype | None = None,
) -> dict:
    """`bench.serve_benchmark` on each workload (`serve_workload`), every
    system, one KV budget per workload, the weights in ``dtype`` (None: as
    `load_model` loads them on ``device``); every system's tokens judged
    (`judge_outputs`). vLLM joins when `bench.find_vllm_python` finds it (and
    ``include_vllm``)."""
    # a 30M model is launch-bound on any GPU: a real shape there (random weights)
    model = model or by_device("small-llama", "Qwen2.5-0.5B", device)
    n = num_requests or by_device(32, 512, device)
    systems = list(SYSTEMS)
    if include_vllm and find_vllm_python(vllm_python) is not None:
        systems.append("vllm")
    out = {}
    for name in workloads:
        w = serve_workload(name, n, max_model_len, budget_requests, systems)
        prompts = w["prompts"] or _prompt_ids(w["requests"])
        rows, outputs = serve_benchmark(
            model,
            w["requests"],
            device=device,
            max_model_len=max_model_len,
            budget_requests=w["budget_requests"],
            systems=w["systems"],
            repeats=repeats,
            vllm_python=vllm_python,
            prompts=prompts,
            prefix_caching=w["prefix_caching"],
            dtype=dtype,
        )
        max_tokens = [r.output_len for r in w["requests"]]
        judged = judge_outputs(outputs, max_tokens, prompts, model, device)
        for row in rows:
            agree = judged[row["system"]]
            row["same_tokens_as_first"] = agree.identical
            row["agreement"] = agree.summary()
            row["sound"] = agree.sound
        out[name] = {
            "requests": len(w["requests"]),
            "budget_requests": w["budget_requests"],
            "rows": rows,
        }
        if progress:
            progress(name)
    return out


def judge_outputs(outputs: dict, max_tokens, prompts, model, device, base=None) -> dict:
    """Every system's tokens against ``base``'s (the first system's by default;
    `compare.compare_systems`): identical in float32; in 16 bits, judged
    against ``model``'s own float32 forward pass at every position (a name,
    loaded once in the systems' dtype, or a loaded model), with each system's
    teacher-forced scores where `serve_benchmark` collected them
    (`serve.Outputs`). The dtype is the outputs' (`serve.Outputs.dtype`), else
    the loaded model's, else the library's for ``device``."""
    from pagedkv_lab.bench.compare import compare_systems, float32_copy
    from pagedkv_lab.device import default_dtype
    from pagedkv_lab.models import load_model

    dtype = getattr(outputs, "dtype", None)
    if dtype is None:
        dtype = default_dtype(device) if isinstance(model, str) else model.dtype
    if dtype == torch.float32:
        return compare_systems(outputs, max_tokens, base=base, exact=True)
    judge = load_model(model, device=device, dtype=dtype)[0] if isinstance(model, str) else model
    reference32 = float32_copy(judge)
    try:
        return compare_systems(
            outputs, max_tokens, base=base, exact=False, model=judge, prompts=prompts,
            scores=getattr(outputs, "scores", None),
            forced_by=getattr(outputs, "forced_by", None), reference32=reference32,
        )  # fmt: skip
    finally:
        del judge, reference32
        if device.type == "cuda":
            torch.cuda.empty_cache()


def serve_section_steps(
    num_requests: int,
    max_model_len: int = 512,
    budget_requests: int = 8,
    repeats: int = 3,
    workloads=("w1", "w2", "w3-prefix", "w1-pressure"),
    systems=SYSTEMS,
    warmup_requests: int | None = None,
) -> dict[str, dict[str, int]]:
    """The forward passes `serve_section` runs, per workload and system (the
    warm-up, one untimed pass of the workload, and ``repeats`` rounds),
    counted without a model by `bench.serve.count_steps`. ``warmup_requests``
    counts an older warm-up instead, as `serve_benchmark` takes it: the first
    ``n`` requests with outputs cut to 16 tokens."""
    from pagedkv_lab.bench.serve import count_steps

    steps = {}
    for name in workloads:
        w = serve_workload(name, num_requests, max_model_len, budget_requests, systems)
        rounds = count_steps(
            w["requests"],
            max_model_len=max_model_len,
            budget_requests=w["budget_requests"],
            systems=w["systems"],
        )
        if warmup_requests is None:
            warm = rounds
        else:
            cut = [dataclasses.replace(r, output_len=min(16, r.output_len))
                   for r in w["requests"][:warmup_requests]]  # fmt: skip
            warm = count_steps(cut, max_model_len=max_model_len,
                               budget_requests=w["budget_requests"], systems=w["systems"])
        steps[name] = {s: warm[s] + repeats * rounds[s] for s in w["systems"]}
    return steps


def sampling_section(
    device: torch.device, num_prompts: int | None = None, n: int = 4
) -> dict:
    """Parallel sampling of ``n`` per prompt under a tight KV budget: one
    request forked with lazy copy-on-write, with an eager tail copy, and ``n``
    independent requests (chapter 07's `experiments.sharing_designs`)."""
    from pagedkv_lab.course.experiments import prompts_for, sharing_designs
    from pagedkv_lab.models import load_model

    k = num_prompts or by_device(6, 64, device)
    requests = scaled_chat_trace(k, 512, seed=2)
    prompts = prompts_for([r.prompt_len for r in requests], seed=2)
    outs = [min(r.output_len, 96) for r in requests]
    pair = load_model(by_device("tiny-llama", "small-llama", device), device=device)
    rows = sharing_designs(
        prompts, outs, n, kv_tokens=by_device(768, 8192, device), model=pair
    )
    base = next(r for r in rows if r["design"] == "no sharing")
    for r in rows:
        r["speedup"] = base["seconds"] / r["seconds"]
        r.pop("tokens", None)
    return {"n": n, "prompts": k, "rows": rows}


def serve_online(
    llm, prompts, params, arrivals: list[float]
) -> list[tuple[float, int]]:
    """Replay ``arrivals`` (seconds from now) against ``llm`` in real time:
    requests join as their time comes, the engine steps while it has work.
    Returns, per request, (latency from its arrival to its last token, output
    tokens)."""
    start = time.perf_counter()
    index, ids, done = 0, {}, {}
    while len(done) < len(prompts):
        now = time.perf_counter() - start
        while index < len(prompts) and arrivals[index] <= now:
            ids[llm.add_request(prompts[index], params[index])] = index
            index += 1
        if llm.has_unfinished_requests():
            for out in llm.step():
                if not out.finished:
                    continue
                done[ids[out.request_id]] = (
                    time.perf_counter() - start - arrivals[ids[out.request_id]],
                    len(out.token_ids),
                )
        else:
            time.sleep(max(0.0, arrivals[index] - now))
    return [done[i] for i in range(len(prompts))]


def _engine_workload(
    model: str | None,
    device: torch.device,
    num_requests: int,
    max_model_len: int,
    budget_requests: int,
    seed: int,
    dtype: torch.dtype | None = None,
):
    """What `rate_section` and `blocks_section` serve: the loaded model (in
    ``dtype``; None: as `load_model` loads it on ``device``), a W1 trace as
    greedy token-id requests (EOS ignored), and the KV budget in bytes for
    ``budget_requests`` full-length requests."""
    from pagedkv_lab.kvmath import KVSpec
    from pagedkv_lab.models import load_model

    name = model or by_device("tiny-llama", "small-llama", device)
    pair = load_model(name, device=device, dtype=dtype)
    requests = scaled_chat_trace(num_requests, max_model_len, seed=seed)
    params = [
        SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
        for r in requests
    ]
    spec = KVSpec.from_config(pair[0].config, pair[0].dtype)
    budget = spec.bytes_for(budget_requests * max_model_len)
    return name, pair, _prompt_ids(requests, seed), params, budget


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival times (seconds) of ``n`` requests of a Poisson process of
    ``rate`` requests per second: exponential gaps, seeded; the same gaps at
    every rate, scaled."""
    gen = torch.Generator().manual_seed(seed)
    gaps = torch.empty(n, dtype=torch.float64).exponential_(generator=gen)
    return (torch.cumsum(gaps, 0) / rate).tolist()


def normalized_latency(served: list[tuple[float, int]]) -> float:
    """The vLLM paper's normalised latency (§6.2, Fig. 12): the mean over
    requests of end-to-end latency divided by output length, from
    `serve_online`'s ``(latency, output tokens)`` pairs."""
    return statistics.fmean(lat / max(1, k) for lat, k in served)


def rate_section(
    device: torch.device,
    model: str | None = None,
    num_requests: int | None = None,
    max_model_len: int | None = None,
    budget_requests: int = 2,
    loads=(0.5, 1.0, 2.0, 3.0),
    seed: int = 0,
    progress: Callable | None = None,
    seeds=None,
    dtype: torch.dtype | None = None,
) -> dict:
    """Normalised latency (seconds per output token, mean over requests)
    against request rate, Poisson arrivals, for this engine paged and with
    max-length reservation (chapter 02's scheme, what Orca (Max) does), one KV
    budget. Rates are multiples (``loads``) of the paged engine's offline
    throughput in requests per second, measured first (the median of three
    passes, after one untimed pass of the same requests, the warm-up).

    ``seed`` draws the trace; each of ``seeds`` (default: ``seed`` alone) draws
    one set of arrivals, replayed by both systems in turn (their order
    alternates from one seed to the next). A row per system and load holds the
    median over seeds (``normalized_latency_s``, ``p90_latency_s``) and the
    range (``normalized_latency_min``, ``normalized_latency_max``); ``runs``
    holds every replay."""
    from pagedkv_lab.llm import LLM

    n = num_requests or by_device(48, 400, device)
    max_model_len = max_model_len or by_device(128, 512, device)
    seeds = tuple(seeds) if seeds is not None else (seed,)
    name, pair, prompts, params, budget = _engine_workload(
        model, device, n, max_model_len, budget_requests, seed, dtype
    )

    def engine(reserve: bool):
        return LLM(
            pair,
            kv_cache_memory=budget,
            max_model_len=max_model_len,
            reserve_max_len=reserve,
        )

    warm = engine(False)
    warm.generate(prompts, params, use_tqdm=False)  # the warm-up: the whole trace
    passes = []  # three timed passes: one disturbed pass does not move a median of three
    for _ in range(3):
        t0 = time.perf_counter()
        warm.generate(prompts, params, use_tqdm=False)
        passes.append(time.perf_counter() - t0)
    capacity = n / statistics.median(passes)
    systems = (("pagedkv", False), ("max-length reservation", True))
    runs = []
    for load in loads:
        rate = load * capacity
        for i, s in enumerate(seeds):
            arrivals = poisson_arrivals(n, rate, s)
            for system, reserve in systems if i % 2 == 0 else systems[::-1]:
                trace(f"rate {name}: {system} load {load} seed {s}")
                served = serve_online(engine(reserve), prompts, params, arrivals)
                runs.append(
                    {
                        "system": system,
                        "load": load,
                        "seed": s,
                        "rate_req_per_s": rate,
                        "normalized_latency_s": normalized_latency(served),
                        "p90_latency_s": sorted(lat for lat, _ in served)[
                            math.ceil(0.9 * n) - 1
                        ],
                    }
                )
        if progress:
            progress(f"load {load}")
    rows = []
    for load in loads:
        for system, _ in systems:
            mine = [r for r in runs if r["system"] == system and r["load"] == load]
            lat = [r["normalized_latency_s"] for r in mine]
            rows.append(
                {
                    "system": system,
                    "load": load,
                    "rate_req_per_s": mine[0]["rate_req_per_s"],
                    "normalized_latency_s": statistics.median(lat),
                    "normalized_latency_min": min(lat),
                    "normalized_latency_max": max(lat),
                    "p90_latency_s": statistics.median(r["p90_latency_s"] for r in mine),
                    "seeds": len(mine),
                }
            )
    return {
        "model": name,
        "requests": n,
        "capacity_req_per_s": capacity,
        "rows": rows,
        "runs": runs,
    }


def rate_section_steps(
    num_requests: int,
    max_model_len: int,
    budget_requests: int = 2,
    loads=(0.5, 1.0, 2.0, 3.0),
    seeds=(0,),
    seed: int = 0,
) -> int:
    """An estimate of `rate_section`'s forward passes, in steps of about one
    cost, counted without a model (`bench.serve.count_steps`): the three
    capacity runs of the paged engine and its warm-up (the same trace), then for each load, seed and
    system a replay counted as the arrivals' span (the paged engine's offline
    steps over the load: the rate is ``load`` times its capacity) plus the
    system's own offline steps. A replay overlaps the two, so this counts
    more than it runs while the engine keeps up; a system that falls behind
    at a high load takes more steps online than offline, which this does not
    count."""
    from pagedkv_lab.bench.serve import count_steps

    requests = scaled_chat_trace(num_requests, max_model_len, seed=seed)
    offline = count_steps(
        requests,
        max_model_len=max_model_len,
        budget_requests=budget_requests,
        systems=("pagedkv", "contiguous"),
    )
    warm = offline["pagedkv"]
    per_seed = sum(
        offline["pagedkv"] / load + offline[system] for load in loads for system in offline
    )
    return round(warm + 3 * offline["pagedkv"] + len(seeds) * per_seed)


def blocks_section_steps(
    num_requests: int,
    max_model_len: int = 512,
    budget_requests: int = 8,
    block_sizes=BLOCK_SIZES,
    repeats: int = 3,
) -> int:
    """`blocks_section`'s forward passes, counted without a model: one engine
    per block size, each serving the trace once to warm up and ``repeats``
    times timed."""
    from pagedkv_lab.bench.serve import count_steps

    requests = scaled_chat_trace(num_requests, max_model_len, seed=4)
    return sum(
        (1 + repeats)
        * count_steps(
            requests,
            max_model_len=max_model_len,
            budget_requests=budget_requests,
            block_size=bs,
            systems=("pagedkv",),
        )["pagedkv"]
        for bs in block_sizes
    )


def sustained_rate(rows: list[dict], system: str, bound_s: float) -> float | None:
    """The highest request rate at which ``system`` keeps its normalised
    latency within ``bound_s`` seconds per token: the vLLM paper's measure of
    throughput "while maintaining similar latencies" (§6.2, Fig. 12).

    ``rows`` are `rate_section`'s. The rate is interpolated linearly between
    the two swept rates around the first crossing; it is the highest rate
    swept (a lower bound) if the system never crosses, and None if it is over
    the bound already at the lowest rate.
    """
    mine = sorted(
        (r["rate_req_per_s"], r["normalized_latency_s"])
        for r in rows
        if r["system"] == system
    )
    if not mine:
        raise ValueError(f"no rows for system {system!r}")
    if mine[0][1] > bound_s:
        return None
    for (r0, l0), (r1, l1) in zip(mine, mine[1:]):
        if l1 > bound_s:
            return r0 + (r1 - r0) * (bound_s - l0) / (l1 - l0)
    return mine[-1][0]


def plot_latency_vs_rate(rate: dict, path: str | None = None):
    """Normalised latency (milliseconds per output token, as the chapters
    print it) against request rate, one curve per system: the median over
    arrival seeds, with their range shaded where there are several."""
    import matplotlib.pyplot as plt

    from pagedkv_lab.course.plotting import SERIES, use_style

    use_style()
    fig, ax = plt.subplots(figsize=(8, 3.4))
    systems = list(dict.fromkeys(r["system"] for r in rate["rows"]))
    for color, system in zip(SERIES, systems):
        mine = [r for r in rate["rows"] if r["system"] == system]
        xs = [r["rate_req_per_s"] for r in mine]
        seeds = mine[0].get("seeds", 1)
        label = system if seeds == 1 else f"{system}, median of {seeds} seeds"
        ax.plot(xs, [1e3 * r["normalized_latency_s"] for r in mine], "o-", color=color,
                label=label)  # fmt: skip
        if seeds > 1:
            ax.fill_between(
                xs,
                [1e3 * r["normalized_latency_min"] for r in mine],
                [1e3 * r["normalized_latency_max"] for r in mine],
                color=color,
                alpha=0.2,
                lw=0,
            )
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("normalised latency (ms/token)")
    ax.set_title(f"{rate['model']}, {rate['requests']} requests, Poisson arrivals")
    # beside the axes, where no curve runs under it
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=120)
        plt.close(fig)
    return fig


def blocks_section(
    device: torch.device,
    model: str | None = None,
    num_requests: int | None = None,
    max_model_len: int = 512,
    budget_requests: int = 8,
    block_sizes=BLOCK_SIZES,
    repeats: int = 3,
    kernel: dict | None = None,
    dtype: torch.dtype | None = None,
) -> dict:
    """S4 end to end: one engine per block size under one KV budget, served in
    alternating rounds after one untimed pass each (`timing.time_rounds`):
    throughput relative to block 16 (``throughput_vs_ref``: on a GPU the median
    over rounds of the ratio within each round, on a CPU the ratio of the
    fastest rounds; ``ratio_min``/``ratio_max``: the per-round ratios' range),
    every size's tokens judged against block 16's (`judge_outputs`); memory
    waste from chapter 03's simulator on a full-size W1 trace; kernel time by
    block size from ``kernel`` (`kernel_section`) when given."""
    from pagedkv_lab.llm import LLM
    from pagedkv_lab.sim.paged import PagedPool
    from pagedkv_lab.sim.workloads import chat_workload, simulate

    n = num_requests or by_device(16, 256, device)
    name, pair, prompts, params, budget = _engine_workload(
        model, device, n, max_model_len, budget_requests, seed=4, dtype=dtype
    )
    engines = {
        bs: LLM(
            pair, block_size=bs, kv_cache_memory=budget, max_model_len=max_model_len
        )
        for bs in block_sizes
    }
    tokens = {}

    def serve(bs):
        outs = engines[bs].generate(prompts, params, use_tqdm=False)
        tokens[bs] = [o.token_ids for o in outs]

    rounds = time_rounds(
        {bs: partial(serve, bs) for bs in block_sizes}, device, repeats, warmup=1
    )
    pick = statistics.median if device.type == "cuda" else min
    seconds = {bs: pick(t) for bs, t in rounds.items()}
    trace = chat_workload(400, seed=0, arrival_rate=1.0, max_model_len=2048)
    kernel_ms = {
        r["block_size"]: r["paged_ms"] for r in (kernel or {}).get("by_block", [])
    }
    ref = 16 if 16 in block_sizes else block_sizes[0]
    max_tokens = [p.max_tokens for p in params]
    outputs = Outputs(tokens)
    outputs.dtype, outputs.scores, outputs.forced_by = pair[0].dtype, {}, {}
    if pair[0].dtype != torch.float32:  # each engine scores block 16's tokens
        for bs, llm in engines.items():
            outputs.scores[bs] = engine_logprobs(llm, prompts, tokens[ref])
            outputs.forced_by[bs] = "this engine's forward pass"
    judged = judge_outputs(outputs, max_tokens, prompts, pair[0], device, base=ref)
    rows = []
    for bs in block_sizes:
        f = simulate(trace, PagedPool(16 * 2048 // bs, bs, 2048)).fractions()
        per_round = [a / b for a, b in zip(rounds[ref], rounds[bs])]
        rows.append(
            {
                "block_size": bs,
                "throughput_vs_ref": seconds[ref] / seconds[bs],
                "ratio_min": min(per_round),
                "ratio_max": max(per_round),
                "per_round": per_round,
                "rounds": len(per_round),
                "tok_per_s": sum(map(len, tokens[bs])) / seconds[bs],
                "unfilled_share": f["reserved"] + f["internal"],
                "kernel_ms": kernel_ms.get(bs),
                "same_tokens": tokens[bs] == tokens[ref],
                "sound": judged[bs].sound,
                "agreement": judged[bs].summary(),
            }
        )
    return {"model": name, "requests": n, "reference_block": ref, "rows": rows}


# -- the report ------------------------------------------------------------------


def _md_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """Markdown table: (header, key, format) per column."""
    head = "| " + " | ".join(h for h, _, _ in columns) + " |"
    rule = "|" + "---|" * len(columns)
    body = []
    for r in rows:
        cells = []
        for _, key, fmt in columns:
            v = r.get(key)
            missing = v is None or (isinstance(v, float) and math.isnan(v))
            cells.append("—" if missing else format(v, fmt))
        body.append("| " + " | ".join(cells) + " |")
    return "\n".join([head, rule, *body])


SERVE_COLUMNS = [
    ("system", "system", ""),
    ("tok/s", "output_tok_per_s", ".1f"),
    ("ratio", "ratio", ".2f"),
    ("ratio min", "ratio_min", ".2f"),
    ("ratio max", "ratio_max", ".2f"),
    ("TTFT p50 s", "ttft_p50", ".2f"),
    ("TTFT p90 s", "ttft_p90", ".2f"),
    ("TPOT p50 s", "tpot_p50", ".3f"),
    ("TPOT p90 s", "tpot_p90", ".3f"),
    ("peak KV MiB", "peak_kv_MiB", ".1f"),
    ("same tokens", "same_tokens_as_first", "d"),
    ("startup s", "startup_s", ".1f"),
]


def write_report(results: dict, out: Path) -> str:
    """``report.md`` from ``results`` (what `run_all` measured)."""
    lines = ["# pagedkv_lab benchmark report", ""]
    lines += [f"- {k}: {v}" for k, v in results["environment"].items()]
    lines += [f"- command: `{results['command']}`", ""]
    if "kernel" in results:
        k = results["kernel"]
        lines += [
            "## Kernel: paged vs contiguous decode attention (S1)",
            "",
            f"Copy bandwidth of this device: {k['copy_GBps']:.1f} GB/s "
            "(read + write). Ratios are time over contiguous SDPA's, same K/V. "
            "S5 (LIFO vs FIFO free list, L2 hit rate) needs a GPU profiler's "
            "hardware counters: unmeasured.",
            "",
            _md_table(
                k["rows"],
                [
                    ("dtype", "dtype", ""),
                    ("batch", "batch", "d"),
                    ("context", "context_len", "d"),
                    ("contig ms", "contiguous_ms", ".3f"),
                    ("paged ms", "paged_ms", ".3f"),
                    ("paged/contig", "paged_over_contiguous", ".2f"),
                    ("torch/contig", "torch_over_contiguous", ".2f"),
                    ("paged GB/s", "paged_GBps", ".1f"),
                    ("contig GB/s", "contiguous_GBps", ".1f"),
                ],
            ),
            "",
            "![kernel bandwidth](kernel_bandwidth.png)",
            "",
        ]
    if "serve" in results:
        lines += ["## Serving (S2)", ""]
        for name, w in results["serve"].items():
            r0 = w["rows"][0]
            lines += [
                f"### {name}: {w['requests']} requests, {r0['model']}, KV budget "
                f"{r0['budget_kv_MiB']:.1f} MiB, {r0['repeats']} alternating rounds, "
                f"{r0.get('kv_bytes_per_element', 4)}-byte K/V elements",
                "",
                _md_table(w["rows"], SERVE_COLUMNS),
                "",
            ]
            lines += [
                f"- {r['system']}: "
                + ", ".join(f"{k} {v}" for k, v in r["versions"].items())
                for r in w["rows"]
                if "versions" in r
            ]
            lines += [""]
    if "sampling" in results:
        s = results["sampling"]
        lines += [
            f"## Parallel sampling, n = {s['n']}, {s['prompts']} prompts (C1)",
            "",
            _md_table(
                s["rows"],
                [
                    ("design", "design", ""),
                    ("seconds", "seconds", ".2f"),
                    ("speedup", "speedup", ".2f"),
                    ("steps", "steps", "d"),
                    ("preemptions", "preemptions", "d"),
                    ("tokens computed", "tokens_computed", "d"),
                    ("mean blocks", "mean_blocks", ".1f"),
                ],
            ),
            "",
        ]
    if "rate" in results:
        r = results["rate"]
        lines += [
            f"## Latency against request rate ({r['model']}, {r['requests']} "
            "requests, Poisson arrivals)",
            "",
            f"Offline capacity of the paged engine: {r['capacity_req_per_s']:.2f} req/s.",
            "",
            _md_table(
                r["rows"],
                [
                    ("system", "system", ""),
                    ("load", "load", ".2f"),
                    ("rate req/s", "rate_req_per_s", ".2f"),
                    ("normalised latency s/token", "normalized_latency_s", ".3f"),
                    ("min over seeds", "normalized_latency_min", ".3f"),
                    ("max over seeds", "normalized_latency_max", ".3f"),
                    ("p90 latency s", "p90_latency_s", ".2f"),
                ],
            ),
            "",
            "![latency](latency_vs_rate.png)",
            "",
        ]
    if "blocks" in results:
        b = results["blocks"]
        lines += [
            f"## Block size end to end (S4), {b['model']}, {b['requests']} requests",
            "",
            _md_table(
                b["rows"],
                [
                    ("block size", "block_size", "d"),
                    (
                        f"throughput / block {b['reference_block']}",
                        "throughput_vs_ref",
                        ".2f",
                    ),
                    ("tok/s", "tok_per_s", ".1f"),
                    ("unfilled share (W1 sim)", "unfilled_share", ".1%"),
                    ("kernel ms", "kernel_ms", ".3f"),
                ],
            ),
            "",
        ]
    text = "\n".join(lines)
    (out / "report.md").write_text(text)
    return text


def run_all(
    out: str | Path,
    device: torch.device,
    sections=SECTIONS,
    vllm_python: str | None = None,
    command: str = "python -m pagedkv_lab.bench all",
    quick: bool = False,
) -> dict:
    """Run ``sections`` on ``device``, write ``report.md``, ``results.json`` and
    the figures into ``out``; return the results. ``quick`` runs small sizes
    (a smoke test of the whole pipeline)."""
    import matplotlib

    matplotlib.use("Agg")
    from tqdm.auto import tqdm

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise ValueError(
            f"unknown section(s) {sorted(unknown)}; choose from {SECTIONS}"
        )
    results: dict = {
        "environment": {**device_report(device), "cpu model": cpu_model()},
        "command": command,
        "threads": torch.get_num_threads(),
    }
    small = dict(num_requests=8) if quick else {}
    bar = tqdm(total=len(sections), desc="bench all", unit="section")
    for name in sections:
        bar.set_postfix_str(name)
        t0 = time.perf_counter()
        if name == "kernel":
            grid = dict(batch_sizes=(1, 4), context_lens=(128, 512), repeats=3)
            results["kernel"] = kernel_section(device, **(grid if quick else {}))
            plot_kernel_bandwidth(results["kernel"], str(out / "kernel_bandwidth.png"))
        elif name == "serve":
            results["serve"] = serve_section(
                device,
                vllm_python=vllm_python,
                # five rounds: one disturbed round moves a median of three a lot
                repeats=1 if quick else 5,
                progress=lambda w: bar.set_postfix_str(f"serve {w}"),
                **small,
            )
        elif name == "sampling":
            results["sampling"] = sampling_section(
                device, num_prompts=2 if quick else None
            )
        elif name == "rate":
            results["rate"] = rate_section(
                device,
                loads=(1.0, 3.0) if quick else (0.5, 1.0, 2.0, 3.0),
                progress=lambda s: bar.set_postfix_str(f"rate {s}"),
                **small,
            )
            plot_latency_vs_rate(results["rate"], str(out / "latency_vs_rate.png"))
        elif name == "blocks":
            results["blocks"] = blocks_section(
                device,
                kernel=results.get("kernel"),
                repeats=1 if quick else 3,
                **small,
            )
        results.setdefault("seconds", {})[name] = time.perf_counter() - t0
        bar.update()
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    bar.close()
    write_report(results, out)
    return results
