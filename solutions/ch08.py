"""Solutions to chapter 08's exercises."""

from pagedkv_lab.course.experiments import prefix_cache_run
from pagedkv_lab.engine.prefix_cache import chained_hash


def block_keys(tokens: list[int], block_size: int) -> list[int]:
    """Each full block's key chains the key of the block before it."""
    keys, key = [], None
    for i in range(len(tokens) // block_size):
        key = chained_hash(key, tuple(tokens[i * block_size : (i + 1) * block_size]))
        keys.append(key)
    return keys


def max_cached_tokens(prompt_len: int, block_size: int) -> int:
    """Whole blocks, and never the prompt's last token."""
    return (prompt_len - 1) // block_size * block_size


def smallest_capacity(requests: list, target: float) -> int:
    """Search capacities upwards; a request needs room for itself and the four
    running ones, so start there."""
    low = 5 * max(-(-len(r.prompt + r.output) // 16) for r in requests)
    blocks = low
    while prefix_cache_run(requests, blocks * 16)["hit_rate"] < target:
        blocks += 1
    return blocks
