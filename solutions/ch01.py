"""Solutions to chapter 01's exercises."""


def bytes_per_token(config, dtype_bytes: int) -> int:
    """2 (K and V) x layers x KV heads x head_dim x bytes per element."""
    kv_heads = config.num_key_value_heads or config.num_attention_heads
    head_dim = config.head_dim or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * dtype_bytes


def max_requests(budget_bytes: int, bytes_per_token: int, max_len: int) -> int:
    """Requests that fit when each reserves ``max_len`` tokens; never negative."""
    return max(0, budget_bytes // (bytes_per_token * max_len))


# Exercise 3:
#   from pagedkv_lab.kvmath import KVSpec, kv_budget, gpu_memory_bytes, real_model_configs
#   cfg = real_model_configs()["Llama-3-8B"]
#   spec = KVSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, 128, dtype_bytes=1)
#   spec.tokens_in(kv_budget(cfg, gpu_memory_bytes()["L4"])) // 2048   # twice the fp16 figure (up to rounding)
