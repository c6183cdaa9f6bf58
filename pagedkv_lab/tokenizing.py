"""Text into the engine: chat templates, end-of-sequence ids, what counts as a
token id (vLLM keeps these in ``vllm/entrypoints/chat_utils.py`` and its
tokenizer helpers). Text out of the engine, decoded as tokens arrive, is the
output processor's (`pagedkv_lab.output_processor.IncrementalDetokenizer`).
"""

from __future__ import annotations

import numbers


def chat_prompts(
    tokenizer,
    messages,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
) -> list[dict]:
    """One prompt dict (``{"prompt": text, "prompt_token_ids": ids}``) per
    conversation, through the tokenizer's chat template (or ``chat_template``).

    ``messages`` is one conversation (a list of ``{"role": ..., "content":
    ...}`` dicts) or a list of them. The template writes the special tokens
    itself (BOS included), so the text is tokenized without adding any.
    """
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer; this LLM has none")
    if isinstance(messages, dict) or not isinstance(messages, (list, tuple)):
        raise ValueError(
            "messages must be a list of {'role', 'content'} dicts, or a list "
            f"of such lists, got {messages!r}"
        )
    conversations = (
        [messages] if not messages or isinstance(messages[0], dict) else messages
    )
    prompts = []
    for i, conv in enumerate(conversations):
        if not conv or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in conv
        ):
            raise ValueError(
                f"conversation {i}: every message must be a dict with 'role' "
                "and 'content'"
            )
        template = chat_template or getattr(tokenizer, "chat_template", None)
        if not template:
            raise ValueError("the tokenizer has no chat template: pass chat_template")
        text = tokenizer.apply_chat_template(
            conv,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=template,
        )
        ids = tokenizer(text, add_special_tokens=False).input_ids
        prompts.append({"prompt": text, "prompt_token_ids": ids})
    return prompts


def is_token_id(x) -> bool:
    """An integer (NumPy's too) that is not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def eos_token_ids(model, tokenizer) -> frozenset[int]:
    """Every end-of-sequence id a request stops at: the tokenizer's, the
    config's and the generation config's, each one id or a list (Llama 3 ends
    a turn with ``<|eot_id|>`` as well as ``<|end_of_text|>``)."""
    found: set[int] = set()
    sources = [
        getattr(tokenizer, "eos_token_id", None),
        getattr(model.config, "eos_token_id", None),
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
    ]
    for eos in sources:
        for t in [eos] if is_token_id(eos) else (eos or []):
            if is_token_id(t):
                found.add(int(t))
    return frozenset(found)
