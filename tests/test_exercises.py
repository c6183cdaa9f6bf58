"""Each exercise check passes the published solution and fails wrong answers."""

import importlib.util
from pathlib import Path

import pytest
import torch

from pagedkv_lab.course import exercises

SOLUTIONS = Path(__file__).resolve().parent.parent / "solutions"


def _solution(chapter: str):
    spec = importlib.util.spec_from_file_location(
        f"solutions_{chapter}", SOLUTIONS / f"{chapter}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CASES = [
    (
        "ch00",
        "gqa_group",
        exercises.check_gqa_group,
        lambda cfg: cfg.num_attention_heads // cfg.num_key_value_heads,
    ),
    (
        "ch00",
        "cache_bytes_per_token",
        exercises.check_cache_bytes_per_token,
        lambda name: 512,
    ),
    (
        "ch01",
        "bytes_per_token",
        exercises.check_bytes_per_token,
        lambda cfg, b: (
            2
            * cfg.num_hidden_layers
            * cfg.num_attention_heads
            * (cfg.hidden_size // cfg.num_attention_heads)
            * b
        ),
    ),
    (
        "ch01",
        "max_requests",
        exercises.check_max_requests,
        lambda budget, bpt, n: budget // (bpt * n),
    ),
    (
        "ch01",
        "longest_request",
        exercises.check_longest_request,
        lambda cfg, gpu, dtype_bytes: gpu // 1024,
    ),
    (
        "ch02",
        "best_fit",
        exercises.check_best_fit,
        lambda gaps, n: next((s for s, g in gaps if g >= n), None),
    ),
    (
        "ch02",
        "external_fragmentation",
        exercises.check_external_fragmentation,
        lambda gaps, need: sum(gaps),
    ),
    ("ch02", "pool_shares", exercises.check_pool_shares, lambda extra: (0.0, 0.0)),
    ("ch03", "blocks_for", exercises.check_blocks_for, lambda n, bs: n // bs),
    ("ch03", "tail_waste", exercises.check_tail_waste, lambda n, bs: bs - n % bs),
    ("ch03", "preemptions", exercises.check_preemptions, lambda w: 0),
    (
        "ch03",
        "slot_of",
        exercises.check_slot_of,
        lambda table, bs, pos: table[pos // bs] + pos % bs,
    ),
    (
        "ch04a",
        "merge_two",
        exercises.check_merge_two,
        lambda oa, la, ob, lb: (oa + ob) / 2,
    ),
    ("ch04a", "visible_keys", exercises.check_visible_keys, lambda ctx, qlen, j: j + 1),
    (
        "ch04a",
        "merge_two",
        exercises.check_merge_two,
        # right on full parts, but an empty part's NaN output leaks through
        lambda oa, la, ob, lb: (
            torch.exp(la - torch.logaddexp(la, lb)) * oa
            + torch.exp(lb - torch.logaddexp(la, lb)) * ob
        ),
    ),
    (
        "ch04b",
        "decode_flops_per_byte",
        exercises.check_decode_flops_per_byte,
        # forgets that the cache supplies a value as well as a key
        lambda g, d, b: 4 * g / b,
    ),
    (
        "ch04b",
        "key_loads",
        exercises.check_key_loads,
        # the L^2 / 2T estimate, not the count
        lambda length, t: length * length // (2 * t),
    ),
    (
        "ch04c",
        "tiles_in_flight",
        exercises.check_tiles_in_flight,
        # rounds down: too few tiles to keep the memory busy
        lambda bandwidth, latency, tile: int(bandwidth * latency / tile),
    ),
    (
        "ch04c",
        "program_of",
        exercises.check_program_of,
        # forgets the one spare number each sequence before it adds
        lambda q_lens, block_q, seq, j: (sum(q_lens[:seq]) + j) // block_q,
    ),
    (
        "ch04d",
        "prefill_flops_per_byte",
        exercises.check_prefill_flops_per_byte,
        # counts K and V only
        lambda s, n, h, kv, d, b: 4 * d * h * s * n * (n + 1) / 2 / (s * n * 2 * kv * d * b),
    ),
    (
        "ch05",
        "positions_for",
        exercises.check_positions_for,
        lambda c, n: list(range(n)),
    ),
    ("ch05", "logits_rows", exercises.check_logits_rows, lambda q: [n - 1 for n in q]),
    (
        "ch05",
        "blocks_held",
        exercises.check_blocks_held,
        lambda lens, new, bs: sum(-(-(p + new) // bs) for p in lens),
    ),
    ("ch06", "static_steps", exercises.check_static_steps, lambda lens, b: max(lens)),
    (
        "ch06",
        "continuous_steps",
        exercises.check_continuous_steps,
        lambda lens, b: sum(lens) // b,
    ),
    ("ch06", "demo_preemptions", exercises.check_demo_preemptions, lambda w: 2),
    (
        "ch07",
        "blocks_after_fork",
        exercises.check_blocks_after_fork,
        lambda p, n, k, bs: -(-p // bs) + n * -(-k // bs),
    ),
    (
        "ch07",
        "copies_after_fork",
        exercises.check_copies_after_fork,
        lambda p, n, bs: n if p % bs else 0,
    ),
    (
        "ch07",
        "unshared_blocks",
        exercises.check_unshared_blocks,
        lambda p, n, k, bs: -(-(p + k) // bs),
    ),
    ("ch08", "block_keys", exercises.check_block_keys, lambda t, bs: [hash(tuple(t))]),
    (
        "ch08",
        "max_cached_tokens",
        exercises.check_max_cached_tokens,
        lambda p, bs: p // bs * bs,
    ),
    ("ch08", "smallest_capacity", exercises.check_smallest_capacity, lambda r, t: 1),
    ("ch09", "swap_bytes", exercises.check_swap_bytes, lambda n, b, bs: n * b),
    (
        "ch09",
        "recompute_cheaper",
        exercises.check_recompute_cheaper,
        lambda r, b, w: True,
    ),
    ("ch09", "crossover_tokens", exercises.check_crossover_tokens, lambda *a: 1),
    ("ch10", "decode_bytes", exercises.check_decode_bytes, lambda *a: a[0] * a[1]),
    (
        "ch10",
        "normalized_latency",
        exercises.check_normalized_latency,
        lambda a, f, n: (sum(f) - sum(a)) / sum(n),
    ),
    (
        "ch11",
        "prefix_saving",
        exercises.check_prefix_saving,
        lambda s, p, n, bs: s / (s + p),
    ),
    ("ch11", "max_private_len", exercises.check_max_private_len, lambda *a: 1),
    ("ch11", "which_share", exercises.check_which_share, lambda *a: "whole model"),
]


@pytest.mark.parametrize("chapter,name,check,wrong", CASES, ids=[c[1] for c in CASES])
def test_check_accepts_solution_and_rejects_wrong_answer(
    chapter, name, check, wrong, capsys
):
    assert check(getattr(_solution(chapter), name)) is True
    assert check(wrong) is False
    assert "Hint:" in capsys.readouterr().out


def test_unattempted_exercise_is_reported_not_crashed(capsys):
    def todo(*args):
        raise NotImplementedError

    assert exercises.check_best_fit(todo) is False
    assert "not attempted yet" in capsys.readouterr().out


def test_two_step_hints_nudge_first_and_never_print_the_answer(capsys):
    """A chapter-04 check shows what the reader's function returned, never the
    expected value; its first miss gets a nudge, the next one the formula too."""
    exercises._MISSES.pop("visible_keys", None)
    wrong = lambda ctx, qlen, j: -1 - j  # noqa: E731
    assert exercises.check_visible_keys(wrong) is False
    first = capsys.readouterr().out
    assert exercises.check_visible_keys(wrong) is False
    second = capsys.readouterr().out
    assert "expected" not in first + second and "got -1" in first
    for answer in (" 1", " 10", " 37", " 24"):  # the cases' answers, never shown
        assert answer not in first.split("Hint:")[0].split("\n", 1)[1]
    nudge, formula = first.split("Hint: ")[1].strip(), "context_len - query_len + j"
    assert formula not in first and formula in second and nudge in second
