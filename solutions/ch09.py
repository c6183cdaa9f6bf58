"""Solutions to chapter 09's exercises."""


def swap_bytes(num_tokens: int, bytes_per_token: int, block_size: int) -> int:
    """Whole blocks, out and back in."""
    blocks = -(-num_tokens // block_size)
    return 2 * blocks * block_size * bytes_per_token


def recompute_cheaper(
    prefill_tokens_per_s: float, bytes_per_token: int, bandwidth: float
) -> bool:
    """Per token: 1 / rate against two copies of its K/V."""
    return 1 / prefill_tokens_per_s < 2 * bytes_per_token / bandwidth


def crossover_tokens(
    rate_flops, params, layers, width, bytes_per_token, bandwidth, fixed_s
):
    """Binary search for the first length where swapping costs less."""

    def gap(n):
        recompute = (2 * params * n + 2 * layers * width * n * n) / rate_flops
        return recompute - (2 * bytes_per_token * n / bandwidth + 2 * fixed_s)

    if gap(10**6) <= 0:
        return None
    lo, hi = 1, 10**6
    while lo < hi:
        mid = (lo + hi) // 2
        if gap(mid) <= 0:
            lo = mid + 1
        else:
            hi = mid
    return lo
