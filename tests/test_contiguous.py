import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedkv_lab.contiguous import (
    ContiguousAllocator,
    ContiguousKVCache,
    ContiguousPool,
    OutOfMemoryError,
    pool_segments,
    reservation,
)
from pagedkv_lab.models import load_model
from pagedkv_lab.workloads import Request, chat_workload, simulate, uniform_workload


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
    assert reservation(r, "pow2", 2048) == 512
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
    layout = [(0, 10, 1, 8), (20, 10, 2, 10)]  # gaps [10,20) and [30,40)
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
