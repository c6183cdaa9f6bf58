"""Prefix caching: chained keys, verified hits, cached-free blocks in LRU order."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from pagedkv_lab.engine import SamplingParams, Sequence
from pagedkv_lab.llm import LLM
from pagedkv_lab.models import load_model
from pagedkv_lab.prefix_cache import (
    PrefixCachingBlockManager,
    PrefixIndex,
    RadixCache,
    chained_hash,
)

PARAMS = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
MODEL, TOKENIZER = load_model("tiny-llama")


class PrefixCacheMachine(RuleBasedStateMachine):
    """Random admissions, steps and frees over a small pool and alphabet, so
    that prefixes repeat, blocks are shared, freed, hit and evicted. The model
    of the K/V: each slot holds the token ids of the whole prefix up to it."""

    @initialize(
        num_blocks=st.integers(2, 16),
        block_size=st.sampled_from([1, 2, 4]),
        policy=st.sampled_from(["lru", "fifo", "evict-all"]),
        free_order=st.sampled_from(["tail-first", "head-first"]),
        weak_hash=st.booleans(),
        register=st.sampled_from(["computed", "scheduled"]),
    )
    def setup(self, num_blocks, block_size, policy, free_order, weak_hash, register):
        def weak(parent, tokens, extra):
            # Two bits of key: collisions all the time; verification saves us.
            return chained_hash(parent, tokens, extra) & 3

        self.bm = PrefixCachingBlockManager(
            num_blocks,
            block_size,
            policy=policy,
            free_order=free_order,
            hash_fn=weak if weak_hash else chained_hash,
            register=register,
        )
        self.kv: dict[int, list] = {}  # block -> what each slot holds
        self.live: list[Sequence] = []

    def _compute(self, seq, n):
        """What one engine step does for ``seq``: slots, copies, writes, cache."""
        self.bm.append_slots(seq, n)
        for src, dst in self.bm.take_copies():
            self.kv[dst] = list(self.kv[src])
        # Before this step's writes: another request admitted now may read any
        # registered block, so each must already hold all its K/V, or (when
        # blocks are registered at schedule time) be written by this step.
        if self.bm.register == "computed":
            self.every_cached_key_holds_its_tokens()
        bs = self.bm.block_size
        for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            block = seq.block_table.blocks[p // bs]
            assert self.bm.ref_counts[block] == 1, "writing into a shared block"
            self.kv.setdefault(block, [None] * bs)[p % bs] = tuple(
                seq.token_ids[: p + 1]
            )
        seq.num_computed_tokens += n
        self.bm.cache_blocks(seq)

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=12))
    def admit(self, tokens):
        seq = Sequence(tokens, PARAMS)
        cached = self.bm.num_cached_tokens(seq, seq.num_tokens)
        assert cached < seq.num_tokens and cached % self.bm.block_size == 0
        n = seq.num_tokens - cached
        before = self.bm.stats.queries, self.bm.stats.hits
        if self.bm.can_allocate(seq, cached, n):
            self.bm.allocate(seq, cached, n)
            assert seq.num_computed_tokens == cached
            s = self.bm.stats
            assert (s.queries, s.hits) == (before[0] + len(tokens), before[1] + cached)
            assert s.resumed_queries == s.resumed_hits == 0
            self._compute(seq, n)
            self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 2))
    def decode(self, data, token):
        seq = data.draw(st.sampled_from(self.live))
        seq.token_ids.append(token)
        if self.bm.can_append_slots([(seq, 1)]):
            self._compute(seq, 1)
        else:
            seq.token_ids.pop()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.live))
        child = parent.fork()
        self.bm.fork(parent, child)
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.live))
        self.live.remove(seq)
        self.bm.free(seq)

    @invariant()
    def every_sequence_reads_its_own_prefix(self):
        bs = self.bm.block_size
        for seq in self.live:
            for p in range(seq.num_computed_tokens):
                block = seq.block_table.blocks[p // bs]
                assert self.kv[block][p % bs] == tuple(seq.token_ids[: p + 1])

    @invariant()
    def every_cached_key_holds_its_tokens(self):
        bs = self.bm.block_size
        for key, entry in self.bm.by_key.items():
            assert entry.key == key
            held = self.kv.get(entry.block, [None])
            assert None not in held, f"block {entry.block} registered before written"
            assert tuple(h[-1] for h in held) == entry.tokens
            # The block's K/V was computed after exactly one prefix: the one
            # its chain of parents spells.
            assert len({len(h) for h in held}) == bs

    @invariant()
    def referenced_blocks_are_never_free_or_cached_free(self):
        a = self.bm.allocator
        held = {b for s in self.live for b in s.block_table.blocks}
        assert held.isdisjoint(a.free_list) and held.isdisjoint(a.evictable)
        for block, count in enumerate(a.ref_counts):
            assert count == sum(
                b == block for s in self.live for b in s.block_table.blocks
            )
        assert set(a.evictable) <= set(a.cached)
        assert len(held) + self.bm.num_free_blocks == self.bm.num_blocks
        assert self.bm.stats.queries >= self.bm.stats.hits

    def teardown(self):
        for seq in self.live:
            self.bm.free(seq)
        assert self.bm.num_free_blocks == self.bm.num_blocks


TestPrefixCache = PrefixCacheMachine.TestCase
TestPrefixCache.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None
)


def test_hits_are_whole_blocks_and_leave_the_last_token_to_compute():
    bm = PrefixCachingBlockManager(8, 4)
    first = Sequence(list(range(1, 10)), PARAMS)
    bm.allocate(first, 0, 9)
    first.num_computed_tokens = 9
    bm.cache_blocks(first)
    assert len(bm.by_key) == 2  # blocks [1..4], [5..8]; the ninth token's is not full
    same = Sequence(list(range(1, 10)), PARAMS)
    assert bm.num_cached_tokens(same, 9) == 8
    exactly_two_blocks = Sequence(list(range(1, 9)), PARAMS)
    # A fully cached prompt still computes its last token.
    assert bm.num_cached_tokens(exactly_two_blocks, 8) == 4
    shorter = Sequence([1, 2, 3], PARAMS)
    assert bm.num_cached_tokens(shorter, 3) == 0  # shorter than one block: no hit
    other_start = Sequence([9, 2, 3, 4, 5, 6, 7, 8, 9], PARAMS)
    assert bm.num_cached_tokens(other_start, 9) == 0


def _cached(bm, tokens):
    seq = Sequence(tokens, PARAMS)
    bm.allocate(seq, 0, len(tokens))
    seq.num_computed_tokens = len(tokens)
    bm.cache_blocks(seq)
    bm.free(seq)


def own_tokens_only(parent, tokens, extra):
    """The trap: a key that ignores everything before the block."""
    return hash(tokens)


@pytest.mark.parametrize(
    "hash_fn,verify,expected",
    [
        (own_tokens_only, False, 8),  # serves [1 2 3 4]'s second block: wrong K/V
        (own_tokens_only, True, 4),  # the parent check refuses it
        (chained_hash, False, 4),  # the chained key never finds it
        (chained_hash, True, 4),
    ],
)
def test_a_key_without_the_parent_serves_the_wrong_prefix(hash_fn, verify, expected):
    bm = PrefixCachingBlockManager(8, 4, hash_fn=hash_fn, verify=verify)
    _cached(bm, [1, 2, 3, 4, 7, 7, 7, 7, 0])
    _cached(bm, [9, 9, 9, 9, 5, 5, 5, 5, 0])
    asking = Sequence([9, 9, 9, 9, 7, 7, 7, 7, 0], PARAMS)
    assert bm.num_cached_tokens(asking, 9) == expected


def test_lru_evicts_the_least_recently_freed_and_fifo_does_not():
    def run(policy):
        # Four blocks of two tokens: a, b, c cached-free, one block never used.
        bm = PrefixCachingBlockManager(4, 2, policy=policy)
        for tokens in ([1, 1, 9], [2, 2, 9], [3, 3, 9]):
            seq = Sequence(tokens, PARAMS)
            bm.allocate(seq, 0, 2)
            seq.num_computed_tokens = 2
            bm.cache_blocks(seq)
            bm.free(seq)
        # Hit a's block and free it again: a is now the most recently used.
        again = Sequence([1, 1, 9], PARAMS)
        bm.allocate(again, bm.num_cached_tokens(again, 3), 1)
        assert bm.stats.evictions == 0
        bm.free(again)
        # Two blocks needed, one on the free list: one eviction.
        fresh = Sequence([4, 4, 5, 5], PARAMS)
        bm.allocate(fresh, 0, 4)
        return sorted(e.tokens for e in bm.by_key.values())

    assert run("lru") == [(1, 1), (3, 3)]  # b: least recently used
    assert run("fifo") == [(2, 2), (3, 3)]  # a: first registered, though just used


def test_evict_all_drops_every_cached_block_at_once():
    bm = PrefixCachingBlockManager(4, 1, policy="evict-all")
    for t in range(1, 5):
        seq = Sequence([t, 0], PARAMS)
        bm.allocate(seq, 0, 1)
        seq.num_computed_tokens = 1
        bm.cache_blocks(seq)
        bm.free(seq)
    assert len(bm.by_key) == 4
    seq = Sequence([7, 0], PARAMS)
    bm.allocate(seq, 0, 1)
    assert len(bm.by_key) == 0 and bm.stats.evictions == 4


def test_allocation_prefers_never_cached_blocks():
    bm = PrefixCachingBlockManager(4, 2)
    seq = Sequence([1, 2, 3], PARAMS)
    bm.allocate(seq, 0, 2)
    seq.num_computed_tokens = 2
    bm.cache_blocks(seq)
    bm.free(seq)
    other = Sequence([5, 6, 7, 8, 9], PARAMS)
    bm.allocate(other, 0, 5)  # three blocks: the three never-cached ones
    assert len(bm.by_key) == 1 and bm.stats.evictions == 0


def _shared_prompts(seed, n=24, system=21):
    g = torch.Generator().manual_seed(seed)
    head = [1] + torch.randint(3, 259, (system,), generator=g).tolist()
    return [
        head + torch.randint(3, 259, (int(k),), generator=g).tolist()
        for k in torch.randint(1, 12, (n,), generator=g)
    ]


@pytest.mark.parametrize("num_blocks", [400, 40])
def test_greedy_outputs_with_caching_equal_outputs_without(num_blocks):
    prompts = _shared_prompts(0)
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = {}
    for caching in (False, True):
        llm = LLM(
            (MODEL, TOKENIZER),
            block_size=4,
            kv_cache_memory=num_blocks * 4 * 512,
            max_model_len=128,
            max_num_batched_tokens=64,
            enable_prefix_caching=caching,
        )
        outs[caching] = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        assert llm.block_manager.num_free_blocks == num_blocks
    assert outs[True] == outs[False]
    stats = llm.block_manager.stats
    assert 0 < stats.hits < stats.queries


def test_a_cache_salt_separates_requests():
    llm = LLM(
        (MODEL, TOKENIZER),
        block_size=4,
        kv_cache_memory=2**20,
        enable_prefix_caching=True,
    )
    prompt = list(range(1, 30))
    sp = SamplingParams(temperature=0, max_tokens=2)
    llm.generate([prompt], sp, use_tqdm=False)
    hits = llm.block_manager.stats.hits
    rid = llm.add_request(prompt, sp, cache_salt="tenant-b")
    while llm.scheduler.has_unfinished:
        llm.step()
    assert llm.block_manager.stats.hits == hits, "a salted request must not hit"
    assert rid is not None


@settings(max_examples=150, deadline=None)
@given(
    streams=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=20), max_size=12),
    query=st.lists(st.integers(0, 3), max_size=25),
)
def test_radix_matches_equal_a_brute_force_longest_common_prefix(streams, query):
    tree = RadixCache(capacity=10_000)
    for tokens in streams:
        tree.insert(tokens)

    def lcp(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    assert tree.match(query)[0] == max((lcp(t, query) for t in streams), default=0)
    assert tree.size == len(
        {tuple(t[:i]) for t in streams for i in range(1, len(t) + 1)}
    )


def test_radix_evicts_unlocked_leaves_least_recently_used_first():
    tree = RadixCache(capacity=100)
    a = tree.insert([1, 2, 3, 4])
    tree.insert([1, 2, 7, 7])
    tree.insert([5, 5])
    tree.match([1, 2, 7, 7])  # now the most recent
    tree.lock(a)
    assert tree.evict(2) == 2  # [5, 5]: the only unlocked, least recent leaf
    assert tree.match([5, 5])[0] == 0 and tree.match([1, 2, 7, 7])[0] == 4
    assert tree.evict(10) == 2  # [7, 7]; [1, 2, 3, 4] is locked
    assert tree.match([1, 2, 3, 4])[0] == 4
    tree.unlock(a)
    assert tree.evict(10) == 4 and tree.size == 0


def test_a_resumed_requests_lookup_is_counted_apart():
    """vLLM PR #25787: a preempted request re-hitting its own blocks is not a
    prefix-cache hit. A tight pool, prompts with nothing in common: every hit
    is a resumed request's, so `hits` (and `hit_rate`) stay 0."""
    g = torch.Generator().manual_seed(3)
    prompts = [[1] + torch.randint(3, 259, (12,), generator=g).tolist() for _ in range(8)]
    llm = LLM(
        (MODEL, TOKENIZER),
        block_size=4,
        kv_cache_memory=14 * 4 * 512,
        max_model_len=56,
        enable_prefix_caching=True,
    )
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm.generate(prompts, sp, use_tqdm=False)
    s = llm.block_manager.stats
    assert llm.scheduler.num_preemptions > 0 and s.resumed_hits > 0
    assert s.hits == 0 and s.hit_rate == 0
    assert s.queries == sum(len(p) for p in prompts)


def test_a_copy_whose_parent_was_evicted_gives_way_to_a_reachable_one():
    index = PrefixIndex(block_size=4)
    never = lambda block: False  # noqa: E731
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    old, displaced = index.register(Sequence(tokens, PARAMS), [10, 11, 12], never, 9)
    assert [e.block for e in old] == [10, 11] and displaced == []
    index.forget(old[0])  # block 10 evicted: block 11 can never be hit again
    asking = Sequence(tokens, PARAMS)
    assert index.match(asking, 9) == []
    new, displaced = index.register(Sequence(tokens, PARAMS), [20, 21, 22], never, 9)
    assert [e.block for e in new] == [20, 21] and displaced == [old[1]]
    assert [e.block for e in index.match(Sequence(tokens, PARAMS), 9)] == [20, 21]


def test_a_displaced_block_stops_being_cached():
    bm = PrefixCachingBlockManager(8, 2, free_order="head-first")
    first = Sequence([1, 1, 2, 2, 0], PARAMS)
    bm.allocate(first, 0, 5)
    first.num_computed_tokens = 5
    bm.cache_blocks(first)
    a0, a1 = first.block_table.blocks[:2]
    bm.free(first)
    bm.allocator.uncache(a0)  # as if evicted: only the second block is cached
    bm.index.forget(next(e for e in bm.by_key.values() if e.block == a0))
    again = Sequence([1, 1, 2, 2, 0], PARAMS)
    bm.allocate(again, bm.num_cached_tokens(again, 5), 5)
    again.num_computed_tokens = 5
    bm.cache_blocks(again)
    assert a1 not in bm.allocator.cached and a1 in bm.allocator.free_list
    assert bm.num_cached_tokens(Sequence([1, 1, 2, 2, 0], PARAMS), 5) == 4


@pytest.mark.parametrize("register", ["computed", "scheduled"])
def test_schedule_time_registration_shares_within_a_step(register):
    """vLLM v1 caches full blocks when it schedules the step that writes them
    (`KVCacheManager.allocate_slots`): requests admitted in the same step hit
    them. Outputs must not change."""
    prompts = _shared_prompts(1, n=12, system=31)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = LLM((MODEL, TOKENIZER), block_size=4, kv_cache_memory=2**20)
    expected = [o.token_ids for o in plain.generate(prompts, sp, use_tqdm=False)]
    bm = PrefixCachingBlockManager(2**20 // (4 * 512), 4, register=register)
    llm = LLM((MODEL, TOKENIZER), block_size=4, kv_cache_memory=2**20, block_manager=bm)
    assert [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == expected
    # All twelve are admitted in the first step.
    if register == "computed":
        assert bm.stats.hits == 0
    else:
        assert bm.stats.hits == 11 * 32  # the 32-token prefix, for all but the first


def test_register_must_be_a_known_moment():
    with pytest.raises(ValueError, match="register"):
        PrefixCachingBlockManager(4, 2, register="allocated")


@settings(max_examples=200, deadline=None)
@given(
    streams=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=8), max_size=30),
    capacity=st.integers(1, 20),
    data=st.data(),
)
def test_radix_cache_never_holds_more_than_its_capacity(streams, capacity, data):
    cache, held = RadixCache(capacity), []
    for tokens in streams:
        node = cache.insert(tokens)
        assert cache.size <= capacity
        if node is None:
            # Only locked prefixes are left, and they leave no room.
            locked = sum(len(n.tokens) for n in cache._nodes() if n.lock)
            assert locked + len(tokens) > capacity
            continue
        assert cache.match(tokens)[0] == len(tokens)
        if data.draw(st.booleans()):
            cache.lock(node)
            held.append(node)
        if held and data.draw(st.booleans()):
            cache.unlock(held.pop(0))
