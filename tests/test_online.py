"""`bench.online.measure_servers`: the servers take turns. Each is warmed up,
then at every rate every round replays the trace against each server, one at a
time, the order reversed every round; each server's median round is kept. No
server runs: `replay` is replaced by a recorder, and no timing is asserted."""

import math
from types import SimpleNamespace

from pagedkv_lab.bench import online


def test_the_servers_alternate_by_round(monkeypatch):
    calls = []

    def fake_replay(url, model, prompts, max_tokens, arrivals, stream, timeout, conc):
        calls.append((url, len(prompts), arrivals[-1]))
        # a throughput that differs by server and by round, so the median is a choice
        done = 1.0 + len(calls) % 5
        return [online.Record(3, n, a, sent=a, first=a + 0.1, done=done,
                              output_tokens=n, token_ids=[1] * n)
                for n, a in zip(max_tokens, arrivals)]  # fmt: skip

    monkeypatch.setattr(online, "replay", fake_replay)
    args = SimpleNamespace(warmup=2, timeout=10.0, arrival_seed=0, repeats=3,
                           no_stream=False, max_concurrency=0)  # fmt: skip
    servers = {"pagedkv": ("http://a", "m"), "vllm": ("http://b", "m")}
    prompts, max_tokens = [[1, 2, 3]] * 4, [2, 3, 4, 5]
    rows, records = online.measure_servers(servers, prompts, max_tokens,
                                           [2.0, math.inf], args)  # fmt: skip
    warm, timed = calls[:2], calls[2:]
    assert [(u, n) for u, n, _ in warm] == [("http://a", 2), ("http://b", 2)]
    one_rate = ["http://a", "http://b", "http://b", "http://a", "http://a", "http://b"]
    assert [u for u, _, _ in timed] == one_rate * 2  # at each rate, reversed every round
    assert all(last > 0 for _, _, last in timed[:6]) and all(
        last == 0 for _, _, last in timed[6:])  # Poisson arrivals, then all at once
    for name in servers:
        assert [r["rate"] for r in rows[name]] == [2.0, math.inf]
        for row in rows[name]:
            kept = sorted(row["rounds_out_tok_per_s"])
            assert len(kept) == 3 and row["out_tok_per_s"] == kept[1]  # the median round
        assert len(records[name]) == 2 and len(records[name][0]) == 4


def test_even_rounds_are_refused_and_the_default_warms_on_the_whole_trace(monkeypatch):
    """A median of two rounds is their mean, so an even ``--repeats`` is refused
    before anything is sent; the default warm-up (-1) replays the whole trace
    once per server, untimed, and the defaults are three rounds."""
    import pytest

    calls = []

    def fake_replay(url, model, prompts, max_tokens, arrivals, stream, timeout, conc):
        calls.append((url, len(prompts)))
        return [online.Record(3, n, a, sent=a, first=a + 0.1, done=1.0 + len(calls),
                              output_tokens=n, token_ids=[1] * n)
                for n, a in zip(max_tokens, arrivals)]  # fmt: skip

    monkeypatch.setattr(online, "replay", fake_replay)
    import argparse

    p = argparse.ArgumentParser()
    online.add_client_args(p)
    args = p.parse_args([])
    assert args.repeats == 3 and args.warmup == -1
    servers = {"pagedkv": ("http://a", "m"), "vllm": ("http://b", "m")}
    prompts, max_tokens = [[1, 2, 3]] * 5, [2, 3, 4, 5, 6]
    args.repeats = 2
    with pytest.raises(ValueError, match="odd"):
        online.measure_servers(servers, prompts, max_tokens, [math.inf], args)
    assert calls == []
    args.repeats = 3
    rows, _ = online.measure_servers(servers, prompts, max_tokens, [math.inf], args)
    assert calls[:2] == [("http://a", 5), ("http://b", 5)]  # the whole trace, each
    assert len(calls) == 2 + 3 * 2


def test_the_table_prints_each_rounds_ratio(capsys):
    """With two servers and several rounds, the table ends with the second
    server's output tokens/s over the first's in every round, and their median."""
    row = {"rate": math.inf, "requests": 2, "failed": 0, "short": 0, "req_per_s": 1.0,
           "tok_per_s": 1.0, "norm_latency_mean": 0.1,
           **{f"{k}_p{q}": 0.1 for k in ("ttft", "tpot", "latency") for q in (50, 90, 99)}}
    a = {**row, "out_tok_per_s": 100.0, "rounds_out_tok_per_s": [100.0, 90.0, 110.0]}
    b = {**row, "out_tok_per_s": 100.0, "rounds_out_tok_per_s": [110.0, 90.0, 99.0]}
    online.print_side_by_side({"ours": [a], "peer": [b]}, {"ours": ["-"], "peer": ["2 of 2"]})
    out = capsys.readouterr().out
    assert "peer over ours, output tokens/s by round: 1.100 1.000 0.900 (median 1.000)" in out
