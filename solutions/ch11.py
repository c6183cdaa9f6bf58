"""Solutions to chapter 11's exercises."""


def prefix_saving(shared_len: int, private_len: int, n: int, block_size: int) -> float:
    """Full prefix blocks are stored once; everything else once per request."""
    shared_blocks = shared_len // block_size
    per_request = -(-(shared_len + private_len) // block_size)
    held = shared_blocks + n * (per_request - shared_blocks)
    return 1 - held / (n * per_request)


def max_private_len(shared_len: int, n: int, target: float, block_size: int) -> int:
    """The saving never rises with the private part: walk up until it drops."""
    best = 0
    while prefix_saving(shared_len, best + 1, n, block_size) >= target:
        best += 1
    return best


def which_share(claimed_bytes: int, config, dtype_bytes: int) -> str | None:
    """Compare the claim with each part of the bill, largest first."""
    heads = config.num_key_value_heads or config.num_attention_heads
    head_dim = config.head_dim or config.hidden_size // config.num_attention_heads
    keys_one_layer = heads * head_dim * dtype_bytes
    layers = config.num_hidden_layers
    shares = {
        "whole model": 2 * layers * keys_one_layer,
        "keys only": layers * keys_one_layer,
        "one layer": 2 * keys_one_layer,
        "one layer, keys only": keys_one_layer,
    }
    for name, nbytes in shares.items():
        if nbytes == claimed_bytes:
            return name
    return None
