"""Solutions to chapter 04b's exercises."""


def decode_flops_per_byte(group: int, head_dim: int, bytes_per_element: int) -> float:
    """Per KV head and key: 4 * head_dim FLOPs for each of the group's query heads
    (2 * head_dim for the score q.k, 2 * head_dim for adding p * v), against a key
    and a value of head_dim elements read from the cache."""
    flops = 4 * head_dim * group
    bytes_read = 2 * head_dim * bytes_per_element
    return flops / bytes_read


def key_loads(prompt_len: int, positions: int) -> int:
    """Program p holds positions p * positions .. (p + 1) * positions - 1; its last
    row sees every key up to its own position, so the program loads that many."""
    programs = -(-prompt_len // positions)
    return sum(min(prompt_len, (p + 1) * positions) for p in range(programs))
