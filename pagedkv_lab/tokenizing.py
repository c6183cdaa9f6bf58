"""Text around the engine: the incremental detokenizer, stop strings, chat
templates and end-of-sequence ids.

vLLM spreads these over ``vllm/v1/engine/detokenizer.py`` (incremental
decoding and stop strings), ``vllm/entrypoints/chat_utils.py`` (chat
templates) and its tokenizer helpers. The engine (`pagedkv_lab.llm`) works on
token ids only; everything that turns them into text, or text into them, is
here.
"""

from __future__ import annotations

import numbers


class IncrementalDetokenizer:
    """The text of a sequence's output, decoded as its tokens arrive.

    Each new token decodes a short window (the tokens since the last complete
    piece of text) and the window without it: the difference is the new text.
    A window that ends in an incomplete character (a byte-level token may be
    half of one: "\ufffd") waits for the next token. The pieces concatenate to
    ``tokenizer.decode(output)``; the cost per token is constant.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = 0
        self.text = ""
        # Set when a stop string ended the text: nothing is added after it.
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def add(self, token_ids: list[int]) -> None:
        """Decode ``token_ids``, the next tokens of the output."""
        for token in token_ids:
            self.ids.append(token)
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            new = self._decode(self.ids[self.prefix_offset :])
            if len(new) > len(prefix) and not new.endswith("\ufffd"):
                self.text += new[len(prefix) :]
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)

    def flush(self) -> None:
        """At the end: add what an incomplete last character left waiting."""
        if self.stopped or self.read_offset == len(self.ids):
            return
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        self.text += self._decode(self.ids[self.prefix_offset :])[len(prefix) :]
        self.read_offset = len(self.ids)

    def stop_at(self, stops, before: int, include: bool) -> str | None:
        """End the text at the earliest of ``stops`` that occurs in the new text
        (characters from ``before`` on, with the overlap a string may have with
        older text): before it, or after it with ``include``. Returns the stop
        string found, or None."""
        found = None
        for s in stops:
            at = self.text.find(s, max(0, before - len(s) + 1))
            if at >= 0 and (found is None or at < found[0]):
                found = (at, s)
        if found is None:
            return None
        at, s = found
        self.text, self.stopped = self.text[: at + len(s) if include else at], True
        return s


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
