"""Solutions to chapter 04c's exercises."""

import math


def tiles_in_flight(bandwidth: float, latency: float, tile_bytes: int) -> int:
    """Little's law: bandwidth x latency bytes must be on their way at once;
    whole tiles carry them, so round up."""
    return math.ceil(bandwidth * latency / tile_bytes)


def program_of(q_lens: list[int], block_q: int, seq: int, j: int) -> int:
    """Sequence ``seq``'s query blocks start at its query_start_loc // block_q + seq;
    query j lies j // block_q blocks further."""
    start = sum(q_lens[:seq])  # query_start_loc[seq]
    return start // block_q + seq + j // block_q
