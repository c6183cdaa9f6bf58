"""Solutions to chapter 00's exercises."""

import torch

from pagedkv_lab.models import load_model


def gqa_group(config) -> int:
    """Query heads per KV head; configs without ``num_key_value_heads`` use multi-head
    attention."""
    kv_heads = config.num_key_value_heads or config.num_attention_heads
    return config.num_attention_heads // kv_heads


def cache_bytes_per_token(name: str) -> int:
    """Bytes per cached token, measured on the cache ``generate`` returns."""
    model, tokenizer = load_model(name)
    inputs = tokenizer("Once upon a time", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=4, do_sample=False, return_dict_in_generate=True
        )
    cache = out.past_key_values
    total = sum(
        t.numel() * t.element_size()
        for layer in cache.layers
        for t in (layer.keys, layer.values)
    )
    return total // cache.get_seq_length()


# Exercise 2: tiny-llama stores the most, 512 bytes per token (2 layers x 2 KV
# heads x 16 x 4 bytes x K and V). tiny-qwen2 and tiny-mistral store 256 each,
# with different shapes: Qwen2's six query heads share one KV head of 16
# numbers, and Mistral keeps two KV heads of only 8. The number and width of KV
# heads, not of query heads, size the cache.
