"""Chapters 10 and 11's GPU code path in its number formats, on a CPU, at tiny
sizes (issue 54): bfloat16, as an sm_80+ card runs it, and float16, as a T4
does. Raw 16-bit arithmetic is right in PyTorch on a CPU (only Triton's
interpreter mishandles it), so every dtype-dependent assert or rule of those
chapters runs here before it runs on a card: the kernels' error bound
(`bench.within_error_bound`), the cross-system comparison of tokens
(`bench.compare` through `report.judge_outputs`: both checks, with this
engine's teacher-forced scores), and the sections that serve in 16 bits.

Why functions and not the chapters: executing chapters 10 and 11 twice more
would add minutes to CI; these are the functions whose dtype-dependent
behaviour those chapters assert on a GPU, called as they call them."""

import pytest
import torch

from pagedkv_lab.bench import kernel_benchmark, within_error_bound
from pagedkv_lab.bench.report import blocks_section, kernel_section, serve_section

CPU = torch.device("cpu")
DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_the_kernel_rows_meet_the_chapters_error_bound(dtype):
    """Chapter 10's kernel section and chapter 11's S1 and S4 rows assert
    `within_error_bound`; float32's bound would fail them in 16 bits."""
    kernel = kernel_section(CPU, batch_sizes=(1, 2), context_lens=(64, 200),
                            block_sizes=(16, 32), repeats=1, dtypes=(dtype,))  # fmt: skip
    rows = kernel["rows"] + kernel["by_block"]
    assert {str(r["dtype"]).removeprefix("torch.") for r in rows} == {str(dtype)[6:]}
    assert within_error_bound(rows)
    s1 = kernel_benchmark(CPU, batch_sizes=(1,), context_lens=(64,), repeats=1,
                          dtype=dtype, in_order=True)  # fmt: skip
    assert within_error_bound(s1) and "shuffled_over_in_order" in s1[0]
    assert not within_error_bound([{**r, "dtype": torch.float32} for r in rows])


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_serving_and_the_block_sweep_judge_16_bit_tokens_soundly(dtype):
    """Chapter 10's serving section and chapter 11's S2 and S4 cells in 16
    bits: every system's tokens judged at every position against float32
    (none may pass on identity alone), this engine's also teacher-forced."""
    serve = serve_section(CPU, model="tiny-llama", num_requests=4, max_model_len=64,
                          budget_requests=2, repeats=1, workloads=("w1", "w3-prefix"),
                          include_vllm=False, dtype=dtype)  # fmt: skip
    for w in serve.values():
        for row in w["rows"]:
            assert row["sound"], (row["system"], row["agreement"])
            assert "tokens judged" in row["agreement"], row["agreement"]
        ours = {r["system"]: r["agreement"] for r in w["rows"]}
        assert "teacher-forced (this engine's forward pass)" in ours["pagedkv"]
    blocks = blocks_section(CPU, model="tiny-llama", num_requests=3, max_model_len=64,
                            block_sizes=(8, 16), repeats=1, dtype=dtype)  # fmt: skip
    assert all(r["sound"] for r in blocks["rows"]), [r["agreement"] for r in blocks["rows"]]
    assert all("teacher-forced (this engine" in r["agreement"] for r in blocks["rows"])
