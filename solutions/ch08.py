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
    """Search the capacities upwards from one block. A capacity smaller than a
    request's own blocks cannot serve it (the simulator raises ValueError) and
    reaches no hit rate; once every request's blocks fit at once, nothing is
    ever evicted and a larger cache changes nothing."""
    everything = sum(-(-len(r.prompt + r.output) // 16) for r in requests)
    for blocks in range(1, everything + 1):
        try:
            hit_rate = prefix_cache_run(requests, blocks * 16)["hit_rate"]
        except ValueError:  # a request larger than the cache
            continue
        if hit_rate >= target:
            return blocks
    raise ValueError(f"no capacity reaches a hit rate of {target}")


# Exercise 3: on chapter 08's check, multi-turn chat (4 conversations of 3
# turns, a 32-token system prompt) needs 69 blocks for a 50% hit rate and 79 for
# 60%, well above its largest request's 28 blocks: each turn's prompt repeats
# its conversation's history, which must still be cached after the other three
# conversations' turns have run in between. The 12 system-prompt chats reach 68%
# as soon as the largest request fits, at 16 blocks: each finds the shared
# system prompt left by the one before, and no larger cache raises the rate,
# since the rest of each prompt is its own.
