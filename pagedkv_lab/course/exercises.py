"""Automatic checks for the chapters' exercises.

Each ``check_*`` takes the reader's function, runs it on cases with known
answers, prints one line per case (✓ or ✗) and a hint on failure, and returns
True when every case passed. Checks whose hint has two steps (chapters 04a-04d)
never print the expected answer: the first miss gets a nudge, later misses the
formula too. Solutions live in the
repository's ``solutions/`` folder, not here.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from types import SimpleNamespace

#: How often each check has failed in this session: a check whose hint is a
#: (nudge, formula) pair gives the nudge on the first miss, the formula after.
_MISSES: dict[str, int] = {}


def _run(
    name: str,
    fn: Callable,
    cases: list[tuple[str, tuple, object]],
    hint: str | tuple[str, str],
    same: Callable[[object, object], bool] | None = None,
) -> bool:
    """Run ``fn`` on ``cases`` and print what passed. ``hint``: one text, or a
    (nudge, formula) pair: then a failed case shows what ``fn`` returned but not
    the answer, and the formula comes only from the second miss on."""
    print(f"Checking {name}:")
    two_step = isinstance(hint, tuple)
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
        elif two_step:
            print(f"  ✗ {label}: got {got!r}")
        else:
            print(f"  ✗ {label}: expected {expected!r}, got {got!r}")
    ok = passed == len(cases)
    if not ok and two_step:
        _MISSES[name] = _MISSES.get(name, 0) + 1
        hint = hint[0] if _MISSES[name] == 1 else f"{hint[0]} {hint[1]}"
    print(f"{passed}/{len(cases)} passed." + ("" if ok else f" Hint: {hint}"))
    return ok


def _cfg(**fields) -> SimpleNamespace:
    fields.setdefault("head_dim", None)
    fields.setdefault("num_key_value_heads", None)
    return SimpleNamespace(**fields)


# Chapter 00 ----------------------------------------------------------------------


def _not_attempted(name: str, fn: Callable, args: tuple) -> bool:
    """Report an exercise still raising NotImplementedError before costly references
    are computed, so that its check prints one block at once."""
    try:
        fn(*args)
    except NotImplementedError:
        print(f"Checking {name}:")
        print(
            "  not attempted yet: replace the `raise NotImplementedError` with your code"
        )
        return True
    except Exception:  # reported case by case by _run
        pass
    return False


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
        "num_key_value_heads may be missing (None): "
        "then every query head has its own KV head.",
    )


def check_cache_bytes_per_token(fn: Callable) -> bool:
    """``fn(name) -> int``: bytes per cached token, measured on an offline model."""
    import torch

    from pagedkv_lab.kvmath import KVSpec
    from pagedkv_lab.models import load_model

    if _not_attempted("cache_bytes_per_token", fn, ("tiny-llama",)):
        return False
    cases = []
    for name in ["tiny-llama", "tiny-qwen2", "tiny-mistral"]:
        model, _ = load_model(name)
        spec = KVSpec.from_config(model.config, dtype=torch.float32)
        cases.append((name, (name,), spec.bytes_per_token))
    return _run(
        "cache_bytes_per_token",
        fn,
        cases,
        "add numel() * element_size() over every layer's keys and values, "
        "then divide by cache.get_seq_length().",
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
        "2 (K and V) x layers x KV heads (not query heads) x head_dim x bytes; "
        "prefer config.head_dim when set.",
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
        "floor division; a request needs all max_len tokens; never negative.",
    )


def check_longest_request(fn: Callable) -> bool:
    """``fn(config, gpu_bytes, kv_dtype_bytes) -> int``: tokens of the longest single
    request whose KV cache fits next to the fp16 weights."""
    from pagedkv_lab.kvmath import (
        KVSpec,
        gpu_memory_bytes,
        kv_budget,
        real_model_configs,
    )

    configs, gpus = real_model_configs(), gpu_memory_bytes()

    def reference(cfg, gpu, dtype_bytes):
        spec = KVSpec.from_config(cfg)
        spec = KVSpec(spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype_bytes)
        return spec.tokens_in(kv_budget(cfg, gpu))

    cases = []
    for name, gpu, dtype_bytes in [
        ("Llama-3-8B", "L4", 2),
        ("Llama-3-8B", "L4", 1),
        ("Llama-2-7B", "T4", 2),
        ("Llama-2-70B", "H100-80GB", 2),
    ]:
        args = (configs[name], gpus[gpu], dtype_bytes)
        label = f"{name} on {gpu}, {dtype_bytes}-byte cache"
        cases.append((label, args, reference(*args)))
    return _run(
        "longest_request",
        fn,
        cases,
        "the budget is kv_budget(config, gpu_bytes) (fp16 weights, 10% reserve); "
        "divide by the bytes per token at kv_dtype_bytes; 0 if the weights do not fit.",
    )


# Chapter 02 ----------------------------------------------------------------------


def _best_fit_reference(gaps: list[tuple[int, int]], n: int) -> int | None:
    fitting = [(length, start) for start, length in gaps if length >= n]
    return min(fitting)[1] if fitting else None


def check_best_fit(fn: Callable) -> bool:
    """``fn(gaps, n) -> start | None``: best-fit choice among free ``(start, length)``
    gaps."""
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
        "count the free slots only when the request is blocked by fragmentation "
        "alone: sum >= need but max < need.",
    )


def _pool_shares_reference(extra_slots: int) -> tuple[float, float]:
    from pagedkv_lab.sim.contiguous import ContiguousPool
    from pagedkv_lab.sim.workloads import chat_workload, simulate

    trace = chat_workload(400, seed=0, arrival_rate=1.0, max_model_len=2048)
    pool = ContiguousPool(16 * 2048 + extra_slots, 2048, policy="max")
    f = simulate(trace, pool).fractions()
    return f["external"], f["free"]


def check_pool_shares(fn: Callable) -> bool:
    """``fn(extra_slots) -> (external, free)``: shares of a max-reservation pool of
    ``16 * 2048 + extra_slots`` slots, averaged over the steps with a queue."""
    if _not_attempted("pool_shares", fn, (1000,)):
        return False
    cases = [
        (f"{extra} extra slots", (extra,), _pool_shares_reference(extra))
        for extra in (1000, 3000)
    ]

    def same(got, expected) -> bool:
        return len(got) == 2 and all(abs(g - e) < 1e-6 for g, e in zip(got, expected))

    return _run(
        "pool_shares",
        fn,
        cases,
        "simulate chat_workload(400, seed=0, arrival_rate=1.0, max_model_len=2048) "
        "through ContiguousPool(16 * 2048 + extra_slots, 2048, policy='max') and "
        "return fractions()['external'] and fractions()['free'].",
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
        "slot = block_table[position // block_size] * block_size "
        "+ position % block_size.",
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
        "blocks * block_size - num_tokens, where blocks = ceil(tokens / block_size).",
    )


def _preemptions_reference(watermark: float) -> int:
    from pagedkv_lab.sim.paged import PagedPool
    from pagedkv_lab.sim.workloads import chat_workload, simulate

    trace = chat_workload(150, seed=0, arrival_rate=1.0, max_model_len=2048)
    return simulate(trace, PagedPool(512, 16, 2048, watermark=watermark)).preemptions


def check_preemptions(fn: Callable) -> bool:
    """``fn(watermark) -> int``: preemptions of a small W1 trace through a paged pool."""
    cases = [
        (f"watermark {w:.0%}", (w,), _preemptions_reference(w))
        for w in (0.0, 0.05, 0.2)
    ]
    return _run(
        "preemptions",
        fn,
        cases,
        "simulate(chat_workload(150, seed=0, arrival_rate=1.0), "
        "PagedPool(512, 16, 2048, watermark=watermark)).preemptions",
    )


# Chapters 04a-04d -----------------------------------------------------------------------------------------------


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
        ("each part weighs its share of the sum of exponentials over both parts, "
         "and a part that saw no key must not touch the result.",
         "The weights are exp(lse_a - lse) and exp(lse_b - lse) with lse = "
         "logaddexp(lse_a, lse_b); leave out a part whose lse is -inf "
         "(0 * NaN is NaN)."),
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
        ("at which position does the j-th new query sit among the "
         "context_len tokens?",
         "Query j sits at position context_len - query_len + j and sees every "
         "position up to and including its own."),
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
        ("count the FLOPs that one key costs all the query heads of its group, "
         "and the bytes it costs the cache.",
         "Per query head and key: head_dim multiply-adds for the score and as "
         "many for the output (a multiply-add is 2 FLOPs); per KV head and key "
         "the cache supplies a key and a value of head_dim elements each."),
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
        ("a program loads every key up to its last row's position, once.",
         "Program p holds positions p * positions to (p + 1) * positions - 1 and "
         "loads min(prompt_len, (p + 1) * positions) keys; add them up over the "
         "ceil(prompt_len / positions) programs."),
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
        ("Little's law: how many bytes must be on their way at once, and how "
         "many whole tiles carry them?",
         "Bytes in flight = bandwidth x latency; tiles = ceil(bytes / tile_bytes)."),
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
        ("which program holds a sequence's first query, and how many programs "
         "after it does query j lie?",
         "Sequence seq starts at query_start_loc[seq] = sum(q_lens[:seq]); its "
         "first program is query_start_loc[seq] // block_q + seq, and query j is "
         "j // block_q programs after it."),
    )


def check_prefill_flops_per_byte(fn: Callable) -> bool:
    """``fn(seqs, length, heads, kv_heads, head_dim, itemsize) -> float``: causal
    attention's FLOPs over the bytes of Q, K, V and the output, each once."""

    def intensity(seqs, length, heads, kv_heads, head_dim, itemsize):
        flops = 4 * head_dim * heads * seqs * length * (length + 1) / 2
        return flops / (seqs * length * (2 * heads + 2 * kv_heads) * head_dim * itemsize)

    args = [
        ("4 prompts of 1,024 tokens, Llama-3-8B, bf16", (4, 1024, 32, 8, 128, 2)),
        ("16 prompts of 256 tokens", (16, 256, 32, 8, 128, 2)),
        ("multi-head attention, fp32", (2, 100, 8, 8, 64, 4)),
        ("one token", (1, 1, 1, 1, 64, 4)),
    ]
    cases = [(label, a, intensity(*a)) for label, a in args]
    return _run(
        "prefill_flops_per_byte",
        lambda *a: float(fn(*a)),
        cases,
        ("count the bytes of Q and of the output (one row per token and query "
         "head) and of K and V (one row per token and KV head).",
         "Bytes = seqs x length x (2 x heads + 2 x kv_heads) x head_dim x "
         "itemsize; divide the FLOPs the exercise gives by them."),
        same=lambda got, expected: abs(got - expected) <= 1e-9 * expected,
    )


# Chapter 05a -----------------------------------------------------------------------------------------------


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
        "each sequence holds ceil((prompt + new_tokens - 1) / block_size) blocks.",
    )


# Chapter 05b ----------------------------------------------------------------------------


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
        ("the matrix stacks the q, k and v projections' weights: how many "
         "output rows does each have?",
         "q has one row per query head and head dimension; k and v one per KV "
         "head and head dimension each."),
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
        ("list the batch sizes that get a graph, then take the smallest that "
         "holds the batch.",
         "The sizes are 1, 2, 4 and 8, every multiple of 16, and max_num_seqs "
         "itself, none above max_num_seqs; a batch larger than all of them runs "
         "eagerly."),
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


def _demo_preemptions(watermark: float) -> int:
    """Chapter 06's scheduler demo, without the model: with EOS ignored the
    schedule does not depend on which tokens are sampled."""
    from pagedkv_lab.engine.block_manager import BlockManager
    from pagedkv_lab.engine.sampler import SampledOutput
    from pagedkv_lab.engine.scheduler import Scheduler
    from pagedkv_lab.engine.sequence import Sequence, SequenceGroup
    from pagedkv_lab.sampling_params import SamplingParams

    sched = Scheduler(
        BlockManager(10, 4), max_model_len=2048, max_num_seqs=4, watermark=watermark
    )
    for i, (p, o) in enumerate([(5, 9), (3, 4), (9, 10), (2, 3), (6, 8), (4, 2)]):
        params = SamplingParams(temperature=0, max_tokens=o, ignore_eos=True)
        sched.add(SequenceGroup(i, Sequence(list(range(1, p + 1)), params)))
    while sched.has_unfinished:
        plan = sched.schedule()  # every sampling sequence gets token 5
        n = len(plan.sample_seqs)
        sched.postprocess(plan, SampledOutput([5] * n, [0.0] * n, [None] * n, {}, []))
    return sched.num_preemptions


def check_demo_preemptions(fn: Callable) -> bool:
    """``fn(watermark) -> int``: preemptions in chapter 06's scheduler demo."""
    cases = [
        (f"watermark {w}", (w,), _demo_preemptions(w)) for w in (0.0, 0.1, 0.25, 0.5)
    ]
    return _run(
        "demo_preemptions",
        fn,
        cases,
        "build the demo's Scheduler(BlockManager(10, 4), ..., watermark=watermark), "
        "serve the six requests and return scheduler.num_preemptions.",
    )


# Chapter 07 -------------------------------------------------------------------


def _fork_and_write(prompt_len: int, n: int, k: int, block_size: int):
    """Drive a real BlockManager: allocate a prompt, fork it n - 1 times, then
    let every sequence append k tokens. Returns (blocks held, copies made)."""
    from pagedkv_lab.engine.block_manager import BlockManager
    from pagedkv_lab.engine.sequence import Sequence
    from pagedkv_lab.sampling_params import SamplingParams

    bm = BlockManager(4 * n * (prompt_len + k) // block_size + 8, block_size)
    params = SamplingParams(max_tokens=10_000, ignore_eos=True)
    parent = Sequence([1] * prompt_len, params)
    bm.allocate(parent, 0, prompt_len)
    parent.num_computed_tokens = prompt_len
    family = [parent]
    for _ in range(n - 1):
        child = parent.fork()
        bm.fork(parent, child)
        family.append(child)
    copies = 0
    for _ in range(k):
        for seq in family:
            seq.token_ids.append(1)
            bm.append_slots(seq, 1)
            seq.num_computed_tokens += 1
        copies += len(bm.take_copies())
    return bm.num_blocks - bm.num_free_blocks, copies


_FORK_CASES = [
    (6, 4, 1, 4),
    (8, 3, 2, 4),
    (5, 2, 9, 4),
    (500, 4, 100, 16),
    (1, 8, 3, 16),
]


def check_blocks_after_fork(fn: Callable) -> bool:
    """``fn(prompt_len, n, k, block_size) -> int``: distinct blocks held."""
    cases = [
        (
            f"prompt {p}, n={n}, k={k}, block {bs}",
            (p, n, k, bs),
            _fork_and_write(p, n, k, bs)[0],
        )
        for p, n, k, bs in _FORK_CASES
    ]
    return _run(
        "blocks_after_fork",
        fn,
        cases,
        "full prompt blocks are shared; each sequence owns its copy of the partial "
        "block plus its own tokens: prompt // bs + n * ceil((prompt % bs + k) / bs).",
    )


def check_copies_after_fork(fn: Callable) -> bool:
    """``fn(prompt_len, n, block_size) -> int``: copies at the first writes."""
    cases = [
        (f"prompt {p}, n={n}, block {bs}", (p, n, bs), _fork_and_write(p, n, 1, bs)[1])
        for p, n, _, bs in _FORK_CASES
    ]
    return _run(
        "copies_after_fork",
        fn,
        cases,
        "only a partial last block is written into; all holders but the last copy it.",
    )


def check_unshared_blocks(fn: Callable) -> bool:
    """``fn(prompt_len, n, k, block_size) -> int``: blocks with no sharing."""
    cases = [
        (f"prompt {p}, n={n}, k={k}, block {bs}", (p, n, k, bs), n * -(-(p + k) // bs))
        for p, n, k, bs in _FORK_CASES
    ]
    return _run(
        "unshared_blocks",
        fn,
        cases,
        "each of the n sequences holds ceil((prompt + k) / block_size) blocks.",
    )


# Chapter 08 -------------------------------------------------------------------


def check_block_keys(fn: Callable) -> bool:
    """``fn(tokens, block_size) -> list[int]``: chained keys of full blocks."""
    from pagedkv_lab.engine.prefix_cache import chained_hash

    def reference(tokens, bs):
        keys, key = [], None
        for i in range(len(tokens) // bs):
            key = chained_hash(key, tuple(tokens[i * bs : (i + 1) * bs]))
            keys.append(key)
        return keys

    rng = random.Random(8)
    cases = [
        ("two full blocks and a partial one", (list(range(1, 12)), 4), None),
        ("shorter than a block", ([5, 6, 7], 4), None),
        ("the same block after another prefix", ([1, 2, 9, 9, 3, 4, 9, 9], 2), None),
        ("random tokens", ([rng.randrange(300) for _ in range(50)], 16), None),
    ]
    cases = [(label, args, reference(*args)) for label, args, _ in cases]
    return _run(
        "block_keys",
        lambda t, bs: list(fn(t, bs)),
        cases,
        "key = chained_hash(previous key or None, tuple(block tokens)), full blocks only.",
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
        "whole blocks only, and the last token is always computed: "
        "(prompt_len - 1) // block_size * block_size.",
    )


def _smallest_capacity(requests, target: float) -> int:
    from pagedkv_lab.course.experiments import prefix_cache_run

    top = sum(-(-len(r.prompt + r.output) // 16) for r in requests)
    low = 5 * max(-(-len(r.prompt + r.output) // 16) for r in requests)
    for blocks in range(low, top + 1):
        if prefix_cache_run(requests, blocks * 16)["hit_rate"] >= target:
            return blocks
    return top


def check_smallest_capacity(fn: Callable) -> bool:
    """``fn(requests, target) -> int``: smallest capacity reaching a hit rate."""
    from pagedkv_lab.sim.workloads import multi_turn_workload, system_prompt_workload

    chat = multi_turn_workload(4, 3, system_len=32, seed=1)
    system = system_prompt_workload(12, system_len=96, seed=2)
    cases = [
        (f"{name}, target {t:.0%}", (reqs, t), _smallest_capacity(reqs, t))
        for name, reqs, t in [
            ("multi-turn chat", chat, 0.5),
            ("multi-turn chat", chat, 0.6),
            ("system prompt", system, 0.5),
        ]
    ]
    return _run(
        "smallest_capacity",
        fn,
        cases,
        "try capacities of b * 16 tokens for b = 1, 2, ... and return the first b "
        "whose prefix_cache_run(requests, b * 16)['hit_rate'] reaches the target "
        "(a request needs room for itself and four running ones).",
    )


# Chapter 09 -------------------------------------------------------------------


def check_swap_bytes(fn: Callable) -> bool:
    """``fn(num_tokens, bytes_per_token, block_size) -> int``: bytes moved."""
    cases = [
        ("one full block", (16, 1024, 16), 2 * 16 * 1024),
        ("one token past a block", (17, 1024, 16), 2 * 32 * 1024),
        ("a long request", (1000, 131072, 16), 2 * 1008 * 131072),
    ]
    return _run(
        "swap_bytes",
        fn,
        cases,
        "whole blocks move, out and back in: 2 * ceil(n / bs) * bs * bytes_per_token.",
    )


def check_recompute_cheaper(fn: Callable) -> bool:
    """``fn(prefill_tokens_per_s, bytes_per_token, bandwidth) -> bool``."""
    cases = [
        ("a slow CPU prefill", (1_400, 20_480, 3e9), False),
        ("a fast prefill over a slow link", (1e6, 131_072, 25e9), True),
        ("a large model over PCIe", (20_000, 131_072, 25e9), False),
    ]
    return _run(
        "recompute_cheaper",
        fn,
        cases,
        "per token, recompute takes 1 / rate; a swap moves the K/V twice: "
        "2 * bytes_per_token / bandwidth.",
    )


def _crossover(rate, params, layers, width, bpt, bw, fixed):
    def gap(n):
        recompute = (2 * params * n + 2 * layers * width * n * n) / rate
        return recompute - (2 * bpt * n / bw + 2 * fixed)

    if gap(10**6) <= 0:
        return None
    lo, hi = 1, 10**6
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if gap(mid) <= 0 else (lo, mid)
    return lo


def check_crossover_tokens(fn: Callable) -> bool:
    """``fn(rate_flops, params, layers, width, bytes_per_token, bandwidth,
    fixed_s) -> int | None``: first length at which swapping is cheaper."""
    raw = [
        ("an 8B model on a fast GPU", (4e14, 8e9, 32, 4096, 131072, 25e9, 2e-5)),
        ("a tiny model, fast prefill", (4e14, 3e7, 10, 512, 20480, 25e9, 2e-5)),
        ("a CPU with small-llama", (4e10, 3e7, 10, 512, 20480, 3e9, 5e-5)),
    ]
    cases = [(label, args, _crossover(*args)) for label, args in raw]
    return _run(
        "crossover_tokens",
        fn,
        cases,
        "find the smallest n with recompute(n) > swap(n); the difference grows "
        "once positive (the L^2 term), so a binary search over 1..10**6 works.",
    )


# Chapter 10 -------------------------------------------------------------------


def check_decode_bytes(fn: Callable) -> bool:
    """``fn(batch, context, num_layers, num_kv_heads, head_dim, dtype_bytes)``:
    K/V bytes one decode step reads."""
    cases = [
        ("one sequence, one layer", (1, 128, 1, 8, 128, 2), 2 * 128 * 8 * 128 * 2),
        ("Llama-3-8B, batch 64, 4k", (64, 4096, 32, 8, 128, 2), 64 * 4096 * 131072),
        ("fp32, odd sizes", (3, 1000, 10, 2, 40, 4), 3 * 1000 * 2 * 10 * 2 * 40 * 4),
    ]
    return _run(
        "decode_bytes",
        fn,
        cases,
        "every sequence reads keys and values of all its context tokens in every "
        "layer: 2 * batch * context * layers * kv_heads * head_dim * dtype_bytes.",
    )


def check_normalized_latency(fn: Callable) -> bool:
    """``fn(arrivals, finishes, output_lens) -> float``: the vLLM paper's
    normalised latency, mean over requests of latency / output tokens."""
    cases = [
        ("one request", ([0.0], [2.0], [4]), 0.5),
        ("two requests", ([0.0, 1.0], [3.0, 2.0], [3, 4]), (1.0 + 0.25) / 2),
        ("a late arrival", ([5.0, 0.0], [6.0, 8.0], [2, 8]), (0.5 + 1.0) / 2),
    ]
    return _run(
        "normalized_latency",
        fn,
        cases,
        "per request (finish - arrival) / output tokens, then the mean over "
        "requests (not total latency over total tokens).",
        same=lambda a, b: math.isclose(a, b, rel_tol=1e-9),
    )


# Chapter 11 -------------------------------------------------------------------


def _prefix_saving(shared_len: int, private_len: int, n: int, block_size: int) -> float:
    shared_blocks = shared_len // block_size
    per_request = -(-(shared_len + private_len) // block_size)
    with_cache = shared_blocks + n * (per_request - shared_blocks)
    return 1 - with_cache / (n * per_request)


def check_prefix_saving(fn: Callable) -> bool:
    """``fn(shared_len, private_len, n, block_size) -> float``: share saved."""
    raw = [
        ("C2's system prompt, short turns", (500, 35, 64, 16)),
        ("a prefix shorter than one block", (10, 20, 8, 16)),
        ("a block-aligned prefix", (64, 1, 4, 16)),
        ("one request shares nothing", (512, 100, 1, 16)),
    ]
    cases = [(label, args, _prefix_saving(*args)) for label, args in raw]
    return _run(
        "prefix_saving",
        fn,
        cases,
        "only the prefix's full blocks (shared_len // block_size) are stored once; "
        "every request keeps its own partial prefix block and its private blocks.",
        same=lambda a, b: math.isclose(a, b, abs_tol=1e-9),
    )


def _max_private_len(shared_len: int, n: int, target: float, block_size: int) -> int:
    best, private = 0, 1
    # The saving never rises with the private part, and falls below any
    # positive target once the private blocks dominate.
    while _prefix_saving(shared_len, private, n, block_size) >= target:
        best, private = private, private + 1
    return best


def check_max_private_len(fn: Callable) -> bool:
    """``fn(shared_len, n, target, block_size) -> int``: longest private part."""
    raw = [
        ("C2: 70% over 64 chats, 500 tokens", (500, 64, 0.70, 16)),
        ("80% with a 2000-token document", (2000, 64, 0.80, 16)),
        ("an unreachable target", (100, 4, 0.9, 16)),
        ("blocks of 32", (500, 64, 0.70, 32)),
    ]
    cases = [(label, args, _max_private_len(*args)) for label, args in raw]
    return _run(
        "max_private_len",
        fn,
        cases,
        "the saving only falls as the private part grows: try 1, 2, 3, ... and "
        "return the last length that still reaches the target (0 if 1 does not).",
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
        "one layer's keys are kv_heads * head_dim * dtype_bytes; values double it, "
        "layers multiply it. head_dim defaults to hidden_size // num_attention_heads "
        "and kv_heads to num_attention_heads.",
    )
