"""``GET /metrics``: the server's state in Prometheus's text format.

Names follow vLLM 0.32's (``PrometheusStatLogger`` in
``vllm/v1/metrics/loggers.py``) where the quantity is the same, so a dashboard
built for ``vllm serve`` reads this server too; every sample carries vLLM's
labels ``model_name`` and ``engine``. Quantities vLLM has no metric for are
named ``pagedkv:...``.

Gauges:

* ``vllm:num_requests_running``, ``vllm:num_requests_waiting``: the queues;
* ``vllm:kv_cache_usage_perc``: the share of KV blocks in use (0 to 1);
* ``pagedkv:kv_blocks_total``, ``_used``, ``_free``: the pool, in blocks
  (cached-free prefix blocks count as free);
* ``pagedkv:prefix_cache_hit_rate``: hits over queries, in tokens.

Counters: ``vllm:prefix_cache_queries_total`` and ``vllm:prefix_cache_hits_total``
(prompt tokens looked up in the prefix cache, and found),
``vllm:num_preemptions_total``, ``vllm:prompt_tokens_total``,
``vllm:generation_tokens_total``, ``vllm:request_success_total`` (by
``finished_reason``).

Histograms: ``vllm:time_to_first_token_seconds`` (from arrival at the server),
``vllm:request_time_per_output_token_seconds`` (a request's mean gap between
tokens), ``vllm:e2e_request_latency_seconds``, ``vllm:iteration_tokens_total``
(tokens computed per engine step) and ``pagedkv:step_duration_seconds`` (the
wall time of one step).

The engine's side is read between steps, by the engine loop's worker thread,
into an `EngineSnapshot`; rendering never touches the engine.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's queues, blocks and counters after a step."""

    num_running: int
    num_waiting: int
    num_blocks: int
    num_free_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    preemptions: int
    tokens_computed: int
    has_unfinished: bool


class Histogram:
    """A Prometheus histogram: cumulative bucket counts, a sum and a count."""

    def __init__(self, buckets: list[float]):
        self.buckets = sorted(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def samples(self, name: str, labels: str) -> list[str]:
        lines, running = [], 0
        for bound, n in zip([*self.buckets, float("inf")], self.counts):
            running += n
            le = "+Inf" if bound == float("inf") else repr(float(bound))
            lines.append(f'{name}_bucket{{{labels},le="{le}"}} {running}')
        lines.append(f"{name}_count{{{labels}}} {running}")
        lines.append(f"{name}_sum{{{labels}}} {self.sum}")
        return lines


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _buckets_1_2_5(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50... up to ``limit`` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return out
            out.append(m * scale)
        scale *= 10


class ServerMetrics:
    """What the server counts itself (tokens, latencies, finished requests),
    and the rendering of everything as Prometheus text."""

    def __init__(self, model_name: str, max_model_len: int):
        self.labels = f'model_name="{_label(model_name)}",engine="0"'
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: Counter[str] = Counter()
        self.ttft = Histogram(
            [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
             1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0]
        )  # fmt: skip
        self.tpot = Histogram(
            [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
             1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
        )  # fmt: skip
        self.e2e = Histogram(
            [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
             40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
        )  # fmt: skip
        self.iteration_tokens = Histogram(_buckets_1_2_5(max(max_model_len, 16384)))
        self.step_seconds = Histogram(
            [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0]
        )

    def observe_step(self, seconds: float | None, tokens: int) -> None:
        if seconds is not None:
            self.step_seconds.observe(seconds)
            self.iteration_tokens.observe(tokens)

    def observe_first_token(self, seconds: float, prompt_tokens: int) -> None:
        self.ttft.observe(seconds)
        self.prompt_tokens += prompt_tokens

    def observe_finished(
        self, reason: str, e2e: float, decode: float | None, tokens: int
    ) -> None:
        """A finished request: its finish reason, end-to-end latency, and the
        time from its first token to its last over the gaps between them."""
        self.finished[reason] += 1
        self.e2e.observe(e2e)
        if decode is not None and tokens > 1:
            self.tpot.observe(decode / (tokens - 1))

    def render(self, engine: EngineSnapshot, num_waiting: int) -> str:
        """Everything, in Prometheus's text exposition format."""
        lab = self.labels
        used = engine.num_blocks - engine.num_free_blocks
        hit_rate = (
            engine.prefix_cache_hits / engine.prefix_cache_queries
            if engine.prefix_cache_queries
            else 0.0
        )
        out: list[str] = []

        def metric(name, kind, help_, value=None, lines=None, suffix=""):
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            if lines is None:
                out.append(f"{name}{suffix}{{{lab}}} {value}")
            else:
                out.extend(lines)

        metric(
            "vllm:num_requests_running",
            "gauge",
            "Number of requests in model execution batches.",
            engine.num_running,
        )
        metric(
            "vllm:num_requests_waiting",
            "gauge",
            "Number of requests waiting to be processed.",
            num_waiting,
        )
        metric(
            "vllm:kv_cache_usage_perc",
            "gauge",
            "KV-cache usage. 1 means 100 percent usage.",
            used / engine.num_blocks if engine.num_blocks else 0.0,
        )
        metric(
            "pagedkv:kv_blocks_total",
            "gauge",
            "KV blocks in the pool.",
            engine.num_blocks,
        )
        metric("pagedkv:kv_blocks_used", "gauge", "KV blocks held by requests.", used)
        metric(
            "pagedkv:kv_blocks_free",
            "gauge",
            "KV blocks free to allocate (cached-free prefix blocks included).",
            engine.num_free_blocks,
        )
        metric(
            "vllm:prefix_cache_queries",
            "counter",
            "Prefix cache queries, in terms of number of queried tokens.",
            engine.prefix_cache_queries,
            suffix="_total",
        )
        metric(
            "vllm:prefix_cache_hits",
            "counter",
            "Prefix cache hits, in terms of number of cached tokens.",
            engine.prefix_cache_hits,
            suffix="_total",
        )
        metric(
            "pagedkv:prefix_cache_hit_rate",
            "gauge",
            "Prefix cache hits over queries, in tokens, since the start.",
            hit_rate,
        )
        metric(
            "vllm:num_preemptions",
            "counter",
            "Cumulative number of preemption from the engine.",
            engine.preemptions,
            suffix="_total",
        )
        metric(
            "vllm:prompt_tokens",
            "counter",
            "Number of prefill tokens processed.",
            self.prompt_tokens,
            suffix="_total",
        )
        metric(
            "vllm:generation_tokens",
            "counter",
            "Number of generation tokens processed.",
            self.generation_tokens,
            suffix="_total",
        )
        reasons = sorted(set(self.finished) | {"stop", "length", "abort"})
        metric(
            "vllm:request_success",
            "counter",
            "Count of successfully processed requests.",
            lines=[
                f'vllm:request_success_total{{{lab},finished_reason="{r}"}} '
                f"{self.finished[r]}"
                for r in reasons
            ],
        )
        for name, hist, help_ in (
            (
                "vllm:time_to_first_token_seconds",
                self.ttft,
                "Histogram of time to first token in seconds.",
            ),
            (
                "vllm:request_time_per_output_token_seconds",
                self.tpot,
                "Histogram of time_per_output_token_seconds per request.",
            ),
            (
                "vllm:e2e_request_latency_seconds",
                self.e2e,
                "Histogram of e2e request latency in seconds.",
            ),
            (
                "vllm:iteration_tokens_total",
                self.iteration_tokens,
                "Histogram of number of tokens per engine_step.",
            ),
            (
                "pagedkv:step_duration_seconds",
                self.step_seconds,
                "Histogram of the wall time of one engine step in seconds.",
            ),
        ):
            metric(name, "histogram", help_, lines=hist.samples(name, lab))
        return "\n".join(out) + "\n"


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text back into ``{"name{labels}": value}``, and each name
    without labels mapped to the sum over its samples (for tests and clients)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        values[key] = float(value)
        name = key.split("{", 1)[0]
        if name != key:
            values[name] = values.get(name, 0.0) + float(value)
    return values
