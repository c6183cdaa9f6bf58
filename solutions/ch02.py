"""Solutions to chapter 02's exercises."""

from pagedkv_lab.sim.contiguous import ContiguousPool
from pagedkv_lab.sim.workloads import chat_workload, simulate


def best_fit(gaps: list[tuple[int, int]], n: int) -> int | None:
    """Start of the smallest gap with length >= n (lowest address on ties), or None."""
    fitting = [(length, start) for start, length in gaps if length >= n]
    return min(fitting)[1] if fitting else None


def external_fragmentation(gap_lengths: list[int], need: int) -> int:
    """Free slots unusable for a request of ``need`` slots: all of them if only
    fragmentation blocks it."""
    free = sum(gap_lengths)
    blocked_by_fragmentation = free >= need and max(gap_lengths, default=0) < need
    return free if blocked_by_fragmentation else 0


def pool_shares(extra_slots: int) -> tuple[float, float]:
    """(external, free) shares of a max-reservation pool of 16 x 2048 + extra slots."""
    w1 = chat_workload(400, seed=0, arrival_rate=1.0, max_model_len=2048)
    pool = ContiguousPool(16 * 2048 + extra_slots, 2048, policy="max")
    f = simulate(w1, pool).fractions()
    return f["external"], f["free"]


# Exercise 3: with 1000 extra slots external fragmentation stays at 0% and about 3% of
# the pool (1000 of 33,768 slots) is free. The waiting request needs 2048 slots and
# only 1000 are free in total: it is short of memory, not blocked by fragmentation,
# so the chapter's definition (enough free slots in total, no gap large enough) does
# not apply. It is waste all the same: a tail smaller than one region never holds a
# token. A pool whose size is not a multiple of the region size always has one. The
# vLLM paper's Figure 2 counts it under "external fragmentation & others": its
# Orca (Max) pool of 15.7K slots holds 7 regions of 2048 and a tail of 8.9%, the
# whole of that row's "others" (chapter 02 measures 8.85%).
