"""scripts/gpu_targets.py reads a GPU report folder into targets.json: every figure
from a file of the run, null (with the reason) where a step did not run, and
"all passed" only when every expected step ran and passed."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_targets.py"
spec = importlib.util.spec_from_file_location("gpu_targets", SCRIPT)
gpu_targets = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_targets)


def decode_row(batch, ctx, ratio, share=None):
    row = {"batch": batch, "context_len": ctx, "paged_over_contiguous": ratio}
    if share is not None:
        row["fraction_of_copy"] = share
    return row


@pytest.fixture
def report(tmp_path):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "decode").mkdir()
    (tmp_path / "nanovllm").mkdir()
    rows = [
        decode_row(1, 512, 3.0),  # outside both target regions
        decode_row(8, 1024, 1.07),
        decode_row(64, 4096, 1.02, 0.97),
        decode_row(256, 16384, 1.01, 0.99),
    ]
    kernels = {
        "device": {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11", "python": "3.12"},
        "decode": rows,
        "prefill": {"engine_over_hf": 1.2},
        "prefill_kernel": {"over_causal_sdpa": 1.4},
    }
    (tmp_path / "kernels" / "results.json").write_text(json.dumps(kernels))
    decode = {"floor_ms": 10.0, "systems": {"pagedkv": {"decode_ms": 12.5}}, "model": "Llama-3-8B"}
    (tmp_path / "decode" / "results.json").write_text(json.dumps(decode))
    breakdown = {"full_batch_decode_steps": {"wall": 9.0, "host": 2.0, "device": 7.0,
                                             "forward": 6.5, "sampling": 0.5,
                                             "waited": 7.0, "mean_batch": 256}}
    published = {"model": "Qwen3-0.6B", "tok_s": 18000.0, "floor_tok_s": 24000.0,
                 "async_scheduling": True, "breakdown": breakdown,
                 "profile_busy": {"busy_ms": 5.0, "idle_ms": 4.0, "batch": 256}}
    (tmp_path / "nanovllm" / "Qwen3-0.6B.json").write_text(json.dumps(published))
    # two separate commands: not a comparison of the modes
    sync = {"model": "Qwen3-0.6B", "tok_s": 15000.0, "async_scheduling": False}
    (tmp_path / "nanovllm" / "Qwen3-0.6B-sync.json").write_text(json.dumps(sync))
    # a separate --temperature 0 command: not a measure of the sampler's share
    separate = {"model": "Qwen3-0.6B", "tok_s": 20000.0, "async_scheduling": True}
    (tmp_path / "nanovllm" / "Qwen3-0.6B-temp0.json").write_text(json.dumps(separate))
    greedy = {"model": "Qwen3-0.6B", "tok_s": 18500.0, "greedy_compare": {
        "rounds": 3, "greedy_over_sampled": {"per_round": [1.04, 1.05, 1.07],
                                             "median": 1.05, "min": 1.04, "max": 1.07}}}  # fmt: skip
    (tmp_path / "nanovllm" / "Qwen3-0.6B-greedy.json").write_text(json.dumps(greedy))
    compared = {"model": "Qwen3-0.6B", "tok_s": 17000.0, "async_compare": {
        "rounds": 3, "async_over_sync": {"per_round": [1.1, 1.2, 1.3], "median": 1.2,
                                         "min": 1.1, "max": 1.3}}}  # fmt: skip
    (tmp_path / "nanovllm" / "Qwen3-0.6B-async.json").write_text(json.dumps(compared))
    other = {"model": "Qwen2.5-0.5B", "tok_s": 30000.0, "floor_tok_s": 150000.0,
             "async_scheduling": True}
    (tmp_path / "nanovllm" / "Qwen2.5-0.5B.json").write_text(json.dumps(other))
    (tmp_path / "steps.tsv").write_text("versions\tpass\t3\tversions.txt\nkernel ladder\tpass\t300\tkernels.txt\n")
    return tmp_path


def test_figures_come_from_the_files(report):
    t = gpu_targets.targets(report, ["versions", "kernel ladder"])
    assert t["decode_kernel_worst_over_sdpa"] == 1.07
    assert t["decode_kernel_min_copy_fraction"] == 0.97
    assert t["prefill_kernel_over_causal_sdpa"] == 1.4
    assert t["prefill_engine_over_hf_forward"] == 1.2
    assert t["decode_step_over_floor"] == 1.25
    assert t["nanovllm_bench_tok_s"] == {"Qwen3-0.6B": 18000.0, "Qwen2.5-0.5B": 30000.0}
    assert t["nanovllm_floor_fraction"] == {"Qwen3-0.6B": 0.75, "Qwen2.5-0.5B": 0.2}
    assert t["nanovllm_floor_goal"] == {"Qwen3-0.6B": 0.65, "Qwen2.5-0.5B": 0.30}
    assert t["nanovllm_meets_goal"] == {"Qwen3-0.6B": True, "Qwen2.5-0.5B": False}
    assert t["nanovllm_step_ms"]["Qwen3-0.6B"] == {
        "wall": 9.0, "host": 2.0, "forward": 6.5, "sampling": 0.5, "device": 7.0,
        "busy": 5.0, "idle": 4.0}  # fmt: skip
    # both ratios from the one-process comparisons only, never from separate files
    assert t["nanovllm_greedy_over_sampled"] == {
        "Qwen3-0.6B": {"median": 1.05, "min": 1.04, "max": 1.07, "rounds": 3}}
    assert t["nanovllm_async_over_sync"] == {
        "Qwen3-0.6B": {"median": 1.2, "min": 1.1, "max": 1.3, "rounds": 3}}
    assert t["gpu"] == "NVIDIA H100 80GB HBM3" and t["missing"] == {}
    assert t["gpu_check"] == {"all_passed": True, "seconds": 303, "not_run": [], "failed": []}


def test_a_step_not_run_is_not_passed(report):
    t = gpu_targets.targets(report, ["versions", "kernel ladder", "bench all"])
    assert not t["gpu_check"]["all_passed"] and t["gpu_check"]["not_run"] == ["bench all"]


def test_a_rerun_step_replaces_its_failure(report):
    with (report / "steps.tsv").open("a") as f:
        f.write("bench all\tFAIL (exit 1)\t5\tbench.txt\n")
    assert gpu_targets.targets(report, ["bench all"])["gpu_check"]["failed"] == ["bench all"]
    with (report / "steps.tsv").open("a") as f:
        f.write("bench all\tpass\t9\tbench.txt\n")
    check = gpu_targets.targets(report, ["versions", "kernel ladder", "bench all"])["gpu_check"]
    assert check["all_passed"] and check["seconds"] == 312


def test_missing_figures_are_null_with_a_reason(tmp_path):
    t = gpu_targets.targets(tmp_path, ["versions"])
    assert t["decode_step_over_floor"] is None
    assert "decode_step_over_floor" in t["missing"]
    assert t["gpu_check"]["all_passed"] is False


def test_the_gpu_check_plans_its_steps_within_eight_minutes(tmp_path):
    """`gpu_check.sh --plan` prints every step with its expected seconds, most
    informative first, without a GPU; the steps of the check itself (the
    optional ones aside) are planned within the 480 s budget, and --emulate t4
    adds chapters 04b, 04c, 05a, 05b and 10 run as a T4."""
    import os
    import re
    import subprocess

    script = SCRIPT.parent / "gpu_check.sh"
    env = {**os.environ, "OUT": str(tmp_path)}
    run = subprocess.run(["bash", str(script), "--plan", "--budget", "480", "--emulate", "t4"],
                         capture_output=True, text=True, env=env, check=True)  # fmt: skip
    plan = (tmp_path / "plan.txt").read_text()
    names = re.findall(r"^  (\S.*?)\s+(\d+) s(?:   predicted .*)?$", plan, re.M)
    order = [n for n, _ in names]
    assert order[:3] == ["versions", "bench nanovllm Qwen3-0.6B", "bench nanovllm Qwen2.5-0.5B"]
    assert [n for n in order if n.endswith("as t4")] == [
        "notebook 04b_reading_blocks_in_place as t4",
        "notebook 04c_climbing_to_the_copy_bandwidth as t4",
        "notebook 05a_engine as t4", "notebook 05b_fused_step as t4",
        "notebook 10_benchmarks as t4"]
    assert sum(n.startswith("notebook ") and "as t4" not in n for n in order) == 16
    required = int(re.search(r"of which (\d+) s for the check itself", plan).group(1))
    emulated = sum(int(s) for n, s in names if n.endswith("as t4"))
    assert required - emulated <= 480
    assert "gpu-check" in run.stderr or plan
    # beside each chapter, its predicted seconds (pagedkv_lab.bench.plan), or "-"
    # where this python cannot import the package
    assert len(re.findall(r"^  notebook \S+\s+\d+ s   predicted\s+(\d+|-) s", plan, re.M)) == 16
