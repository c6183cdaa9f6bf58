"""The OpenAI-compatible request bodies and response shapes, as vLLM's server has them.

Requests are pydantic models that refuse unknown fields, so a field this server
does not implement (``logit_bias``, ``suffix``, ``tools``...) is an HTTP 400
that names it rather than a silent no-op. Each request turns into the engine's
`SamplingParams` (`to_sampling_params`); a value the engine refuses becomes a
`RequestError` naming the field. Responses are plain dicts in OpenAI's JSON
shapes (``text_completion``, ``chat.completion``, their stream chunks,
``usage``, ``logprobs``), built by the small functions at the end.

Sampling fields: OpenAI's (``n``, ``temperature``, ``top_p``, ``seed``,
``stop``, ``presence_penalty``, ``frequency_penalty``, ``max_tokens``,
``logprobs``) and the extra fields vLLM's server takes in the body
(``top_k``, ``min_p``, ``min_tokens``, ``ignore_eos``, ``repetition_penalty``,
``stop_token_ids``, ``include_stop_str_in_output``, ``skip_special_tokens``).
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedkv_lab.outputs import Logprob
from pagedkv_lab.sampling_params import RequestOutputKind, SamplingParams

# vLLM's default --max-logprobs.
MAX_LOGPROBS = 20
# JSON has no -inf: vLLM reports a token the model rules out at this value.
_MIN_LOGPROB = -9999.0


class RequestError(Exception):
    """A request the server refuses, with its HTTP status and OpenAI error type."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        kind: str = "BadRequestError",
    ):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind


def error_body(err: RequestError) -> dict:
    """OpenAI's (and vLLM's) error JSON: ``{"error": {message, type, param, code}}``."""
    return {
        "error": {
            "message": err.message,
            "type": err.kind,
            "param": err.param,
            "code": err.status,
        }
    }


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False
    # vLLM's: a usage field on every chunk, not only the last.
    continuous_usage_stats: bool = False


class _SamplingRequest(_Body):
    """The fields completions and chats share."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extra sampling fields.
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's: the choices carry their token ids (and the prompt's).
    return_token_ids: bool | None = None

    def _params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """The engine's parameters (streamed as deltas), or a RequestError."""
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options needs stream=true", "stream_options")
        asked = {"logprobs": logprobs, "prompt_logprobs": prompt_logprobs}
        for name, value in asked.items():
            if value is not None and value > MAX_LOGPROBS:
                raise RequestError(
                    f"{name} must be at most {MAX_LOGPROBS}, got {value}", name
                )
        given = {
            "n": self.n,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "stop": self.stop,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "min_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
            "stop_token_ids": self.stop_token_ids,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens,
            "max_tokens": max_tokens,
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
        }
        fields = {k: v for k, v in given.items() if v is not None}
        fields["max_tokens"] = max_tokens  # None: up to the model's length
        try:
            return SamplingParams(output_kind=RequestOutputKind.DELTA, **fields)
        except ValueError as err:
            raise RequestError(str(err), _field_named(str(err), given)) from None


def _field_named(message: str, fields) -> str | None:
    """The request field an engine error message starts with, if any."""
    word = re.match(r"\w+", message)
    return word.group(0) if word and word.group(0) in fields else None


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``: a text, a list of texts, token ids or a list of
    token-id lists; ``max_tokens`` defaults to 16 as in OpenAI's API.

    ``echo`` returns each prompt before its completion; with ``logprobs=N`` the
    prompt's tokens get log-probabilities too (the engine's
    ``prompt_logprobs``, null for the first token), and ``max_tokens=0`` scores
    the prompt without generating (the engine samples one token, which the
    reply leaves out). ``prompt_logprobs`` (vLLM's field) returns them in
    vLLM's own shape, per choice; as in vLLM, not with ``stream``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    # vLLM's extra field.
    prompt_logprobs: int | None = None

    @property
    def scoring_only(self) -> bool:
        """``echo`` with ``max_tokens=0``: the prompt scored, nothing generated."""
        return self.echo and self.max_tokens == 0

    def prompts(self) -> list[dict]:
        """The prompts as the engine takes them (``{"prompt": ...}`` or
        ``{"prompt_token_ids": ...}``); an empty one is a RequestError."""
        p = self.prompt
        many = isinstance(p, list) and bool(p) and not isinstance(p[0], int)
        prompts = list(p) if many else [p]
        if not all(prompts):
            raise RequestError("prompt must not be empty", "prompt")
        return [
            {"prompt": x} if isinstance(x, str) else {"prompt_token_ids": list(x)}
            for x in prompts
        ]

    def to_sampling_params(self) -> SamplingParams:
        """The engine's parameters; ``echo`` with ``logprobs`` asks for the
        prompt's log-probabilities, as vLLM does."""
        plp = self.prompt_logprobs
        if plp is not None and plp > 0 and self.stream:
            raise RequestError(
                "prompt_logprobs are not available with stream=true (as in vLLM); "
                "ask for echo with logprobs instead",
                "prompt_logprobs",
            )
        if plp is None and self.echo:
            plp = self.logprobs
        max_tokens = 1 if self.scoring_only else self.max_tokens
        return self._params(max_tokens, self.logprobs, plp)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]
    name: str | None = None

    def as_dict(self) -> dict:
        """The message as a chat template reads it (text parts joined)."""
        content = self.content
        if not isinstance(content, str):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content}


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``: messages through the tokenizer's chat
    template; ``max_tokens`` (or ``max_completion_tokens``) defaults to the
    room left in the model."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # vLLM's extra field.
    add_generation_prompt: bool = True

    def to_sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs=true", "top_logprobs")
        if self.top_logprobs is not None and self.top_logprobs > MAX_LOGPROBS:
            raise RequestError(
                f"top_logprobs must be at most {MAX_LOGPROBS}, got {self.top_logprobs}",
                "top_logprobs",
            )
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens or self.max_tokens
        try:
            return self._params(max_tokens, logprobs)
        except RequestError as err:
            if err.param == "logprobs":
                err.param = "top_logprobs"
            raise


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _lp(x: float) -> float:
    return max(float(x), _MIN_LOGPROB)


def _token_text(entry: Logprob) -> str:
    return entry.decoded_token or ""


def completion_logprobs(
    token_ids: list[int],
    logprobs: list[dict[int, Logprob] | None],
    text_offset: int,
    top: int | None = None,
    unscored_text: str = "",
) -> dict:
    """The legacy completions ``logprobs`` object for these tokens: each token's
    text, its log-probability, the top alternatives (the token itself and the
    ``top`` most likely, by text; all it has when ``top`` is None) and where its
    text starts, counted from ``text_offset``. A token without log-probabilities
    (the prompt's first, entry None) gets nulls and the text ``unscored_text``."""
    out: dict[str, list[Any]] = {
        "text_offset": [],
        "token_logprobs": [],
        "tokens": [],
        "top_logprobs": [],
    }
    for token, entries in zip(token_ids, logprobs):
        if entries is None:
            text, logprob, alternatives = unscored_text, None, None
        else:
            mine = entries[token]
            text, logprob = _token_text(mine), _lp(mine.logprob)
            ranked = sorted(entries.values(), key=lambda e: e.rank)
            kept = [mine] + [e for e in ranked if top is None or e.rank <= top]
            alternatives = {}
            for e in sorted(kept, key=lambda e: e.rank):
                # tokens with the same text share a key: keep the likeliest
                alternatives.setdefault(_token_text(e), _lp(e.logprob))
        out["text_offset"].append(text_offset)
        out["tokens"].append(text)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(alternatives)
        text_offset += len(text)
    return out


def vllm_prompt_logprobs(entries: list[dict[int, Logprob] | None]) -> list:
    """vLLM's ``prompt_logprobs`` of a completion choice: per prompt token, None
    (the first) or ``{token id: {logprob, rank, decoded_token}}``."""

    def entry(e: Logprob) -> dict:
        return {"logprob": _lp(e.logprob), "rank": e.rank,
                "decoded_token": e.decoded_token}  # fmt: skip

    return [None if d is None else {str(t): entry(e) for t, e in d.items()}
            for d in entries]  # fmt: skip


def _chat_token(entry: Logprob) -> dict:
    text = _token_text(entry)
    return {"token": text, "logprob": _lp(entry.logprob), "bytes": list(text.encode())}


def chat_logprobs(
    token_ids: list[int], logprobs: list[dict[int, Logprob]], top: int
) -> list[dict]:
    """Chat's ``logprobs.content`` entries: each token with its ``top`` most
    likely alternatives, most likely first."""
    content = []
    for token, entries in zip(token_ids, logprobs):
        best = sorted(entries.values(), key=lambda e: e.rank)[:top]
        item = _chat_token(entries[token])
        item["top_logprobs"] = [_chat_token(e) for e in best]
        content.append(item)
    return content


def completion_choice(
    index: int,
    text: str,
    finish_reason: str | None,
    stop_reason: str | int | None = None,
    logprobs: dict | None = None,
) -> dict:
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def completion_body(
    rid: str, created: int, model: str, choices: list[dict], use: dict | None
) -> dict:
    """A ``text_completion`` object: the whole reply, or one stream chunk."""
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": use,
    }


def chat_choice(
    index: int,
    text: str,
    finish_reason: str | None,
    stop_reason: str | int | None = None,
    logprobs: list[dict] | None = None,
) -> dict:
    return {
        "index": index,
        "message": {"role": "assistant", "content": text},
        "logprobs": None if logprobs is None else {"content": logprobs},
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def chat_delta(
    index: int,
    delta: dict,
    finish_reason: str | None = None,
    stop_reason: str | int | None = None,
    logprobs: list[dict] | None = None,
) -> dict:
    return {
        "index": index,
        "delta": delta,
        "logprobs": None if logprobs is None else {"content": logprobs},
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def chat_body(
    rid: str,
    created: int,
    model: str,
    choices: list[dict],
    use: dict | None,
    chunk: bool = False,
) -> dict:
    """A ``chat.completion`` object, or a ``chat.completion.chunk``."""
    return {
        "id": rid,
        "object": "chat.completion.chunk" if chunk else "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": use,
    }
