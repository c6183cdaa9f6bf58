"""The chapters' pool simulations as *runs*: the compact JSON the page viewer
replays (`pagedkv_lab.course.poolviewer`, format ``pagedkv-trace/1``).

A run is one simulation at one setting of a viewer's controls, written with
integers and strings only, so that a chapter's output is the same on every
machine. Every number the viewer shows comes from a run. There are three kinds.

``slots``: a contiguous pool (chapter 02's `ContiguousPool`) serving a trace.
    ``requests`` is flat, 8 integers per request: ``arrival, admit, finish,
    start, length, asked, final, prompt``. The request is queued from step
    ``arrival``, admitted at step ``admit`` into the region ``[start, start +
    length)`` of which the policy asked for ``asked`` slots, and released after
    step ``finish``; ``final`` is what it holds when it ends. At a step ``s`` in
    ``admit..finish`` it holds ``prompt + s - admit + 1`` tokens: the simulator
    gives every running request one token a step, the admitted one its first
    token in its admission step (`pagedkv_lab.sim.workloads.simulate`).
    ``blocked`` lists inclusive step ranges ``a0, b0, a1, b1, ...`` in which the
    free slots are external fragmentation (the head of the queue would fit in
    the free slots, but in no gap).

``blocks``: a paged pool (chapter 03's `PagedPool`). ``requests`` holds one
    ``[arrival, final, spell, spell, ...]`` per request; a spell is ``[admit,
    end, held0, b0, b1, ...]``: admitted at step ``admit`` with ``held0`` tokens,
    the request holds ``held0 + s - admit + 1`` tokens at steps ``admit..end``,
    in the first ``ceil(held / block_size)`` blocks of its block table ``b0,
    b1, ...`` (physical ids, logical order). A preempted request has several
    spells; its last spell ends at the step it finishes.

``cells``: a pool recorded frame by frame (chapters 07-09). ``frames`` holds,
    per frame, one entry per group of cells: a string, one character per cell
    (the view's ``codes`` name its colour), or for richer cells a dict with
    ``cells``, ``label`` and optionally ``fill`` (slots filled per cell),
    ``mark`` (a character per cell: ``c`` copied into this step, ``w`` written
    in place, ``-`` neither), ``ids`` (block ids) and ``dim`` (the group ends
    here). A frame equal to the one before it is written ``0``. ``values`` maps a
    name to one integer per frame, run-length coded: ``[value, count, ...]``.

Every kind has ``steps``, the number of frames the time slider runs over.
"""

from __future__ import annotations

import math
from inspect import signature

from pagedkv_lab.sim.contiguous import ContiguousPool
from pagedkv_lab.sim.paged import PagedPool
from pagedkv_lab.sim.workloads import Request, chat_workload, simulate

#: The W1 trace both chapter 02 and chapter 03 replay on the page: the one
#: chapter 02's live viewer and static figure use (`widgets.contiguous_trace_frames`).
W1_VIEW = {"num_requests": 120, "arrival_rate": 0.5, "max_model_len": 2048, "seed": 0}


class SpellLog:
    """Stands in for a simulator pool and logs each spell a request runs there,
    in steps: ``[admitted, last step run, tokens at admission, *opened(req)]``,
    then ``closed(req, spell)`` may add to it when the spell ends. Everything
    else is the pool's.

    `simulate` calls ``usage`` once a step, after admitting and growing the
    requests and before releasing the finished ones; so a spell admitted now
    starts at ``self.step`` and one released now last ran at ``self.step - 1``
    (preempted before this step's record, or finished after the last one).
    ``observed(waiting_head)`` sees each step's record."""

    def __init__(self, pool, opened=None, closed=None, observed=None):
        self.pool = pool
        self.step = 0
        self.spells: dict[int, list[list[int]]] = {}
        self._opened = opened or (lambda req: [])
        self._closed = closed or (lambda req, spell: None)
        self._observed = observed or (lambda waiting_head: None)

    def try_admit(self, req: Request, num_tokens: int) -> bool:
        if not self.pool.try_admit(req, num_tokens):
            return False
        spell = [self.step, -1, num_tokens, *self._opened(req)]
        self.spells.setdefault(req.id, []).append(spell)
        return True

    def release(self, req: Request) -> None:
        spell = self.spells[req.id][-1]
        spell[1] = self.step - 1
        self._closed(req, spell)
        self.pool.release(req)

    def usage(self, held, waiting_head):
        totals = self.pool.usage(held, waiting_head)
        self._observed(waiting_head)
        self.step += 1
        return totals

    def __getattr__(self, name: str):
        return getattr(self.pool, name)


def _logged_contiguous(pool: ContiguousPool) -> tuple[SpellLog, list[int]]:
    """A `ContiguousPool`'s spell log with each region (start, length, slots
    asked), and the steps at which its free slots were external fragmentation."""
    blocked: list[int] = []

    def opened(req: Request) -> list[int]:
        region = pool.allocator.regions[req.id]
        return [region.start, region.length, pool.asked[req.id]]

    def observed(waiting_head) -> None:
        if pool._blocked(waiting_head):
            blocked.append(log.step)

    log = SpellLog(pool, opened=opened, observed=observed)
    return log, blocked


def _logged_paged(pool: PagedPool) -> SpellLog:
    """A `PagedPool`'s spell log with each spell's block table at its end."""
    return SpellLog(pool, closed=lambda req, spell: spell.extend(pool.tables[req.id].blocks))


def _ranges(steps: list[int]) -> list[int]:
    """Sorted steps as inclusive ranges, flat: ``[a0, b0, a1, b1, ...]``."""
    flat: list[int] = []
    for s in steps:
        if flat and flat[-1] == s - 1:
            flat[-1] = s
        else:
            flat += [s, s]
    return flat


def _arrival_step(req: Request) -> int:
    """The first step at which `simulate` queues ``req``."""
    return max(0, math.ceil(req.arrival))


def w1_requests(**overrides) -> list[Request]:
    """The W1 trace of `W1_VIEW` (``overrides`` change its fields)."""
    p = {**W1_VIEW, **overrides}
    return chat_workload(
        p["num_requests"],
        seed=p["seed"],
        arrival_rate=p["arrival_rate"],
        max_model_len=p["max_model_len"],
    )


def contiguous_run(policy: str, fit: str, rows: int, **trace) -> dict:
    """A ``slots`` run: the W1 trace (`w1_requests`) through a contiguous pool of
    ``rows`` rows of ``max_model_len`` slots."""
    max_len = {**W1_VIEW, **trace}["max_model_len"]
    requests = w1_requests(**trace)
    pool, blocked = _logged_contiguous(
        ContiguousPool(rows * max_len, max_len, policy=policy, fit=fit)
    )
    result = simulate(requests, pool)
    assert result.preemptions == 0, "a reservation covers its request: no preemption"
    flat: list[int] = []
    for req in requests:
        ((admit, finish, prompt, start, length, asked),) = pool.spells[req.id]
        flat += [_arrival_step(req), admit, finish, start, length, asked]
        flat += [req.total_len, prompt]
    return {
        "steps": result.steps,
        "capacity": pool.capacity,
        "row": max_len,
        "requests": flat,
        "blocked": _ranges(blocked),
    }


def paged_run(block_size: int, num_slots: int | None = None, **trace) -> dict:
    """A ``blocks`` run: the W1 trace through a paged pool of ``num_slots`` token
    slots (default: 8 rows of ``max_model_len``, chapter 02's viewer pool) cut
    into blocks of ``block_size``."""
    max_len = {**W1_VIEW, **trace}["max_model_len"]
    num_slots = num_slots or 8 * max_len
    requests = w1_requests(**trace)
    pool = _logged_paged(PagedPool(num_slots // block_size, block_size, max_len))
    result = simulate(requests, pool)
    out = []
    for req in requests:
        spells = [
            s for s in pool.spells[req.id] if s[1] >= s[0]
        ]  # ran one step at least
        out.append([_arrival_step(req), req.total_len, *spells])
    return {
        "steps": result.steps,
        "blocks": pool.allocator.num_blocks,
        "block_size": block_size,
        "requests": out,
    }


# Frame-by-frame pools -----------------------------------------------------------


def rle(column: list[int]) -> list[int]:
    """``column`` as ``[value, count, value, count, ...]``: counters that stay
    the same for many frames take a few numbers."""
    flat: list[int] = []
    for value in column:
        if flat and flat[-2] == value:
            flat[-1] += 1
        else:
            flat += [value, 1]
    return flat


def _cells_run(frames: list, values: dict[str, list[int]], **fields) -> dict:
    """A ``cells`` run: a frame equal to the one before it is written ``0``, and
    each column of ``values`` with `rle`."""
    out = [0 if i and f == frames[i - 1] else f for i, f in enumerate(frames)]
    columns = {name: rle(column) for name, column in values.items()}
    return {"steps": len(frames), **fields, "frames": out, "values": columns}


def beam_run(beams: int, block_size: int, **kwargs) -> dict:
    """A ``cells`` run of chapter 07's beam search (`widgets.trace_beam_search`):
    a group per beam, its blocks in logical order, ``o`` held by one beam, ``s``
    shared."""
    from pagedkv_lab.course.widgets import trace_beam_search

    frames = trace_beam_search(beam_width=beams, block_size=block_size, **kwargs)
    out = []
    for f in frames:
        copied = {dst for _, dst in f["copies"]}
        groups = []
        for beam, blocks, tokens in f["beams"]:
            group = {
                "label": f"beam {beam}",
                "cells": "".join("s" if f["refs"][b] > 1 else "o" for b in blocks),
                "fill": [
                    min(block_size, max(0, tokens - i * block_size))
                    for i in range(len(blocks))
                ],
                "ids": list(blocks),
            }
            mark = "".join(
                "c" if b in copied else "w" if b in f["in_place"] else "-"
                for b in blocks
            )
            if mark.strip("-"):
                group["mark"] = mark
            if beam in f["dropped"]:
                group["dim"] = True
            groups.append(group)
        out.append(groups)
    values = {
        "copies": [len(f["copies"]) for f in frames],
        "in_place": [len(f["in_place"]) for f in frames],
        "finished": [f["finished"] for f in frames],
    }
    return _cells_run(out, values, block_size=block_size)


#: Characters of the prefix cache's block states in a ``cells`` run.
CACHE_CODES = {"used": "u", "shared": "s", "cached": "c", "free": "f"}


def prefix_cache_run(requests, capacity_blocks: int, block_size: int = 16) -> dict:
    """A ``cells`` run of chapter 08's prefix cache (`widgets.trace_prefix_cache`):
    one frame per request, each block's state as a character (`CACHE_CODES`)."""
    from pagedkv_lab.course.widgets import trace_prefix_cache

    frames = trace_prefix_cache(requests, capacity_blocks, block_size)
    cells = [["".join(CACHE_CODES[s] for s in f["states"])] for f in frames]
    values = {k: [f[k] for f in frames] for k in ("hit", "prompt", "evictions")}
    return _cells_run(cells, values)


def _owners(owners: list) -> str:
    """A pool's owners as one character per block: ``.`` free, else the request
    id in base 36 (the viewer colours it as that request)."""
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    return "".join("." if rid is None else digits[int(rid)] for rid in owners)


def preemption_run(mode: str, num_blocks: int, swap_blocks: int, **kwargs) -> dict:
    """A ``cells`` run of chapter 09's preemption storm (`widgets.trace_preemption`):
    per step, the device and host pools' owners (`_owners`) and the queues."""
    from pagedkv_lab.course.widgets import trace_preemption

    frames = trace_preemption(
        mode=mode, num_blocks=num_blocks, swap_blocks=swap_blocks, **kwargs
    )
    total = kwargs.get(
        "num_requests", signature(trace_preemption).parameters["num_requests"].default
    )
    queues = ("running", "waiting", "swapped")
    values = {q: [len(f[q]) for f in frames] for q in queues}
    values["finished"] = [total - sum(len(f[q]) for q in queues) for f in frames]
    for name in ("preemptions", "fallbacks"):
        values[name] = [f[name] for f in frames]
    pools = [[_owners(f["device"]), _owners(f["host"])] for f in frames]
    return _cells_run(pools, values)
