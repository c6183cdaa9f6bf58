"""Timing on the device at hand: median of alternating rounds, CUDA-graph
replays on a GPU, best of passes on a CPU."""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Callable, Collection

import torch


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


def time_rounds(
    fns: dict[str, Callable[[], object]],
    device: torch.device,
    repeats: int = 20,
    warmup: int = 3,
    graphs: Collection[str] = (),
) -> dict[str, list[float]]:
    """Seconds of every call of each function, round by round, timed in
    alternation: every round calls each function once, the order reversed
    every other round (ABC, CBA, ABC...), so that drift in the machine's load
    (other processes, clock changes) falls on all of them alike and none is
    always first. On a GPU each call is timed with CUDA events after an L2
    flush, as ``triton.testing.do_bench`` does; the functions named in
    ``graphs`` are captured in a CUDA graph and their replays timed, which
    leaves out the host's launch overhead (the engine replays its decode steps
    so). On a CPU calls are timed with ``perf_counter``."""
    if device.type == "cuda":
        fns = {k: _graph_replay(f) if k in graphs else f for k, f in fns.items()}
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    cuda = device.type == "cuda"
    order = list(fns)
    for r in range(repeats):
        for name in order if r % 2 == 0 else order[::-1]:
            fn = fns[name]
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
    return times


def time_calls(
    fns: dict[str, Callable[[], object]],
    device: torch.device,
    repeats: int = 20,
    warmup: int = 3,
    graphs: Collection[str] = (),
) -> dict[str, float]:
    """Seconds per call of each function, timed in alternation (`time_rounds`).

    On a GPU the median over rounds is returned. On a CPU the minimum: other
    processes on a shared machine only ever add time (a thread of a parallel
    region that loses its core stalls the whole region), so the fastest round
    is the least disturbed.
    """
    times = time_rounds(fns, device, repeats, warmup, graphs)
    pick = statistics.median if device.type == "cuda" else min
    return {name: pick(t) for name, t in times.items()}


def time_call(
    fn: Callable[[], object], device: torch.device, repeats: int = 20, warmup: int = 3
) -> float:
    """Seconds per call of one function (see `time_calls`)."""
    return time_calls({"fn": fn}, device, repeats, warmup)["fn"]


def trace(message: str) -> None:
    """Append ``message`` as a line to the file named by ``$PAGEDKV_TRACE``, if
    set (nothing otherwise), with the time of day: a run cut off by a time
    limit still shows where its time went."""
    path = os.environ.get("PAGEDKV_TRACE")
    if path:
        with open(path, "a") as f:
            f.write(f"{time.strftime('%H:%M:%S')} {message}\n")
