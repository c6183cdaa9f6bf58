"""Serving side by side: this engine and its peers over one trace, one KV
budget, alternating rounds (`python -m pagedkv_lab.bench serve`)."""

from __future__ import annotations

import math
import statistics
import time

import torch

from pagedkv_lab.bench.common import (
    ALL_SYSTEMS,
    SYSTEMS,
    ServeSetup,
    _prompt_ids,
    _run_result,
    peak_kv_note,
    scaled_chat_trace,
    static_batches,
)
from pagedkv_lab.bench.peers import (
    _HFContinuousRunner,
    _HFStaticRunner,
    _save_for_vllm,
    _VLLMRunner,
    find_vllm_python,
    vllm_block_sizes,
)
from pagedkv_lab.bench.timing import trace


class _OursRunner:
    """This engine; ``reserve=True`` reserves ``max_model_len`` tokens per request (chapter 02's scheme)."""

    def __init__(self, setup: ServeSetup, reserve: bool):
        from pagedkv_lab.kvmath import KVSpec
        from pagedkv_lab.llm import LLM
        from pagedkv_lab.models import load_model

        self.name = "contiguous" if reserve else "pagedkv"
        self.block_size = setup.block_size
        # loaded as the transformers runners load it: same weights, same dtype
        pair = load_model(setup.model_name, device=setup.device, dtype=setup.dtype)
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
        from pagedkv_lab.sampling_params import SamplingParams

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

    def score(self, prompts: list[list[int]], outputs: list[list[int]]) -> list[list[float]]:
        """This engine's teacher-forced log-probabilities of ``outputs``
        (`compare.engine_logprobs`): its own runner, kernels and paged cache."""
        from pagedkv_lab.bench.compare import engine_logprobs

        return engine_logprobs(self.llm, prompts, outputs)

    @property
    def dtype(self) -> torch.dtype:
        return self.llm.model.dtype

    def close(self) -> None:
        del self.llm


class Outputs(dict):
    """`serve_benchmark`'s tokens, by system (each system's first timed round),
    with what `report.judge_outputs` needs to judge them: ``dtype``, the weights'
    number format every system served in, and, in 16 bits, ``scores``: each
    system's teacher-forced log-probabilities of the first system's tokens where
    it can score a sequence (this engine: ``prompt_logprobs``), and
    ``forced_by``, whose forward pass produced them."""

    dtype: torch.dtype | None = None
    scores: dict
    forced_by: dict




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
    """One table row from a system's repetitions: medians over rounds; ``ratio``
    the median of per-round ratios, ``ratio_min``/``ratio_max`` their range."""

    def tok_s(r):
        return sum(map(len, r["tokens"])) / r["seconds"]

    med = statistics.median
    n = len(runs[0]["tokens"])
    ratios = [tok_s(r) / tok_s(b) for r, b in zip(runs, base_runs)]
    row = {
        "system": name,
        "model": setup.model_name,
        "device": str(setup.device),
        "threads": setup.threads,
        "repeats": len(runs),
        "block_size": block_size,
        "seconds": med(r["seconds"] for r in runs),
        "output_tok_per_s": med(tok_s(r) for r in runs),
        "ratio": med(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
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
    warmup_requests: int | None = None,
    threads: int | None = None,
    static_policy: str = "padded",
    vllm_python: str | None = None,
    vllm_block_sizes_to_try: tuple[int, ...] = (32, 64, 128),
    vllm_modes: tuple[str, ...] = ("compile", "eager"),
    prompts: list[list[int]] | None = None,
    prefix_caching: bool = False,
    dtype: torch.dtype | None = None,
    score: bool | None = None,
) -> tuple[list[dict], Outputs]:
    """Serve the same requests with each system, like for like; return summary rows and outputs.

    Every system gets the same model weights (in ``dtype``: None loads them as
    `load_model` does on ``device``), the same token-id requests (greedy,
    EOS ignored, exactly ``output_len`` tokens each), the same warm-up (by
    default one untimed pass of the whole workload, so that no timed round
    compiles, captures or allocates for the first time; ``warmup_requests=n``:
    the first ``n`` requests, outputs cut to 16 tokens), the same KV budget (``budget_requests * max_model_len`` tokens'
    worth of bytes), the same per-step token budget (``max_num_batched_tokens``:
    transformers calls it ``max_batch_tokens``; ``generate`` has none, it prefills a
    whole batch at once), the same batch limit (``max_num_seqs``) and the same
    number of CPU threads. ``hf-generate`` runs static batches sized by the budget
    (`static_batches`, ``static_policy``). ``"vllm"`` runs vLLM in a subprocess (see
    `find_vllm_python`) at each block size of ``vllm_block_sizes_to_try`` that its
    CPU backend accepts and in each of ``vllm_modes``: ``"eager"`` (row
    ``vllm-b<size>``) and ``"compile"``, vLLM's default torch.compile (row
    ``vllm-b<size>-tc``). Which of the two is faster depends on the machine
    (``book/vllm.md`` gives what two 2-core CPUs measured), so both run by
    default.

    ``prompts`` replaces the random token ids drawn for ``requests`` (e.g. a
    workload whose prompts share a prefix; ``requests`` still gives the output
    lengths). ``prefix_caching`` turns prefix caching on in every system that has
    it (this engine, transformers' block sharing, vLLM); ``hf-generate`` has none.

    ``startup_s`` in each row is the time to start the system and serve the
    warm-up, kept apart from the timed rounds: loading, packing weights and,
    for vLLM's compiled rows, ``torch.compile`` (vLLM's CPU backend also
    compiles some graphs in the warm-up's first steps).

    The systems run ``repeats`` rounds, alternating their order (ABC, CBA, ABC...);
    a row holds medians over rounds, and ``ratio`` is the median over rounds of its
    throughput over the first system's in the same round. The ``peak_kv_MiB``
    column is `PEAK_KV`. ``outputs`` (`Outputs`) maps each system to its first
    round's tokens. With ``score`` (None: when the weights are 16-bit), each
    system that can score a token sequence scores the first system's tokens
    before it closes (`Outputs.scores`), for `report.judge_outputs`.
    """
    import gc
    import tempfile

    from pagedkv_lab.device import pick_device

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
    if warmup_requests is None:  # the whole workload, once, untimed
        warm_prompts, warm_tokens = prompts, max_tokens
    else:
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
        dtype=dtype,
    )
    runners: list = []
    startup: list[float] = []  # per runner: seconds to start (load, pack, compile)

    def start(runner_class, *args, **kwargs) -> None:
        started = time.perf_counter()
        runners.append(runner_class(*args, **kwargs))
        startup.append(time.perf_counter() - started)

    tmp = tempfile.TemporaryDirectory(prefix="pagedkv-serve-")
    try:
        for system in systems:
            if system in ("pagedkv", "contiguous"):
                start(_OursRunner, setup, system == "contiguous")
            elif system == "hf-generate":
                start(_HFStaticRunner, setup)
            elif system == "hf-continuous":
                start(_HFContinuousRunner, setup)
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
                        start(
                            _VLLMRunner,
                            setup,
                            python,
                            size,
                            model_dir,
                            tmp.name,
                            eager=mode == "eager",
                        )
        for i, runner in enumerate(runners):  # the same warm-up for every system
            started = time.perf_counter()
            trace(f"serve {model_name}: {runner.name} warm-up")
            runner.run(warm_prompts, warm_tokens)
            # vLLM compiles on its first step: the warm-up belongs to the start
            startup[i] += time.perf_counter() - started
        results: dict[str, list[dict]] = {r.name: [] for r in runners}
        for round_ in range(repeats):
            for runner in runners if round_ % 2 == 0 else runners[::-1]:
                gc.collect()
                trace(f"serve {model_name}: {runner.name} round {round_} starts")
                results[runner.name].append(runner.run(prompts, max_tokens))
                seconds = results[runner.name][-1]["seconds"]
                trace(f"serve {model_name}: {runner.name} round {round_}: {seconds:.1f} s")
        outputs = Outputs({name: runs[0]["tokens"] for name, runs in results.items()})
        outputs.dtype = next((r.dtype for r in runners if hasattr(r, "dtype")), dtype)
        outputs.scores, outputs.forced_by = {}, {}
        if score is None:
            score = outputs.dtype not in (None, torch.float32)
        reference = outputs[runners[0].name]
        for runner in runners if score else ():
            if hasattr(runner, "score"):
                outputs.scores[runner.name] = runner.score(prompts, reference)
                outputs.forced_by[runner.name] = "this engine's forward pass"
    finally:
        for runner in runners:
            runner.close()
        tmp.cleanup()
        torch.set_num_threads(old_threads)
    base = results[runners[0].name]
    rows = [
        _summarise(r.name, results[r.name], base, setup, r.block_size) for r in runners
    ]
    for runner, row, seconds in zip(runners, rows, startup):
        row["startup_s"] = seconds
        if isinstance(runner, _VLLMRunner):
            row["versions"] = {
                k: runner.info[k] for k in ("vllm", "torch", "transformers")
            }
    return rows, outputs


def count_steps(
    requests,
    *,
    max_model_len: int,
    budget_requests: int,
    block_size: int = 16,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int | None = None,
    systems: tuple[str, ...] = SYSTEMS,
) -> dict[str, int]:
    """The forward passes each system of `serve_benchmark` takes to serve
    ``requests`` once, counted without a model (EOS is ignored, so the
    schedule does not depend on the tokens): a round's cost on a device where
    each step costs about the same.

    ``pagedkv`` and ``contiguous`` run this engine's own `Scheduler` on a block
    manager of the budget (exact; prefix caching is left out, which can only
    add steps); ``hf-generate`` is its static batches (`static_batches`), each
    as many passes as its longest output; ``hf-continuous`` and ``vllm`` have
    schedulers of their own and are counted as ``pagedkv`` (an estimate).
    """
    from pagedkv_lab.engine.block_manager import BlockManager
    from pagedkv_lab.engine.sampler import SampledOutput
    from pagedkv_lab.engine.scheduler import Scheduler
    from pagedkv_lab.engine.sequence import Sequence, SequenceGroup
    from pagedkv_lab.sampling_params import SamplingParams

    budget_tokens = budget_requests * max_model_len
    batched = max_num_batched_tokens or max(512, max_model_len)

    def scheduled(reserve: bool) -> int:
        sched = Scheduler(
            BlockManager(budget_tokens // block_size, block_size),
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=batched,
            reserve_tokens=max_model_len if reserve else 0,
        )
        for i, r in enumerate(requests):
            params = SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
            sched.add(SequenceGroup(i, Sequence([1] * r.prompt_len, params)))
        steps = 0
        while sched.has_unfinished:
            plan, steps = sched.schedule(), steps + 1
            n = len(plan.sample_seqs)  # every sampled token is 5
            sched.postprocess(plan, SampledOutput([5] * n, [0.0] * n, [None] * n, {}, []))
        return steps

    counts = {}
    for system in systems:
        if system == "hf-generate":
            outs = [r.output_len for r in requests]
            batches = static_batches(
                [r.prompt_len for r in requests], outs, budget_tokens, max_num_seqs
            )
            counts[system] = sum(max(outs[i] for i in b) for b in batches)
        elif system == "contiguous":
            counts[system] = scheduled(reserve=True)
        else:
            counts[system] = counts.get("pagedkv") or scheduled(reserve=False)
    return counts


def serve_title(rows: list[dict]) -> str:
    """One line naming the model, device and threads of `serve_benchmark` rows."""
    r = rows[0]
    return f"serve: {r['model']} on {r['device']} ({r['threads']} threads)"


def print_serve_notes(
    systems: list[str] | tuple[str, ...], width: int = 88, ms: bool = False
) -> None:
    """The notes `print_serve_table` prints under a table: the TTFT and TPOT
    columns' unit (with ``ms``) and how peak KV is read for ``systems``; for
    printing them once under several tables."""
    if ms:
        _print_units_note(width)
    _print_peak_kv_note(systems, width)


def _print_units_note(width: int) -> None:
    import textwrap

    print(textwrap.fill(
        "TTFT (time to first token) and TPOT (time per output token after the "
        "first) in ms; 50, 90: percentiles over the requests.", width
    ))  # fmt: skip


def _print_peak_kv_note(systems: list[str] | tuple[str, ...], width: int) -> None:
    import textwrap

    note = peak_kv_note(list(systems))
    print(textwrap.fill(note + ".", width, break_on_hyphens=False))


def print_serve_table(
    rows: list[dict],
    title: str | None = None,
    width: int = 88,
    ms: bool = False,
    notes: bool = True,
) -> None:
    """Print `serve_benchmark` rows under a title naming the model and device.

    ``ratio`` is throughput over the first row's, the median of per-round ratios;
    TTFT and TPOT in seconds, or in milliseconds with ``ms`` (a note under the
    table says so); the table is 80 columns wide and the notes under it are
    wrapped to ``width``. With ``notes=False`` the general notes (units, peak
    KV: `print_serve_notes`) are left out, for printing once under several
    tables; the lines about this table's own rows stay.
    """
    import textwrap

    r0 = rows[0]
    print(title or serve_title(rows))
    rounds = f"{r0['repeats']} alternating round{'s' * (r0['repeats'] != 1)}"
    print(
        f"KV budget {r0['budget_kv_MiB']:.1f} MiB, {rounds}; ratio: tok/s over "
        f"{r0['system']}'s, same round"
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

    scale, ttft_digits, tpot_digits = (1e3, 1, 2) if ms else (1, 2, 3)
    for r in rows:
        ttft = [cell(scale * r[k], 7, ttft_digits) for k in ("ttft_p50", "ttft_p90")]
        tpot = [cell(scale * r[k], 7, tpot_digits) for k in ("tpot_p50", "tpot_p90")]
        print(
            f"{r['system']:14} {r['output_tok_per_s']:7.1f} {r['ratio']:6.2f} "
            f"{r['req_per_s']:6.2f} {ttft[0]} {ttft[1]} {tpot[0]} {tpot[1]} "
            f"{r['peak_kv_MiB']:11.1f}"
        )
    if ms and notes:
        _print_units_note(width)
    if r0["repeats"] > 1 and "ratio_min" in r0:
        spread = "; ".join(
            f"{r['system']} {r['ratio_min']:.2f}-{r['ratio_max']:.2f}" for r in rows[1:]
        )
        print(textwrap.fill(f"ratio per round, min-max: {spread}", width))
    if notes:
        _print_peak_kv_note([r["system"] for r in rows], width)
    for r in rows:
        if "batch_sizes" in r:
            sizes = r["batch_sizes"]
            batches = "batch" if len(sizes) == 1 else "batches"
            lo, hi = min(sizes), max(sizes)
            span = f"{lo}" if lo == hi else f"{lo}-{hi}"
            print(
                f"{r['system']}: {len(sizes)} static {batches} of {span} "
                "requests, sized by the KV budget"
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

    from pagedkv_lab.course.plotting import SERIES, use_style

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
