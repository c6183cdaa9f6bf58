"""Solutions to chapter 06's exercises."""

import heapq


def static_steps(output_lens: list[int], batch_size: int) -> int:
    """Each batch runs as long as its longest request."""
    return sum(
        max(output_lens[i : i + batch_size])
        for i in range(0, len(output_lens), batch_size)
    )


def continuous_steps(output_lens: list[int], batch_size: int) -> int:
    """Each request takes the slot that frees first; the last one to end sets the total."""
    free_at = [0] * batch_size
    for n in output_lens:
        heapq.heappush(free_at, heapq.heappop(free_at) + n)
    return max(free_at)


# Exercise 3: with a 25% watermark, admission waits until 3 of the 12 blocks would stay free, so fewer
# requests start early, fewer preemptions happen, and more steps may be needed: the watermark keeps room
# for running sequences to grow into instead of giving it to newcomers who would be preempted later.
