"""Solutions to chapter 05a's exercises."""

from itertools import accumulate


def positions_for(num_computed: int, num_new: int) -> list[int]:
    """New tokens continue where the cached ones stop."""
    return list(range(num_computed, num_computed + num_new))


def logits_rows(query_lens: list[int]) -> list[int]:
    """A sequence's last token sits at the running total of query lengths, minus 1."""
    return [end - 1 for end in accumulate(query_lens)]


def blocks_held(prompt_lens: list[int], new_tokens: int, block_size: int) -> int:
    """Every token but the last sampled one has K/V; each sequence rounds up."""
    return sum(-(-(p + new_tokens - 1) // block_size) for p in prompt_lens)


# Exercise 3, by running: outputs stay identical for any block size (attention
# reads the same keys, wherever they are). block_size=1 holds exactly as many
# blocks as tokens (292); block_size=128 holds one block per sequence here (6),
# most of it empty.
