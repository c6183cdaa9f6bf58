"""Where a served run's steps spend their time: `StepClock` splits every
``LLM.step`` into the host's work and the device's, and `profile_decode_steps`
records a `torch.profiler` table of decode steps at full batch.

On a GPU a step's wall time is the host's own work (scheduling, packing the
inputs, launching, appending tokens, outputs) plus the time it waits for the
device to hand back the step's tokens; the device's time is measured apart,
with CUDA events around the forward pass (a graph replay, for decode) and
around the sampler. In the synchronous loop the GPU idles for the whole of the
host's share; with a step in flight, for whatever of it exceeds the device's
time. Either way that idle time is the engine's, whatever the kernels do. On a CPU the host runs the forward
pass and the sampler itself, so their share is wall time, and nothing waits.
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


class StepClock:
    """Times every step of ``llm``: call `step` instead of ``llm.step``.

    The model runner's forward pass (`ModelRunner.logits`, packing included)
    and its sampler are bracketed, on a GPU by CUDA events, read only once the
    run is over (`summary`), so that the clock adds no wait of its own; the
    host's waits are the `SampledTokens.read` waits the engine reports. The
    clock stands in for the runner's two collaborators (an instrument, as
    ``scripts/host_step_time.py``'s), and `detach` puts them back.
    """

    def __init__(self, llm):
        self.llm = llm
        runner = llm.runner
        self.cuda = runner.device.type == "cuda"
        self.steps: list[_Step] = []
        self._current: _Step | None = None
        self._sampled: list = []
        self._saved = {"logits": runner.logits, "sampler": runner.sampler}
        runner.logits = self._timed(runner.logits, "forward")
        runner.sampler = self._timed(runner.sampler, "sampling", keep=True)

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _timed(self, fn, span: str, keep: bool = False):
        clock = self

        class Timed:
            batch = property(lambda _: getattr(fn, "batch", None))

            def __call__(self, *args, **kwargs):
                start = clock._mark()
                try:
                    out = fn(*args, **kwargs)
                finally:
                    if clock._current is not None:
                        clock._current.spans[span].append((start, clock._mark()))
                if keep and out is not None:
                    clock._sampled.append(out)
                return out

        return Timed()

    def detach(self) -> None:
        """Give the runner its own collaborators back."""
        runner = self.llm.runner
        runner.logits, runner.sampler = self._saved["logits"], self._saved["sampler"]

    def step(self) -> list:
        """``llm.step()``, timed."""
        self._current = _Step()
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
        """Milliseconds per step, as means over all steps and over the decode
        steps: ``wall``, ``host`` (wall minus waits), ``waited``, and the
        device's ``forward``, ``sampling`` and ``device`` (their sum)."""
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


def profile_decode_steps(llm, requests, steps: int = 20, path=None) -> str:
    """Serve ``requests`` (``(prompt, SamplingParams)`` pairs) on ``llm`` until
    every step is a decode step, profile the next ``steps`` steps with
    `torch.profiler`, abort what is left, and return the profiler's table of
    operations (sorted by the device's time on a GPU, the CPU's otherwise);
    write it to ``path`` too if given."""
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
            for _ in range(steps):
                llm.step()
            if cuda:
                torch.cuda.synchronize()
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
    return table


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
        runner.forward = forward
    return counts
