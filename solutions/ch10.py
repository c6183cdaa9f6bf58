"""Solutions to chapter 10's exercises."""


def decode_bytes(
    batch: int,
    context: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
) -> int:
    """Keys and values of every context token, every layer, every sequence."""
    return 2 * batch * context * num_layers * num_kv_heads * head_dim * dtype_bytes


def normalized_latency(
    arrivals: list[float], finishes: list[float], output_lens: list[int]
) -> float:
    """Mean over requests of end-to-end latency per output token."""
    per_request = [(f - a) / n for a, f, n in zip(arrivals, finishes, output_lens)]
    return sum(per_request) / len(per_request)
