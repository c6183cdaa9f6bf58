"""Solutions to chapter 04a's exercises."""

import math

import torch


def merge_two(out_a, lse_a, out_b, lse_b):
    """Each part weighs its share of the total sum of exponentials, e^(lse_p - lse).

    A part with no keys (lse = -inf) weighs 0, but its output may be NaN and
    0 * NaN is NaN: leave it out instead of multiplying.
    """
    lse_a, lse_b = float(lse_a), float(lse_b)
    if lse_a == -math.inf and lse_b == -math.inf:
        return torch.zeros_like(torch.as_tensor(out_a))
    if lse_b == -math.inf:
        return out_a
    if lse_a == -math.inf:
        return out_b
    lse = max(lse_a, lse_b) + math.log1p(math.exp(-abs(lse_a - lse_b)))
    return math.exp(lse_a - lse) * out_a + math.exp(lse_b - lse) * out_b


def visible_keys(context_len: int, query_len: int, j: int) -> int:
    """Query j sits at position context_len - query_len + j and sees every position
    up to its own."""
    return context_len - query_len + j + 1
