"""Automatic checks for the chapters' exercises.

Each ``check_*`` takes the reader's function, runs it on fixed cases whose
answers are written out here, prints one line per case (✓, or ✗ with what the
function returned) and returns True when every case passed. A check never
prints the expected answer: its hint comes in two steps, a nudge on the first
miss and the formula too from the second miss on. The expected values were
computed once and checked against the reference solutions in the repository's
``solutions/`` folder and, where one exists, against the library or a
simulator run (``tests/test_exercises.py``); no solution lives here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import SimpleNamespace

#: How often each check has failed in this session: the first miss gets the
#: nudge of a check's (nudge, formula) hint, later misses the formula too.
_MISSES: dict[str, int] = {}


def _run(
    name: str,
    fn: Callable,
    cases: list[tuple[str, tuple, object]],
    hint: tuple[str, str],
    same: Callable[[object, object], bool] | None = None,
) -> bool:
    """Run ``fn`` on ``cases`` and print what passed. A failed case shows what
    ``fn`` returned, never the answer. ``hint`` is a (nudge, formula) pair: the
    nudge comes with the first miss, the formula only from the second on."""
    nudge, formula = hint
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
        if _matches(got, expected, same):
            passed += 1
            print(f"  ✓ {label}")
        else:
            print(f"  ✗ {label}: got {got!r}")
    ok = passed == len(cases)
    if not ok:
        _MISSES[name] = _MISSES.get(name, 0) + 1
        text = nudge if _MISSES[name] == 1 else f"{nudge} {formula}"
    print(f"{passed}/{len(cases)} passed." + ("" if ok else f" Hint: {text}"))
    return ok


def _matches(got, expected, same) -> bool:
    """Whether ``got`` is right; a value of the wrong kind is just wrong."""
    try:
        if same is not None and not isinstance(got, str):
            return bool(same(got, expected))
        return bool(got == expected)
    except Exception:
        return False


def _cfg(**fields) -> SimpleNamespace:
    fields.setdefault("head_dim", None)
    fields.setdefault("num_key_value_heads", None)
    return SimpleNamespace(**fields)


def _close(rel: float = 0.0, abs_: float = 0.0) -> Callable[[object, object], bool]:
    """A float comparison for ``_run``'s ``same``."""

    def same(got, expected) -> bool:
        return math.isclose(float(got), expected, rel_tol=rel, abs_tol=abs_)

    return same


# Chapter 00 ----------------------------------------------------------------------


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
        (
            "how many KV heads does a config have whose num_key_value_heads is "
            "None, one made before GQA?",
            "Such a config gives every query head its own KV head; otherwise the "
            "group is num_attention_heads // num_key_value_heads.",
        ),
    )


def check_cache_bytes_per_token(fn: Callable) -> bool:
    """``fn(name) -> int``: bytes per cached token, measured on an offline model
    (the offline models load in float32)."""
    cases = [
        ("tiny-llama", ("tiny-llama",), 512),
        ("tiny-qwen2", ("tiny-qwen2",), 256),
        ("tiny-mistral", ("tiny-mistral",), 256),
    ]
    return _run(
        "cache_bytes_per_token",
        fn,
        cases,
        (
            "the cache holds a key and a value tensor for every layer: divide "
            "their bytes by the tokens the cache holds, not by the tokens you "
            "generated.",
            "Add numel() * element_size() over every layer's keys and values, "
            "then divide by cache.get_seq_length().",
        ),
    )


# Chapter 01 ----------------------------------------------------------------------


def check_bytes_per_token(fn: Callable) -> bool:
    """``fn(config, dtype_bytes) -> int``: KV-cache bytes one token costs."""

    def llama(layers, heads, kv_heads, hidden, **extra):
        return _cfg(
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            hidden_size=hidden,
            **extra,
        )

    cases = [
        ("Llama-2-7B fp16", (llama(32, 32, 32, 4096), 2), 524288),
        ("Llama-2-70B fp16 (GQA)", (llama(80, 64, 8, 8192), 2), 327680),
        ("fp32 storage", (llama(2, 4, 2, 64), 4), 512),
        (
            "explicit head_dim != hidden/heads",
            (llama(4, 8, 2, 256, head_dim=64), 2),
            2048,
        ),
    ]
    return _run(
        "bytes_per_token",
        fn,
        cases,
        (
            "count what one token stores in every layer: a key and a value for "
            "each KV head (not each query head).",
            "2 (K and V) x layers x KV heads x head_dim x bytes; head_dim is "
            "config.head_dim when set, else hidden_size // num_attention_heads.",
        ),
    )


def check_max_requests(fn: Callable) -> bool:
    """``fn(budget_bytes, bytes_per_token, max_len) -> int``: max-length requests
    that fit a KV budget."""
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
        (
            "each request reserves the bytes of max_len tokens; can part of a "
            "request fit, and what if the budget is negative?",
            "max(0, budget_bytes // (bytes_per_token * max_len)).",
        ),
    )


def check_longest_request(fn: Callable) -> bool:
    """``fn(config, gpu_bytes, kv_dtype_bytes) -> int``: tokens of the longest single
    request whose KV cache fits next to the fp16 weights."""
    from pagedkv_lab.kvmath import gpu_memory_bytes, real_model_configs

    configs, gpus = real_model_configs(), gpu_memory_bytes()
    cases = [
        (
            f"{name} on {gpu}, {dtype_bytes}-byte cache",
            (configs[name], gpus[gpu], dtype_bytes),
            expected,
        )
        for name, gpu, dtype_bytes, expected in [
            ("Llama-3-8B", "L4", 2, 43312),
            ("Llama-3-8B", "L4", 1, 86625),
            ("Llama-2-7B", "T4", 2, 1942),
            ("Llama-2-70B", "H100-80GB", 2, 0),
        ]
    ]
    return _run(
        "longest_request",
        fn,
        cases,
        (
            "kv_budget(config, gpu_bytes) is what the fp16 weights leave; how "
            "many tokens' K/V, stored in kv_dtype_bytes a number, fit in it?",
            "kv_budget(config, gpu_bytes) // (2 x layers x KV heads x head_dim x "
            "kv_dtype_bytes), and 0 when the budget is negative.",
        ),
    )


# Chapter 02 ----------------------------------------------------------------------


def check_best_fit(fn: Callable) -> bool:
    """``fn(gaps, n) -> start | None``: best-fit choice among free ``(start, length)``
    gaps."""
    cases = [
        ("one gap that fits", ([(0, 10)], 4), 0),
        ("smallest sufficient gap wins", ([(0, 10), (20, 5), (40, 6)], 5), 20),
        ("ties go to the lowest address", ([(50, 8), (10, 8), (30, 9)], 8), 10),
        ("nothing fits", ([(0, 3), (10, 2)], 4), None),
        ("an exact fit", ([(0, 6)], 6), 0),
        (
            "six gaps",
            ([(0, 54), (100, 11), (200, 48), (300, 52), (400, 43), (500, 55)], 20),
            400,
        ),
        (
            "five gaps, all too short",
            ([(0, 39), (100, 14), (200, 39), (300, 3), (400, 38)], 44),
            None,
        ),
        ("the first gap is not the best", ([(0, 41), (100, 28), (200, 26)], 26), 200),
    ]
    return _run(
        "best_fit",
        fn,
        cases,
        (
            "best fit picks, among the gaps long enough, the one that leaves the "
            "least over; and between two equally good gaps?",
            "Among gaps with length >= n take the smallest length, ties to the "
            "lower start; None when no gap is long enough.",
        ),
    )


def check_external_fragmentation(fn: Callable) -> bool:
    """``fn(gap_lengths, need) -> int``: free slots that are unusable for a request
    needing ``need`` slots."""
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
        (
            "by the chapter's definition, free slots are external fragmentation "
            "only when fragmentation alone blocks the request.",
            "Return sum(gap_lengths) when the sum is >= need but no gap is (the "
            "largest gap < need; no gaps at all: 0), else 0.",
        ),
    )


def check_pool_shares(fn: Callable) -> bool:
    """``fn(extra_slots) -> (external, free)``: shares of a max-reservation pool of
    ``16 * 2048 + extra_slots`` slots, averaged over the steps with a queue."""
    cases = [
        ("1000 extra slots", (1000,), (0.0, 0.029613835583984838)),
        ("3000 extra slots", (3000,), (0.0, 0.026615969581749048)),
    ]

    def same(got, expected) -> bool:
        return len(got) == 2 and all(abs(g - e) < 1e-6 for g, e in zip(got, expected))

    return _run(
        "pool_shares",
        fn,
        cases,
        (
            "run simulate on the chapter's W1 trace through a first-fit "
            "max-reservation ContiguousPool, and read the result's fractions().",
            "simulate(chat_workload(400, seed=0, arrival_rate=1.0, "
            "max_model_len=2048), ContiguousPool(16 * 2048 + extra_slots, 2048, "
            "policy='max')).fractions(): return its 'external' and 'free' shares.",
        ),
        same=same,
    )


# Chapter 03 ----------------------------------------------------------------------


def check_blocks_for(fn: Callable) -> bool:
    """``fn(num_tokens, block_size) -> int``: blocks a sequence of ``num_tokens``
    occupies."""
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
        (
            "a partly filled last block is still a whole block.",
            "Ceiling division: (num_tokens + block_size - 1) // block_size.",
        ),
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
        (
            "which logical block holds the position, which physical block is "
            "it, and where in that block does the token sit? Slots count tokens, "
            "not blocks.",
            "block_table[position // block_size] * block_size + position % block_size.",
        ),
    )


def check_tail_waste(fn: Callable) -> bool:
    """``fn(num_tokens, block_size) -> int``: empty slots in a sequence's last block."""
    cases = [
        ("100 tokens, block size 16", (100, 16), 12),
        ("a full last block", (64, 16), 0),
        ("one token", (1, 16), 15),
        ("one past a block", (17, 16), 15),
        ("empty sequence: no block, no waste", (0, 16), 0),
        ("block size 1 never wastes", (37, 1), 0),
    ]
    return _run(
        "tail_waste",
        fn,
        cases,
        (
            "the waste is the slots of the blocks the sequence occupies minus its "
            "tokens; a full last block wastes nothing.",
            "blocks * block_size - num_tokens, with blocks = "
            "ceil(num_tokens / block_size).",
        ),
    )


def check_preemptions(fn: Callable) -> bool:
    """``fn(watermark) -> int``: preemptions of a small W1 trace through a paged pool."""
    cases = [
        ("watermark 0%", (0.0,), 242),
        ("watermark 5%", (0.05,), 86),
        ("watermark 20%", (0.2,), 11),
    ]
    return _run(
        "preemptions",
        fn,
        cases,
        (
            "run the simulator on the exercise's trace and pool, and read the "
            "preemptions off its result.",
            "simulate(chat_workload(150, seed=0, arrival_rate=1.0), PagedPool("
            "num_blocks=512, block_size=16, max_model_len=2048, watermark=watermark)"
            ").preemptions",
        ),
    )


# Chapters 04a-04d ---------------------------------------------------------------


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
        (
            "each part weighs its share of the sum of exponentials over both parts, "
            "and a part that saw no key must not touch the result.",
            "The weights are exp(lse_a - lse) and exp(lse_b - lse) with lse = "
            "logaddexp(lse_a, lse_b); leave out a part whose lse is -inf "
            "(0 * NaN is NaN).",
        ),
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
        (
            "at which position does the j-th new query sit among the "
            "context_len tokens?",
            "Query j sits at position context_len - query_len + j and sees every "
            "position up to and including its own.",
        ),
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
        (
            "count the FLOPs that one key costs all the query heads of its group, "
            "and the bytes it costs the cache.",
            "Per query head and key: head_dim multiply-adds for the score and as "
            "many for the output (a multiply-add is 2 FLOPs); per KV head and key "
            "the cache supplies a key and a value of head_dim elements each.",
        ),
        same=lambda got, expected: abs(got - expected) < 1e-9,
    )


def check_key_loads(fn: Callable) -> bool:
    """``fn(prompt_len, positions) -> int``: keys loaded, for one KV head, by
    programs of ``positions`` consecutive query positions over a whole prompt."""
    cases = [
        ("one position per program, 10 tokens", (10, 1), 55),
        ("4 positions, 16 tokens", (16, 4), 40),
        ("4 positions, 10 tokens (a short last program)", (10, 4), 22),
        ("16 positions, 1,000 tokens", (1000, 16), 32248),
        ("a prompt shorter than one program", (7, 16), 7),
    ]
    return _run(
        "key_loads",
        fn,
        cases,
        (
            "a program loads every key up to its last row's position, once.",
            "Program p holds positions p * positions to (p + 1) * positions - 1 and "
            "loads min(prompt_len, (p + 1) * positions) keys; add them up over the "
            "ceil(prompt_len / positions) programs.",
        ),
    )


def check_tiles_in_flight(fn: Callable) -> bool:
    """``fn(bandwidth, latency, tile_bytes) -> int``: tiles that must be in flight
    to draw ``bandwidth`` bytes/s from a memory of ``latency`` seconds."""
    cases = [
        ("H100 HBM, 0.5 us, 32 KiB tiles", (3.35e12, 0.5e-6, 32768), 52),
        ("2 TB/s, 1 us, 64 KiB tiles", (2e12, 1e-6, 65536), 31),
        ("an exact fit", (2.0**40, 2.0**-20, 1024), 1024),
        ("a slow memory, large tiles", (1e11, 1e-7, 65536), 1),
    ]
    return _run(
        "tiles_in_flight",
        lambda b, lat, t: int(fn(b, lat, t)),
        cases,
        (
            "Little's law: how many bytes must be on their way at once, and how "
            "many whole tiles carry them?",
            "Bytes in flight = bandwidth x latency; tiles = ceil(bytes / tile_bytes).",
        ),
    )


def check_program_of(fn: Callable) -> bool:
    """``fn(q_lens, block_q, seq, j) -> int``: the tiled kernel's program that holds
    query ``j`` of sequence ``seq``."""
    chat = [1, 1, 37, 1, 300]
    cases = [
        ("a one-token decode after another", (chat, 16, 1, 0), 1),
        ("the first query of a prompt", (chat, 16, 2, 0), 2),
        ("the last query of that prompt", (chat, 16, 2, 36), 4),
        ("the first query of the long prompt", (chat, 16, 4, 0), 6),
        ("its last query", (chat, 16, 4, 299), 24),
        ("blocks of 4, the second sequence", ([5, 5], 4, 1, 3), 2),
    ]
    return _run(
        "program_of",
        fn,
        cases,
        (
            "which program holds a sequence's first query, and how many programs "
            "after it does query j lie?",
            "Sequence seq starts at query_start_loc[seq] = sum(q_lens[:seq]); its "
            "first program is query_start_loc[seq] // block_q + seq, and query j is "
            "j // block_q programs after it.",
        ),
    )


def check_prefill_flops_per_byte(fn: Callable) -> bool:
    """``fn(seqs, length, heads, kv_heads, head_dim, itemsize) -> float``: causal
    attention's FLOPs over the bytes of Q, K, V and the output, each once."""

    cases = [
        (
            "4 prompts of 1,024 tokens, Llama-3-8B, bf16",
            (4, 1024, 32, 8, 128, 2),
            410.0,
        ),
        ("16 prompts of 256 tokens", (16, 256, 32, 8, 128, 2), 102.8),
        ("multi-head attention, fp32", (2, 100, 8, 8, 64, 4), 12.625),
        ("one token", (1, 1, 1, 1, 64, 4), 0.25),
    ]
    return _run(
        "prefill_flops_per_byte",
        lambda *a: float(fn(*a)),
        cases,
        (
            "count the bytes of Q and of the output (one row per token and query "
            "head) and of K and V (one row per token and KV head).",
            "Bytes = seqs x length x (2 x heads + 2 x kv_heads) x head_dim x "
            "itemsize; divide the FLOPs the exercise gives by them.",
        ),
        same=lambda got, expected: abs(got - expected) <= 1e-9 * expected,
    )


# Chapter 05a ---------------------------------------------------------------------


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
        (
            "the cached tokens already hold positions 0 to num_computed - 1.",
            "range(num_computed, num_computed + num_new).",
        ),
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
        (
            "the packed batch puts each sequence's new tokens right after those "
            "of the sequences before it.",
            "Sequence i's last row is sum(query_lens[: i + 1]) - 1: the running "
            "total of the query lengths, minus one.",
        ),
    )


def check_blocks_held(fn: Callable) -> bool:
    """``fn(prompt_lens, new_tokens, block_size) -> int``: blocks left held."""
    lengths = [1, 7, 8, 9, 29, 100]
    cases = [
        ("one prompt that fills its block", ([4], 1, 4), 1),
        ("one token past a block", ([5], 1, 4), 2),
        ("the chapter's prompts, block 8", (lengths, 24, 8), 38),
        ("the chapter's prompts, block 1", (lengths, 24, 1), 292),
        ("the chapter's prompts, block 128", (lengths, 24, 128), 6),
    ]
    return _run(
        "blocks_held",
        fn,
        cases,
        (
            "which of a finished sequence's tokens have K/V in the cache? Each "
            "sequence rounds up to whole blocks on its own.",
            "The sum over prompts of ceil((prompt + new_tokens - 1) / block_size).",
        ),
    )


# Chapter 05b ---------------------------------------------------------------------


def check_fused_rows(fn: Callable) -> bool:
    """``fn(heads, kv_heads, head_dim) -> int``: rows of one layer's
    concatenated q/k/v weight."""
    cases = [
        ("multi-head attention: 12 heads of 64", (12, 12, 64), 2304),
        ("GQA: 32 query heads, 8 KV heads of 128", (32, 8, 128), 6144),
        ("Qwen3-0.6B's shape: 16 and 8 heads of 128", (16, 8, 128), 4096),
        ("one head of 8", (1, 1, 8), 24),
    ]
    return _run(
        "fused_rows",
        lambda h, kv, d: int(fn(h, kv, d)),
        cases,
        (
            "the matrix stacks the q, k and v projections' weights: how many "
            "output rows does each have?",
            "q has one row per query head and head dimension; k and v one per KV "
            "head and head dimension each.",
        ),
    )


def check_graph_bucket(fn: Callable) -> bool:
    """``fn(batch, max_num_seqs) -> int | None``: the CUDA graph a pure decode
    step of ``batch`` sequences replays, or None (eager)."""
    cases = [
        ("a batch of 1", (1, 256), 1),
        ("3 sequences", (3, 256), 4),
        ("exactly 8", (8, 256), 8),
        ("9 sequences", (9, 256), 16),
        ("33 sequences", (33, 256), 48),
        ("250 of at most 256", (250, 256), 256),
        ("max_num_seqs 20, batch 17", (17, 20), 20),
        ("max_num_seqs 4, batch 3", (3, 4), 4),
        ("more than max_num_seqs", (300, 256), None),
    ]
    return _run(
        "graph_bucket",
        fn,
        cases,
        (
            "list the batch sizes that get a graph, then take the smallest that "
            "holds the batch.",
            "The sizes are 1, 2, 4 and 8, every multiple of 16, and max_num_seqs "
            "itself, none above max_num_seqs; a batch larger than all of them runs "
            "eagerly.",
        ),
    )


# Chapter 06 ----------------------------------------------------------------------


def check_static_steps(fn: Callable) -> bool:
    """``fn(output_lens, batch_size) -> int``: iterations of static batching."""
    cases = [
        ("one batch", ([3, 9, 4], 4), 9),
        ("two batches", ([3, 9, 4, 1], 2), 13),
        ("batch of one", ([2, 5], 1), 7),
        ("a last batch that is not full", ([4, 1, 7, 2, 2], 2), 13),
    ]
    return _run(
        "static_steps",
        fn,
        cases,
        (
            "cut the requests, in their order, into batches of batch_size; a "
            "batch lasts as long as its longest request.",
            "The sum of max(output_lens[i : i + batch_size]) for i = 0, "
            "batch_size, 2 * batch_size, ...",
        ),
    )


def check_continuous_steps(fn: Callable) -> bool:
    """``fn(output_lens, batch_size) -> int``: iterations of continuous batching with ``batch_size`` slots."""
    cases = [
        ("everything fits at once", ([3, 9, 4], 4), 9),
        ("a freed slot is refilled", ([3, 9, 4, 1], 2), 9),
        ("one slot", ([2, 5], 1), 7),
        ("12 requests, 3 slots", ([27, 3, 16, 25, 9, 2, 1, 5, 22, 19, 16, 25], 3), 72),
        ("8 requests, 4 slots", ([25, 1, 9, 16, 26, 7, 24, 28], 4), 44),
        ("11 requests, 1 slot", ([18, 22, 4, 7, 19, 18, 23, 26, 24, 9, 22], 1), 192),
    ]
    return _run(
        "continuous_steps",
        fn,
        cases,
        (
            "follow the slots step by step: each request, in order, takes a slot "
            "as soon as one frees.",
            "Keep each slot's free time (all 0 at first); give each request the "
            "slot that frees first, which then frees output_len steps later; the "
            "answer is the latest free time.",
        ),
    )


def check_demo_preemptions(fn: Callable) -> bool:
    """``fn(watermark) -> int``: preemptions in chapter 06's scheduler demo."""
    cases = [
        ("watermark 0", (0.0,), 2),
        ("watermark 0.1", (0.1,), 1),
        ("watermark 0.25", (0.25,), 0),
        ("watermark 0.5", (0.5,), 0),
    ]
    return _run(
        "demo_preemptions",
        fn,
        cases,
        (
            "rerun the demo's cell with the watermark as a parameter: a fresh "
            "block manager, runner and scheduler for each call.",
            "Scheduler(BlockManager(num_blocks=10, block_size=4), "
            "max_model_len=2048, max_num_seqs=4, watermark=watermark), the six "
            "(prompt, output) requests with ignore_eos=True, serve_by_hand's loop "
            "until nothing is unfinished, then scheduler.num_preemptions.",
        ),
    )


# Chapter 07 ----------------------------------------------------------------------

#: (prompt_len, n, k, block_size, blocks after fork, copies at the first writes,
#: blocks without sharing), counted on a real BlockManager (tests/test_exercises.py).
_FORK_CASES = [
    (6, 4, 1, 4, 5, 3, 8),
    (8, 3, 2, 4, 5, 0, 9),
    (5, 2, 9, 4, 7, 1, 8),
    (500, 4, 100, 16, 59, 3, 152),
    (1, 8, 3, 16, 8, 7, 8),
]


def check_blocks_after_fork(fn: Callable) -> bool:
    """``fn(prompt_len, n, k, block_size) -> int``: distinct blocks held."""
    cases = [
        (f"prompt {p}, n={n}, k={k}, block {bs}", (p, n, k, bs), held)
        for p, n, k, bs, held, _, _ in _FORK_CASES
    ]
    return _run(
        "blocks_after_fork",
        fn,
        cases,
        (
            "which of the prompt's blocks are still shared once every sequence "
            "has written its own tokens, and what does each sequence own?",
            "Full prompt blocks are shared; each sequence owns its copy of the "
            "partial block plus its own tokens: prompt // bs + n * "
            "ceil((prompt % bs + k) / bs).",
        ),
    )


def check_copies_after_fork(fn: Callable) -> bool:
    """``fn(prompt_len, n, block_size) -> int``: copies at the first writes."""
    cases = [
        (f"prompt {p}, n={n}, block {bs}", (p, n, bs), copies)
        for p, n, _, bs, _, copies, _ in _FORK_CASES
    ]
    return _run(
        "copies_after_fork",
        fn,
        cases,
        (
            "a block is copied only when a sequence writes into it while it is "
            "shared; which block does a first token land in, and does the last "
            "holder copy it?",
            "Only a partial last prompt block is written into, and all its "
            "holders but the last copy it: n - 1 copies if prompt_len % "
            "block_size, else 0.",
        ),
    )


def check_unshared_blocks(fn: Callable) -> bool:
    """``fn(prompt_len, n, k, block_size) -> int``: blocks with no sharing."""
    cases = [
        (f"prompt {p}, n={n}, k={k}, block {bs}", (p, n, k, bs), alone)
        for p, n, k, bs, _, _, alone in _FORK_CASES
    ]
    return _run(
        "unshared_blocks",
        fn,
        cases,
        (
            "without sharing, each sequence holds its own prompt and its own "
            "tokens, in whole blocks.",
            "n * ceil((prompt_len + k) / block_size).",
        ),
    )


# Chapter 08 ----------------------------------------------------------------------


def check_block_keys(fn: Callable) -> bool:
    """``fn(tokens, block_size) -> list[int]``: chained keys of full blocks."""
    from pagedkv_lab.engine.prefix_cache import chained_hash as h

    two = h(None, (1, 2, 3, 4))
    a1 = h(None, (1, 2))
    a2 = h(a1, (9, 9))
    a3 = h(a2, (3, 4))
    again = [a1, a2, a3, h(a3, (9, 9))]  # the two (9, 9) blocks: other parents
    long = [(37 * i + 11) % 300 for i in range(50)]
    first = h(None, tuple(long[:16]))
    second = h(first, tuple(long[16:32]))
    cases = [
        (
            "two full blocks and a partial one",
            (list(range(1, 12)), 4),
            [two, h(two, (5, 6, 7, 8))],
        ),
        ("shorter than a block", ([5, 6, 7], 4), []),
        ("the same block after another prefix", ([1, 2, 9, 9, 3, 4, 9, 9], 2), again),
        (
            "50 tokens, blocks of 16",
            (long, 16),
            [first, second, h(second, tuple(long[32:48]))],
        ),
    ]
    return _run(
        "block_keys",
        lambda t, bs: list(fn(t, bs)),
        cases,
        (
            "only full blocks get a key, and each key depends on the key of the "
            "block before it.",
            "key = chained_hash(previous key, or None for the first block, "
            "tuple(the block's tokens)), for full blocks only.",
        ),
    )


def check_max_cached_tokens(fn: Callable) -> bool:
    """``fn(prompt_len, block_size) -> int``: most tokens a cache can supply."""
    cases = [
        ("a prompt of whole blocks", (64, 16), 48),
        ("one token past a block", (17, 16), 16),
        ("shorter than a block", (10, 16), 0),
        ("exactly one block", (16, 16), 0),
        ("block size 1", (5, 1), 4),
    ]
    return _run(
        "max_cached_tokens",
        fn,
        cases,
        (
            "a cache supplies whole blocks only, and the prompt's last token is "
            "always computed: its logits give the first output token.",
            "(prompt_len - 1) // block_size * block_size.",
        ),
    )


def check_smallest_capacity(fn: Callable) -> bool:
    """``fn(requests, target) -> int``: smallest capacity reaching a hit rate."""
    from pagedkv_lab.sim.workloads import multi_turn_workload, system_prompt_workload

    chat = multi_turn_workload(4, 3, system_len=32, seed=1)
    system = system_prompt_workload(12, system_len=96, seed=2)
    # Found by running prefix_cache_run at every capacity from one block up
    # (tests/test_exercises.py); a capacity below a request's own blocks
    # cannot serve it (ValueError).
    cases = [
        ("multi-turn chat, target 50%", (chat, 0.5), 69),
        ("multi-turn chat, target 60%", (chat, 0.6), 79),
        ("system prompt, target 50%", (system, 0.5), 16),
    ]
    return _run(
        "smallest_capacity",
        fn,
        cases,
        (
            "run prefix_cache_run at capacities of b * 16 tokens for b = 1, 2, "
            "3, ...; a capacity too small for a request raises ValueError and "
            "reaches no hit rate at all.",
            "Return the first b whose prefix_cache_run(requests, b * 16)"
            "['hit_rate'] is >= target, skipping each b that raises ValueError "
            "(those below the largest request's own blocks).",
        ),
    )


# Chapter 09 ----------------------------------------------------------------------


def check_swap_bytes(fn: Callable) -> bool:
    """``fn(num_tokens, bytes_per_token, block_size) -> int``: bytes moved."""
    cases = [
        ("one full block", (16, 1024, 16), 32768),
        ("one token past a block", (17, 1024, 16), 65536),
        ("a long request", (1000, 131072, 16), 264241152),
    ]
    return _run(
        "swap_bytes",
        fn,
        cases,
        (
            "whole blocks move, and each moves twice.",
            "2 * ceil(num_tokens / block_size) * block_size * bytes_per_token.",
        ),
    )


def check_recompute_cheaper(fn: Callable) -> bool:
    """``fn(prefill_tokens_per_s, bytes_per_token, bandwidth) -> bool``."""
    cases = [
        ("a slow CPU prefill", (1_400, 20_480, 3e9), False),
        ("a fast prefill over a slow link", (1e6, 131_072, 25e9), True),
        ("a large model over PCIe", (20_000, 131_072, 25e9), False),
        # One way the copy takes 5.2 us, out and back in 10.5 us, against a
        # recompute of 8 us (this case) and of 12.5 us (the next).
        ("125,000 tokens/s, 128 KiB a token over PCIe", (125_000, 131_072, 25e9), True),
        ("80,000 tokens/s, 128 KiB a token over PCIe", (80_000, 131_072, 25e9), False),
        ("exactly equal costs", (2**20, 2**10, 2**31), False),
        ("one token/s faster than equal", (2**20 + 1, 2**10, 2**31), True),
    ]
    return _run(
        "recompute_cheaper",
        fn,
        cases,
        (
            "compare one token's prefill time with the time its K/V spend on the "
            "link: how many times does a swapped token's K/V cross it? Cheaper "
            "means strictly less.",
            "Recompute takes 1 / prefill_tokens_per_s; a swap moves the K/V out "
            "and back in: 2 * bytes_per_token / bandwidth.",
        ),
    )


def check_crossover_tokens(fn: Callable) -> bool:
    """``fn(rate_flops, params, layers, width, bytes_per_token, bandwidth,
    fixed_s) -> int | None``: first length at which swapping is cheaper."""
    cases = [
        ("an 8B model on a fast GPU", (4e14, 8e9, 32, 4096, 131072, 25e9, 2e-5), 2),
        (
            "an 8B model, 1 ms a transfer",
            (4e14, 8e9, 32, 4096, 131072, 25e9, 1e-3),
            68,
        ),
        (
            "a tiny model, fast prefill",
            (4e14, 3e7, 10, 512, 20480, 25e9, 2e-5),
            58168,
        ),
        ("a CPU with small-llama", (4e10, 3e7, 10, 512, 20480, 3e9, 5e-5), 1),
        (
            "a small model over a slow link",
            (1e15, 1e6, 2, 64, 131072, 1e9, 1e-5),
            None,
        ),
    ]
    return _run(
        "crossover_tokens",
        fn,
        cases,
        (
            "write the chapter's two cost models as functions of the length L, "
            "fixed costs and the L^2 term included, and find the first whole L "
            "at which swap < recompute.",
            "recompute(L) = (2 * params * L + 2 * layers * width * L**2) / "
            "rate_flops; swap(L) = 2 * bytes_per_token * L / bandwidth + 2 * "
            "fixed_s. Their difference only grows once positive, so a scan or a "
            "binary search over 1 .. 999,999 finds the first L.",
        ),
    )


# Chapter 10 ----------------------------------------------------------------------


def check_decode_bytes(fn: Callable) -> bool:
    """``fn(batch, context, num_layers, num_kv_heads, head_dim, dtype_bytes)``:
    K/V bytes one decode step reads."""
    cases = [
        ("one sequence, one layer", (1, 128, 1, 8, 128, 2), 524288),
        ("Llama-3-8B, batch 64, 4k", (64, 4096, 32, 8, 128, 2), 34359738368),
        ("fp32, odd sizes", (3, 1000, 10, 2, 40, 4), 19200000),
    ]
    return _run(
        "decode_bytes",
        fn,
        cases,
        (
            "in one decode step every sequence reads the keys and the values of "
            "its whole context, in every layer.",
            "2 * batch * context * layers * kv_heads * head_dim * dtype_bytes.",
        ),
    )


def check_normalized_latency(fn: Callable) -> bool:
    """``fn(arrivals, finishes, output_lens) -> float``: the vLLM paper's
    normalised latency, mean over requests of latency / output tokens."""
    cases = [
        ("one request", ([0.0], [2.0], [4]), 0.5),
        ("two requests", ([0.0, 1.0], [3.0, 2.0], [3, 4]), 0.625),
        ("a late arrival", ([5.0, 0.0], [6.0, 8.0], [2, 8]), 0.75),
    ]
    return _run(
        "normalized_latency",
        fn,
        cases,
        (
            "normalise each request's end-to-end latency by its own output "
            "length before averaging.",
            "The mean over requests of (finish - arrival) / output tokens (not "
            "the total latency over the total tokens).",
        ),
        same=_close(rel=1e-9),
    )


# Chapter 11 ----------------------------------------------------------------------


def check_prefix_saving(fn: Callable) -> bool:
    """``fn(shared_len, private_len, n, block_size) -> float``: share saved."""
    cases = [
        ("C2's system prompt, short turns", (500, 35, 64, 16), 0.8975183823529411),
        ("a prefix shorter than one block", (10, 20, 8, 16), 0.0),
        ("a block-aligned prefix", (64, 1, 4, 16), 0.6),
        ("one request shares nothing", (512, 100, 1, 16), 0.0),
    ]
    return _run(
        "prefix_saving",
        fn,
        cases,
        (
            "count blocks, not tokens: which of a request's blocks are stored "
            "once for all n requests, and which once per request?",
            "Only the prefix's full blocks (shared_len // block_size) are stored "
            "once; every request keeps its own partial prefix block and its "
            "private blocks, ceil((shared_len + private_len) / block_size) "
            "blocks a request in all.",
        ),
        same=_close(abs_=1e-9),
    )


def check_max_private_len(fn: Callable) -> bool:
    """``fn(shared_len, n, target, block_size) -> int``: longest private part."""
    cases = [
        ("C2: 70% over 64 chats, 500 tokens", (500, 64, 0.70, 16), 188),
        ("80% with a 2000-token document", (2000, 64, 0.80, 16), 448),
        ("an unreachable target", (100, 4, 0.9, 16), 0),
        ("blocks of 32", (500, 64, 0.70, 32), 172),
    ]
    return _run(
        "max_private_len",
        fn,
        cases,
        (
            "the saving only falls as the private part grows: walk the private "
            "length up from 1 with prefix_saving.",
            "Return the last length whose saving still reaches the target (0 if "
            "a private part of 1 already misses it).",
        ),
    )


def check_which_share(fn: Callable) -> bool:
    """``fn(claimed_bytes, config, dtype_bytes) -> str | None``."""
    l7 = _cfg(num_hidden_layers=32, num_attention_heads=32, hidden_size=4096)
    l70 = _cfg(
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        hidden_size=8192,
    )
    cases = [
        ("M5: Llama-2-7B, 16 KiB", (16 * 1024, l7, 2), "one layer"),
        ("Llama-2-7B, 512 KiB", (512 * 1024, l7, 2), "whole model"),
        ("Llama-2-70B, 160 KiB", (160 * 1024, l70, 2), "keys only"),
        ("Llama-2-70B fp32, 4 KiB", (4 * 1024, l70, 4), "one layer, keys only"),
        ("a figure that is none of these", (1000, l7, 2), None),
    ]
    return _run(
        "which_share",
        fn,
        cases,
        (
            "compute the four shares of one token's bill for the config and "
            "compare each with the claim, in the order given.",
            "One layer's keys are kv_heads * head_dim * dtype_bytes; values "
            "double it, layers multiply it. head_dim defaults to hidden_size // "
            "num_attention_heads and kv_heads to num_attention_heads.",
        ),
    )
