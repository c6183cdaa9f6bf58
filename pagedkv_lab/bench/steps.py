"""Where a served run's steps spend their time: `StepClock` splits every
``LLM.step`` into the host's work and the device's, and `profile_decode_steps`
records a `torch.profiler` table of decode steps at full batch, with the
device's busy time.

On a GPU a step's wall time is the host's own work (scheduling, packing and
uploading the inputs, launching, appending tokens, outputs) plus the time it
waits for the device to hand back the step's tokens. The clock brackets two
spans with CUDA events, tightly: the forward pass from after its inputs are
uploaded (for a decode step, around the graph replay alone; for an eager step,
around the runner's ``forward``) and the sampler's own launches. An event
span is the device's timeline between two marks, so it also holds any time
the device sat idle between them, waiting for the host to launch the next
kernel: for a graph replay (one launch) that is nothing, for an eager step or
the sampler (many small launches) it can be most of the span. The device's
busy time, kernels and copies actually running, comes from ``torch.profiler``'s
CUDA activity instead (`profile_decode_steps`, `device_busy_seconds`), and its
idle time is the wall time minus that. On a CPU the host runs the forward
pass and the sampler itself, so their spans are wall time and nothing waits.
"""

from __future__ import annotations

import collections
import statistics
import time
from dataclasses import dataclass, field

import torch


@dataclass
class _Step:
    wall: float = 0.0
    waited: float = 0.0
    decode_only: bool = False
    batch: int = 0
    spans: dict = field(default_factory=lambda: {"forward": [], "sampling": []})


class _Stand:
    """Calls ``make(original, *args)`` in place of ``original``; any other
    attribute is the original's (``runner.sampler.batch``, ...)."""

    def __init__(self, original, make):
        self.original, self._make = original, make

    def __call__(self, *args, **kwargs):
        return self._make(self.original, *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.original, name)


class StepClock:
    """Times every step of ``llm``: call `step` instead of ``llm.step``.

    The clock stands in, on this engine only, for the places where a step's
    device work begins and ends (an instrument, as
    ``scripts/host_step_time.py``'s; `detach` puts them back): the runner's
    eager ``forward`` (called once the step's inputs are on the device); for a
    graph replay, the graphs' input upload (``_fill``: the replay follows it)
    and ``replay`` (which returns right after it); the sampler's ``sample``
    (its batch built: the sampler's launches begin) and the sampler's call
    (which returns with the launches done). The host's waits are the waits the
    step's `SampledTokens.read` reports. On a GPU the marks are CUDA events,
    read only once the run is over (`summary`), so that the clock adds no wait
    of its own.
    """

    def __init__(self, llm):
        self.llm = llm
        runner = llm.runner
        self.cuda = runner.device.type == "cuda"
        self.steps: list[_Step] = []
        self._current: _Step | None = None
        self._open: dict[str, object] = {}  # span -> its start, until it ends
        self._sampled: list = []
        self._wrapped: list[tuple[object, str]] = []
        self._wrap(runner, "forward", self._around("forward"))
        if runner.graphs is not None:  # graph replays
            self._wrap(runner.graphs, "_fill", self._then_start("forward"))
            self._wrap(runner.graphs, "replay", self._then_end("forward"))
        self._wrap(runner.sampler, "sample", self._start_first("sampling"))
        self._wrap(runner, "sampler", self._then_end("sampling", keep=True))

    def _mark(self):
        """A point on the device's timeline (a CUDA event), or the wall clock."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _recording(self) -> bool:
        # a graph being captured records nothing real (and events inside it would not time)
        return self._current is not None and not (
            self.cuda and torch.cuda.is_current_stream_capturing()
        )

    def _wrap(self, owner, name: str, make) -> None:
        """Stand in for ``owner.name`` (a method or a callable object) with
        ``make(original)``, a `_Stand` that forwards any other attribute."""
        setattr(owner, name, _Stand(getattr(owner, name), make))
        self._wrapped.append((owner, name))

    def _around(self, span: str):
        def timed(original, *args, **kwargs):
            if not self._recording():
                return original(*args, **kwargs)
            start = self._mark()
            out = original(*args, **kwargs)
            self._current.spans[span].append((start, self._mark()))
            return out

        return timed

    def _then_start(self, span: str):
        def then_start(original, *args, **kwargs):
            out = original(*args, **kwargs)
            if self._recording():
                self._open[span] = self._mark()
            return out

        return then_start

    def _start_first(self, span: str):
        def start_first(original, *args, **kwargs):
            if self._recording():
                self._open[span] = self._mark()
            return original(*args, **kwargs)

        return start_first

    def _then_end(self, span: str, keep: bool = False):
        def then_end(original, *args, **kwargs):
            out = original(*args, **kwargs)
            start = self._open.pop(span, None)
            if start is not None and self._recording():
                self._current.spans[span].append((start, self._mark()))
            if keep and out is not None:
                self._sampled.append(out)
            return out

        return then_end

    def detach(self) -> None:
        """Give the engine its own methods and collaborators back."""
        for owner, name in reversed(self._wrapped):
            stand = getattr(owner, name)
            if name in vars(type(owner)):  # a method: the class has it again
                delattr(owner, name)
            else:  # a collaborator held by the instance
                setattr(owner, name, stand.original)
        self._wrapped = []

    def step(self) -> list:
        """``llm.step()``, timed."""
        self._current, self._open = _Step(), {}
        start = time.perf_counter()
        try:
            return self.llm.step()
        finally:
            self._current.wall = time.perf_counter() - start
            done = [t for t in self._sampled if t.waited or t._ready is None]
            self._current.waited = sum(t.waited for t in done)
            self._sampled = [t for t in self._sampled if t not in done]
            plan = self.llm.last_plan
            self._current.decode_only = bool(plan is not None and plan.decode_only)
            self._current.batch = 0 if plan is None else len(plan.seqs)
            self.steps.append(self._current)
            self._current = None

    def _seconds(self, span) -> float:
        start, end = span
        if self.cuda:
            return start.elapsed_time(end) / 1e3
        return end - start

    def summary(self) -> dict:
        """Milliseconds per step, as means over all steps, over the decode steps
        and over the decode steps at full batch: ``wall``, ``host`` (wall
        minus waits), ``waited``, and the spans ``forward``, ``sampling`` and
        ``device`` (their sum; on a GPU an upper bound on the device's busy
        time in them, see the module's docstring)."""
        if self.cuda:
            torch.cuda.synchronize()
        rows = []
        for s in self.steps:
            fwd = sum(self._seconds(x) for x in s.spans["forward"])
            smp = sum(self._seconds(x) for x in s.spans["sampling"])
            rows.append({"wall": s.wall, "waited": s.waited, "host": s.wall - s.waited,
                         "forward": fwd, "sampling": smp, "device": fwd + smp,
                         "decode_only": s.decode_only, "batch": s.batch})  # fmt: skip
        keys = ("wall", "host", "waited", "device", "forward", "sampling")

        def means(selected) -> dict:
            if not selected:
                return {}
            out = {k: 1e3 * statistics.fmean(r[k] for r in selected) for k in keys}
            out["steps"] = len(selected)
            out["mean_batch"] = statistics.fmean(r["batch"] for r in selected)
            return out

        decode = [r for r in rows if r["decode_only"]]
        full = max((r["batch"] for r in decode), default=0)
        return {"clock": "cuda events" if self.cuda else "wall clock (CPU)",
                "all_steps": means(rows), "decode_steps": means(decode),
                "full_batch_decode_steps": means([r for r in decode if r["batch"] == full])}


def device_busy_seconds(events) -> float | None:
    """Seconds during which the device ran something (kernels, copies, memsets),
    from a profiler's events (``prof.events()``): the union of the CUDA
    events' time ranges, so that overlapping work counts once. None without
    CUDA events (a CPU run, or a profiler without CUDA activity)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if getattr(e, "device_type", None) is not None
                   and e.device_type.name == "CUDA")  # fmt: skip
    if not spans:
        return None
    busy, (start, end) = 0.0, spans[0]
    for s, e in spans[1:]:
        if s > end:
            busy, start, end = busy + end - start, s, e
        else:
            end = max(end, e)
    return (busy + end - start) / 1e6  # the profiler's microseconds


def step_over_floor(llm, prompts, params) -> dict:
    """Serve ``prompts`` (with ``params``) on ``llm``, timing every step, and
    compare its decode steps at their largest batch with their physical floor:
    the bytes such a step must read (every weight but the input embedding, and
    every sequence's K/V) over the copy bandwidth measured on the device now.
    Returns ``step_ms`` and ``floor_ms`` (medians over those steps), their
    ``ratio``, the ``batch`` and the ``steps`` counted. A step within a small
    multiple of its floor spends most of its time reading memory (chapter 11's
    gate for claims about serving at scale, `claims.memory_bound`)."""
    from pagedkv_lab.bench.nanovllm import weight_bytes_per_step
    from pagedkv_lab.bench.report import copy_bandwidth
    from pagedkv_lab.kvmath import KVSpec

    bandwidth = copy_bandwidth(llm.runner.device)
    weights = weight_bytes_per_step(llm.model)
    per_token = KVSpec.from_config(llm.model.config, llm.model.dtype).bytes_per_token
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        llm.add_request(f"floor-{i}", prompt, p)
    rows = []
    while llm.has_unfinished_requests():
        start = time.perf_counter()
        llm.step()
        wall = time.perf_counter() - start
        plan = llm.last_plan
        if plan is not None and plan.decode_only:
            kv = sum(seq.num_computed_tokens for seq in plan.seqs)
            rows.append((len(plan.seqs), wall, (weights + kv * per_token) / bandwidth))
    if not rows:
        raise ValueError("no decode step: ask for more than one token")
    batch = max(r[0] for r in rows)
    full = [r for r in rows if r[0] == batch]
    step, floor = (statistics.median(r[k] for r in full) for k in (1, 2))
    return {"step_ms": 1e3 * step, "floor_ms": 1e3 * floor, "ratio": step / floor,
            "batch": batch, "steps": len(full)}  # fmt: skip


def format_breakdown(b: dict) -> list[str]:
    """`StepClock.summary` as lines of text."""
    lines = []
    for key, label in (("all_steps", "all steps"), ("decode_steps", "decode steps"),
                       ("full_batch_decode_steps", "decode steps at full batch")):  # fmt: skip
        m = b.get(key)
        if not m:
            continue
        lines.append(
            f"{label} ({m['steps']}, mean batch {m['mean_batch']:.0f}): "
            f"{m['wall']:.2f} ms a step = host {m['host']:.2f} ms + waiting "
            f"{m['waited']:.2f} ms; device: forward {m['forward']:.2f} ms, "
            f"sampling {m['sampling']:.2f} ms"
        )
    if lines:
        lines.append(f"(device times from {b['clock']}; host = wall - waiting for the device)")
    return lines


def profile_decode_steps(llm, requests, steps: int = 20, path=None) -> dict:
    """Serve ``requests`` (``(prompt, SamplingParams)`` pairs) on ``llm`` until
    every step is a decode step, profile the next ``steps`` steps with
    `torch.profiler`, abort what is left. Returns ``table``, the profiler's
    table of operations (sorted by the device's time on a GPU, the CPU's
    otherwise; written to ``path`` too if given), the ``batch``, and per step,
    in milliseconds: ``wall_ms`` (under the profiler, which slows the host)
    and, on a GPU, ``busy_ms`` (`device_busy_seconds`: the device running
    anything). Idle time is a wall time minus ``busy_ms``; the wall time to
    take is an unprofiled one at the same batch (`StepClock`)."""
    from torch.profiler import ProfilerActivity, profile

    ids = [f"profile-{i}" for i in range(len(requests))]
    for rid, (prompt, params) in zip(ids, requests):
        llm.add_request(rid, prompt, params)
    try:
        for _ in range(10_000):
            llm.step()
            plan = llm.last_plan
            if plan is not None and plan.decode_only and not llm.scheduler.waiting:
                break
        cuda = llm.runner.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        batch = len(llm.last_plan.seqs)
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                llm.step()
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
    finally:
        llm.abort_request(ids)
        while llm.has_unfinished_requests():
            llm.step()
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    table = (f"{steps} decode steps at batch {batch}, sorted by {sort}\n"
             + prof.key_averages().table(sort_by=sort, row_limit=40))
    if path is not None:
        from pathlib import Path

        Path(path).write_text(table + "\n")
    busy = device_busy_seconds(prof.events()) if cuda else None
    return {"table": table, "steps": steps, "batch": batch, "wall_ms": 1e3 * wall / steps,
            "busy_ms": None if busy is None else 1e3 * busy / steps}  # fmt: skip


def step_ops(llm) -> collections.Counter[str]:
    """The torch operations one ``llm.step()`` dispatches outside the model's
    forward pass, by name (`fused.count_ops`): scheduling, the inputs' upload,
    sampling, reading the tokens back. On a GPU each is a kernel launch or a
    copy; a step whose count grows with its batch has a per-row loop in it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts: collections.Counter[str] = collections.Counter()
    paused = [False]

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not paused[0]:
                counts[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    runner = llm.runner
    forward = runner.forward

    def uncounted(step):
        paused[0] = True
        try:
            return forward(step)
        finally:
            paused[0] = False

    runner.forward = uncounted
    try:
        with Counting():
            llm.step()
    finally:
        del runner.forward
    return counts
