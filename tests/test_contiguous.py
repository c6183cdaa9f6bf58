import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedkv_lab.models import load_model
from pagedkv_lab.sim.contiguous import (
    BuddyAllocator,
    ContiguousAllocator,
    ContiguousKVCache,
    ContiguousPool,
    GrowingPool,
    OutOfMemoryError,
    max_reservation_share,
    next_pow2,
    pool_segments,
    reservation,
)
from pagedkv_lab.sim.workloads import Request, chat_workload, simulate, uniform_workload


def test_first_fit_and_best_fit_choose_different_gaps():
    for fit, start, gaps_after in [("first", 0, [7, 4]), ("best", 16, [10, 1])]:
        a = ContiguousAllocator(20, fit=fit)
        a.allocate("x", 10)
        a.allocate("y", 4)
        a.allocate("z", 2)
        a.free("x")  # gaps: [0, 10) and [16, 20)
        assert a.allocate("w", 3).start == start
        assert [g.length for g in a.gaps()] == gaps_after


def test_freed_neighbours_merge_into_one_gap():
    a = ContiguousAllocator(12)
    for owner in "abc":
        a.allocate(owner, 4)
    a.free("a")
    a.free("b")
    assert [(g.start, g.length) for g in a.gaps()] == [(0, 8)]
    assert a.can_allocate(8) and not a.can_allocate(9)


def test_misuse_raises_clear_errors_and_disturbs_nothing():
    a = ContiguousAllocator(10)
    a.allocate("a", 6)
    with pytest.raises(ValueError, match="the pool has 10"):
        a.allocate("big", 11)
    with pytest.raises(ValueError, match="already holds"):
        a.allocate("a", 1)
    with pytest.raises(ValueError, match="at least one slot"):
        a.allocate("zero", 0)
    with pytest.raises(OutOfMemoryError, match="largest gap is 4"):
        a.allocate("b", 5)
    with pytest.raises(KeyError, match="never allocated, or already freed"):
        a.free("nobody")
    a.free("a")
    with pytest.raises(KeyError):
        a.free("a")  # double free
    assert a.num_free == 10 and a.regions == {}
    with pytest.raises(ValueError):
        ContiguousAllocator(0)
    with pytest.raises(ValueError):
        ContiguousAllocator(5, fit="worst")


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate/free sequences keep the pool consistent."""

    def __init__(self):
        super().__init__()
        self.alloc = ContiguousAllocator(64, fit="best")
        self.next_owner = 0

    @rule(n=st.integers(1, 64))
    def allocate(self, n):
        if self.alloc.can_allocate(n):
            self.alloc.allocate(self.next_owner, n)
        else:
            with pytest.raises(OutOfMemoryError):
                self.alloc.allocate(self.next_owner, n)
        self.next_owner += 1

    @precondition(lambda self: self.alloc.regions)
    @rule(data=st.data())
    def free(self, data):
        owner = data.draw(st.sampled_from(sorted(self.alloc.regions)))
        self.alloc.free(owner)

    @invariant()
    def regions_do_not_overlap_and_gaps_fill_the_rest(self):
        spans = sorted((r.start, r.end) for r in self.alloc.regions.values())
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert end <= start
        assert all(0 <= s < e <= 64 for s, e in spans)
        used = sum(e - s for s, e in spans)
        gaps = self.alloc.gaps()
        assert used + sum(g.length for g in gaps) == 64 == used + self.alloc.num_free
        assert self.alloc.largest_gap == max((g.length for g in gaps), default=0)


TestAllocatorMachine = AllocatorMachine.TestCase


@given(
    st.lists(
        st.tuples(st.integers(1, 300), st.integers(1, 300), st.floats(0, 50)),
        min_size=1,
        max_size=25,
    ),
    st.sampled_from(["max", "pow2", "oracle"]),
    st.sampled_from(["first", "best"]),
)
def test_pool_accounting_sums_to_capacity_and_everything_is_freed(specs, policy, fit):
    reqs = [Request(i, t, p, o) for i, (p, o, t) in enumerate(specs)]
    pool = ContiguousPool(4 * 600 + 123, 600, policy=policy, fit=fit)
    result = simulate(reqs, pool)
    total = sum(result.usage.values())
    assert (total == pool.capacity).all()
    assert set(result.finish_step) == {r.id for r in reqs}
    assert pool.allocator.regions == {} and pool.allocator.num_free == pool.capacity
    for r in reqs:  # a request runs output_len steps once started
        assert result.finish_step[r.id] - result.start_step[r.id] == r.output_len - 1


def test_simulation_is_deterministic():
    reqs = chat_workload(80, seed=3, arrival_rate=0.5)
    a = simulate(reqs, ContiguousPool(8 * 2048, 2048, policy="pow2"))
    b = simulate(
        chat_workload(80, seed=3, arrival_rate=0.5),
        ContiguousPool(8 * 2048, 2048, policy="pow2"),
    )
    assert a.finish_step == b.finish_step
    assert all((a.usage[k] == b.usage[k]).all() for k in a.usage)


def test_max_reservation_wastes_most_of_the_pool_and_oracle_has_no_internal_waste():
    reqs = chat_workload(150, seed=0, arrival_rate=1.0)
    f_max = simulate(reqs, ContiguousPool(8 * 2048, 2048, policy="max")).fractions()
    f_oracle = simulate(
        reqs, ContiguousPool(8 * 2048, 2048, policy="oracle")
    ).fractions()
    assert f_max["used"] < 0.35 and f_max["internal"] > 0.4 and f_max["external"] == 0
    assert f_oracle["internal"] == 0 and f_oracle["used"] > f_max["used"]


def test_reservation_policies():
    r = Request(0, 0.0, 100, 200)
    assert reservation(r, "max", 2048) == 2048
    # §6.1: the output is rounded up to a power of two, the prompt added on top.
    assert reservation(r, "pow2", 2048) == 100 + 256
    assert reservation(Request(1, 0.0, 40, 25), "pow2", 2048) == 40 + 32
    assert reservation(Request(2, 0.0, 1600, 300), "pow2", 2048) == 2048  # capped
    assert reservation(r, "oracle", 2048) == 300
    with pytest.raises(ValueError, match="unknown reservation policy"):
        reservation(r, "guess", 2048)
    with pytest.raises(ValueError):
        ContiguousPool(1000, 2048)


def test_request_longer_than_max_model_len_is_rejected():
    pool = ContiguousPool(4096, 1024)
    with pytest.raises(ValueError, match="more than max_model_len"):
        simulate([Request(0, 0.0, 1000, 100)], pool)


def test_segments_mark_external_only_when_fragmentation_blocks():
    layout = [(0, 10, 1, 8, 10), (20, 10, 2, 10, 10)]  # gaps [10,20) and [30,40)
    held = {1: 5, 2: 10}
    segs = pool_segments(layout, held, 40, waiting_need=15)
    assert ("external" in {s for _, _, s in segs}) and sum(n for _, n, _ in segs) == 40
    assert (
        (0, 5, "used") in segs
        and (5, 3, "reserved") in segs
        and (8, 2, "internal") in segs
    )
    assert {s for _, _, s in pool_segments(layout, held, 40, waiting_need=10)} == {
        "used",
        "reserved",
        "internal",
        "free",
    }
    assert "external" not in {
        s for _, _, s in pool_segments(layout, held, 40, waiting_need=25)
    }  # shortage


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_tensor_cache_generates_like_transformers(name):
    model, tok = load_model(name)
    kv = ContiguousKVCache(model.config, num_slots=3 * 64)
    for i, n_prompt in enumerate([1, 15, 40]):
        ids = torch.randint(
            3, 259, (1, n_prompt), generator=torch.Generator().manual_seed(i)
        )
        kwargs = dict(
            attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False
        )
        ref = model.generate(ids, **kwargs)
        out = model.generate(ids, past_key_values=kv.reserve(i, 64), **kwargs)
        assert torch.equal(ref, out)
        assert kv.tokens_held(i) == n_prompt + 9
    assert kv.bytes_reserved == kv.bytes_total
    assert kv.bytes_used == sum(kv.tokens_held(i) for i in range(3)) * kv.bytes_per_slot


def test_tensor_cache_overflow_names_the_request_and_keeps_others():
    model, tok = load_model("tiny-llama")
    kv = ContiguousKVCache(model.config, num_slots=64)
    ids = torch.tensor([[1, 5, 6, 7]])
    model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=3,
        past_key_values=kv.reserve("a", 32),
    )
    snapshot = kv.k.clone()
    with pytest.raises(OutOfMemoryError, match="'b' outgrew its reservation of 5"):
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=3,
            past_key_values=kv.reserve("b", 5),
        )
    assert torch.equal(kv.k[:, :, :32], snapshot[:, :, :32])
    assert kv.tokens_held("a") == 6


def test_uniform_workload_bounds():
    reqs = uniform_workload(200, seed=1, low=100, high=1024)
    assert all(
        100 <= r.prompt_len <= 1024 and 100 <= r.output_len <= 1024 for r in reqs
    )


def test_segments_split_the_allocators_rounding():
    # A 16-slot block for a request that asked 12 and will reach 9, holding 4.
    segs = pool_segments([(0, 16, 1, 9, 12)], {1: 4}, 16)
    assert segs == [
        (0, 4, "used"),
        (4, 5, "reserved"),
        (9, 3, "internal"),
        (12, 4, "rounding"),
    ]
    assert pool_segments([(0, 8, 1, 8, 8)], {1: 8}, 16, blocked=True)[-1] == (
        8,
        8,
        "external",
    )


def test_next_pow2():
    assert [next_pow2(n) for n in (1, 2, 3, 4, 5, 1000, 1024, 1025)] == [
        1,
        2,
        4,
        4,
        8,
        1024,
        1024,
        2048,
    ]


def test_buddy_allocator_splits_merges_and_rounds_up():
    a = BuddyAllocator(13)  # 8 + 4 + 1
    assert a.allocate("A", 3) == a.regions["A"] and a.regions["A"].length == 4
    assert a.regions["A"].start == 8  # the free block of 4, no split
    b = a.allocate("B", 2)
    assert (b.start, b.length) == (0, 2)  # the block of 8 split twice
    assert a.largest_gap == 4 and a.num_free == 13 - 6
    a.free("B")
    assert a.largest_gap == 8  # merged back into the initial block
    with pytest.raises(OutOfMemoryError):
        a.allocate("C", 9)
    with pytest.raises(KeyError):
        a.free("B")


def test_free_neighbours_that_are_not_buddies_do_not_merge():
    a = BuddyAllocator(16)
    for owner in "ABCD":
        a.allocate(owner, 4)
    a.free("B")
    a.free("C")
    assert [(g.start, g.length) for g in a.gaps()] == [(4, 8)]
    assert not a.can_allocate(8) and a.can_allocate(4)
    a.free("A")
    assert a.can_allocate(8)


class BuddyMachine(RuleBasedStateMachine):
    """Random allocate/free sequences keep a buddy pool consistent: blocks are
    powers of two aligned to their size, they never overlap, free blocks and
    regions tile the pool, and no two free buddies are left unmerged."""

    def __init__(self):
        super().__init__()
        self.alloc = BuddyAllocator(100)
        self.next_owner = 0

    @rule(n=st.integers(1, 70))
    def allocate(self, n):
        if self.alloc.can_allocate(n):
            region = self.alloc.allocate(self.next_owner, n)
            assert region.length == next_pow2(n)
        else:
            with pytest.raises(OutOfMemoryError):
                self.alloc.allocate(self.next_owner, n)
        self.next_owner += 1

    @precondition(lambda self: self.alloc.regions)
    @rule(data=st.data())
    def free(self, data):
        self.alloc.free(data.draw(st.sampled_from(sorted(self.alloc.regions))))

    @invariant()
    def blocks_tile_the_pool(self):
        a = self.alloc
        spans = [(r.start, r.length) for r in a.regions.values()]
        spans += [(s, 1 << k) for k, starts in a.free_blocks.items() for s in starts]
        covered = sorted(spans)
        cursor = 0
        for start, length in covered:
            assert start == cursor and start % length == 0
            cursor += length
        assert cursor == 100
        for k, starts in a.free_blocks.items():
            for s in starts:
                if a.initial.get(s) != k:
                    assert s ^ (1 << k) not in starts  # free buddies merge


TestBuddyMachine = BuddyMachine.TestCase


@given(
    st.lists(
        st.tuples(st.integers(1, 300), st.integers(1, 300), st.floats(0, 50)),
        min_size=1,
        max_size=25,
    ),
    st.sampled_from(["max", "pow2", "oracle"]),
)
def test_buddy_pool_accounting_sums_to_capacity(specs, policy):
    reqs = [Request(i, t, p, o) for i, (p, o, t) in enumerate(specs)]
    pool = ContiguousPool(4 * 600 + 123, 600, policy=policy, fit="buddy")
    result = simulate(reqs, pool, snapshot_every=7)
    assert (sum(result.usage.values()) == pool.capacity).all()
    assert pool.allocator.regions == {} and pool.allocator.largest_gap == 2048
    for snap in result.snapshots:  # the viewer's segments tile the pool
        assert sum(n for _, n, _ in snap["segments"]) == pool.capacity


def test_max_reservation_share_matches_the_simulator():
    reqs = chat_workload(300, seed=4, arrival_rate=1.0)
    res = simulate(
        reqs, ContiguousPool(7 * 2048 + 500, 2048, policy="max", fit="buddy")
    )
    closed = max_reservation_share(reqs, 2048, 7 * 2048 + 500)
    assert abs(closed - res.fractions()["used"]) < 0.02  # a finite trace
    assert abs(res.fractions()["free"] - 500 / (7 * 2048 + 500)) < 1e-9


def test_growing_pool_copies_preempts_and_reports_it():
    reqs = chat_workload(120, seed=0, arrival_rate=1.0)
    pool = GrowingPool(4 * 2048, 2048)
    res = simulate(reqs, pool)
    assert set(res.finish_step) == {r.id for r in reqs}
    assert res.copied_slots == pool.copied > 0 and pool.moves > 0
    assert res.preemptions > 0 and res.recomputed_tokens > 0
    assert (
        res.costs()["recomputed_per_token"]
        == res.recomputed_tokens / res.generated_tokens
    )
    assert res.steps_with_recompute(100) == res.steps + res.recomputed_tokens / 100


def test_recompute_crossover_is_where_the_charged_step_counts_meet():
    from pagedkv_lab.sim.paged import PagedPool

    reqs = chat_workload(120, seed=0, arrival_rate=1.0)
    paged = simulate(reqs, PagedPool(4 * 2048 // 16, 16, 2048))
    oracle = simulate(reqs, ContiguousPool(4 * 2048, 2048, policy="oracle"))
    assert paged.steps < oracle.steps and paged.recomputed_tokens > 0
    r = paged.recompute_crossover(oracle)
    assert r == oracle.recompute_crossover(paged) and r > 0
    assert paged.steps_with_recompute(r) == pytest.approx(
        oracle.steps_with_recompute(r)
    )
    assert paged.steps_with_recompute(2 * r) < oracle.steps_with_recompute(2 * r)
    assert paged.steps_with_recompute(r / 2) > oracle.steps_with_recompute(r / 2)
    # Fewer steps and no more recompute: faster at every rate, no crossover.
    assert oracle.recompute_crossover(oracle) is None
    # Dearer paged steps move the crossover up.
    r2 = paged.recompute_crossover(oracle, step_cost=1.2)
    assert r2 > r
    costly = paged.steps * 1.2 + paged.recomputed_tokens / r2
    assert costly == pytest.approx(oracle.steps + oracle.recomputed_tokens / r2)
