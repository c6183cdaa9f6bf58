"""Solutions to chapter 00's exercises."""


def gqa_group(config) -> int:
    """Query heads per KV head; configs without ``num_key_value_heads`` use multi-head attention."""
    kv_heads = config.num_key_value_heads or config.num_attention_heads
    return config.num_attention_heads // kv_heads


# Exercise 2: tiny-qwen2 stores 1 KV head of 16 numbers per layer and token, tiny-llama 2 of 16;
# with 2 layers each and float32, that is 256 vs 512 bytes per token: Qwen2's 6 query heads share one KV head.
