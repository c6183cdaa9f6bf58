"""Replay the course's W1 trace against a running `vllm serve`, with Poisson arrivals.

The requests are the ones `python -m pagedkv_lab.bench serve --workload w1` serves:
`pagedkv_lab.bench.scaled_chat_trace` (ShareGPT-like lengths scaled to
``--max-model-len``) and `pagedkv_lab.bench.common._prompt_ids` (seeded token ids), sent as
token-id prompts to the OpenAI-compatible ``/v1/completions`` endpoint, greedy, EOS
ignored, so every request produces exactly its trace's output length. Each request
arrives at its time in a Poisson process of ``--rate`` requests per second (``inf``:
all at once) and runs in its own thread; only the standard library talks to the
server.

For each rate it prints the throughput (requests and tokens per second over the
time from the first arrival to the last reply) and percentiles of the time to first
token (streamed replies only), the end-to-end latency (from the request's arrival)
and the normalised latency: a request's end-to-end latency divided by its number of
output tokens, whose mean the vLLM paper plots against the request rate (Kwon et
al., 2023, section 6.1 and Fig. 12). Several rates make one such curve.

    vllm serve ./small-llama-hf --block-size 32 ...     # see book/vllm.md
    python scripts/vllm_client.py --rate 1 2 4 8 --out w1.json
    python scripts/vllm_client.py --dry-run              # the trace only, no server
"""

from __future__ import annotations

import argparse
import json
import math
import random
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass


@dataclass
class Record:
    """One request's lengths and timings (seconds from the replay's start)."""

    prompt_len: int
    max_tokens: int
    arrival: float
    sent: float = math.nan
    first: float = math.nan
    done: float = math.nan
    output_tokens: int = 0
    error: str = ""

    @property
    def latency(self) -> float:
        return self.done - self.arrival

    @property
    def ttft(self) -> float:
        return self.first - self.arrival


def build_trace(num_requests: int, max_model_len: int, seed: int):
    """The bench's W1 requests and their token ids (imports the course's library)."""
    from pagedkv_lab.bench.common import _prompt_ids, scaled_chat_trace

    requests = scaled_chat_trace(num_requests, max_model_len, seed=seed)
    return requests, _prompt_ids(requests, seed=seed)


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Arrival times: the first at 0, then exponential gaps of mean 1 / rate."""
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def server_model(url: str, timeout: float) -> str:
    """The first model the server lists at ``/v1/models``."""
    with urllib.request.urlopen(f"{url}/v1/models", timeout=timeout) as resp:
        return json.load(resp)["data"][0]["id"]


def send(url, model, ids, record, t0, stream, timeout):
    """POST one completion and fill in ``record``'s timings and token count."""
    body = {
        "model": model,
        "prompt": ids,
        "max_tokens": record.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    record.sent = time.perf_counter() - t0
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            if stream:
                # Server-sent events: one "data: {json}" line per chunk, then [DONE].
                for raw in resp:
                    line = raw.decode().strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:") :].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if chunk.get("choices") and math.isnan(record.first):
                        record.first = time.perf_counter() - t0
                    if chunk.get("usage"):
                        record.output_tokens = chunk["usage"]["completion_tokens"]
            else:
                reply = json.load(resp)
                record.output_tokens = reply["usage"]["completion_tokens"]
        record.done = time.perf_counter() - t0
    except (urllib.error.URLError, OSError, ValueError, KeyError) as err:
        record.error = f"{type(err).__name__}: {err}"


def replay(url, model, prompts, max_tokens, arrivals, stream, timeout, concurrency):
    """Send every request at its arrival time, each in a thread; wait for all."""
    records = [Record(len(p), n, a) for p, n, a in zip(prompts, max_tokens, arrivals)]
    gate = threading.Semaphore(concurrency) if concurrency else None

    def worker(ids, record):
        if gate is None:
            send(url, model, ids, record, t0, stream, timeout)
            return
        with gate:
            send(url, model, ids, record, t0, stream, timeout)

    threads = []
    t0 = time.perf_counter()
    for ids, record in zip(prompts, records):
        wait = record.arrival - (time.perf_counter() - t0)
        if wait > 0:
            time.sleep(wait)
        thread = threading.Thread(target=worker, args=(ids, record), daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    return records


def percentile(xs: list[float], q: float) -> float:
    """The q-quantile (0..1) with linear interpolation, as numpy's default."""
    if not xs:
        return math.nan
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarise(records: list[Record], rate: float) -> dict:
    """Throughput and latency figures of one replay."""
    ok = [r for r in records if not r.error]
    span = max((r.done for r in ok), default=math.nan) - min(r.arrival for r in records)
    out_tokens = sum(r.output_tokens for r in ok)
    all_tokens = out_tokens + sum(r.prompt_len for r in ok)
    latency = [r.latency for r in ok]
    norm = [r.latency / r.output_tokens for r in ok if r.output_tokens]
    ttft = [r.ttft for r in ok if not math.isnan(r.first)]
    tpot = [
        (r.done - r.first) / (r.output_tokens - 1)
        for r in ok
        if not math.isnan(r.first) and r.output_tokens > 1
    ]
    short = sum(r.output_tokens < r.max_tokens for r in ok)
    row = {
        "rate": rate,
        "requests": len(records),
        "failed": len(records) - len(ok),
        "short": short,
        "seconds": span,
        "req_per_s": len(ok) / span,
        "out_tok_per_s": out_tokens / span,
        "tok_per_s": all_tokens / span,
        "norm_latency_mean": sum(norm) / len(norm) if norm else math.nan,
    }
    for name, xs in (
        ("ttft", ttft),
        ("latency", latency),
        ("tpot", tpot),
        ("norm_latency", norm),
    ):
        for q in (0.5, 0.9, 0.99):
            row[f"{name}_p{round(q * 100)}"] = percentile(xs, q)
    return row


def print_summary(row: dict) -> None:
    rate = "all at once" if math.isinf(row["rate"]) else f"{row['rate']:g} req/s"
    lines = [
        f"rate {rate}: {row['requests']} requests ({row['failed']} failed, "
        f"{row['short']} shorter than asked) in {row['seconds']:.2f} s",
        f"  throughput {row['req_per_s']:.2f} req/s, "
        f"{row['out_tok_per_s']:.1f} output tok/s, {row['tok_per_s']:.1f} tok/s",
        f"  {'':28}{'p50':>9}{'p90':>9}{'p99':>9}",
    ]
    names = (
        ("ttft", "time to first token (s)"),
        ("latency", "end-to-end latency (s)"),
        ("tpot", "time per output token (s)"),
        ("norm_latency", "normalised latency (s/token)"),
    )
    for key, label in names:
        cells = "".join(f"{row[f'{key}_p{q}']:9.3f}" for q in (50, 90, 99))
        lines.append(f"  {label:28}{cells}")
    lines.append(f"  mean normalised latency {row['norm_latency_mean']:.4f} s/token")
    print("\n".join(lines), flush=True)


def _finite(x):
    """``x`` with every NaN or infinity replaced by None, so that it is valid JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python scripts/vllm_client.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--url", default="http://localhost:8000")
    parser.add_argument("--model", default=None, help="default: the server's first")
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=512,
        help="scales W1's lengths, as the bench's --max-model-len (default 512)",
    )
    parser.add_argument(
        "--rate",
        type=float,
        nargs="+",
        default=[math.inf],
        help="requests per second, one replay per value (default: inf)",
    )
    parser.add_argument("--seed", type=int, default=0, help="trace and token ids")
    parser.add_argument("--arrival-seed", type=int, default=0)
    parser.add_argument(
        "--no-stream",
        action="store_true",
        help="one reply per request: no time to first token",
    )
    parser.add_argument(
        "--max-concurrency", type=int, default=0, help="0: no client-side limit"
    )
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--out", default=None, help="write every record as JSON")
    parser.add_argument(
        "--dry-run", action="store_true", help="print the trace; send nothing"
    )
    args = parser.parse_args(argv)

    requests, prompts = build_trace(args.num_requests, args.max_model_len, args.seed)
    max_tokens = [r.output_len for r in requests]
    print(
        f"W1: {len(requests)} requests, {sum(map(len, prompts))} prompt tokens, "
        f"{sum(max_tokens)} output tokens, longest request "
        f"{max(r.total_len for r in requests)} tokens "
        f"(max_model_len {args.max_model_len})"
    )
    if args.dry_run:
        for rate in args.rate:
            arrivals = poisson_arrivals(len(requests), rate, args.arrival_seed)
            print(f"rate {rate:g} req/s: last arrival at {arrivals[-1]:.2f} s")
        return
    try:
        model = args.model or server_model(args.url, args.timeout)
    except (urllib.error.URLError, OSError) as err:
        raise SystemExit(
            f"no server at {args.url} ({err}): start `vllm serve` first"
        ) from None
    print(f"server {args.url}, model {model}")
    rows, dump = [], []
    for rate in args.rate:
        arrivals = poisson_arrivals(len(requests), rate, args.arrival_seed)
        records = replay(
            args.url,
            model,
            prompts,
            max_tokens,
            arrivals,
            not args.no_stream,
            args.timeout,
            args.max_concurrency,
        )
        row = summarise(records, rate)
        print_summary(row)
        for r in records:
            if r.error:
                print(f"  failed: {r.error}")
                break
        rows.append(row)
        dump.append({"summary": row, "records": [asdict(r) for r in records]})
    if len(rows) > 1:
        print("rate (req/s)  req/s  out tok/s  mean norm. latency (s/token)")
        for row in rows:
            print(
                f"{row['rate']:12g}{row['req_per_s']:7.2f}{row['out_tok_per_s']:11.1f}"
                f"{row['norm_latency_mean']:13.4f}"
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(_finite(dump), f, indent=1)
        print(f"records: {args.out}")


if __name__ == "__main__":
    main()
