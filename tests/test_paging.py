import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedkv_lab.engine.block_manager import BlockAllocator, OutOfBlocksError
from pagedkv_lab.sim.contiguous import ContiguousPool
from pagedkv_lab.sim.paged import (
    BlockTable,
    PagedPool,
    block_table_tensor,
    slot_mapping,
)
from pagedkv_lab.sim.workloads import Request, chat_workload, simulate


def test_free_list_is_lifo_and_errors_are_clear():
    a = BlockAllocator(3, 4)
    assert [a.allocate(), a.allocate()] == [0, 1]
    a.free(0)
    assert a.allocate() == 0  # the block freed last comes back first
    with pytest.raises(ValueError, match="not allocated"):
        a.free(2)
    with pytest.raises(ValueError, match="numbered 0..2"):
        a.free(3)
    a.allocate()
    with pytest.raises(OutOfBlocksError, match="all 3 blocks"):
        a.allocate()
    with pytest.raises(ValueError):
        BlockAllocator(0, 16)


def test_ref_counts_free_a_block_only_when_the_last_holder_frees_it():
    a = BlockAllocator(2, 4)
    b = a.allocate()
    a.incref(b)
    a.free(b)
    assert a.num_free == 1 and a.ref_counts[b] == 1
    a.free(b)
    assert a.num_free == 2
    with pytest.raises(ValueError, match="already freed"):
        a.free(b)
    with pytest.raises(ValueError, match="cannot share"):
        a.incref(b)


@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("length", [1, 2, 15, 16, 17, 33, 48])
def test_slots_at_block_boundaries(block_size, length):
    a = BlockAllocator(128, block_size)
    other, table = BlockTable(a), BlockTable(a)
    for _ in range(
        length
    ):  # interleave with another sequence so blocks are not contiguous
        other.append(1)
        table.append(1)
    assert len(table.blocks) == -(-length // block_size)
    slots = [table.slot(p) for p in range(length)]
    assert slots == slot_mapping([table], [0]).tolist()
    for p, s in enumerate(slots):
        assert (
            s // block_size == table.blocks[p // block_size]
            and s % block_size == p % block_size
        )
    assert not set(slots) & set(slot_mapping([other], [0]).tolist())
    assert slot_mapping([table, other], [length - 1, length - 1]).tolist() == [
        slots[-1],
        other.slot(length - 1),
    ]
    with pytest.raises(IndexError):
        table.slot(length)


def test_append_is_all_or_nothing():
    a = BlockAllocator(3, 4)
    t = BlockTable(a)
    t.append(9)  # 3 blocks
    u = BlockTable(a)
    with pytest.raises(OutOfBlocksError):
        u.append(1)
    assert u.blocks == [] and u.num_tokens == 0 and a.num_free == 0
    t.append(3)  # fills the last block, no new one needed
    assert t.num_tokens == 12 and not t.can_append(1)
    t.free()
    assert a.num_free == 3 and t.blocks == []


def test_block_table_tensor_pads():
    a = BlockAllocator(8, 2)
    t1, t2 = BlockTable(a), BlockTable(a)
    t1.append(5)
    t2.append(1)
    bt = block_table_tensor([t1, t2])
    assert bt.dtype == torch.int32 and bt.tolist() == [t1.blocks, t2.blocks + [-1, -1]]
    assert block_table_tensor([]).shape == (0, 0)
    with pytest.raises(ValueError):
        slot_mapping([t1], [0, 0])


class PagingMachine(RuleBasedStateMachine):
    """Random growth and frees of many sequences never lose or double-own a block."""

    def __init__(self):
        super().__init__()
        self.alloc = BlockAllocator(24, 4)
        self.tables: list[BlockTable] = []

    @rule()
    def start(self):
        self.tables.append(BlockTable(self.alloc))

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), n=st.integers(0, 20))
    def grow(self, data, n):
        table = data.draw(st.sampled_from(self.tables))
        if table.can_append(n):
            table.append(n)
        else:
            before = (list(table.blocks), self.alloc.num_free)
            with pytest.raises(OutOfBlocksError):
                table.append(n)
            assert (table.blocks, self.alloc.num_free) == before

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def finish(self, data):
        table = self.tables.pop(data.draw(st.integers(0, len(self.tables) - 1)))
        table.free()

    @invariant()
    def every_block_is_owned_once_or_free(self):
        owned = [b for t in self.tables for b in t.blocks]
        assert len(owned) == len(set(owned))
        assert set(owned).isdisjoint(self.alloc.free_list)
        assert len(owned) + self.alloc.num_free == 24
        assert all(self.alloc.ref_counts[b] == 1 for b in owned)
        assert all(self.alloc.ref_counts[b] == 0 for b in self.alloc.free_list)
        for t in self.tables:
            assert len(t.blocks) == -(-t.num_tokens // 4)


TestPagingMachine = PagingMachine.TestCase


@given(
    st.lists(
        st.tuples(st.integers(1, 200), st.integers(1, 200), st.floats(0, 30)),
        min_size=1,
        max_size=30,
    ),
    st.sampled_from([1, 4, 16]),
)
def test_paged_pool_serves_everything_and_frees_all(specs, block_size):
    reqs = [Request(i, t, p, o) for i, (p, o, t) in enumerate(specs)]
    pool = PagedPool(512 // block_size, block_size)
    result = simulate(reqs, pool)
    assert set(result.finish_step) == {r.id for r in reqs}
    assert pool.allocator.num_free == pool.allocator.num_blocks and pool.tables == {}
    assert (sum(result.usage.values()) == pool.capacity).all()
    tails = result.usage["reserved"] + result.usage["internal"]
    assert (tails <= result.running * (block_size - 1)).all()
    # A request's never-used slots are those past its final length, in its last block.
    assert (result.usage["internal"] <= result.running * (block_size - 1)).all()


def test_paging_beats_contiguous_on_the_same_trace():
    reqs = chat_workload(150, seed=0, arrival_rate=1.0)
    paged = simulate(reqs, PagedPool(8 * 2048 // 16, 16, 2048))
    contig = simulate(reqs, ContiguousPool(8 * 2048, 2048, policy="max"))
    assert paged.fractions()["used"] > 0.9 > 0.4 > contig.fractions()["used"]
    assert paged.mean_running() > 2.5 * contig.mean_running()


def test_request_too_large_for_the_pool_is_rejected_at_admission():
    with pytest.raises(ValueError, match="whole pool holds 64"):
        simulate([Request(0, 0.0, 60, 10)], PagedPool(4, 16))
    with pytest.raises(ValueError, match="max_model_len"):
        simulate([Request(0, 0.0, 60, 10)], PagedPool(40, 16, max_model_len=64))


def test_preempted_requests_resume_with_their_tokens():
    # Two long requests in a pool that holds one and a bit: the later one is preempted and resumes.
    reqs = [Request(0, 0.0, 10, 40), Request(1, 0.0, 10, 40)]
    result = simulate(reqs, PagedPool(5, 16, watermark=0.0))
    assert result.preemptions >= 1 and set(result.finish_step) == {0, 1}


def test_paged_tails_split_into_filled_later_and_never_used():
    # One request of 20 + 5 tokens, blocks of 8: 4 blocks at the end, 7 slots unused.
    reqs = [Request(0, 0.0, 20, 5)]
    pool = PagedPool(8, 8, watermark=0.0)
    res = simulate(reqs, pool)
    first = {k: int(v[0]) for k, v in res.usage.items()}
    # Step 0: 21 tokens in 3 blocks (24 slots); it will end at 25 (4 blocks).
    assert first == {"used": 21, "reserved": 3, "internal": 0, "free": 40}
    last = {k: int(v[-1]) for k, v in res.usage.items()}
    assert last == {"used": 25, "reserved": 0, "internal": 7, "free": 32}


def test_recompute_is_counted_on_readmission():
    reqs = [Request(0, 0.0, 10, 40), Request(1, 0.0, 10, 40)]
    result = simulate(reqs, PagedPool(5, 16, watermark=0.0))
    assert result.preemptions >= 1 and result.recomputed_tokens >= 10
    assert result.generated_tokens == 80


def test_freeing_a_table_hands_its_blocks_back_in_the_same_order():
    alloc = BlockAllocator(8, 4)
    a = BlockTable(alloc)
    a.append(12)  # blocks 0, 1, 2
    a.free()
    b = BlockTable(alloc)
    b.append(12)
    assert b.blocks == [0, 1, 2]
