"""Online serving: one client replays the W1 trace over HTTP against any
OpenAI-compatible server, ours (``python -m pagedkv_lab.serve``) or ``vllm serve``.

The requests are those of ``python -m pagedkv_lab.bench serve --workload w1``:
`scaled_chat_trace` lengths (ShareGPT-like, scaled to ``max_model_len``) and
seeded token-id prompts, sent to ``/v1/completions`` greedy, EOS ignored, with
``return_token_ids`` (vLLM's field; ours takes it too), so every request
produces exactly its trace's output length and the servers' tokens can be
compared. Each request arrives at its time in a Poisson process of ``rate``
requests per second (``inf``: all at once) and runs in its own thread; only the
standard library talks to the servers.

Per server and rate it measures the throughput (requests and tokens per second
from the first arrival to the last reply) and percentiles of the time to first
token (TTFT, streamed replies), the time per output token after the first
(TPOT), the end-to-end latency and the normalised latency (end-to-end latency
over output tokens; its mean against the rate is the curve of the vLLM paper's
Figure 12, Kwon et al. 2023, section 6.1).

Two ways to run it:

* ``python scripts/vllm_client.py --url URL [--url URL2 ...]``: against servers
  you started (`client_main`);
* ``python -m pagedkv_lab.bench online``: starts our server and, where a vLLM
  python is given (``--vllm-python`` or ``$PAGEDKV_VLLM_PYTHON``), vLLM's, with
  the same model, KV bytes and limits, replays the same trace against each, and
  prints them side by side (`online_main`).

Either way the servers take turns (`measure_servers`): at every rate each round
replays the trace against every server, one at a time, the order reversed every
round, and each server's median round is reported.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class Record:
    """One request's lengths, timings (seconds from the replay's start) and tokens."""

    prompt_len: int
    max_tokens: int
    arrival: float
    sent: float = math.nan
    first: float = math.nan
    done: float = math.nan
    output_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    error: str = ""

    @property
    def latency(self) -> float:
        return self.done - self.arrival

    @property
    def ttft(self) -> float:
        return self.first - self.arrival


def build_trace(num_requests: int, max_model_len: int, seed: int):
    """The bench's W1 requests and their token-id prompts."""
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


def server_model(url: str, timeout: float = 10.0) -> str:
    """The first model the server lists at ``/v1/models``."""
    with urllib.request.urlopen(f"{url}/v1/models", timeout=timeout) as resp:
        return json.load(resp)["data"][0]["id"]


def send(url, model, ids, record: Record, t0: float, stream: bool, timeout: float):
    """POST one completion; fill in ``record``'s timings, token count and tokens."""
    body = {
        "model": model,
        "prompt": ids,
        "max_tokens": record.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
        "return_token_ids": True,
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
                    for choice in chunk.get("choices") or ():
                        if math.isnan(record.first):
                            record.first = time.perf_counter() - t0
                        record.token_ids += choice.get("token_ids") or []
                    if chunk.get("usage"):
                        record.output_tokens = chunk["usage"]["completion_tokens"]
            else:
                reply = json.load(resp)
                record.output_tokens = reply["usage"]["completion_tokens"]
                record.token_ids = reply["choices"][0].get("token_ids") or []
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
    norm = [r.latency / r.output_tokens for r in ok if r.output_tokens]
    tpot = [
        (r.done - r.first) / (r.output_tokens - 1)
        for r in ok
        if not math.isnan(r.first) and r.output_tokens > 1
    ]
    row = {
        "rate": rate,
        "requests": len(records),
        "failed": len(records) - len(ok),
        "short": sum(r.output_tokens < r.max_tokens for r in ok),
        "seconds": span,
        "req_per_s": len(ok) / span,
        "out_tok_per_s": out_tokens / span,
        "tok_per_s": all_tokens / span,
        "norm_latency_mean": sum(norm) / len(norm) if norm else math.nan,
    }
    for name, xs in (
        ("ttft", [r.ttft for r in ok if not math.isnan(r.first)]),
        ("latency", [r.latency for r in ok]),
        ("tpot", tpot),
        ("norm_latency", norm),
    ):
        for q in (0.5, 0.9, 0.99):
            row[f"{name}_p{round(q * 100)}"] = percentile(xs, q)
    return row


_ROWS = (
    ("requests/s", "req_per_s", "{:.2f}"),
    ("output tokens/s", "out_tok_per_s", "{:.1f}"),
    ("TTFT p50/p90/p99 (ms)", "ttft", "ms"),
    ("TPOT p50/p90/p99 (ms)", "tpot", "ms"),
    ("e2e latency p50/p90/p99 (s)", "latency", "s"),
    ("mean norm. latency (s/token)", "norm_latency_mean", "{:.4f}"),
    ("failed / shorter than asked", None, None),
)


def _cell(row: dict, key: str | None, fmt: str | None) -> str:
    if key is None:
        return f"{row['failed']} / {row['short']}"
    if fmt in ("ms", "s"):
        scale = 1000 if fmt == "ms" else 1
        parts = [row[f"{key}_p{q}"] * scale for q in (50, 90, 99)]
        return "/".join(
            "-" if math.isnan(x) else f"{x:.0f}" if fmt == "ms" else f"{x:.2f}"
            for x in parts
        )
    value = row[key]
    return "-" if isinstance(value, float) and math.isnan(value) else fmt.format(value)


def print_side_by_side(
    results: dict[str, list[dict]], identical: dict[str, list]
) -> None:
    """One table per rate, one column per server (the median round where a
    server ran several), and how many requests' tokens equal the first server's."""
    names = list(results)
    width = max(16, *map(len, names)) + 2
    for i, rate in enumerate(r["rate"] for r in results[names[0]]):
        label = "all at once" if math.isinf(rate) else f"{rate:g} req/s"
        first = results[names[0]][i]
        print(f"\nrate {label}: {first['requests']} requests")
        print(f"  {'':30}" + "".join(f"{n:>{width}}" for n in names))
        for title, key, fmt in _ROWS:
            cells = "".join(f"{_cell(results[n][i], key, fmt):>{width}}" for n in names)
            print(f"  {title:30}{cells}")
        same = "".join(
            f"{'-' if n == names[0] else identical[n][i]:>{width}}" for n in names
        )
        print(f"  {'tokens identical to ' + names[0]:30}{same}")
        for n in names[1:]:  # each round's ratio, both servers measured in that round
            per_round = [b / a for a, b in zip(first.get("rounds_out_tok_per_s", ()),
                                               results[n][i].get("rounds_out_tok_per_s", ()))]  # fmt: skip
            if len(per_round) > 1:
                print(
                    f"  {n} over {names[0]}, output tokens/s by round: "
                    + " ".join(f"{x:.3f}" for x in per_round)
                    + f" (median {statistics.median(per_round):.3f})"
                )


def _median_row(rows: list[dict]) -> dict:
    """The round with the median output throughput."""
    ranked = sorted(rows, key=lambda r: r["out_tok_per_s"])
    return ranked[(len(ranked) - 1) // 2]


def measure_servers(servers: dict[str, tuple[str, str]], prompts, max_tokens, rates,
                    args) -> tuple[dict[str, list[dict]], dict[str, list]]:  # fmt: skip
    """Replay the trace against every server, ``servers`` mapping a name to its
    ``(url, model)``: each is warmed up first on the first ``args.warmup``
    requests of the trace (a negative value: the whole trace), sent all at once
    and not timed; then at every rate, ``args.repeats`` rounds (odd, so that the
    median is one round), each round replaying the trace against every server in
    turn, the order reversed every round (the first server first in even
    rounds), so that neither inherits a machine the other left busier or colder.
    Returns, per server, its median round's row at every rate and that round's
    records; each row also lists every round's output tokens/s."""
    if args.repeats < 1 or args.repeats % 2 == 0:
        raise ValueError(f"repeats={args.repeats}: an odd number of rounds "
                         "(the median of an even number is a mean of two)")  # fmt: skip
    names = list(servers)
    warm = len(prompts) if args.warmup < 0 else min(args.warmup, len(prompts))
    if warm:  # first requests pay one-time costs (allocation, kernel caches, graphs)
        for url, model in servers.values():
            replay(url, model, prompts[:warm], max_tokens[:warm], [0.0] * warm,
                   True, args.timeout, 0)  # fmt: skip
    rows = {name: [] for name in names}
    records = {name: [] for name in names}
    for rate in rates:
        arrivals = poisson_arrivals(len(prompts), rate, args.arrival_seed)
        rounds = {name: [] for name in names}
        for r in range(args.repeats):
            for name in names if r % 2 == 0 else names[::-1]:
                url, model = servers[name]
                recs = replay(url, model, prompts, max_tokens, arrivals,
                              not args.no_stream, args.timeout, args.max_concurrency)  # fmt: skip
                rounds[name].append((summarise(recs, rate), recs))
        for name in names:
            row = _median_row([r for r, _ in rounds[name]])
            row["rounds_out_tok_per_s"] = [r["out_tok_per_s"] for r, _ in rounds[name]]
            rows[name].append(row)
            records[name].append(next(recs for r, recs in rounds[name] if r is row))
            bad = next((r.error for r in records[name][-1] if r.error), None)
            if bad:
                print(f"  {servers[name][0]}: a request failed: {bad}")
    return rows, records


def _compare(results, records) -> dict[str, list]:
    names = list(results)
    base = records[names[0]]
    return {
        n: [
            f"{sum(a.token_ids == b.token_ids and bool(a.token_ids) for a, b in zip(x, y))} of {len(x)}"
            for x, y in zip(base, records[n])
        ]
        for n in names
    }


def _finite(x):
    """``x`` with every NaN or infinity replaced by None, so that it is valid JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def _write(path, results, records) -> None:
    dump = {
        name: [
            {"summary": row, "records": [asdict(r) for r in recs]}
            for row, recs in zip(results[name], records[name])
        ]
        for name in results
    }
    with open(path, "w") as f:
        json.dump(_finite(dump), f, indent=1)
    print(f"records: {path}")


def add_client_args(p: argparse.ArgumentParser) -> None:
    """The trace and replay options both entry points share."""
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument(
        "--max-model-len", type=int, default=512,
        help="scales W1's lengths, as bench serve's --max-model-len (default 512)",
    )  # fmt: skip
    p.add_argument(
        "--rate", type=float, nargs="+", default=[math.inf],
        help="requests per second, one replay per value (default: inf)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="trace and token ids")
    p.add_argument("--arrival-seed", type=int, default=0)
    p.add_argument(
        "--repeats", type=int, default=3,
        help="rounds per rate, odd (default 3); the median round is reported",
    )  # fmt: skip
    p.add_argument(
        "--warmup", type=int, default=-1,
        help="requests of the trace sent (all at once, untimed) to each server "
        "before measuring; -1 (default): the whole trace; 0: none",
    )  # fmt: skip
    p.add_argument(
        "--no-stream", action="store_true",
        help="one reply per request: no time to first token",
    )  # fmt: skip
    p.add_argument(
        "--max-concurrency", type=int, default=0, help="0: no client-side limit"
    )
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--out", default=None, help="write every record as JSON")


def _trace(args):
    requests, prompts = build_trace(args.num_requests, args.max_model_len, args.seed)
    max_tokens = [r.output_len for r in requests]
    print(
        f"W1: {len(requests)} requests, {sum(map(len, prompts))} prompt tokens, "
        f"{sum(max_tokens)} output tokens, longest request "
        f"{max(r.total_len for r in requests)} tokens "
        f"(max_model_len {args.max_model_len})"
    )
    return prompts, max_tokens


def client_main(argv: list[str] | None = None) -> None:
    """``scripts/vllm_client.py``: replay against servers already running."""
    p = argparse.ArgumentParser(
        prog="python scripts/vllm_client.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--url", nargs="+", action="extend", default=None,
        help="one or more servers (default http://localhost:8000), replayed in "
        "rounds that alternate them (--repeats), and printed side by side",
    )  # fmt: skip
    p.add_argument("--name", nargs="+", default=None, help="a column name per --url")
    p.add_argument("--model", default=None, help="default: each server's first")
    p.add_argument(
        "--dry-run", action="store_true", help="the trace only; send nothing"
    )
    add_client_args(p)
    args = p.parse_args(argv)
    urls = args.url or ["http://localhost:8000"]
    names = args.name or [u.split("//")[-1] for u in urls]
    if len(names) != len(urls):
        raise SystemExit(f"{len(urls)} --url but {len(names)} --name")
    prompts, max_tokens = _trace(args)
    if args.dry_run:
        for rate in args.rate:
            arrivals = poisson_arrivals(len(prompts), rate, args.arrival_seed)
            print(f"rate {rate:g} req/s: last arrival at {arrivals[-1]:.2f} s")
        return
    servers = {}
    for name, url in zip(names, urls):
        try:
            model = args.model or server_model(url)
        except (urllib.error.URLError, OSError) as err:
            raise SystemExit(f"no server at {url} ({err}): start it first") from None
        print(f"{name}: {url}, model {model}")
        servers[name] = (url, model)
    results, records = measure_servers(servers, prompts, max_tokens, args.rate, args)
    print_side_by_side(results, _compare(results, records))
    if args.out:
        _write(args.out, results, records)


# ---- bench online: start the servers too --------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LaunchedServer:
    """A server subprocess on 127.0.0.1; `stop` sends SIGTERM and waits."""

    def __init__(self, name: str, cmd: list[str], env: dict, log: Path, port: int):
        self.name, self.url, self.log = name, f"http://127.0.0.1:{port}", log
        self._out = open(log, "w")
        self.proc = subprocess.Popen(
            cmd, stdout=self._out, stderr=subprocess.STDOUT, env=env
        )

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(
            f"{self.name} did not start; its log ({self.log}):\n"
            + self.log.read_text()[-3000:]
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()


def _budget_bytes(model: str, tokens: int) -> int:
    from pagedkv_lab.bench.common import _kv_spec

    return _kv_spec(model).bytes_for(tokens)


def online_commands(args, model_dir: str | None, port: int, vllm: bool) -> list[str]:
    """The command line of our server, or of vLLM's, with the same settings."""
    budget = _budget_bytes(args.model, args.budget_requests * args.max_model_len)
    batched = args.max_num_batched_tokens or max(512, args.max_model_len)
    common = ["--max-model-len", str(args.max_model_len), "--max-num-seqs",
              str(args.max_num_seqs), "--max-num-batched-tokens", str(batched),
              "--seed", "0", "--port", str(port), "--host", "127.0.0.1"]  # fmt: skip
    if not vllm:
        cmd = [sys.executable, "-m", "pagedkv_lab.serve", args.model,
               "--block-size", str(args.block_size), "--kv-cache-memory", str(budget),
               "--disable-access-log", "--log-level", "warning", *common]  # fmt: skip
        return cmd + (["--device", args.device] if args.device else [])
    from pagedkv_lab.models import OFFLINE_MODELS

    dtype = "float32" if args.model in OFFLINE_MODELS else "auto"
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
           "--model", model_dir, "--served-model-name", args.model, "--dtype", dtype,
           "--block-size", str(args.vllm_block_size),
           "--kv-cache-memory-bytes", str(budget), "--no-enable-prefix-caching",
           "--disable-uvicorn-access-log", *common]  # fmt: skip
    return cmd + (["--enforce-eager"] if args.vllm_mode == "eager" else [])


def online_main(args) -> None:
    """``python -m pagedkv_lab.bench online``: start the servers (ours, then
    vLLM's where a vLLM python is found), warm each up, replay the trace at every
    rate in rounds that alternate the servers (`measure_servers`), stop them;
    print them side by side."""
    from pagedkv_lab.bench.peers import _save_for_vllm, find_vllm_python

    prompts, max_tokens = _trace(args)
    args.vllm_python = find_vllm_python(args.vllm_python)
    systems = ["pagedkv"] + (["vllm"] if args.vllm_python else [])
    if not args.vllm_python:
        print("vllm: not found (set PAGEDKV_VLLM_PYTHON or --vllm-python); ours only")
    threads = args.threads or os.cpu_count() or 1
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
    }
    print(
        f"model {args.model}, KV budget {args.budget_requests} x {args.max_model_len} "
        f"tokens, blocks of {args.block_size} (vLLM {args.vllm_block_size}, "
        f"{args.vllm_mode}), {threads} threads per server; both servers up, one "
        "replaying at a time, in alternating rounds"
    )
    with tempfile.TemporaryDirectory(prefix="pagedkv-online-") as tmp:
        model_dir = _save_for_vllm(args.model, tmp) if args.vllm_python else None
        launched: list[LaunchedServer] = []
        try:
            for name in systems:  # started one at a time; each idles while not replayed
                port = _free_port()
                cmd = online_commands(args, model_dir, port, vllm=name == "vllm")
                log = Path(args.log_dir or tmp) / f"{name}-server.log"
                log.parent.mkdir(parents=True, exist_ok=True)
                server = LaunchedServer(name, cmd, env, log, port)
                launched.append(server)
                start = time.perf_counter()
                server.wait_ready(args.startup_timeout)
                print(
                    f"{name}: up in {time.perf_counter() - start:.0f} s at {server.url}"
                )
            results, records = measure_servers(
                {s.name: (s.url, args.model) for s in launched},
                prompts, max_tokens, args.rate, args,
            )  # fmt: skip
        finally:
            for server in launched:
                server.stop()
    identical = _compare(results, records)
    if args.reference:
        identical["LLM.generate"] = _reference(args, prompts, max_tokens, records)
    print_side_by_side(results, identical)
    if args.reference:
        print(
            f"  tokens identical to LLM.generate (greedy), pagedkv: {identical['LLM.generate']}"
        )
    if args.out:
        _write(args.out, results, records)


def _reference(args, prompts, max_tokens, records) -> list[str]:
    """How many of our server's replies equal `LLM.generate`'s greedy tokens."""
    from pagedkv_lab import LLM, SamplingParams

    llm = LLM(args.model, max_model_len=args.max_model_len, seed=0)
    params = [
        SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens
    ]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
    )
    return [
        f"{sum(o.token_ids == r.token_ids for o, r in zip(outs, recs))} of {len(outs)}"
        for recs in records["pagedkv"]
    ]


def add_online_parser(sub) -> None:
    """``bench online``'s options."""
    p = sub.add_parser(
        "online",
        help="our HTTP server vs vllm serve: one client, one trace, side by side",
    )
    p.add_argument("--model", default="small-llama")
    p.add_argument(
        "--budget-requests",
        type=int,
        default=8,
        help="KV budget, in max-length requests",
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--vllm-block-size", type=int, default=32, help="a multiple of 32 on a CPU"
    )
    p.add_argument("--vllm-mode", choices=["compile", "eager"], default="compile")
    p.add_argument("--vllm-python", default=None, help="or $PAGEDKV_VLLM_PYTHON")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument(
        "--threads", type=int, default=None, help="OMP_NUM_THREADS per server"
    )
    p.add_argument("--device", default=None, help="our server's device")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--log-dir", default=None, help="keep the servers' logs here")
    p.add_argument(
        "--reference", action="store_true",
        help="also check our server's tokens against LLM.generate (greedy)",
    )  # fmt: skip
    add_client_args(p)
