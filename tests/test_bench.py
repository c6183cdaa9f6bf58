"""The benchmarks run end to end on a CPU and compare like with like (no timing assertions)."""

import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from pagedkv_lab import bench
from pagedkv_lab.bench import (
    PEAK_KV,
    SYSTEMS,
    common,
    find_vllm_python,
    kernel_benchmark,
    peak_kv_note,
    peers,
    print_serve_notes,
    print_serve_table,
    serve_benchmark,
    static_batches,
    vllm_block_sizes,
)
from pagedkv_lab.bench import serve as serve_module
from pagedkv_lab.bench.cli import main
from pagedkv_lab.bench.common import cpu_model
from pagedkv_lab.kvmath import KVSpec
from pagedkv_lab.models import offline_config
from pagedkv_lab.sim.workloads import Request

REQUESTS = [
    Request(i, 0.0, p, o)
    for i, (p, o) in enumerate([(5, 9), (30, 3), (12, 20), (2, 40), (7, 7)])
]


def test_serve_benchmark_systems_agree_token_for_token():
    rows, outputs = serve_benchmark(
        "tiny-llama",
        REQUESTS,
        device=torch.device("cpu"),
        max_model_len=64,
        budget_requests=2,
        repeats=2,
    )
    assert [r["system"] for r in rows] == list(SYSTEMS)
    assert all(r["output_tokens"] == sum(q.output_len for q in REQUESTS) for r in rows)
    for name, outs in outputs.items():
        assert outs == outputs["pagedkv"], name
    spec = KVSpec.from_config(offline_config("tiny-llama"), torch.float32)
    budget = spec.bytes_for(2 * 64)
    for r in rows:
        assert r["same_across_repeats"] and r["repeats"] == 2
        assert r["model"] == "tiny-llama" and r["device"] == "cpu"
        # one quantity for every system, measured from its own cache, never above the budget
        assert 0 < r["peak_kv_MiB"] * 2**20 <= budget, r["system"]
        if r["block_size"]:  # paged systems hold whole blocks
            assert r["peak_kv_MiB"] * 2**20 % spec.bytes_for(r["block_size"]) == 0
    ours = rows[0]
    assert ours["ratio"] == 1 and ours["ttft_p50"] <= ours["ttft_p90"]
    # static generate: batches sized by the budget, and its measured cache is the padded formula
    hf = next(r for r in rows if r["system"] == "hf-generate")
    batches = static_batches(
        [q.prompt_len for q in REQUESTS],
        [q.output_len for q in REQUESTS],
        2 * 64,
        256,
    )
    assert hf["batch_sizes"] == [len(b) for b in batches]
    largest = max(
        len(b)
        * (
            max(REQUESTS[i].prompt_len for i in b)
            + max(REQUESTS[i].output_len for i in b)
            - 1
        )
        for b in batches
    )
    assert hf["peak_kv_MiB"] * 2**20 == spec.bytes_for(largest)
    # reserving max_model_len per request holds more than paging, on the same budget
    contiguous = next(r for r in rows if r["system"] == "contiguous")
    assert contiguous["peak_kv_MiB"] >= ours["peak_kv_MiB"]


def test_static_batches_follow_the_kv_budget():
    prompts, outputs = [5, 30, 12, 2, 7, 40], [9, 3, 20, 40, 7, 1]
    batches = static_batches(prompts, outputs, 128, max_batch=256)
    assert [i for b in batches for i in b] == list(range(6))  # trace order, each once

    def need(b):
        return len(b) * (max(prompts[i] for i in b) + max(outputs[i] for i in b) - 1)

    for b in batches[:-1]:
        assert need(b) <= 128
        # maximal: adding the next request would break the budget
        assert need(range(b.start, b.stop + 1)) > 128
    assert need(batches[-1]) <= 128
    # the batch limit caps them; the max-length policy is budget // max_model_len
    assert all(len(b) <= 2 for b in static_batches(prompts, outputs, 10**6, 2))
    assert [
        len(b) for b in static_batches(prompts, outputs, 128, 256, "max-len", 64)
    ] == [2] * 3
    # a request longer than the budget alone still runs (alone)
    assert static_batches([100], [100], 64, 8) == [range(0, 1)]
    with pytest.raises(ValueError):
        static_batches(prompts, outputs, 128, 8, "nope")


def test_every_system_gets_the_same_warmup_and_requests_in_alternating_rounds(
    monkeypatch,
):
    calls = []

    class Fake:
        block_size = 16

        def __init__(self, setup, name):
            self.name = name

        def run(self, prompts, max_tokens):
            calls.append((self.name, [list(p) for p in prompts], list(max_tokens)))
            return common._run_result(
                1.0, [[0] * n for n in max_tokens], [0.1], [0.01], 0
            )

        def close(self):
            pass

    monkeypatch.setattr(
        serve_module,
        "_OursRunner",
        lambda s, reserve: Fake(s, "contiguous" if reserve else "pagedkv"),
    )
    monkeypatch.setattr(serve_module, "_HFStaticRunner", lambda s: Fake(s, "hf-generate"))
    rows, _ = serve_benchmark(
        "tiny-llama",
        REQUESTS,
        device=torch.device("cpu"),
        max_model_len=64,
        systems=("pagedkv", "contiguous", "hf-generate"),
        repeats=3,
        warmup_requests=2,
    )
    names = [c[0] for c in calls]
    assert names == ["pagedkv", "contiguous", "hf-generate"] * 2 + [
        "hf-generate",
        "contiguous",
        "pagedkv",
    ] + ["pagedkv", "contiguous", "hf-generate"]
    warmups, timed = calls[:3], calls[3:]
    assert all(c[1:] == warmups[0][1:] for c in warmups)
    assert warmups[0][2] == [9, 3]  # the first requests, outputs cut to 16 tokens
    assert all(c[1:] == timed[0][1:] for c in timed)
    assert timed[0][2] == [q.output_len for q in REQUESTS]
    # by default the warm-up is one untimed pass of the whole workload
    calls.clear()
    serve_benchmark("tiny-llama", REQUESTS, device=torch.device("cpu"), max_model_len=64,
                    systems=("pagedkv", "hf-generate"), repeats=1)  # fmt: skip
    assert [c[0] for c in calls] == ["pagedkv", "hf-generate"] * 2
    assert calls[0][1:] == calls[2][1:]  # the warm-up serves what a round serves


def tiny_setup(budget_tokens: int, max_num_seqs: int, max_num_batched_tokens):
    """A CPU `ServeSetup` of tiny-llama for the peers' tests."""
    return bench.ServeSetup(
        "tiny-llama", torch.device("cpu"), max_model_len=64, budget_tokens=budget_tokens,
        block_size=16, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, threads=torch.get_num_threads(),
    )  # fmt: skip


def test_hf_continuous_thread_lives_only_inside_its_runs():
    # a live manager thread keeps an OpenMP team that slows every other system in the process
    setup = tiny_setup(128, 8, 64)
    runner = peers._HFContinuousRunner(setup)
    try:
        assert not runner.manager.is_running()
        prompts = [[3, 4, 5], [6, 7, 8, 9, 10]]
        first = runner.run(prompts, [6, 4])
        assert not runner.manager.is_running()
        second = runner.run(prompts, [6, 4])
        assert not runner.manager.is_running()
        assert first["tokens"] == second["tokens"]
        assert [len(t) for t in first["tokens"]] == [6, 4]
        # both cache layouts (transformers 5.17 and >= 5.18) read the same bytes:
        # the whole budget, and one 16-token block per request at the peak
        assert runner.capacity_bytes == setup.budget_bytes
        bytes_per_block = setup.budget_bytes // (setup.budget_tokens // setup.block_size)
        assert second["peak_kv_bytes"] == 2 * bytes_per_block
    finally:
        runner.close()
    assert getattr(runner.model, "_cached_continuous_batching_manager", None) is None


def test_hf_continuous_default_budget_is_transformers_default_not_the_free_memory():
    # no step budget (bench nanovllm's peer): transformers 5.17 would size it to take
    # 80-90% of the machine's memory (20 GB on CI's 24 GiB, issue 47)
    setup = tiny_setup(2048, 512, None)
    runner = peers._HFContinuousRunner(setup)
    try:
        cache = runner.manager.batch_processor.cache
        assert cache.max_batch_tokens == peers.HF_DEFAULT_MAX_BATCH_TOKENS
    finally:
        runner.close()


def test_vllm_block_sizes_are_multiples_of_32_that_fit():
    assert vllm_block_sizes((16, 32, 48, 64, 128), 512, 4096) == [32, 64, 128]
    assert vllm_block_sizes((32, 64, 128), 64, 128) == [32, 64]
    assert vllm_block_sizes((32, 64), 100, 128) == [32, 64]
    # a 100-token request needs 4 blocks of 32 (or 2 of 64): a 100-token pool has 3 (or 1)
    assert vllm_block_sizes((32, 64), 100, 100) == []


def test_serve_cli_names_model_and_device_and_defines_peak_kv(capsys, tmp_path):
    figure = tmp_path / "serve.png"
    main(
        [
            "serve",
            "--model",
            "tiny-llama",
            "--num-requests",
            "3",
            "--max-model-len",
            "64",
            "--budget-requests",
            "2",
            "--repeats",
            "1",
            "--systems",
            "pagedkv",
            "hf-generate",
            "--plot",
            str(figure),
        ]
    )
    out = capsys.readouterr().out
    assert "serve: tiny-llama on cpu" in out and "workload w1" in out
    note = peak_kv_note(["pagedkv", "hf-generate"])
    assert " ".join(note.split()) in " ".join(out.split())
    assert "vllm" not in note and "contiguous" not in note  # only the rows printed
    assert " ".join(peak_kv_note().split()) == " ".join(PEAK_KV.split())
    # print_serve_table's lines fit the book's 88 columns
    table = out[out.index("serve: tiny-llama") : out.index("tokens against")]
    assert max(map(len, table.splitlines())) <= 88
    # every system's tokens judged against the first's (float32 here: exact)
    assert "hf-generate: 3/3 identical" in out
    assert figure.stat().st_size > 0
    # the CPU is named (ratios differ between CPU models); start-up kept apart
    assert f"cpu model: {cpu_model()}" in out
    assert re.search(r"startup s .*: pagedkv [0-9.]+; hf-generate [0-9.]+", out)


def test_cpu_model_names_the_widest_vector_extension():
    name, _, isa = cpu_model().rpartition(", ")
    assert name and isa in (
        "AVX-512", "AVX2 (no AVX-512)", "no AVX2", "vector extensions unknown"
    )  # fmt: skip


def test_serve_cli_heavy_workload_is_w1_at_a_longer_max_len(capsys):
    main(["serve", "--model", "tiny-llama", "--workload", "heavy", "--num-requests",
          "2", "--repeats", "1", "--systems", "pagedkv", "--max-model-len", "128"])  # fmt: skip
    out = capsys.readouterr().out
    assert "workload heavy" in out and "max_model_len 128" in out
    assert "pagedkv: 2/2 identical" in out


def test_importing_the_bench_does_not_import_vllm():
    code = "import sys, pagedkv_lab, pagedkv_lab.bench; print('vllm' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"


@pytest.mark.skipif(
    find_vllm_python() is None, reason="vLLM is not installed (optional peer)"
)
def test_vllm_peer_gives_our_greedy_tokens_on_the_same_budget():
    # vLLM's CPU attention has no kernel for tiny-llama's head_dim 16: the small model it is
    requests = REQUESTS[:3]
    rows, outputs = serve_benchmark(
        "small-llama",
        requests,
        device=torch.device("cpu"),
        max_model_len=64,
        budget_requests=2,
        systems=("pagedkv", "vllm"),
        vllm_block_sizes_to_try=(32,),
    )
    # both modes by default: vLLM's compiled one ("-tc") and eager
    assert [r["system"] for r in rows] == ["pagedkv", "vllm-b32-tc", "vllm-b32"]
    spec = KVSpec.from_config(offline_config("small-llama"), torch.float32)
    for row in rows[1:]:
        assert outputs[row["system"]] == outputs["pagedkv"]
        assert 0 < row["peak_kv_MiB"] * 2**20 <= spec.bytes_for(2 * 64)
        assert row["versions"]["vllm"]


def test_kernel_benchmark_rows_and_cli(capsys):
    rows = kernel_benchmark(torch.device("cpu"), (2,), (40, 64), repeats=2)
    assert [(r["batch"], r["context_len"]) for r in rows] == [(2, 40), (2, 64)]
    assert all(r["max_error"] < 1e-4 for r in rows)
    main(["kernel", "--batch", "1", "--context", "32", "--repeats", "2"])
    assert "paged/contig" in capsys.readouterr().out


def test_kernel_benchmark_in_order_blocks_give_the_same_answer(capsys):
    """With ``in_order`` the paged kernel also reads blocks laid out in order:
    checked against contiguous SDPA like the other paths, and its column printed."""
    rows = kernel_benchmark(torch.device("cpu"), (3,), (37,), repeats=1, in_order=True)
    assert rows[0]["max_error"] < 1e-4 and rows[0]["in_order_ms"] > 0
    assert rows[0]["shuffled_over_in_order"] == rows[0]["paged_ms"] / rows[0]["in_order_ms"]
    from pagedkv_lab.bench import print_kernel_table

    print_kernel_table(rows)
    out = capsys.readouterr().out
    assert "paged/in order" in out and "SDPA's, except paged/in order" in out


def test_paged_copy_in_order_lays_each_sequence_out_in_a_row():
    from pagedkv_lab.bench.kernel import _paged_copy

    k = torch.randn(2, 1, 5, 4)
    k_cache, _, tables = _paged_copy(k, k, 2, torch.Generator(), shuffle=False)
    assert tables.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert torch.equal(k_cache[:2].flatten(0, 1)[:, 0], k[0, 0, :4])


def test_kernel_benchmark_leaves_out_rows_over_the_memory_cap():
    # CPU defaults: 2 KV heads, head_dim 64, float32: 1 KiB of K+V per token
    per_token = 2 * 2 * 64 * 4
    rows = kernel_benchmark(
        torch.device("cpu"), (1, 2), (16, 32), repeats=1, max_kv_bytes=32 * per_token
    )
    assert [(r["batch"], r["context_len"]) for r in rows] == [(1, 16), (1, 32), (2, 16)]
    assert all(r["kv_bytes"] <= 32 * per_token for r in rows)


def test_kernel_tables_read_back_what_was_printed(capsys):
    """`parse_kernel_tables` recovers every GPU row `print_kernel_table` prints,
    to the printed precision, under its dtype and block size."""
    from pagedkv_lab.bench import parse_kernel_tables, print_kernel_table

    rows = [
        {"path": "Triton kernel", "dtype": "torch.bfloat16", "batch": b, "context_len": c,
         "contiguous_ms": 0.25 * b, "paged_ms": 0.3 * b, "paged_over_contiguous": 1.2,
         "torch_over_contiguous": 3.456, "first_triton_ms": 1.0,
         "first_triton_over_contiguous": 4.5, "copy_GBps": 3000.0,
         "paged_GBps": 2500.04, "fraction_of_copy": 0.834}
        for b, c in [(1, 512), (64, 16384)]
    ]  # fmt: skip
    print("bfloat16, block size 32")
    print_kernel_table(rows)
    got = parse_kernel_tables(capsys.readouterr().out)
    assert [(r["batch"], r["context_len"]) for r in got] == [(1, 512), (64, 16384)]
    assert all(r["dtype"] == "bfloat16" and r["block_size"] == 32 for r in got)
    assert got[1]["contiguous_ms"] == 16.0 and got[1]["torch_over_contiguous"] == 3.46
    assert got[0]["paged_GBps"] == 2500.0 and got[0]["fraction_of_copy"] == 0.83


def test_sustained_rate_interpolates_the_first_crossing_of_the_bound():
    from pagedkv_lab.bench.report import sustained_rate

    def rows(system, points):
        return [
            {"system": system, "rate_req_per_s": r, "normalized_latency_s": lat}
            for r, lat in points
        ]

    table = rows("a", [(40.0, 0.004), (10.0, 0.001), (20.0, 0.002)]) + rows(
        "b", [(10.0, 0.003), (20.0, 0.009)]
    )
    # rows out of order; crossing 0.003 between 20 (0.002) and 40 (0.004)
    assert sustained_rate(table, "a", 0.003) == pytest.approx(30.0)
    assert sustained_rate(table, "a", 0.01) == 40.0  # never crosses: a lower bound
    assert sustained_rate(table, "b", 0.002) is None  # over at the lowest rate
    # a later dip below the bound does not count: the first crossing does
    dip = rows("c", [(1.0, 1.0), (2.0, 3.0), (3.0, 1.0)])
    assert sustained_rate(dip, "c", 2.0) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="no rows for system 'z'"):
        sustained_rate(table, "z", 1.0)


def test_the_vllm_peer_script_is_where_the_runner_starts_it():
    # runs without vLLM: the test that starts the peer is skipped where it is absent
    from pagedkv_lab.bench.peers import VLLM_PEER_SCRIPT

    assert VLLM_PEER_SCRIPT.is_file()
    assert "import vllm" in VLLM_PEER_SCRIPT.read_text()


def test_serve_rows_carry_the_spread_of_per_round_ratios(capsys):
    base = [{"tokens": [[0] * 10], "seconds": s, "ttft": [0.1], "tpot": [0.01],
             "peak_kv_bytes": 0} for s in (1.0, 1.0, 1.0)]  # fmt: skip
    runs = [dict(b, seconds=s) for b, s in zip(base, (0.5, 1.0, 2.0))]
    setup = SimpleNamespace(
        model_name="m", device="cpu", threads=2, budget_bytes=2**20,
        spec=SimpleNamespace(dtype_bytes=4),
    )  # fmt: skip
    rows = [serve_module._summarise(n, r, base, setup, 16)
            for n, r in (("ours", base), ("peer", runs))]  # fmt: skip
    peer = rows[1]
    assert (peer["ratio_min"], peer["ratio"], peer["ratio_max"]) == (0.5, 1.0, 2.0)
    print_serve_table(rows, title="t")
    assert "ratio per round, min-max: peer 0.50-2.00" in capsys.readouterr().out
    # notes=False leaves the general notes to one print_serve_notes call
    print_serve_table(rows, title="t", ms=True, notes=False)
    out = capsys.readouterr().out
    assert "ratio per round, min-max: peer 0.50-2.00" in out
    assert "peak KV =" not in out and "TTFT (time to first token)" not in out
    print_serve_notes(["ours", "peer"], ms=True)
    out = " ".join(capsys.readouterr().out.split())
    assert "TTFT (time to first token)" in out
    assert " ".join(peak_kv_note(["ours", "peer"]).split()) in out


def test_serve_cli_runs_several_workloads_and_sums_them_up(capsys):
    main(["serve", "--model", "tiny-llama", "--workload", "w1", "w2", "--num-requests",
          "2", "3", "--repeats", "2", "--systems", "pagedkv", "hf-continuous",
          "--max-model-len", "64"])  # fmt: skip
    out = capsys.readouterr().out
    assert "workload w1 (2 requests)" in out and "workload w2 (3 requests)" in out
    summary = out[out.index("summary: pagedkv tok/s") :].splitlines()
    assert "hf-continuous" in summary[1] and "tokens identical" in summary[1]
    assert [line.split()[:2] for line in summary[2:4]] == [["w1", "2"], ["w2", "3"]]
    assert re.search(r"[0-9.]+ \([0-9.]+-[0-9.]+\) +all$", summary[2])


def test_serve_cli_rejects_a_count_per_workload_that_does_not_match():
    with pytest.raises(SystemExit, match="one count or one per workload"):
        main(["serve", "--workload", "w1", "w2", "--num-requests", "1", "2", "3"])


# ---- chapters 04c and 04d's ladders ---------------------------------------------------

REPORT = __import__("pathlib").Path(__file__).resolve().parent.parent / "book/reports/h100"


def test_committed_ladder_reads_each_rung_from_the_file_that_holds_it():
    """The figures issue 37 quotes, read back: 64 -> 128 keys per tile took batch
    64 / 4,096 from 1.17 to 1.02 (one sweep), the fused merge took batch 8 /
    1,024 to 1.07 from a sweep whose best there was 1.30; rungs no committed run
    measured say so."""
    from pagedkv_lab.bench.kernel import committed_ladder
    from pagedkv_lab.course.ladder import DECODE_LADDER, PREFILL_LADDER

    rows = committed_ladder(REPORT, DECODE_LADDER, PREFILL_LADDER)

    def row(kind, rung, shape):
        return next(r for r in rows if (r["kind"], r["rung"], r["shape"]) == (kind, rung, shape))

    assert row("decode", 0, (64, 4096))["over_contiguous"] == 3.53
    assert row("decode", 0, (64, 4096))["timed"] == "launched"
    assert row("decode", 1, (256, 4096))["over_contiguous"] == 4.68
    assert row("decode", 5, (64, 4096))["over_contiguous"] == 1.17
    assert row("decode", 6, (64, 4096))["over_contiguous"] == 1.02
    assert row("decode", 6, (256, 4096))["source"] == "kernel_tune.txt"  # same launch
    bound = row("decode", 6, (8, 1024))
    assert not bound["measured"] and bound["at_least"] == 1.30
    assert row("decode", 7, (8, 1024))["over_contiguous"] == 1.07
    assert row("decode", 7, (256, 4096))["GBps"] == 3005.6
    for rung in (2, 3, 4):
        assert not any(r["measured"] for r in rows if (r["kind"], r["rung"]) == ("decode", rung))
    assert row("prefill", 2, (4, 1024))["over_causal_sdpa"] == 2.08
    # rung 2 from the sweep; rung 4 and the default (the same launch then) from
    # the run of 2026-11-26
    assert sum(r["measured"] for r in rows if r["kind"] == "prefill") == 9


def test_a_committed_ladder_run_comes_first(tmp_path):
    import json
    import shutil

    from pagedkv_lab.bench.kernel import committed_ladder
    from pagedkv_lab.course.ladder import DECODE_LADDER, PREFILL_LADDER

    for f in REPORT.glob("kernel_*.txt"):
        shutil.copy(f, tmp_path)
    mine = {"kind": "decode", "rung": 3, "name": DECODE_LADDER[3].name, "batch": 8,
            "context_len": 1024, "ms": 0.05, "over_contiguous": 1.9, "GBps": 700.0}  # fmt: skip
    (tmp_path / "kernel_ladder.json").write_text(json.dumps([mine]))
    rows = committed_ladder(tmp_path, DECODE_LADDER, PREFILL_LADDER)
    got = next(r for r in rows if (r["rung"], r["shape"]) == (3, (8, 1024)) and r["kind"] == "decode")
    assert got["measured"] and got["over_contiguous"] == 1.9
    assert got["source"] == "kernel_ladder.json"


def test_tune_files_read_back():
    from pagedkv_lab.bench.kernel import parse_tune_lines, parse_tune_prefill_lines

    tune = parse_tune_lines((REPORT / "kernel_tune.txt").read_text())
    assert len(tune) == 6 and tune[3]["best_setting"] == (128, 2, 4, None)
    pre = parse_tune_prefill_lines((REPORT / "kernel_tune_prefill.txt").read_text())
    assert [s["current_over_causal_sdpa"] for s in pre["shapes"]] == [2.08, 2.00, 2.18]
    assert pre["geometric_means"][(64, 64, 4, None)] == 2.087


def test_ladder_benchmarks_time_every_rung_beside_its_bar(capsys):
    from pagedkv_lab.bench.kernel import (
        decode_ladder_benchmark,
        prefill_ladder_benchmark,
        print_ladder_table,
    )
    from pagedkv_lab.course.ladder import DECODE_LADDER, PREFILL_LADDER

    cpu = torch.device("cpu")
    rungs = [DECODE_LADDER[0], DECODE_LADDER[-1]]
    rows = decode_ladder_benchmark(cpu, rungs, ((2, 20),), heads=(4, 2, 16), repeats=1)
    assert [r["name"] for r in rows] == [r.name for r in rungs]
    assert all(r["max_error"] < 1e-4 and r["GBps"] > 0 and r["timed"] == "launched"
               for r in rows)  # fmt: skip
    rows += prefill_ladder_benchmark(cpu, PREFILL_LADDER[-1:], ((2, 9),), heads=(4, 2, 16),
                                     repeats=1)  # fmt: skip
    assert rows[-1]["over_causal_sdpa"] > 0 and rows[-1]["max_error"] < 1e-4
    assert {"rung", "name", "change", "prediction"} <= set(rows[-1])
    print_ladder_table(rows)
    assert "x causal" in capsys.readouterr().out


def test_kernel_ladder_writes_the_prefill_kernel_target(tmp_path, capsys):
    """``prefill_kernel.over_causal_sdpa`` in results.json, where the targets
    writer reads it (here on the CPU, in the interpreter: the script's check)."""
    import importlib.util
    import json

    path = REPORT.parent.parent.parent / "scripts" / "kernel_ladder.py"
    spec = importlib.util.spec_from_file_location("kernel_ladder", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--smoke", "--sections", "prefill-kernel", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["prefill_kernel"]["over_causal_sdpa"] > 0
    assert results["prefill_kernel"]["grid"] == [[2, 24], [3, 9]]
    assert "prefill kernel" in (tmp_path / "summary.txt").read_text()


def test_nanovllm_workload_is_bench_py_draw_and_gives_the_published_count(capsys):
    """Drawn as nano-vllm's bench.py draws it, with the module-level random
    functions and seed(0): the same prompts and output lengths, whose sum is the
    count of its README's table."""
    import random

    from pagedkv_lab.bench.nanovllm import NANOVLLM_OUTPUT_TOKENS, nanovllm_workload

    state = random.getstate()
    try:
        random.seed(0)
        want_prompts = [
            [random.randint(0, 10000) for _ in range(random.randint(100, 1024))]
            for _ in range(256)
        ]
        want_tokens = [random.randint(100, 1024) for _ in range(256)]
    finally:
        random.setstate(state)
    prompts, max_tokens = nanovllm_workload()
    assert prompts == want_prompts and max_tokens == want_tokens
    total = sum(max_tokens)
    print(f"nano-vllm's workload: {len(prompts)} requests, {total:,} output tokens")
    assert total == NANOVLLM_OUTPUT_TOKENS == 133_966
    assert all(100 <= len(p) <= 1024 and max(p) <= 10000 for p in prompts)
    assert "133,966 output tokens" in capsys.readouterr().out


def test_nanovllm_cli_smoke_writes_its_json(capsys, tmp_path):
    import json

    out = tmp_path / "nanovllm.json"
    main(["nanovllm", "--model", "tiny-llama", "--num-requests", "4",
          "--min-len", "4", "--max-input-len", "20", "--max-output-len", "12",
          "--max-model-len", "64", "--kv-cache-memory", str(2**20),
          "--max-num-batched-tokens", "64", "--device", "cpu", "--json", str(out)])  # fmt: skip
    text = capsys.readouterr().out
    assert "Throughput:" in text and "floor-bound:" in text and "hf-continuous:" in text
    r = json.loads(out.read_text())
    assert {"model", "dtype", "cpu", "requests", "output_tokens", "seconds", "tok_s",
            "floor_tok_s", "peers"} <= set(r)  # fmt: skip
    from pagedkv_lab.bench.nanovllm import nanovllm_workload

    _, max_tokens = nanovllm_workload(4, 20, 12, min_len=4)
    assert r["model"] == "tiny-llama" and r["requests"] == 4
    assert r["output_tokens"] == sum(max_tokens)
    assert r["peers"]["hf-continuous"]["output_tokens"] == sum(max_tokens)
    # the floor bounds the run from below: more tokens per second than measured
    assert r["floor_tok_s"] > r["tok_s"] > 0


def test_nanovllm_compares_greedy_and_sampled_in_one_process(capsys, tmp_path):
    """--compare-greedy at a tiny size: after the run as published, greedy
    against temperature 0.6 in 3 alternating rounds of the same engine, every
    round serving every token (no timing is asserted)."""
    import json

    out = tmp_path / "greedy.json"
    main(["nanovllm", "--model", "tiny-llama", "--num-requests", "3",
          "--min-len", "4", "--max-input-len", "12", "--max-output-len", "6",
          "--max-model-len", "64", "--kv-cache-memory", str(2**20),
          "--max-num-batched-tokens", "64", "--device", "cpu", "--no-peers",
          "--compare-greedy", "--json", str(out)])  # fmt: skip
    assert "greedy over sampled" in capsys.readouterr().out
    cmp = json.loads(out.read_text())["greedy_compare"]
    assert cmp["rounds"] == 3 and len(cmp["tok_s"]["greedy"]) == 3
    assert len(cmp["greedy_over_sampled"]["per_round"]) == 3
    assert cmp["greedy_over_sampled"]["min"] <= cmp["greedy_over_sampled"]["median"] > 0


def test_nanovllm_floor_counts_every_step_weights_and_kv(monkeypatch):
    from pagedkv_lab import LLM
    from pagedkv_lab.bench.nanovllm import serve_timed

    llm = LLM("tiny-llama", kv_cache_memory=2**20, seed=0)
    seen = []
    result = serve_timed(llm, [[1, 5, 6, 7], [1, 9]], [3, 2], 0.6,
                         lambda kv: seen.append(kv) or 1.0)  # fmt: skip
    assert result["output_tokens"] == 5 and result["steps"] == len(seen)
    assert result["floor_seconds"] == len(seen)
    # the first step computes both prompts (4 + 2 tokens), each later one a token more
    assert seen[0] == 6 and seen[1] == 8
