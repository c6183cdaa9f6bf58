"""Each chapter's GPU time predicted before a run (issue 54,
`pagedkv_lab.bench.plan`): its forward passes and kernel-benchmark rows counted
here at its GPU sizes, read from its own cells, priced at the committed H100
run's costs. No chapter may be predicted over the 60 s a chapter has in the GPU
check."""

from __future__ import annotations

import json

import pytest

from pagedkv_lab.bench import plan

#: Chapters predicted over the limit today, reported to the lead (issue 54): each
#: fails here until its GPU sizes shrink (strict: remove it from here then).
KNOWN_OVER = {
    "06_continuous_batching": "transformers' generate, one request at a time, and "
    "serve_benchmark's peers at 128 requests",
    "10_benchmarks": "the kernel section's 37 rows beside the serving sections",
    "11_claims_audit": "S3's 512 requests served twice, the peers of S2's serve",
}


@pytest.fixture(scope="module")
def plans():
    return plan.predict()


def test_the_prices_are_the_committed_runs(plans):
    prices = plan.h100_prices()
    assert set(prices["step_s"]) >= {"pagedkv", "contiguous", "hf-generate", "hf-continuous"}
    assert all(0 < s < 1 for s in prices["step_s"].values())
    assert 0 < prices["kernel_row_s"] < 10 and 0 < prices["setup_s"] < 30
    assert set(prices["sources"]) == {"step_s", "kernel_row_s", "setup_s"}


def test_every_chapter_is_planned_and_the_counted_ones_count_work(plans):
    chapters = sorted(p.stem for p in plan.NOTEBOOKS.glob("[0-9][0-9]*_*.ipynb"))
    assert list(plans) == chapters
    for chapter in plan.COUNTED:
        assert len(plans[chapter]) > 1 and all(i.units > 0 for i in plans[chapter])


@pytest.mark.parametrize("chapter", sorted(
    p.stem for p in plan.NOTEBOOKS.glob("[0-9][0-9]*_*.ipynb")))  # fmt: skip
def test_no_chapter_is_predicted_over_a_minute_on_an_h100(plans, chapter, request):
    if chapter in KNOWN_OVER:
        request.applymarker(pytest.mark.xfail(strict=True, reason=KNOWN_OVER[chapter]))
    seconds = sum(i.seconds for i in plans[chapter])
    assert seconds <= plan.CHAPTER_LIMIT_S, (chapter, round(seconds))


def test_gpu_values_reads_a_chapters_gpu_sizes(tmp_path):
    cells = ["n = by_device(cpu=4, gpu=240)\nA, B = 3, n * 2",
             "grid = by_device(cpu=dict(x=(1,)), gpu=dict(x=(1, 8), y=(2,)))",
             "t = scaled_chat_trace(by_device(cpu=1, gpu=128), A, seed=3)",
             "%pip install nothing\nlate = by_device(9, 10)\nskip = DEVICE"]
    nb = {"cells": [{"cell_type": "code", "source": c} for c in cells]}
    path = tmp_path / "99_x.ipynb"
    path.write_text(json.dumps(nb))
    got = plan.gpu_values(path)
    assert got["n"] == 240 and (got["A"], got["B"]) == (3, 480)
    assert got["grid"] == {"x": (1, 8), "y": (2,)} and got["late"] == 10
    assert got["t"] == plan.Call("scaled_chat_trace", (128, 3), {"seed": 3})
    assert "skip" not in got
