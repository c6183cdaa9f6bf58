"""Solutions to chapter 04d's exercises."""


def prefill_flops_per_byte(seqs, length, heads, kv_heads, head_dim, itemsize):
    """The FLOPs the exercise gives, over the bytes of Q and the output (a row per
    token and query head) and of K and V (a row per token and KV head)."""
    flops = 4 * head_dim * heads * seqs * length * (length + 1) / 2
    least = seqs * length * (2 * heads + 2 * kv_heads) * head_dim * itemsize
    return flops / least
