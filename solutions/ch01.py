"""Solutions to chapter 01's exercises."""

from pagedkv_lab.kvmath import KVSpec, kv_budget


def bytes_per_token(config, dtype_bytes: int) -> int:
    """2 (K and V) x layers x KV heads x head_dim x bytes per element."""
    kv_heads = config.num_key_value_heads or config.num_attention_heads
    head_dim = config.head_dim or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * dtype_bytes


def max_requests(budget_bytes: int, bytes_per_token: int, max_len: int) -> int:
    """Requests that fit when each reserves ``max_len`` tokens; never negative."""
    return max(0, budget_bytes // (bytes_per_token * max_len))


def longest_request(config, gpu_bytes: int, kv_dtype_bytes: int) -> int:
    """Tokens of the longest request whose K/V fit next to the fp16 weights."""
    spec = KVSpec.from_config(config)
    spec = KVSpec(spec.num_layers, spec.num_kv_heads, spec.head_dim, kv_dtype_bytes)
    return spec.tokens_in(kv_budget(config, gpu_bytes))


# Exercise 3: on an L4 (23,034 MiB as its runtime reports it) Llama-3-8B's fp16 weights
# leave room for about 43,000 tokens of fp16 cache, twice that in fp8: one conversation
# longer than the model's 8192-token context fits either way, and 2048-token requests
# number 21 and 42.
