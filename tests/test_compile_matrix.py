"""The compile matrix (issue 54): every Triton kernel the course launches, compiled
on a CPU by Triton for each card's target (`pagedkv_lab.bench.compile`), and
committed as book/reports/compiled/kernels.json by `make compile-matrix`.

The committed file is checked against today's code in a subprocess (the kernels
must be defined with ``TRITON_INTERPRET=0`` to compile): every configuration
today's launches compile is in it, and a fixed sample compiles again to the same
registers, spills, shared memory and occupancy. The T4 path is checked from the
file: what a T4 launches compiles for sm_75, fits its 64 KiB of shared memory
and, for the library's own launches, spills nothing."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv_lab.bench.compile import CARDS, T4_CANDIDATES, programs_per_sm

ROOT = Path(__file__).resolve().parents[1]
MATRIX = ROOT / "book" / "reports" / "compiled" / "kernels.json"
#: The labels of the ladders' launches: timed at Llama-3-8B's heads, and checked
LADDER = ("decode rung", "prefill rung", "check of")


@pytest.fixture(scope="module")
def matrix() -> dict:
    return json.loads(MATRIX.read_text())


def test_the_matrix_holds_five_cards_in_the_rules_dtypes(matrix):
    got = {name: (c["target"], c["dtype"]) for name, c in matrix["cards"].items()}
    assert got == {"T4": ("sm_75", "float16"), "A100": ("sm_80", "bfloat16"),
                   "L4": ("sm_89", "bfloat16"), "H100": ("sm_90", "bfloat16"),
                   "H200": ("sm_90", "bfloat16")}  # fmt: skip
    kernels = {"_paged_decode_kernel", "_tiled_attention_kernel", "_merge_segments_kernel",
               "_add_rms_norm_kernel", "_silu_mul_kernel", "_rope_store_kernel"}  # fmt: skip
    for card in got:
        assert {e["kernel"] for e in matrix["entries"] if e["card"] == card} == kernels


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="no Triton here")
def test_the_committed_matrix_is_todays():
    """Every launch of today's code compiles a configuration the matrix holds
    (and nothing else is in it), and `SAMPLE` compiles again as it says: tens of
    seconds, most of it recording some nine hundred launches."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    run = subprocess.run(
        [sys.executable, "-m", "pagedkv_lab.bench", "compile", "--check", str(MATRIX)],
        env=env, capture_output=True, text=True, timeout=900, cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]


#: Bytes of stack (spilled registers) a thread of the library's own launches may
#: use on a T4: none.
T4_LIBRARY_STACK = 0


def test_every_t4_launch_compiles_and_the_librarys_fit_without_spilling(matrix):
    """What a T4 launches compiles for sm_75, with no tensor-core instruction
    (Triton 3.3 and later have none before sm_80); the library's own launches
    (attention, merge, first kernel, layer ops) fit its 64 KiB of shared memory
    and spill nothing. The ladders' rungs reproduce an H100's climb at
    Llama-3-8B's heads: several spill there, and the 128-key and 128-row ones
    need more than 64 KiB, so chapter 04c does not time the ladder before
    sm_80; a T4 runs every rung only in the chapters' float64 checks, whose
    smaller heads fit."""
    t4 = [e for e in matrix["entries"] if e["card"] == "T4"]
    assert t4
    for e in t4:
        assert e["compiled"], (e["config"], e["error"])
        assert e["tensor_cores"] == "none"
        if any(label.startswith("check of") for label in e["launches"]):
            assert e["fits"], (e["config"], e["launches"][0], e["shared"])
        if all(label.startswith(LADDER) for label in e["launches"]):
            continue
        assert e["fits"] and e["shared"] <= 64 * 1024, (e["config"], e["shared"])
        assert e["programs_per_sm"] >= 1
        assert e["stack"] <= T4_LIBRARY_STACK and not e["spill_stores"], (
            e["config"], e["launches"][0], e["stack"])


def test_the_t4_tiles_are_the_largest_candidates_that_do_not_spill(matrix):
    """`TILE_SIZES_PRE_AMPERE` is chosen from the matrix's T4 candidates: per
    launch kind, the tiles with the most rows x keys (then keys) that spill
    nothing at head_dim 128 and 64."""
    from pagedkv_lab.kernels.triton_tiled import TILE_SIZES_PRE_AMPERE

    for kind in ("decode", "prefill"):
        clean = []
        for rows, keys in T4_CANDIDATES:
            label = f"candidate {kind} {rows}x{keys}: "
            got = [e for e in matrix["candidates"]
                   if any(x.startswith(label) for x in e["launches"])]  # fmt: skip
            assert len(got) == 2  # head_dim 128 and 64
            if all(e["compiled"] and e["fits"] and not e["stack"] for e in got):
                clean.append((rows, keys))
        best = max(clean, key=lambda t: (t[0] * t[1], t[1]))
        assert TILE_SIZES_PRE_AMPERE[kind] == best, (kind, clean)


def test_the_rules_t4_launch_is_in_the_matrix(matrix):
    e = next(e for e in matrix["entries"] if e["card"] == "T4"
             and "decode (library): Llama-3-8B, batch 64 x 4096" in e["launches"]
             and e["kernel"] == "_tiled_attention_kernel")  # fmt: skip
    c = e["constants"]
    assert (c["BLOCK_Q"] * c["GROUP_PAD"], c["TILE_N"]) == (16, 32)


@pytest.mark.parametrize("card, regs, warps, shared, want", [
    ("H100", 128, 4, 0, (4, "registers")),  # 4096 a warp: 4 warps a partition
    ("H100", 255, 4, 0, (2, "registers")),  # 8192 a warp: 2 warps a partition
    ("H100", 32, 4, 0, (16, "warps")),  # 64 warps / 4
    ("H100", 64, 8, 100_000, (2, "shared memory")),  # 228 KiB / (97.7 + 1 KiB)
    ("T4", 213, 4, 24576, (2, "registers")),  # 6912 a warp: 2 warps a partition
    ("T4", 40, 4, 0, (8, "warps")),  # a T4 holds 32 warps
    ("T4", 64, 4, 70_000, (0, "shared memory")),  # over 64 KiB: does not launch
    ("L4", 32, 1, 0, (24, "blocks")),  # at most 24 blocks on sm_89
])  # fmt: skip
def test_programs_per_sm_counts_as_cuda_does(card, regs, warps, shared, want):
    assert programs_per_sm(CARDS[card], regs, warps, shared) == want
