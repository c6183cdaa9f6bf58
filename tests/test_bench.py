"""The benchmarks run end to end on a CPU and compare like with like (no timing assertions)."""

import torch

from pagedkv_lab.bench import SYSTEMS, kernel_benchmark, main, serve_benchmark
from pagedkv_lab.workloads import Request


def test_serve_benchmark_systems_agree_token_for_token():
    requests = [
        Request(i, 0.0, p, o)
        for i, (p, o) in enumerate([(5, 9), (30, 3), (12, 20), (2, 40)])
    ]
    rows, outputs = serve_benchmark(
        "tiny-llama",
        requests,
        device=torch.device("cpu"),
        max_model_len=64,
        budget_requests=2,
    )
    assert [r["system"] for r in rows] == list(SYSTEMS)
    assert all(r["output_tokens"] == sum(q.output_len for q in requests) for r in rows)
    for name, outs in outputs.items():
        assert outs == outputs["pagedkv"], name
    ours = rows[0]
    assert ours["peak_kv_MiB"] > 0 and ours["ttft_p50"] <= ours["ttft_p90"]


def test_kernel_benchmark_rows_and_cli(capsys):
    rows = kernel_benchmark(torch.device("cpu"), (2,), (40, 64), repeats=2)
    assert [(r["batch"], r["context_len"]) for r in rows] == [(2, 40), (2, 64)]
    assert all(r["max_error"] < 1e-4 for r in rows)
    main(["kernel", "--batch", "1", "--context", "32", "--repeats", "2"])
    assert "paged/contig" in capsys.readouterr().out
