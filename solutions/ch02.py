"""Solutions to chapter 02's exercises."""


def best_fit(gaps: list[tuple[int, int]], n: int) -> int | None:
    """Start of the smallest gap with length >= n (lowest address on ties), or None."""
    fitting = [(length, start) for start, length in gaps if length >= n]
    return min(fitting)[1] if fitting else None


def external_fragmentation(gap_lengths: list[int], need: int) -> int:
    """Free slots unusable for a request of ``need`` slots: all of them if only fragmentation blocks it."""
    free = sum(gap_lengths)
    blocked_by_fragmentation = free >= need and max(gap_lengths, default=0) < need
    return free if blocked_by_fragmentation else 0


# Exercise 3: with 16 * MAX_LEN + 1000 slots the pool has a 1000-slot tail that no 2048-slot reservation
# fits. Whenever a request waits, those free slots count as external fragmentation: even equal-sized
# regions fragment a pool whose size is not a multiple of the region size.
