"""What the engine is checked against: transformers' own greedy generate, one prompt alone."""

import torch


def greedy_alone(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Tokens ``model.generate`` produces greedily for ``prompt`` alone, EOS ignored."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
    )
    return out[0, len(prompt) :].tolist()
