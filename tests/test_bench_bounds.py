"""Chapter 10's bounds and method: step counts made without a model equal the
engine's own, Poisson arrivals and the normalised latency, several seeds per
rate, and the trace file a cut-off run leaves behind."""

import pytest
import torch

from pagedkv_lab.bench import report, scaled_chat_trace, static_batches
from pagedkv_lab.bench.serve import count_steps
from pagedkv_lab.bench.timing import trace
from pagedkv_lab.kvmath import KVSpec
from pagedkv_lab.llm import LLM
from pagedkv_lab.models import load_model
from pagedkv_lab.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def pair():
    return load_model("tiny-llama")


@pytest.mark.parametrize("reserve", [False, True])
@pytest.mark.parametrize("budget_requests", [1, 2, 8])
def test_counted_steps_are_the_engines_steps(pair, reserve, budget_requests):
    max_len = 128
    requests = scaled_chat_trace(12, max_len, seed=3)
    gen = torch.Generator().manual_seed(0)
    prompts = [
        [1] + torch.randint(3, 259, (r.prompt_len - 1,), generator=gen).tolist()
        for r in requests
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
        for r in requests
    ]
    spec = KVSpec.from_config(pair[0].config, pair[0].dtype)
    llm = LLM(
        pair,
        kv_cache_memory=spec.bytes_for(budget_requests * max_len),
        max_model_len=max_len,
        max_num_batched_tokens=512,
        reserve_max_len=reserve,
    )
    llm.generate(prompts, params, use_tqdm=False)
    system = "contiguous" if reserve else "pagedkv"
    counted = count_steps(
        requests, max_model_len=max_len, budget_requests=budget_requests,
        systems=(system,),
    )  # fmt: skip
    assert counted[system] == llm.stats.steps


def test_static_batches_count_their_longest_outputs():
    requests = scaled_chat_trace(10, 128, seed=1)
    counted = count_steps(requests, max_model_len=128, budget_requests=2,
                          systems=("hf-generate", "hf-continuous", "pagedkv"))  # fmt: skip
    outs = [r.output_len for r in requests]
    batches = static_batches([r.prompt_len for r in requests], outs, 256, 256)
    assert counted["hf-generate"] == sum(max(outs[i] for i in b) for b in batches)
    assert counted["hf-continuous"] == counted["pagedkv"]


def test_section_counts_add_warm_up_and_rounds():
    """The warm-up is one untimed pass of the whole workload: a section of
    ``repeats`` rounds counts ``repeats + 1`` passes of it."""
    one = report.serve_section_steps(8, 128, repeats=1, workloads=("w1",))
    three = report.serve_section_steps(8, 128, repeats=3, workloads=("w1",))
    w = report.serve_workload("w1", 8, 128, 8, ("pagedkv",))
    a_round = count_steps(w["requests"], max_model_len=128, budget_requests=8,
                          systems=("pagedkv",))["pagedkv"]  # fmt: skip
    assert one["w1"]["pagedkv"] == 2 * a_round
    for system, n in one["w1"].items():
        assert n % 2 == 0 and three["w1"][system] == 2 * n
    prefix = report.serve_section_steps(8, 128, workloads=("w3-prefix",))["w3-prefix"]
    assert set(prefix) == {"pagedkv", "hf-continuous"}
    assert report.blocks_section_steps(4, 64, repeats=2, block_sizes=(16,)) == 3 * (
        count_steps(scaled_chat_trace(4, 64, seed=4), max_model_len=64,
                    budget_requests=8, systems=("pagedkv",))["pagedkv"]
    )  # fmt: skip
    assert report.rate_section_steps(8, 64, seeds=(0, 1, 2)) > report.rate_section_steps(
        8, 64, seeds=(0,)
    )


def test_poisson_arrivals_and_the_normalised_latency():
    a = report.poisson_arrivals(1000, 50.0, seed=2)
    assert a == sorted(a) and a == report.poisson_arrivals(1000, 50.0, seed=2)
    assert a != report.poisson_arrivals(1000, 50.0, seed=3)
    # the same gaps at every rate, scaled
    assert report.poisson_arrivals(5, 10.0, 1) == pytest.approx(
        [t / 2 for t in report.poisson_arrivals(5, 5.0, 1)]
    )
    assert 1000 / a[-1] == pytest.approx(50.0, rel=0.1)  # the mean rate
    assert report.normalized_latency([(1.0, 4), (3.0, 2)]) == pytest.approx(0.875)
    assert report.normalized_latency([(1.0, 0)]) == 1.0  # no division by zero


def test_rate_section_reports_the_median_and_range_of_its_seeds():
    rate = report.rate_section(
        torch.device("cpu"), model="tiny-llama", num_requests=6, max_model_len=64,
        loads=(1.0, 4.0), seeds=(0, 1, 2),
    )  # fmt: skip
    assert len(rate["rows"]) == 4 and len(rate["runs"]) == 12
    for row in rate["rows"]:
        mine = [r["normalized_latency_s"] for r in rate["runs"]
                if r["system"] == row["system"] and r["load"] == row["load"]]  # fmt: skip
        assert sorted(mine)[1] == row["normalized_latency_s"]
        assert (min(mine), max(mine)) == (
            row["normalized_latency_min"], row["normalized_latency_max"]
        )
    single = report.rate_section(
        torch.device("cpu"), model="tiny-llama", num_requests=4, max_model_len=64,
        loads=(1.0,),
    )  # fmt: skip
    assert [r["seeds"] for r in single["rows"]] == [1, 1]


def test_trace_appends_only_when_asked(tmp_path, monkeypatch):
    path = tmp_path / "trace.txt"
    monkeypatch.delenv("PAGEDKV_TRACE", raising=False)
    trace("nothing")
    assert not path.exists()
    monkeypatch.setenv("PAGEDKV_TRACE", str(path))
    trace("first")
    trace("second")
    lines = path.read_text().splitlines()
    assert [line.split(" ", 1)[1] for line in lines] == ["first", "second"]


def test_serve_benchmark_traces_each_system_and_round(tmp_path, monkeypatch):
    from pagedkv_lab.bench import serve_benchmark

    path = tmp_path / "trace.txt"
    monkeypatch.setenv("PAGEDKV_TRACE", str(path))
    serve_benchmark("tiny-llama", scaled_chat_trace(3, 64), max_model_len=64,
                    systems=("pagedkv", "contiguous"), repeats=2)  # fmt: skip
    text = path.read_text()
    for system in ("pagedkv", "contiguous"):
        assert f"{system} warm-up" in text
        for r in (0, 1):
            assert f"{system} round {r} starts" in text
            assert f"{system} round {r}:" in text
