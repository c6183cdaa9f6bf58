"""The exercises' checks: the published solutions pass them, so do solutions
written here straight from each exercise's wording (without the published
ones), plausible wrong answers fail them, and no check prints its answer.

The solutions below are independent of ``solutions/``: several take another
route (the library's BlockManager for chapter 07, its `shared_prefix_memory`
for chapter 11, a closed form for chapter 09's crossover, a step-by-step
simulation for continuous batching), so that a check passing both is
evidence that its written-out answers are right.
"""

import importlib.util
import math
import statistics
from pathlib import Path

import pytest
import torch

from pagedkv_lab.course import exercises

SOLUTIONS = Path(__file__).resolve().parent.parent / "solutions"

#: Every exercise: its name (``check_<name>`` checks it) and its chapter.
CHAPTER = {
    "gqa_group": "ch00",
    "cache_bytes_per_token": "ch00",
    "bytes_per_token": "ch01",
    "max_requests": "ch01",
    "longest_request": "ch01",
    "best_fit": "ch02",
    "external_fragmentation": "ch02",
    "pool_shares": "ch02",
    "blocks_for": "ch03",
    "slot_of": "ch03",
    "tail_waste": "ch03",
    "preemptions": "ch03",
    "merge_two": "ch04a",
    "visible_keys": "ch04a",
    "decode_flops_per_byte": "ch04b",
    "key_loads": "ch04b",
    "tiles_in_flight": "ch04c",
    "program_of": "ch04c",
    "prefill_flops_per_byte": "ch04d",
    "positions_for": "ch05a",
    "logits_rows": "ch05a",
    "blocks_held": "ch05a",
    "fused_rows": "ch05b",
    "graph_bucket": "ch05b",
    "static_steps": "ch06",
    "continuous_steps": "ch06",
    "demo_preemptions": "ch06",
    "blocks_after_fork": "ch07",
    "copies_after_fork": "ch07",
    "unshared_blocks": "ch07",
    "block_keys": "ch08",
    "max_cached_tokens": "ch08",
    "smallest_capacity": "ch08",
    "swap_bytes": "ch09",
    "recompute_cheaper": "ch09",
    "crossover_tokens": "ch09",
    "decode_bytes": "ch10",
    "normalized_latency": "ch10",
    "prefix_saving": "ch11",
    "max_private_len": "ch11",
    "which_share": "ch11",
}


def _check(name: str):
    return getattr(exercises, f"check_{name}")


def _solution(chapter: str):
    spec = importlib.util.spec_from_file_location(
        f"solutions_{chapter}", SOLUTIONS / f"{chapter}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


# Independent solutions, one per exercise, from the exercises' text ----------------


def gqa_group(config):
    if config.num_key_value_heads is None:  # before GQA: one KV head per query head
        return 1
    return config.num_attention_heads // config.num_key_value_heads


def cache_bytes_per_token(name):
    from pagedkv_lab.models import load_model

    model, tokenizer = load_model(name)
    ids = tokenizer("The cache", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True
        )
    cache = out.past_key_values
    held = 0
    for layer in cache.layers:
        held += layer.keys.numel() * layer.keys.element_size()
        held += layer.values.numel() * layer.values.element_size()
    return held // cache.get_seq_length()


def bytes_per_token(config, dtype_bytes):
    heads = config.num_attention_heads
    kv_heads = config.num_key_value_heads or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * dtype_bytes


def max_requests(budget_bytes, bytes_per_token, max_len):
    if budget_bytes <= 0:
        return 0
    return budget_bytes // (bytes_per_token * max_len)


def longest_request(config, gpu_bytes, kv_dtype_bytes):
    from pagedkv_lab.kvmath import kv_budget

    budget = kv_budget(config, gpu_bytes)
    return max(0, budget // bytes_per_token(config, kv_dtype_bytes))


def best_fit(gaps, n):
    best = None
    for start, length in gaps:
        if length >= n and (best is None or (length, start) < best):
            best = (length, start)
    return None if best is None else best[1]


def external_fragmentation(gap_lengths, need):
    total = sum(gap_lengths)
    if total >= need and all(g < need for g in gap_lengths):
        return total
    return 0


def pool_shares(extra_slots):
    from pagedkv_lab.sim.contiguous import ContiguousPool
    from pagedkv_lab.sim.workloads import chat_workload, simulate

    max_len = 2048
    w1 = chat_workload(400, seed=0, arrival_rate=1.0, max_model_len=max_len)
    pool = ContiguousPool(16 * max_len + extra_slots, max_len, policy="max")
    shares = simulate(w1, pool).fractions()
    return shares["external"], shares["free"]


def blocks_for(num_tokens, block_size):
    return _ceil_div(num_tokens, block_size)


def slot_of(block_table, block_size, position):
    logical, offset = divmod(position, block_size)
    return block_table[logical] * block_size + offset


def tail_waste(num_tokens, block_size):
    rest = num_tokens % block_size
    return 0 if rest == 0 else block_size - rest


def preemptions(watermark):
    from pagedkv_lab.sim.paged import PagedPool
    from pagedkv_lab.sim.workloads import chat_workload, simulate

    trace = chat_workload(150, seed=0, arrival_rate=1.0)
    return simulate(trace, PagedPool(512, 16, 2048, watermark=watermark)).preemptions


def merge_two(out_a, lse_a, out_b, lse_b):
    lse_a, lse_b = torch.as_tensor(lse_a), torch.as_tensor(lse_b)
    empty_a, empty_b = bool(torch.isneginf(lse_a)), bool(torch.isneginf(lse_b))
    if empty_a and empty_b:
        return torch.zeros_like(torch.as_tensor(out_a))
    if empty_a:
        return out_b
    if empty_b:
        return out_a
    lse = torch.logaddexp(lse_a, lse_b)
    return torch.exp(lse_a - lse) * out_a + torch.exp(lse_b - lse) * out_b


def visible_keys(context_len, query_len, j):
    position = context_len - query_len + j  # of the j-th new query
    return position + 1


def decode_flops_per_byte(group, head_dim, bytes_per_element):
    flops_per_key = group * (2 * head_dim + 2 * head_dim)  # q.k, then p * v
    bytes_per_key = (head_dim + head_dim) * bytes_per_element  # the key and value
    return flops_per_key / bytes_per_key


def key_loads(prompt_len, positions):
    total, first = 0, 0
    while first < prompt_len:
        last = min(first + positions, prompt_len) - 1
        total += last + 1  # keys 0..last, each once
        first += positions
    return total


def tiles_in_flight(bandwidth, latency, tile_bytes):
    return math.ceil(bandwidth * latency / tile_bytes)


def program_of(q_lens, block_q, seq, j):
    query_start_loc = sum(q_lens[:seq])
    return query_start_loc // block_q + seq + j // block_q


def prefill_flops_per_byte(seqs, length, heads, kv_heads, head_dim, itemsize):
    flops = 4 * head_dim * heads * seqs * length * (length + 1) / 2
    rows = seqs * length * (heads + kv_heads + kv_heads + heads)  # Q, K, V, out
    return flops / (rows * head_dim * itemsize)


def positions_for(num_computed, num_new):
    return [num_computed + i for i in range(num_new)]


def logits_rows(query_lens):
    rows, end = [], 0
    for n in query_lens:
        end += n
        rows.append(end - 1)
    return rows


def blocks_held(prompt_lens, new_tokens, block_size):
    # The last sampled token of each sequence never gets K/V.
    return sum(_ceil_div(p + new_tokens - 1, block_size) for p in prompt_lens)


def fused_rows(heads, kv_heads, head_dim):
    return heads * head_dim + kv_heads * head_dim + kv_heads * head_dim


def graph_bucket(batch, max_num_seqs):
    from pagedkv_lab.engine.graphs import graph_batch_sizes

    return next((s for s in graph_batch_sizes(max_num_seqs) if s >= batch), None)


def static_steps(output_lens, batch_size):
    steps = 0
    for i in range(0, len(output_lens), batch_size):
        steps += max(output_lens[i : i + batch_size])
    return steps


def continuous_steps(output_lens, batch_size):
    waiting, running, step = list(output_lens), [], 0
    while waiting or running:
        while waiting and len(running) < batch_size:
            running.append(waiting.pop(0))
        step += 1
        running = [left - 1 for left in running if left > 1]
    return step


def demo_preemptions(watermark):
    from pagedkv_lab.engine.block_manager import BlockManager
    from pagedkv_lab.engine.model_runner import ModelRunner
    from pagedkv_lab.engine.scheduler import Scheduler
    from pagedkv_lab.engine.sequence import Sequence, SequenceGroup
    from pagedkv_lab.models import load_model
    from pagedkv_lab.sampling_params import SamplingParams

    model, _ = load_model("tiny-llama")
    runner = ModelRunner(model, num_blocks=10, block_size=4)
    blocks = BlockManager(num_blocks=10, block_size=4)
    scheduler = Scheduler(
        blocks, max_model_len=2048, max_num_seqs=4, watermark=watermark
    )
    lengths = [(5, 9), (3, 4), (9, 10), (2, 3), (6, 8), (4, 2)]
    for i, (prompt_len, out_len) in enumerate(lengths):
        params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
        prompt = list(range(1, prompt_len + 1))
        scheduler.add(SequenceGroup(i, Sequence(prompt, params)))
    while scheduler.has_unfinished:
        plan = scheduler.schedule()
        sampled = runner.execute(plan)
        scheduler.postprocess(plan, sampled and sampled.read())
    return scheduler.num_preemptions


def _fork_on_a_block_manager(prompt_len, n, k, block_size):
    """Fork a prompt into n sequences on the library's BlockManager, let each
    append k tokens; return (blocks held, copies made)."""
    from pagedkv_lab.engine.block_manager import BlockManager
    from pagedkv_lab.engine.sequence import Sequence
    from pagedkv_lab.sampling_params import SamplingParams

    bm = BlockManager(n * _ceil_div(prompt_len + k, block_size) + 1, block_size)
    parent = Sequence([1] * prompt_len, SamplingParams(max_tokens=10**6))
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


def blocks_after_fork(prompt_len, n, k, block_size):
    return _fork_on_a_block_manager(prompt_len, n, k, block_size)[0]


def copies_after_fork(prompt_len, n, block_size):
    return _fork_on_a_block_manager(prompt_len, n, 1, block_size)[1]


def unshared_blocks(prompt_len, n, k, block_size):
    per_sequence = _ceil_div(prompt_len + k, block_size)
    return n * per_sequence


def block_keys(tokens, block_size):
    from pagedkv_lab.engine.prefix_cache import chained_hash

    keys = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = keys[-1] if keys else None
        keys.append(chained_hash(parent, tuple(tokens[start : start + block_size])))
    return keys


def max_cached_tokens(prompt_len, block_size):
    full = prompt_len // block_size
    if prompt_len % block_size == 0:
        full -= 1  # that block holds the last token, which is always computed
    return max(full, 0) * block_size


def smallest_capacity(requests, target):
    """The search the exercise asks for: every capacity from one block up."""
    from pagedkv_lab.course.experiments import prefix_cache_run

    blocks = 0
    while True:
        blocks += 1
        try:
            if prefix_cache_run(requests, 16 * blocks)["hit_rate"] >= target:
                return blocks
        except ValueError:  # a request does not fit: no hit rate at all
            pass


def swap_bytes(num_tokens, bytes_per_token, block_size):
    moved = _ceil_div(num_tokens, block_size) * block_size * bytes_per_token
    return moved + moved  # out, then back in


def recompute_cheaper(prefill_tokens_per_s, bytes_per_token, bandwidth):
    # recompute 1/rate < swap 2B/W, multiplied out
    return bandwidth < 2 * bytes_per_token * prefill_tokens_per_s


def crossover_tokens(
    rate_flops, params, layers, width, bytes_per_token, bandwidth, fixed_s
):
    """The root of recompute(L) - swap(L) = a L^2 + b L - 2c in closed form,
    then the whole numbers around it checked against the costs themselves."""

    def swap_cheaper(n):
        recompute = (2 * params * n + 2 * layers * width * n * n) / rate_flops
        return 2 * bytes_per_token * n / bandwidth + 2 * fixed_s < recompute

    a = 2 * layers * width / rate_flops
    b = 2 * params / rate_flops - 2 * bytes_per_token / bandwidth
    root = (-b + math.sqrt(b * b + 8 * a * fixed_s)) / (2 * a)
    n = max(1, math.floor(root) - 2)
    while n > 1 and swap_cheaper(n - 1):
        n -= 1
    while not swap_cheaper(n):
        n += 1
        if n >= 1_000_000:
            return None
    return n


def decode_bytes(batch, context, num_layers, num_kv_heads, head_dim, dtype_bytes):
    per_token = 2 * num_layers * num_kv_heads * head_dim * dtype_bytes
    return batch * context * per_token


def normalized_latency(arrivals, finishes, output_lens):
    return statistics.mean(
        (f - a) / n for a, f, n in zip(arrivals, finishes, output_lens)
    )


def prefix_saving(shared_len, private_len, n, block_size):
    """Counted by the library's `shared_prefix_memory` on n real requests."""
    from pagedkv_lab.course.experiments import shared_prefix_memory
    from pagedkv_lab.sim.workloads import TokenRequest

    prefix = list(range(1, shared_len + 1))
    requests = []
    for i in range(n):  # private tokens unlike any other request's
        private = [10**6 + i * private_len + t for t in range(private_len)]
        requests.append(TokenRequest(prefix + private, []))
    return shared_prefix_memory(requests, block_size)["saved"]


def _saving_counted(shared_len, private_len, n, block_size):
    """The same saving counted by hand (fast, for the search below)."""
    per_request = _ceil_div(shared_len + private_len, block_size)
    stored_once = shared_len // block_size
    with_cache = stored_once + n * (per_request - stored_once)
    return 1 - with_cache / (n * per_request)


def max_private_len(shared_len, n, target, block_size):
    length = 0
    while _saving_counted(shared_len, length + 1, n, block_size) >= target:
        length += 1
    return length


def which_share(claimed_bytes, config, dtype_bytes):
    heads = config.num_attention_heads
    kv_heads = config.num_key_value_heads or heads
    head_dim = config.head_dim or config.hidden_size // heads
    keys = kv_heads * head_dim * dtype_bytes  # one layer's keys
    for name, share in [
        ("whole model", 2 * keys * config.num_hidden_layers),
        ("keys only", keys * config.num_hidden_layers),
        ("one layer", 2 * keys),
        ("one layer, keys only", keys),
    ]:
        if share == claimed_bytes:
            return name
    return None


INDEPENDENT = {name: globals()[name] for name in CHAPTER}


# Plausible wrong answers: each must fail its check ----------------------------------


def _keys_only_bytes_per_token(name):
    """Chapter 00: counts the keys and forgets the values."""
    from pagedkv_lab.models import load_model

    model, tokenizer = load_model(name)
    ids = tokenizer("The cache", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=3, return_dict_in_generate=True)
    cache = out.past_key_values
    keys = sum(lay.keys.numel() * lay.keys.element_size() for lay in cache.layers)
    return keys // cache.get_seq_length()


def _unclamped_longest(config, gpu_bytes, kv_dtype_bytes):
    """Chapter 01: a negative budget gives a negative length."""
    from pagedkv_lab.kvmath import kv_budget

    return kv_budget(config, gpu_bytes) // bytes_per_token(config, kv_dtype_bytes)


def _unchained_keys(tokens, block_size):
    """Chapter 08: each block hashed on its own, without its parent's key."""
    from pagedkv_lab.engine.prefix_cache import chained_hash

    starts = range(0, len(tokens) - block_size + 1, block_size)
    return [chained_hash(None, tuple(tokens[i : i + block_size])) for i in starts]


def _pool_shares_over_all_steps(extra_slots):
    """Chapter 02: averages over every step, not only those with a queue."""
    from pagedkv_lab.sim.contiguous import ContiguousPool
    from pagedkv_lab.sim.workloads import chat_workload, simulate

    w1 = chat_workload(400, seed=0, arrival_rate=1.0, max_model_len=2048)
    pool = ContiguousPool(16 * 2048 + extra_slots, 2048, policy="max")
    shares = simulate(w1, pool).fractions(loaded_only=False)
    return shares["external"], shares["free"]


def _preemptions_all_at_once(watermark):
    """Chapter 03: forgets the arrival rate, so every request arrives at once."""
    from pagedkv_lab.sim.paged import PagedPool
    from pagedkv_lab.sim.workloads import chat_workload, simulate

    trace = chat_workload(150, seed=0)
    return simulate(trace, PagedPool(512, 16, 2048, watermark=watermark)).preemptions


def _capacity_from_five_requests(requests, target):
    """Chapter 08, the old reference's search: it starts at 5 x the largest
    request's blocks ("room for itself and four running ones"), an unstated
    floor above every answer, so it returns the floor."""
    from pagedkv_lab.course.experiments import prefix_cache_run

    blocks = 5 * max(_ceil_div(len(r.prompt + r.output), 16) for r in requests)
    while prefix_cache_run(requests, blocks * 16)["hit_rate"] < target:
        blocks += 1
    return blocks


def _first_capacity_that_runs(requests, target):
    """Chapter 08: returns the first capacity that serves every request,
    whatever its hit rate."""
    from pagedkv_lab.course.experiments import prefix_cache_run

    blocks = 1
    while True:
        try:
            prefix_cache_run(requests, blocks * 16)
            return blocks
        except ValueError:
            blocks += 1


def _capacity_in_tokens(requests, target):
    """Chapter 08: the right search, answered in tokens instead of blocks."""
    return 16 * smallest_capacity(requests, target)


def _crossover_with(swap_trips=2, fixed_trips=2, off_by_one=0):
    """Chapter 09: a linear-scan crossover with one detail changed."""

    def crossover(rate, params, layers, width, bpt, bw, fixed):
        for n in range(1, 1_000_000):
            recompute = (2 * params * n + 2 * layers * width * n * n) / rate
            if swap_trips * bpt * n / bw + fixed_trips * fixed < recompute:
                return n - off_by_one
        return None

    return crossover


WRONG = [
    (
        "gqa_group",
        "a missing num_key_value_heads taken as 1 KV head",
        lambda c: c.num_attention_heads // (c.num_key_value_heads or 1),
    ),
    ("cache_bytes_per_token", "keys only", _keys_only_bytes_per_token),
    (
        "bytes_per_token",
        "query heads instead of KV heads",
        lambda c, b: (
            2
            * c.num_hidden_layers
            * c.num_attention_heads
            * (c.hidden_size // c.num_attention_heads)
            * b
        ),
    ),
    (
        "bytes_per_token",
        "ignores an explicit head_dim",
        lambda c, b: (
            2
            * c.num_hidden_layers
            * (c.num_key_value_heads or c.num_attention_heads)
            * (c.hidden_size // c.num_attention_heads)
            * b
        ),
    ),
    (
        "max_requests",
        "negative when the weights do not fit",
        lambda m, b, n: m // (b * n),
    ),
    ("longest_request", "negative when the weights do not fit", _unclamped_longest),
    (
        "longest_request",
        "the cache's bytes at fp16 whatever kv_dtype_bytes",
        lambda c, g, b: longest_request(c, g, 2),
    ),
    (
        "best_fit",
        "first fit",
        lambda gaps, n: next((s for s, g in gaps if g >= n), None),
    ),
    (
        "best_fit",
        "ties to the later gap",
        lambda gaps, n: max(((-g, s) for s, g in gaps if g >= n), default=(None, None))[
            1
        ],
    ),
    ("external_fragmentation", "every free slot", lambda gaps, need: sum(gaps)),
    (
        "external_fragmentation",
        "a shortage counted as fragmentation",
        lambda gaps, need: sum(gaps) if max(gaps, default=0) < need else 0,
    ),
    ("pool_shares", "averaged over every step", _pool_shares_over_all_steps),
    ("blocks_for", "floor division", lambda n, bs: n // bs),
    ("slot_of", "block number plus offset", lambda t, bs, p: t[p // bs] + p % bs),
    ("tail_waste", "a full block wastes one", lambda n, bs: bs - n % bs),
    ("preemptions", "no arrival rate", _preemptions_all_at_once),
    ("merge_two", "the average", lambda oa, la, ob, lb: (oa + ob) / 2),
    (
        "merge_two",
        "right on full parts, but an empty part's NaN leaks through",
        lambda oa, la, ob, lb: (
            torch.exp(la - torch.logaddexp(la, lb)) * oa
            + torch.exp(lb - torch.logaddexp(la, lb)) * ob
        ),
    ),
    ("visible_keys", "counts from the first new query", lambda c, q, j: j + 1),
    (
        "decode_flops_per_byte",
        "forgets that the cache supplies a value as well as a key",
        lambda g, d, b: 4 * g / b,
    ),
    ("key_loads", "the L^2 / 2T estimate", lambda n, t: n * n // (2 * t)),
    (
        "tiles_in_flight",
        "rounds down",
        lambda bw, lat, tile: int(bw * lat / tile),
    ),
    (
        "program_of",
        "forgets the one spare program each earlier sequence adds",
        lambda q, bq, seq, j: (sum(q[:seq]) + j) // bq,
    ),
    (
        "prefill_flops_per_byte",
        "counts K and V only",
        lambda s, n, h, kv, d, b: (
            4 * d * h * s * n * (n + 1) / 2 / (s * n * 2 * kv * d * b)
        ),
    ),
    ("positions_for", "restarts at 0", lambda c, n: list(range(n))),
    ("logits_rows", "each sequence's own last index", lambda q: [n - 1 for n in q]),
    (
        "blocks_held",
        "gives the last sampled token K/V too",
        lambda lens, new, bs: sum(_ceil_div(p + new, bs) for p in lens),
    ),
    ("fused_rows", "three times the query rows", lambda h, kv, d: 3 * h * d),
    (
        "graph_bucket",
        "powers of two only",
        lambda b, m: next(
            (s for s in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= s <= m), None
        ),
    ),
    ("static_steps", "one batch for all", lambda lens, b: max(lens)),
    (
        "continuous_steps",
        "perfect packing",
        lambda lens, b: _ceil_div(sum(lens), b),
    ),
    (
        "continuous_steps",
        "static batching",
        lambda lens, b: static_steps(lens, b),
    ),
    ("demo_preemptions", "the watermark ignored", lambda w: demo_preemptions(0.0)),
    (
        "blocks_after_fork",
        "the partial prompt block shared too",
        lambda p, n, k, bs: _ceil_div(p, bs) + n * _ceil_div(k, bs),
    ),
    (
        "copies_after_fork",
        "the last holder copies too",
        lambda p, n, bs: n if p % bs else 0,
    ),
    (
        "unshared_blocks",
        "one sequence's blocks",
        lambda p, n, k, bs: _ceil_div(p + k, bs),
    ),
    ("block_keys", "keys not chained", _unchained_keys),
    (
        "max_cached_tokens",
        "caches the last token's block too",
        lambda p, bs: p // bs * bs,
    ),
    (
        "smallest_capacity",
        "starts at 5 x the largest request",
        _capacity_from_five_requests,
    ),
    ("smallest_capacity", "the first capacity that runs", _first_capacity_that_runs),
    ("smallest_capacity", "answers in tokens", _capacity_in_tokens),
    ("swap_bytes", "exact bytes, one way", lambda n, b, bs: n * b),
    ("swap_bytes", "whole blocks, one way", lambda n, b, bs: _ceil_div(n, bs) * bs * b),
    (
        "recompute_cheaper",
        "forgets the swap back in",
        lambda r, b, w: 1 / r < b / w,
    ),
    (
        "recompute_cheaper",
        "counts K and V twice (bytes_per_token already holds both)",
        lambda r, b, w: 1 / r < 4 * b / w,
    ),
    (
        "recompute_cheaper",
        "a tie counted as cheaper",
        lambda r, b, w: w <= 2 * b * r,
    ),
    ("recompute_cheaper", "always recompute", lambda r, b, w: True),
    ("crossover_tokens", "one-way swap", _crossover_with(swap_trips=1, fixed_trips=1)),
    ("crossover_tokens", "no fixed cost", _crossover_with(fixed_trips=0)),
    (
        "crossover_tokens",
        "the last length where swap is dearer",
        _crossover_with(off_by_one=1),
    ),
    (
        "decode_bytes",
        "keys only",
        lambda bt, c, layers, kv, d, b: bt * c * layers * kv * d * b,
    ),
    (
        "normalized_latency",
        "total latency over total tokens",
        lambda a, f, n: (sum(f) - sum(a)) / sum(n),
    ),
    ("prefix_saving", "tokens, not blocks", lambda s, p, n, bs: s / (s + p)),
    (
        "prefix_saving",
        "the partial prefix block shared too",
        lambda s, p, n, bs: _saving_counted(bs * _ceil_div(s, bs), p, n, bs),
    ),
    (
        "max_private_len",
        "the first length that misses",
        lambda s, n, t, bs: max_private_len(s, n, t, bs) + 1,
    ),
    (
        "which_share",
        "query heads instead of KV heads",
        lambda claim, c, b: which_share(
            claim, type(c)(**{**vars(c), "num_key_value_heads": None}), b
        ),
    ),
]


# The tests -------------------------------------------------------------------------


def test_every_check_is_covered():
    checks = {n[len("check_") :] for n in dir(exercises) if n.startswith("check_")}
    assert checks == set(CHAPTER) == set(INDEPENDENT)
    assert checks == {name for name, _, _ in WRONG}


@pytest.mark.parametrize("name", list(CHAPTER))
def test_published_solution_passes(name, capsys):
    assert _check(name)(getattr(_solution(CHAPTER[name]), name)) is True
    assert "✗" not in capsys.readouterr().out


@pytest.mark.parametrize("name", list(CHAPTER))
def test_solution_from_the_wording_passes(name, capsys):
    """A solution written here from the exercise's text, not from solutions/."""
    assert _check(name)(INDEPENDENT[name]) is True
    assert "✗" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "name,wrong", [(name, fn) for name, _, fn in WRONG], ids=[w[1] for w in WRONG]
)
def test_wrong_answer_fails(name, wrong, capsys):
    exercises._MISSES.pop(name, None)
    assert _check(name)(wrong) is False
    out = capsys.readouterr().out
    assert "Hint:" in out and "expected" not in out


def test_08_3_the_search_the_text_asks_for():
    """Exercise 08.3's answers are those of a search from one block up: the
    capacity before each answer misses the target, or cannot serve a request."""
    from pagedkv_lab.course.experiments import prefix_cache_run
    from pagedkv_lab.sim.workloads import multi_turn_workload, system_prompt_workload

    chat = multi_turn_workload(4, 3, system_len=32, seed=1)
    system = system_prompt_workload(12, system_len=96, seed=2)
    for requests, target, blocks in [
        (chat, 0.5, 69),
        (chat, 0.6, 79),
        (system, 0.5, 16),
    ]:
        assert prefix_cache_run(requests, blocks * 16)["hit_rate"] >= target
        try:
            below = prefix_cache_run(requests, (blocks - 1) * 16)["hit_rate"]
        except ValueError:
            below = None  # the largest request does not fit
        assert below is None or below < target
    largest = max(_ceil_div(len(r.prompt + r.output), 16) for r in system)
    assert largest == 16  # the system-prompt answer is the first capacity that runs


def test_unattempted_exercise_is_reported_not_crashed(capsys):
    def todo(*args):
        raise NotImplementedError

    for name in CHAPTER:
        assert _check(name)(todo) is False
        out = capsys.readouterr().out
        assert "not attempted yet" in out and "Hint:" not in out


def _cheap_wrong(*args):
    return -7


@pytest.mark.parametrize("name", list(CHAPTER))
def test_hints_come_in_two_steps_and_never_show_the_answer(name, capsys, monkeypatch):
    """Every check: the first miss prints a nudge, the second the nudge and a
    formula; a failed case shows what the function returned, never the
    expected value."""
    labels = []
    run = exercises._run

    def recording_run(name_, fn, cases, hint, same=None):
        labels.extend(label for label, _, _ in cases)
        return run(name_, fn, cases, hint, same)

    monkeypatch.setattr(exercises, "_run", recording_run)
    exercises._MISSES.pop(name, None)
    assert _check(name)(_cheap_wrong) is False
    first = capsys.readouterr().out
    assert _check(name)(_cheap_wrong) is False
    second = capsys.readouterr().out
    nudge = first.split("Hint: ")[1].strip()
    both = second.split("Hint: ")[1].strip()
    assert both.startswith(nudge) and len(both) > len(nudge) + 20
    wrongs = ("-7", "-7.0")  # as returned, or as a check's wrapper casts it
    for out in (first, second):
        failed = [line for line in out.splitlines() if line.startswith("  ✗ ")]
        assert failed and "expected" not in out
        for line in failed:
            label, _, got = line[len("  ✗ ") :].rpartition(": got ")
            assert label in labels, line
            # what the function returned, or the error its result raised
            assert got in wrongs or got.startswith(("\"TypeError", "'TypeError")), line


def test_the_visible_keys_hint_reveals_no_answer(capsys):
    """A check's nudge names no formula, and its output none of the answers."""
    exercises._MISSES.pop("visible_keys", None)

    def wrong(ctx, qlen, j):
        return -1 - j

    assert exercises.check_visible_keys(wrong) is False
    first = capsys.readouterr().out
    assert exercises.check_visible_keys(wrong) is False
    second = capsys.readouterr().out
    assert "got -1" in first
    for answer in (" 1", " 10", " 37", " 24"):  # the cases' answers, never shown
        assert answer not in first.split("Hint:")[0].split("\n", 1)[1]
    formula = "context_len - query_len + j"
    assert formula not in first and formula in second
