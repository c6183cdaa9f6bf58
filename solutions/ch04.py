"""Solutions to chapter 04's exercises."""

import torch


def merge_two(out_a, lse_a, out_b, lse_b):
    """Weights are each part's share of the total sum of exponentials."""
    lse = torch.logaddexp(torch.as_tensor(lse_a), torch.as_tensor(lse_b))
    return torch.exp(lse_a - lse) * out_a + torch.exp(lse_b - lse) * out_b


def visible_keys(context_len: int, query_len: int, j: int) -> int:
    """Query j is at position context_len - query_len + j and attends to every position up to its own."""
    return context_len - query_len + j + 1


# Exercise 3: the errors stay at rounding level. Each partition's (output, lse) pair summarises its keys
# exactly, and softmax weights over lse values reproduce exp(score) / sum(exp) for any split.
