"""Solutions to chapter 03's exercises."""


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Ceiling division: a partly filled last block still counts."""
    return -(-num_tokens // block_size)


def slot_of(block_table: list[int], block_size: int, position: int) -> int:
    """Physical slot of the token at ``position``."""
    return block_table[position // block_size] * block_size + position % block_size


# Exercise 3: 100 tokens occupy 7 blocks of 16 = 112 slots, wasting 12. Lengths that are multiples of
# 16 waste nothing; every other length wastes 16 - length % 16 slots.
