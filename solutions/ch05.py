"""Solutions to chapter 05's exercises."""

from itertools import accumulate


def positions_for(num_computed: int, num_new: int) -> list[int]:
    """New tokens continue where the cached ones stop."""
    return list(range(num_computed, num_computed + num_new))


def logits_rows(query_lens: list[int]) -> list[int]:
    """Each sequence's last token sits at the running total of query lengths, minus one."""
    return [end - 1 for end in accumulate(query_lens)]


# Exercise 3: outputs stay identical for any block size (attention reads the same keys, wherever they are).
# block_size=1 holds exactly as many blocks as tokens; block_size=128 holds one block per sequence here,
# most of it empty.
