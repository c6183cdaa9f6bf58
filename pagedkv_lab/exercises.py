"""Automatic checks for the chapters' exercises.

Each ``check_*`` takes the reader's function, runs it on cases with known
answers, prints one line per case (✓ or ✗ with what was expected) and a hint on
failure, and returns True when every case passed. Solutions live in the
repository's ``solutions/`` folder, not here.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from types import SimpleNamespace


def _run(
    name: str,
    fn: Callable,
    cases: list[tuple[str, tuple, object]],
    hint: str,
    same: Callable[[object, object], bool] | None = None,
) -> bool:
    print(f"Checking {name}:")
    passed = 0
    for label, args, expected in cases:
        try:
            got = fn(*args)
        except NotImplementedError:
            print(
                "  not attempted yet: replace the `raise NotImplementedError` with your code"
            )
            return False
        except Exception as err:  # show the reader's error without a traceback wall
            got = f"{type(err).__name__}: {err}"
        if (
            same(got, expected)
            if same is not None and not isinstance(got, str)
            else got == expected
        ):
            passed += 1
            print(f"  ✓ {label}")
        else:
            print(f"  ✗ {label}: expected {expected!r}, got {got!r}")
    ok = passed == len(cases)
    print(f"{passed}/{len(cases)} passed." + ("" if ok else f" Hint: {hint}"))
    return ok


def _cfg(**fields) -> SimpleNamespace:
    fields.setdefault("head_dim", None)
    fields.setdefault("num_key_value_heads", None)
    return SimpleNamespace(**fields)


# Chapter 00 -----------------------------------------------------------------------------------------------


def check_gqa_group(fn: Callable) -> bool:
    """``fn(config) -> int``: how many query heads share each KV head."""
    cases = [
        (
            "Llama-2-7B (multi-head: no sharing)",
            (_cfg(num_attention_heads=32, num_key_value_heads=32),),
            1,
        ),
        (
            "Llama-2-70B (GQA)",
            (_cfg(num_attention_heads=64, num_key_value_heads=8),),
            8,
        ),
        (
            "multi-query attention",
            (_cfg(num_attention_heads=16, num_key_value_heads=1),),
            16,
        ),
        ("old config without num_key_value_heads", (_cfg(num_attention_heads=12),), 1),
    ]
    return _run(
        "gqa_group",
        fn,
        cases,
        "num_key_value_heads may be missing (None): then every query head has its own KV head.",
    )


# Chapter 01 -----------------------------------------------------------------------------------------------


def check_bytes_per_token(fn: Callable) -> bool:
    """``fn(config, dtype_bytes) -> int``: KV-cache bytes one token costs."""
    cases = [
        (
            "Llama-2-7B fp16",
            (
                _cfg(
                    num_hidden_layers=32,
                    num_attention_heads=32,
                    num_key_value_heads=32,
                    hidden_size=4096,
                ),
                2,
            ),
            524288,
        ),
        (
            "Llama-2-70B fp16 (GQA)",
            (
                _cfg(
                    num_hidden_layers=80,
                    num_attention_heads=64,
                    num_key_value_heads=8,
                    hidden_size=8192,
                ),
                2,
            ),
            327680,
        ),
        (
            "fp32 storage",
            (
                _cfg(
                    num_hidden_layers=2,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                    hidden_size=64,
                ),
                4,
            ),
            512,
        ),
        (
            "explicit head_dim != hidden/heads",
            (
                _cfg(
                    num_hidden_layers=4,
                    num_attention_heads=8,
                    num_key_value_heads=2,
                    hidden_size=256,
                    head_dim=64,
                ),
                2,
            ),
            2048,
        ),
    ]
    return _run(
        "bytes_per_token",
        fn,
        cases,
        "2 (K and V) x layers x KV heads (not query heads) x head_dim x bytes; prefer config.head_dim when set.",
    )


def check_max_requests(fn: Callable) -> bool:
    """``fn(budget_bytes, bytes_per_token, max_len) -> int``: max-length requests that fit a KV budget."""
    cases = [
        ("exact fit", (2 * 1024 * 2048, 1024, 2048), 2),
        ("remainder is wasted", (5 * 1024 * 2048 - 1, 1024, 2048), 4),
        ("nothing fits", (1000, 1024, 2048), 0),
        ("negative budget (weights do not fit)", (-10, 1024, 2048), 0),
    ]
    return _run(
        "max_requests",
        fn,
        cases,
        "floor division; a request needs all max_len tokens; never negative.",
    )


# Chapter 02 -----------------------------------------------------------------------------------------------


def _best_fit_reference(gaps: list[tuple[int, int]], n: int) -> int | None:
    fitting = [(length, start) for start, length in gaps if length >= n]
    return min(fitting)[1] if fitting else None


def check_best_fit(fn: Callable) -> bool:
    """``fn(gaps, n) -> start | None``: best-fit choice among free ``(start, length)`` gaps."""
    rng = random.Random(2)
    cases = [
        ("one gap that fits", ([(0, 10)], 4), 0),
        ("smallest sufficient gap wins", ([(0, 10), (20, 5), (40, 6)], 5), 20),
        ("ties go to the lowest address", ([(50, 8), (10, 8), (30, 9)], 8), 10),
        ("nothing fits", ([(0, 3), (10, 2)], 4), None),
    ]
    for i in range(4):
        gaps = [(100 * j, rng.randint(1, 60)) for j in range(rng.randint(1, 8))]
        n = rng.randint(1, 60)
        cases.append((f"random case {i + 1}", (gaps, n), _best_fit_reference(gaps, n)))
    return _run(
        "best_fit",
        fn,
        cases,
        "among gaps with length >= n take the smallest length; break ties by start.",
    )


def check_external_fragmentation(fn: Callable) -> bool:
    """``fn(gap_lengths, need) -> int``: free slots that are unusable for a request needing ``need`` slots."""
    cases = [
        ("fits in one gap: nothing is external", ([100, 300], 250), 0),
        ("enough in total, no single gap", ([100, 200, 150], 250), 450),
        ("not enough in total: shortage, not fragmentation", ([100, 50], 400), 0),
        ("no gaps at all", ([], 10), 0),
    ]
    return _run(
        "external_fragmentation",
        fn,
        cases,
        "count the free slots only when the request is blocked by fragmentation alone: sum >= need but max < need.",
    )


# Chapter 03 -----------------------------------------------------------------------------------------------


def check_blocks_for(fn: Callable) -> bool:
    """``fn(num_tokens, block_size) -> int``: blocks a sequence of ``num_tokens`` occupies."""
    cases = [
        ("empty sequence", (0, 16), 0),
        ("one token", (1, 16), 1),
        ("exactly one block", (16, 16), 1),
        ("one past a block", (17, 16), 2),
        ("block size 1", (5, 1), 5),
        ("long sequence", (4097, 128), 33),
    ]
    return _run(
        "blocks_for",
        fn,
        cases,
        "ceiling division: (num_tokens + block_size - 1) // block_size.",
    )


def check_slot_of(fn: Callable) -> bool:
    """``fn(block_table, block_size, position) -> int``: physical slot of a token."""
    table = [7, 2, 9]
    cases = [
        ("first token", (table, 4, 0), 28),
        ("last slot of the first block", (table, 4, 3), 31),
        ("first slot of the second block", (table, 4, 4), 8),
        ("inside the third block", (table, 4, 10), 38),
    ]
    return _run(
        "slot_of",
        fn,
        cases,
        "slot = block_table[position // block_size] * block_size + position % block_size.",
    )


# Chapter 04 -----------------------------------------------------------------------------------------------


def check_merge_two(fn: Callable) -> bool:
    """``fn(out_a, lse_a, out_b, lse_b) -> out``: merge two partial attention results
    of one query; a part with no keys has ``lse = -inf`` and any output, even NaN."""
    import torch

    gen = torch.Generator().manual_seed(4)
    cases = []
    for label, n_a, n_b in [
        ("equal halves", 8, 8),
        ("uneven split", 3, 29),
        ("one key on one side", 1, 15),
        ("scores far apart", 4, 4),
    ]:
        scores = torch.randn(n_a + n_b, dtype=torch.float64, generator=gen) * 3
        if label == "scores far apart":
            scores[:n_a] += 200.0  # e^score overflows unless the max is factored out
        values = torch.randn(n_a + n_b, 4, dtype=torch.float64, generator=gen)
        exact = torch.softmax(scores, 0) @ values
        parts = []
        for sl in (slice(0, n_a), slice(n_a, None)):
            parts += [
                torch.softmax(scores[sl], 0) @ values[sl],
                torch.logsumexp(scores[sl], 0),
            ]
        cases.append((label, tuple(parts), exact))
    out, lse = cases[0][1][0], cases[0][1][1]
    nan, empty = torch.full((4,), float("nan"), dtype=torch.float64), -math.inf
    empty_lse = torch.tensor(empty, dtype=torch.float64)
    cases += [
        ("second part empty (its output is NaN)", (out, lse, nan, empty_lse), out),
        ("first part empty (its output is NaN)", (nan, empty_lse, out, lse), out),
        ("both parts empty: zeros", (nan, empty_lse, nan, empty_lse), 0 * out),
    ]

    def same(got, expected) -> bool:
        got = torch.as_tensor(got, dtype=torch.float64)
        return got.shape == expected.shape and torch.allclose(got, expected, atol=1e-10)

    return _run(
        "merge_two",
        fn,
        cases,
        "weights are exp(lse_a - lse) and exp(lse_b - lse) with lse = "
        "logaddexp(lse_a, lse_b); leave out a part whose lse is -inf "
        "(0 * NaN is NaN).",
        same=same,
    )


def check_visible_keys(fn: Callable) -> bool:
    """``fn(context_len, query_len, j) -> int``: keys the j-th new query of a prefill attends to."""
    cases = [
        ("whole prompt, first query", (10, 10, 0), 1),
        ("whole prompt, last query", (10, 10, 9), 10),
        ("decode: one new token", (37, 1, 0), 37),
        ("chunk after 20 cached tokens", (28, 8, 3), 24),
    ]
    return _run(
        "visible_keys",
        fn,
        cases,
        "query j sits at position context_len - query_len + j and sees itself.",
    )


def check_decode_flops_per_byte(fn: Callable) -> bool:
    """``fn(group, head_dim, bytes_per_element) -> float``: FLOPs per byte of K/V
    that decode attention performs."""
    cases = [
        ("multi-head attention, fp16", (1, 128, 2), 1.0),
        ("GQA group of 4, fp16", (4, 128, 2), 4.0),
        ("group of 8, fp32", (8, 64, 4), 4.0),
        ("group of 4, fp8, head_dim 80", (4, 80, 1), 8.0),
    ]
    return _run(
        "decode_flops_per_byte",
        lambda g, d, b: float(fn(g, d, b)),
        cases,
        "per query head and key: head_dim multiply-adds for the score and as many "
        "for the output (a multiply-add is 2 FLOPs); per KV head and key the cache "
        "supplies a key and a value of head_dim elements each.",
        same=lambda got, expected: abs(got - expected) < 1e-9,
    )


# Chapter 05 -----------------------------------------------------------------------------------------------


def check_positions_for(fn: Callable) -> bool:
    """``fn(num_computed, num_new) -> list[int]``: position ids of a sequence's new tokens."""
    cases = [
        ("a prompt of 4", (0, 4), [0, 1, 2, 3]),
        ("a decode step after 17 tokens", (17, 1), [17]),
        ("a chunk after 7 tokens", (7, 3), [7, 8, 9]),
    ]
    return _run(
        "positions_for",
        lambda a, b: list(fn(a, b)),
        cases,
        "new tokens continue where the cached ones stop: range(num_computed, num_computed + num_new).",
    )


def check_logits_rows(fn: Callable) -> bool:
    """``fn(query_lens) -> list[int]``: row of each sequence's last new token in the packed batch."""
    cases = [
        ("one prompt", ([5],), [4]),
        ("decodes only", ([1, 1, 1],), [0, 1, 2]),
        ("prefill, decode, chunk", ([5, 1, 3],), [4, 5, 8]),
    ]
    return _run(
        "logits_rows",
        lambda q: list(fn(q)),
        cases,
        "cumulative sum of the query lengths, minus one.",
    )


# Chapter 06 -----------------------------------------------------------------------------------------------


def _continuous_reference(output_lens: list[int], batch_size: int) -> int:
    import heapq

    free_at = [0] * batch_size
    end = 0
    for n in output_lens:
        start = heapq.heappop(free_at)
        heapq.heappush(free_at, start + n)
        end = max(end, start + n)
    return end


def check_static_steps(fn: Callable) -> bool:
    """``fn(output_lens, batch_size) -> int``: iterations of static batching."""
    cases = [
        ("one batch", ([3, 9, 4], 4), 9),
        ("two batches", ([3, 9, 4, 1], 2), 13),
        ("batch of one", ([2, 5], 1), 7),
    ]
    return _run(
        "static_steps",
        fn,
        cases,
        "sum over consecutive batches of the longest request in each.",
    )


def check_continuous_steps(fn: Callable) -> bool:
    """``fn(output_lens, batch_size) -> int``: iterations of continuous batching with ``batch_size`` slots."""
    rng = random.Random(6)
    cases = [
        ("everything fits at once", ([3, 9, 4], 4), 9),
        ("a freed slot is refilled", ([3, 9, 4, 1], 2), 9),
        ("one slot", ([2, 5], 1), 7),
    ]
    for i in range(3):
        lens = [rng.randint(1, 30) for _ in range(rng.randint(3, 12))]
        b = rng.randint(1, 4)
        cases.append(
            (f"random case {i + 1}", (lens, b), _continuous_reference(lens, b))
        )
    return _run(
        "continuous_steps",
        fn,
        cases,
        "give each request, in order, the slot that frees first; the answer is when the last one ends.",
    )
