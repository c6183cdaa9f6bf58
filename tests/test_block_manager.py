"""The block manager: reference counts, fork, copy-on-write, never a leak."""

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from pagedkv_lab.engine.block_manager import BlockManager, OutOfBlocksError
from pagedkv_lab.engine.sequence import Sequence
from pagedkv_lab.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)


def _seq(num_tokens: int) -> Sequence:
    return Sequence([1] * num_tokens, PARAMS)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / free; the model is a set of live
    sequences, each writing its next tokens the way the engine does."""

    @initialize(
        num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 4, 16])
    )
    def setup(self, num_blocks, block_size):
        self.bm = BlockManager(num_blocks, block_size)
        self.live: list[Sequence] = []
        # What each live sequence's K/V holds, token by token: (id, position)
        # pairs written by the model, and what a copy must carry over.
        self.content: dict[int, list] = {}
        self.blocks: dict[int, list] = {}

    def _write(self, seq, n):
        """Append slots, apply copies, write tokens: what one engine step does."""
        self.bm.append_slots(seq, n)
        for src, dst in self.bm.take_copies():
            assert self.bm.ref_counts[dst] == 1
            self.blocks[dst] = list(self.blocks.get(src, []))
        bs = self.bm.block_size
        for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            block = seq.block_table[p // bs]
            # The runner's assertion: nobody else reads what we write.
            assert self.bm.ref_counts[block] == 1
            row = self.blocks.setdefault(block, [None] * bs)
            row += [None] * (bs - len(row))
            row[p % bs] = (seq.seq_id, p)
            self.content[seq.seq_id].append((seq.seq_id, p))
        seq.num_computed_tokens += n
        seq.token_ids += [1] * max(0, seq.num_computed_tokens + 1 - seq.num_tokens)

    @rule(tokens=st.integers(1, 40), cut=st.integers(0, 39))
    def allocate(self, tokens, cut):
        seq = _seq(tokens)
        n = min(tokens, cut + 1)
        if self.bm.can_allocate(seq, 0, n):
            self.bm.allocate(seq, 0, n)
            self.content[seq.seq_id] = []
            self.live.append(seq)
            # allocate() made room for n tokens; write them as a step would.
            self._write(seq, n)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), n=st.integers(1, 9))
    def append(self, data, n):
        seq = data.draw(st.sampled_from(self.live))
        if self.bm.can_append_slots([(seq, n)]):
            self._write(seq, n)
        else:
            with pytest.raises(OutOfBlocksError):
                self.bm.append_slots(seq, n)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.live))
        child = parent.fork()
        self.bm.fork(parent, child)
        self.content[child.seq_id] = list(self.content[parent.seq_id])
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.live))
        self.live.remove(seq)
        self.bm.free(seq)
        assert seq.block_table is None

    @invariant()
    def counts_match_tables(self):
        if not hasattr(self, "bm"):
            return
        held = Counter(b for s in self.live for b in s.block_table)
        for block, count in enumerate(self.bm.ref_counts):
            assert count == held.get(block, 0), f"block {block}"
        assert len(held) + self.bm.num_free_blocks == self.bm.num_blocks

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        if not hasattr(self, "bm"):
            return
        bs = self.bm.block_size
        for seq in self.live:
            table = seq.block_table
            seen = [
                self.blocks[table[p // bs]][p % bs]
                for p in range(seq.num_computed_tokens)
            ]
            # A shared prefix was written by an ancestor: compare positions
            # and writers with the sequence's own history.
            assert seen == self.content[seq.seq_id]

    def teardown(self):
        if hasattr(self, "bm"):
            for seq in self.live:
                self.bm.free(seq)
            assert self.bm.num_free_blocks == self.bm.num_blocks
            assert not any(self.bm.ref_counts)


TestBlockManager = BlockManagerMachine.TestCase
TestBlockManager.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)


def test_fork_shares_and_the_first_writer_copies():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = _seq(6)
    bm.allocate(parent, 0, 6)
    parent.num_computed_tokens = 6
    child = parent.fork()
    bm.fork(parent, child)
    assert bm.ref_counts[parent.block_table[0]] == 2
    assert bm.num_free_blocks == 6  # no K/V copied, no block taken
    # The child writes token 6 into the shared, half-full block 1: a copy.
    bm.append_slots(child, 1)
    (copy,) = bm.take_copies()
    assert copy == (parent.block_table[1], child.block_table[1])
    # The parent is now the only holder of its block: it writes in place.
    bm.append_slots(parent, 1)
    assert bm.take_copies() == []
    # Full blocks stay shared.
    assert child.block_table[0] == parent.block_table[0]
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 8


def test_freeing_a_sequence_cancels_its_pending_copies():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = _seq(3)
    bm.allocate(parent, 0, 3)
    parent.num_computed_tokens = 3
    child = parent.fork()
    bm.fork(parent, child)
    bm.append_slots(child, 1)
    bm.free(child)  # preempted in the same step, before the copy ran
    assert bm.take_copies() == []
    bm.free(parent)
    assert bm.num_free_blocks == 8


class _TrustingAllocator:
    """The trap from CLAIMS.md: a reference count that defaults to 1 for a block
    it has never seen. A double free then looks like a normal free."""

    def __init__(self, num_blocks):
        self.ref_counts: dict[int, int] = {}
        self.free_list = list(range(num_blocks))

    def allocate(self):
        block = self.free_list.pop()
        self.ref_counts[block] = 1
        return block

    def free(self, block):
        count = self.ref_counts.get(block, 1) - 1
        self.ref_counts[block] = count
        if count == 0:
            self.free_list.append(block)


def _block_handed_out_twice(allocator) -> bool:
    """Free a block that was never allocated (a caller's bug), then allocate
    the whole pool: does some block go to two sequences at once?"""
    first = allocator.allocate()
    allocator.free(first)
    never_allocated = 0 if first != 0 else 1
    try:
        allocator.free(never_allocated)
    except ValueError:
        return False
    handed = [allocator.allocate() for _ in range(len(allocator.free_list))]
    return len(handed) != len(set(handed))


def test_a_reference_count_defaulting_to_one_hides_a_double_free():
    # The trusting allocator takes the bad free silently: one block will be
    # handed to two sequences, which then overwrite each other's K/V.
    assert _block_handed_out_twice(_TrustingAllocator(4))
    # Ours counts every block from 0 and refuses the bad free at once.
    assert not _block_handed_out_twice(BlockManager(4, 4).allocator)
    bm = BlockManager(4, 4)
    block = bm.allocator.allocate()
    bm.allocator.free(block)
    with pytest.raises(ValueError, match="already freed"):
        bm.allocator.free(block)
