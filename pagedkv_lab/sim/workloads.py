"""Seeded serving workloads and an event-driven simulator of a KV-cache memory pool.

The simulator is deliberately small: it knows nothing about models, only about
how many token slots each request holds. Time advances in *steps*; in one step
every running request produces one token (iteration-level batching, as in Orca
and vLLM). A memory pool decides whether a request may start and how its
memory grows; chapters 02 (contiguous reservation) and 03 (paging) plug in
their own pools and are measured on the same trace.

A step is charged the same whatever it contains: a prefill, or the recompute of
a preempted request's K/V, costs nothing here. The simulator does count that
work (`SimResult.recomputed_tokens`) and the K/V a pool copies
(`SimResult.copied_slots`), so that a comparison of step counts can add it back
(`SimResult.steps_with_recompute`).

Workloads
---------
W1, chat-like (`chat_workload`): prompt and output lengths are log-normal, with
means set to the ShareGPT means that Kwon et al. (SOSP 2023) print in their
Figure 11(a): 161.31 input and 337.99 output tokens. The paper does not publish
the spread; ``sigma_prompt=1.0`` and ``sigma_output=0.8`` are this library's
choice (not fitted to any result of the paper), and chapter 02 shows how its
results move with them. Requests whose prompt plus output exceed the maximum
model length are drawn again, which trims the long tail: the trace's mean
lengths come out below those targets (chapter 02 prints them).

W2, uniform (`uniform_workload`): input and output lengths uniform in
[100, 1024], as in nano-vllm's benchmark, EOS ignored.

Arrivals are a Poisson process (exponential gaps) with a rate in requests per
step. At the chapters' rate of one request per step, 400 requests have all
arrived by about step 400 while serving them takes thousands of steps: after
the first few hundred steps the trace is an offline backlog, the regime in which
the memory pool alone decides how many requests run.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

SHAREGPT_MEAN_PROMPT = 161.31  # Kwon et al. 2023, Fig. 11(a) (ShareGPT)
SHAREGPT_MEAN_OUTPUT = 337.99


@dataclass(frozen=True)
class Request:
    """One request of a trace: when it arrives and how long it is."""

    id: int
    arrival: float  # in steps
    prompt_len: int
    output_len: int

    @property
    def total_len(self) -> int:
        """Tokens the request holds when it finishes (prompt + output)."""
        return self.prompt_len + self.output_len


def _arrivals(rng: np.random.Generator, n: int, rate: float | None) -> np.ndarray:
    if rate is None or math.isinf(rate):
        return np.zeros(n)
    if rate <= 0:
        raise ValueError(
            f"arrival rate must be positive (requests per step), got {rate}"
        )
    return np.cumsum(rng.exponential(1.0 / rate, size=n))


def _lognormal(rng: np.random.Generator, mean: float, sigma: float) -> int:
    mu = math.log(mean) - sigma**2 / 2  # so that E[X] = mean
    return max(1, int(round(rng.lognormal(mu, sigma))))


def chat_workload(
    n: int,
    *,
    seed: int = 0,
    arrival_rate: float | None = None,
    max_model_len: int = 2048,
    mean_prompt: float = SHAREGPT_MEAN_PROMPT,
    mean_output: float = SHAREGPT_MEAN_OUTPUT,
    sigma_prompt: float = 1.0,
    sigma_output: float = 0.8,
) -> list[Request]:
    """W1: ``n`` chat-like requests, heavy-tailed ShareGPT-like lengths (module doc).

    ``arrival_rate`` is in requests per step; ``None`` means all arrive at step 0.
    """
    if n < 1:
        raise ValueError(f"need at least one request, got n={n}")
    rng = np.random.default_rng(seed)
    lengths = []
    while len(lengths) < n:
        p, o = (
            _lognormal(rng, mean_prompt, sigma_prompt),
            _lognormal(rng, mean_output, sigma_output),
        )
        if p + o <= max_model_len:
            lengths.append((p, o))
    times = _arrivals(rng, n, arrival_rate)
    return [
        Request(i, float(t), p, o) for i, (t, (p, o)) in enumerate(zip(times, lengths))
    ]


def uniform_workload(
    n: int,
    *,
    seed: int = 0,
    arrival_rate: float | None = None,
    low: int = 100,
    high: int = 1024,
) -> list[Request]:
    """W2: ``n`` requests, prompt and output lengths uniform in ``[low, high]``.

    As in nano-vllm's benchmark.
    """
    if n < 1 or not 1 <= low <= high:
        raise ValueError(
            f"need n >= 1 and 1 <= low <= high, got n={n}, low={low}, high={high}"
        )
    rng = np.random.default_rng(seed)
    prompts = rng.integers(low, high + 1, size=n)
    outputs = rng.integers(low, high + 1, size=n)
    times = _arrivals(rng, n, arrival_rate)
    return [
        Request(i, float(t), int(p), int(o))
        for i, (t, p, o) in enumerate(zip(times, prompts, outputs))
    ]


class MemoryPool(Protocol):
    """What the simulator needs from a KV-cache memory manager (in token slots)."""

    capacity: int

    def try_admit(self, req: Request, num_tokens: int) -> bool:
        """Give ``req`` memory for ``num_tokens`` tokens plus what the policy reserves.

        ``num_tokens`` is its prompt, or all it held when it was preempted; False
        if it does not fit now.
        """

    def append_token(self, req: Request, held: int) -> bool:
        """``req`` now holds ``held`` tokens; False if there is no room."""

    def release(self, req: Request) -> None:
        """Free everything ``req`` holds."""

    def usage(
        self, held: dict[int, int], waiting_head: Request | None
    ) -> dict[str, int]:
        """Split ``capacity`` slots into states (keys of ``plotting.COLORS``).

        The values must add up to ``capacity``.
        """


@dataclass
class SimResult:
    """What happened to the pool, step by step."""

    capacity: int
    usage: dict[str, np.ndarray]  # state -> slots in that state at each step
    running: np.ndarray  # requests running at each step
    waiting: np.ndarray  # requests that had arrived but not started
    finish_step: dict[int, int]
    start_step: dict[int, int]
    preemptions: int = 0
    snapshots: list[dict] = field(default_factory=list)
    #: K/V recomputed on readmission: the tokens each preempted request held.
    recomputed_tokens: int = 0
    #: Tokens the trace generates (the sum of its output lengths).
    generated_tokens: int = 0
    #: Token slots whose K/V the pool copied (``pool.copied``; 0 when it never copies).
    copied_slots: int = 0

    @property
    def steps(self) -> int:
        return len(self.running)

    @property
    def recompute_per_token(self) -> float:
        """Recomputed tokens per generated token: the work preemption adds."""
        return self.recomputed_tokens / max(1, self.generated_tokens)

    def steps_with_recompute(self, tokens_per_step: float) -> float:
        """Steps plus the recompute, charged at ``tokens_per_step`` prefill tokens
        for the time of one decode step (a model of the device, not a measurement:
        the simulator's steps charge a recompute nothing)."""
        return self.steps + self.recomputed_tokens / tokens_per_step

    def recompute_crossover(
        self, other: SimResult, step_cost: float = 1.0, other_step_cost: float = 1.0
    ) -> float | None:
        """The ``tokens_per_step`` at which this run and ``other`` take the same
        time, steps plus recompute: above it the run with less step time is
        faster, below it the one with less recompute. None when one of them is
        faster at every rate. Like `steps_with_recompute`, it takes every decode
        step to cost the same, whatever the batch, unless ``step_cost`` and
        ``other_step_cost`` give each run's step time (in the decode steps that
        ``tokens_per_step`` counts)."""
        fewer_steps = self.steps * step_cost - other.steps * other_step_cost
        more_recompute = self.recomputed_tokens - other.recomputed_tokens
        if fewer_steps * more_recompute >= 0:
            return None
        return -more_recompute / fewer_steps

    def costs(self) -> dict[str, float]:
        """The work behind the step count, for any table that compares step counts
        or utilisation: preemptions, recomputed tokens, recomputed tokens per
        generated token, and slots copied."""
        return {
            "preemptions": self.preemptions,
            "recomputed": self.recomputed_tokens,
            "recomputed_per_token": self.recompute_per_token,
            "copied": self.copied_slots,
        }

    def _mask(self, loaded_only: bool) -> np.ndarray:
        if loaded_only and (self.waiting > 0).any():
            return self.waiting > 0
        return np.ones(self.steps, bool)

    def fractions(self, loaded_only: bool = True) -> dict[str, float]:
        """Mean fraction of the pool in each state.

        ``loaded_only`` averages over the steps in which requests were waiting.
        """
        mask = self._mask(loaded_only)
        return {k: float(v[mask].mean() / self.capacity) for k, v in self.usage.items()}

    @property
    def max_running(self) -> int:
        return int(self.running.max()) if self.steps else 0

    def mean_running(self, loaded_only: bool = True) -> float:
        """Mean number of running requests (over loaded steps by default)."""
        return float(self.running[self._mask(loaded_only)].mean())


def simulate(
    requests: list[Request],
    pool: MemoryPool,
    *,
    max_num_seqs: int | None = None,
    max_steps: int = 1_000_000,
    snapshot_every: int | None = None,
) -> SimResult:
    """Serve ``requests`` through ``pool`` a step at a time; record the pool each step.

    Each step: (1) arrived requests join the queue; (2) waiting requests are
    admitted first-come-first-served while the pool accepts them (one that does
    not fit blocks those behind it); (3) every running request produces one
    token (a newly admitted one holds its prompt plus that token); if the pool
    cannot grow a request, the most recently started one is preempted: it frees
    everything and goes back to the head of the queue, keeping its tokens, and
    on readmission recomputes their K/V in one prefill, as vLLM's recompute
    preemption does (counted in ``recomputed_tokens``, charged no step); (4)
    the pool's state is recorded; (5) finished requests free their memory.

    With ``snapshot_every``, a dict ``{"step", "held", "waiting_head", "layout",
    "tables", "segments"}`` is kept every that many steps: ``layout`` from
    ``pool.layout()``, ``tables`` (request id -> block table, logical order) from
    ``pool.block_tables()`` and ``segments`` from ``pool.segments(held, head)``,
    each None when the pool has no such method.
    """
    pending = deque(sorted(requests, key=lambda r: (r.arrival, r.id)))
    waiting: deque[Request] = deque()
    running: dict[int, Request] = {}  # insertion order = start order
    held: dict[int, int] = {}  # request id -> tokens it holds
    resume: dict[int, int] = {}  # preempted request id -> tokens it held
    start: dict[int, int] = {}
    finish: dict[int, int] = {}
    usage: dict[str, list[int]] = {}
    n_running, n_waiting, snaps = [], [], []
    preemptions = recomputed = 0
    step = 0
    while pending or waiting or running:
        if step >= max_steps:
            raise RuntimeError(f"simulation did not finish in {max_steps} steps")
        # (1) Requests that have arrived join the queue.
        while pending and pending[0].arrival <= step:
            waiting.append(pending.popleft())
        # (2) Admit from the head of the queue until one does not fit.
        while waiting and (max_num_seqs is None or len(running) < max_num_seqs):
            req = waiting[0]
            num_tokens = resume.get(req.id, req.prompt_len)
            if not pool.try_admit(req, num_tokens):
                break
            waiting.popleft()
            recomputed += resume.pop(req.id, 0)  # a readmitted request recomputes
            running[req.id], held[req.id] = req, num_tokens
            start.setdefault(req.id, step)
        # (3) Every running request produces one token; preempt the newest if
        # the pool cannot make room for it.
        for rid in list(running):
            if rid not in running:  # preempted earlier in this loop
                continue
            while not pool.append_token(running[rid], held[rid] + 1):
                victim = next(reversed(running))
                pool.release(running[victim])
                waiting.appendleft(running.pop(victim))
                resume[victim] = held.pop(victim)
                preemptions += 1
                if victim == rid:
                    break
            if rid in running:
                held[rid] += 1
        # (4) Record how the pool's slots are used.
        head = waiting[0] if waiting else None
        for key, value in pool.usage(held, head).items():
            usage.setdefault(key, []).append(value)
        n_running.append(len(running))
        n_waiting.append(len(waiting))
        if snapshot_every and step % snapshot_every == 0:
            snaps.append(_snapshot(pool, step, held, head))
        # (5) Finished requests free their memory.
        for rid in [r for r, req in running.items() if held[r] >= req.total_len]:
            pool.release(running.pop(rid))
            del held[rid]
            finish[rid] = step
        step += 1
    return SimResult(
        capacity=pool.capacity,
        usage={k: np.asarray(v) for k, v in usage.items()},
        running=np.asarray(n_running),
        waiting=np.asarray(n_waiting),
        finish_step=finish,
        start_step=start,
        preemptions=preemptions,
        snapshots=snaps,
        recomputed_tokens=recomputed,
        generated_tokens=sum(r.output_len for r in requests),
        copied_slots=getattr(pool, "copied", 0),
    )


def _snapshot(pool, step: int, held: dict[int, int], head: Request | None) -> dict:
    """The pool's layout at ``step``, for viewers that redraw it later."""
    return {
        "step": step,
        "held": dict(held),
        "waiting_head": head,
        "layout": pool.layout() if hasattr(pool, "layout") else None,
        "tables": pool.block_tables() if hasattr(pool, "block_tables") else None,
        "segments": pool.segments(held, head) if hasattr(pool, "segments") else None,
    }


# Workloads that share prefixes (chapter 08) --------------------------------------


@dataclass
class TokenRequest:
    """A request given by its tokens: ``prompt`` then the ``output`` it generates
    (known in advance, so that later turns can contain it). ``group`` names the
    conversation or document it belongs to."""

    prompt: list[int]
    output: list[int]
    group: int = 0


def _tokens(rng: np.random.Generator, n: int) -> list[int]:
    # Byte tokens of the offline tokenizer (ids 3..258).
    return rng.integers(3, 259, n).tolist()


def system_prompt_workload(
    n: int,
    *,
    system_len: int = 500,
    user_len: tuple[int, int] = (10, 60),
    output_len: tuple[int, int] = (20, 120),
    seed: int = 0,
) -> list[TokenRequest]:
    """W3: ``n`` chats that all start with one ``system_len``-token system
    prompt, then a short user turn of their own."""
    rng = np.random.default_rng(seed)
    system = [1] + _tokens(rng, system_len - 1)
    return [
        TokenRequest(
            system + _tokens(rng, int(rng.integers(*user_len))),
            _tokens(rng, int(rng.integers(*output_len))),
        )
        for _ in range(n)
    ]


def rag_workload(
    n: int,
    *,
    num_docs: int = 1,
    doc_len: int = 2000,
    question_len: tuple[int, int] = (10, 40),
    output_len: tuple[int, int] = (20, 120),
    seed: int = 0,
) -> list[TokenRequest]:
    """W4: ``n`` questions, each about one of ``num_docs`` shared documents of
    ``doc_len`` tokens placed before the question (retrieval-augmented
    generation), documents drawn at random."""
    rng = np.random.default_rng(seed)
    docs = [[1] + _tokens(rng, doc_len - 1) for _ in range(num_docs)]
    requests = []
    for _ in range(n):
        d = int(rng.integers(num_docs))
        requests.append(
            TokenRequest(
                docs[d] + _tokens(rng, int(rng.integers(*question_len))),
                _tokens(rng, int(rng.integers(*output_len))),
                d,
            )
        )
    return requests


def multi_turn_workload(
    num_conversations: int,
    turns: int,
    *,
    system_len: int = 0,
    user_len: tuple[int, int] = (10, 60),
    output_len: tuple[int, int] = (20, 120),
    interleave: bool = True,
    seed: int = 0,
) -> list[TokenRequest]:
    """Multi-turn chat: each turn's prompt is the previous turn's prompt, its
    answer and a new question. Turns of different conversations are
    interleaved (round-robin) unless ``interleave`` is False."""
    rng = np.random.default_rng(seed)
    system = [1] + _tokens(rng, max(0, system_len - 1))
    convs = []
    for c in range(num_conversations):
        history, conv = list(system), []
        for _ in range(turns):
            prompt = history + _tokens(rng, int(rng.integers(*user_len)))
            output = _tokens(rng, int(rng.integers(*output_len)))
            conv.append(TokenRequest(prompt, output, c))
            history = prompt + output
        convs.append(conv)
    if not interleave:
        return [r for conv in convs for r in conv]
    return [conv[t] for t in range(turns) for conv in convs]
