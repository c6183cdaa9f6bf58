"""vLLM's tokenizer endpoints, on the tokenizer the served model uses.

    POST /tokenize         a prompt, or chat messages -> ``tokens``, ``count``,
                           ``max_model_len`` (and ``token_strs`` if asked)
    POST /detokenize       ``tokens`` -> ``prompt``, their text
    GET  /tokenizer_info   the tokenizer's settings (``tokenizer_class``, the
                           special tokens, ``model_max_length``, the chat
                           template); only with ``--enable-tokenizer-info-endpoint``

Evaluation clients read a remote model's tokenizer through these: lm-evaluation
harness's ``local-completions`` asks ``/tokenizer_info`` for the end-of-sequence
token and ``/tokenize`` for the token ids it then sends as prompts, so its
context lengths count the server's own tokens. The functions here take the
tokenizer as an argument; the routes (`app`) run them in the engine loop's
worker thread (`EngineLoop.run_in_worker`), the one thread that uses it.
"""

from __future__ import annotations

from pagedkv_lab.serve.protocol import ChatMessage, RequestError, _Body
from pagedkv_lab.tokenizing import chat_prompts

#: transformers' "no limit" (``VERY_LARGE_INTEGER``) is 1e30: any
#: ``model_max_length`` past this is no limit at all.
_NO_LIMIT = 10**20


class TokenizeRequest(_Body):
    """``POST /tokenize``: a ``prompt`` (text) or chat ``messages``, not both.
    ``add_special_tokens`` defaults, as in vLLM, to true for a prompt (BOS
    added) and false for messages (the chat template writes its own)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    """``POST /detokenize``: token ids to turn back into text."""

    model: str | None = None
    tokens: list[int]


def _need(tokenizer) -> None:
    if tokenizer is None:
        raise RequestError("this server's model has no tokenizer", None)


def tokenize(tokenizer, body: TokenizeRequest, max_model_len: int) -> dict:
    """vLLM's ``/tokenize`` answer for ``body``; a prompt longer than the
    model's context is refused, as vLLM does."""
    _need(tokenizer)
    if (body.prompt is None) == (body.messages is None):
        raise RequestError("give either prompt or messages", "prompt")
    if body.messages is not None:
        field, special = "messages", bool(body.add_special_tokens)
        messages = [m.as_dict() for m in body.messages]
        try:  # a template that raises is the request's problem, as in a chat
            (chat,) = chat_prompts(
                tokenizer, messages, None, body.add_generation_prompt
            )
        except Exception as err:
            raise RequestError(str(err), "messages") from None
        text = chat["prompt"]
    else:
        field, text = "prompt", body.prompt
        special = body.add_special_tokens is not False
    ids = list(tokenizer(text, add_special_tokens=special).input_ids)
    if len(ids) > max_model_len:
        raise RequestError(
            f"the {field} has {len(ids)} tokens; this model's maximum context "
            f"length is {max_model_len} tokens",
            field,
        )
    strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {
        "count": len(ids),
        "max_model_len": max_model_len,
        "tokens": ids,
        "token_strs": strs,
    }


def detokenize(
    tokenizer, body: DetokenizeRequest, vocab_size: int, max_model_len: int
) -> dict:
    """vLLM's ``/detokenize`` answer: the tokens' text, special tokens
    included; ids outside the model's vocabulary are refused."""
    _need(tokenizer)
    for i, t in enumerate(body.tokens):
        if not 0 <= t < vocab_size:
            raise RequestError(
                f"tokens: token ids must be in [0, {vocab_size}), got {t} at "
                f"position {i}",
                "tokens",
            )
    if len(body.tokens) > max_model_len:
        raise RequestError(
            f"tokens: {len(body.tokens)} tokens is more than this model's maximum "
            f"context length, {max_model_len}",
            "tokens",
        )
    return {"prompt": tokenizer.decode(body.tokens)}


def _plain(value):
    """``value`` as JSON: special-token objects become their text; what JSON
    cannot hold (a tokenizer object, a path...) becomes None."""
    if hasattr(value, "content"):  # transformers' AddedToken
        return value.content
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return None


def tokenizer_info(tokenizer, max_model_len: int) -> dict:
    """vLLM's ``/tokenizer_info``: the settings the tokenizer was made with
    (its ``tokenizer_config.json``, file paths left out), its class, its
    special tokens, ``model_max_length`` (the model's context length where the
    tokenizer sets no limit of its own) and its chat template, if any."""
    _need(tokenizer)
    config = {
        k: _plain(v)
        for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items()
        if k not in ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")
        and _plain(v) is not None
    }
    for name in ("bos_token", "eos_token", "pad_token"):
        config[name] = _plain(getattr(tokenizer, name, None))
    limit = getattr(tokenizer, "model_max_length", None)
    if not isinstance(limit, int) or limit >= _NO_LIMIT:
        limit = max_model_len
    config["model_max_length"] = limit
    config["tokenizer_class"] = type(tokenizer).__name__
    template = getattr(tokenizer, "chat_template", None)
    if template:
        config["chat_template"] = template
    return config
