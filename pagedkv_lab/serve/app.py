"""The HTTP routes: OpenAI's API as vLLM's server offers it, over one `EngineLoop`.

    GET  /health                 200 while the engine loop is alive
    GET  /version                the package's version
    GET  /v1/models              the served model name(s)
    GET  /metrics                Prometheus text (`metrics`)
    POST /v1/completions         a prompt (text or token ids, one or several);
                                 ``echo`` returns it, scored with ``logprobs``
    POST /v1/chat/completions    messages through the tokenizer's chat template
    POST /tokenize, /detokenize  the model's tokenizer (`tokenization`)
    GET  /tokenizer_info         its settings, with ``enable_tokenizer_info``

Both POST routes answer with one JSON body, or with ``"stream": true`` as
server-sent events (``data: {chunk}`` lines, then ``data: [DONE]``). A handler
checks the body, hands the request to the engine loop and turns the outputs
it receives into OpenAI's JSON (`protocol`). Every refusal is OpenAI's error
JSON: 400 for a bad body (the message names the field), 404 for a model name
this server does not serve (as vLLM and OpenAI answer), 503 when the waiting
queue is full or the server is stopping. A client that goes away aborts its
request: a stream is cancelled by the server when the client disconnects; a
plain request watches for the disconnect while it waits.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import (
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)

from pagedkv_lab import __version__
from pagedkv_lab.llm import LLM, RequestOutput
from pagedkv_lab.serve.engine_loop import EngineLoop, PromptEcho, RequestStream
from pagedkv_lab.serve.metrics import ServerMetrics
from pagedkv_lab.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    chat_body,
    chat_choice,
    chat_delta,
    chat_logprobs,
    completion_body,
    completion_choice,
    completion_logprobs,
    error_body,
    new_id,
    now,
    usage,
    vllm_prompt_logprobs,
)
from pagedkv_lab.serve.tokenization import (
    DetokenizeRequest,
    TokenizeRequest,
    detokenize,
    tokenize,
    tokenizer_info,
)


@dataclass
class _Choice:
    """One choice of a reply, as it accumulates."""

    prompt: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list | dict | None = None
    text_offset: int = 0
    started: bool = False
    echoed: bool = False
    ended: bool = False


@dataclass
class _Delta:
    """What one engine output added to a choice."""

    text: str
    token_ids: list[int]
    logprobs: list | dict | None


class _Reply:
    """Turns a request's outputs into OpenAI's JSON, for a completion or a chat:
    `update` takes one engine output and returns what it added to each choice,
    `chunks` makes the stream chunks of that, `body` the whole reply at the end.
    With vLLM's ``return_token_ids`` the choices carry their token ids, and the
    prompt's. A completion's ``echo`` puts the prompt (``echoes``) before each
    choice's first text, and its log-probabilities before the first tokens'."""

    def __init__(
        self,
        model: str,
        body: CompletionRequest | ChatCompletionRequest,
        logprobs: int | None,
        chat: bool,
        echoes: dict[int, PromptEcho] | None = None,
    ):
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created, self.model, self.n = now(), model, body.n
        self.logprobs, self.chat = logprobs, chat
        self.token_ids = bool(body.return_token_ids)
        self.echoes = echoes if not chat and body.echo else None
        self.scoring_only = not chat and body.scoring_only
        self.vllm_prompt_logprobs = not chat and body.prompt_logprobs is not None
        self.prompts: dict[int, list[int]] = {}
        self.prompt_logprobs: dict[int, list] = {}
        self.choices: dict[int, _Choice] = {}

    def usage(self) -> dict:
        return usage(
            sum(map(len, self.prompts.values())),
            sum(len(c.token_ids) for c in self.choices.values()),
        )

    def update(self, index: int, out: RequestOutput) -> list[tuple[int, _Delta]]:
        """Add prompt ``index``'s output; return ``(choice index, delta)`` for
        every choice that got tokens or ended."""
        if out.finish_reason == "error":
            raise RequestError(
                out.error or "the request failed", None, 500, "InternalServerError"
            )
        self.prompts[index] = out.prompt_token_ids
        if self.vllm_prompt_logprobs and out.prompt_logprobs is not None:
            self.prompt_logprobs[index] = out.prompt_logprobs
        changed = []
        for c in out.outputs:
            i = index * self.n + c.index
            choice = self.choices.setdefault(i, _Choice(index))
            if choice.ended:
                continue
            # scoring only (echo, max_tokens=0): the engine's one token is not shown
            shown = [] if self.scoring_only else list(c.token_ids)
            delta = _Delta("" if self.scoring_only else c.text, shown, None)
            parts = [(shown, c.logprobs or [], "")]
            if self.echoes is not None and not choice.echoed:
                echo, choice.echoed = self.echoes[index], True
                delta.text = echo.text + delta.text
                prompt_ids, prompt_lps = out.prompt_token_ids, out.prompt_logprobs
                parts.insert(0, (prompt_ids, prompt_lps or [], echo.first_token))
            if self.logprobs is not None:
                delta.logprobs = self._logprobs(choice, parts)
            choice.text += delta.text
            choice.token_ids += shown
            if c.finish_reason is not None:
                choice.finish_reason, choice.stop_reason = (
                    c.finish_reason,
                    c.stop_reason,
                )
                choice.ended = True
            if shown or delta.text or choice.ended:
                changed.append((i, delta))
        return changed

    def _logprobs(self, choice: _Choice, parts: list[tuple]):
        """The log-probabilities of ``parts`` (token ids, their entries, the
        text of a token without any), added to ``choice``; returns them."""
        if self.chat:
            ((ids, entries, _),) = parts
            piece = chat_logprobs(ids, entries, self.logprobs)
            choice.logprobs = (choice.logprobs or []) + piece
            return piece
        if choice.logprobs is None:
            choice.logprobs = {
                "text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []
            }  # fmt: skip
        piece = {k: [] for k in choice.logprobs}
        for ids, entries, unscored in parts:
            part = completion_logprobs(
                ids, entries, choice.text_offset, self.logprobs, unscored
            )
            choice.text_offset += sum(len(t) for t in part["tokens"])
            for k, v in part.items():
                piece[k] += v
                choice.logprobs[k] += v
        return piece

    def _ids(self, item: dict, choice: _Choice, token_ids: list[int], first: bool):
        if self.token_ids:
            item["token_ids"] = token_ids
            if not self.chat:
                item["prompt_token_ids"] = (
                    self.prompts[choice.prompt] if first else None
                )
        return item

    def chunks(self, i: int, delta: _Delta) -> list[dict]:
        """The stream chunks of one choice's delta."""
        choice = self.choices[i]
        first, choice.started = not choice.started, True
        reason = choice.finish_reason if choice.ended else None
        stop_reason = choice.stop_reason if reason else None
        if not self.chat:
            item = completion_choice(i, delta.text, reason, stop_reason, delta.logprobs)
            item = self._ids(item, choice, delta.token_ids, first)
            return [completion_body(self.id, self.created, self.model, [item], None)]
        out = []
        if first:
            role = chat_delta(i, {"role": "assistant", "content": ""})
            out.append(chat_body(self.id, self.created, self.model, [role], None, True))
        content = {"content": delta.text} if delta.text or not reason else {}
        item = chat_delta(i, content, reason, stop_reason, delta.logprobs)
        item = self._ids(item, choice, delta.token_ids, first)
        out.append(chat_body(self.id, self.created, self.model, [item], None, True))
        return out

    def body(self) -> dict:
        """The whole reply, choices in index order."""
        make = chat_choice if self.chat else completion_choice
        choices = sorted(self.choices.items())
        items = [
            self._ids(
                make(i, c.text, c.finish_reason, c.stop_reason, c.logprobs),
                c, c.token_ids, True,
            )
            for i, c in choices
        ]  # fmt: skip
        if self.vllm_prompt_logprobs:  # vLLM's field, per choice
            for item, (_, c) in zip(items, choices):
                entries = self.prompt_logprobs.get(c.prompt, [])
                item["prompt_logprobs"] = vllm_prompt_logprobs(entries)
        if self.chat:
            out = chat_body(self.id, self.created, self.model, items, self.usage())
            if self.token_ids:
                out["prompt_token_ids"] = self.prompts[0]
            return out
        return completion_body(self.id, self.created, self.model, items, self.usage())


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def _events(
    reply: _Reply, stream: RequestStream, engine: EngineLoop, options
) -> AsyncIterator[str]:
    """The server-sent events of a streamed reply; a client that leaves (the
    server cancels this generator) aborts the request."""
    include_usage = options is not None and options.include_usage
    continuous = options is not None and options.continuous_usage_stats
    try:
        try:
            async for index, out in stream:
                for i, delta in reply.update(index, out):
                    for chunk in reply.chunks(i, delta):
                        if continuous:
                            chunk["usage"] = reply.usage()
                        yield _sse(chunk)
            if include_usage:
                make = chat_body if reply.chat else completion_body
                last = make(reply.id, reply.created, reply.model, [], reply.usage())
                if reply.chat:
                    last["object"] = "chat.completion.chunk"
                yield _sse(last)
        except RequestError as err:
            yield _sse(error_body(err))
        yield _sse("[DONE]")
    finally:
        if not stream.finished:
            engine.abort(stream)


async def _until_disconnect(request: Request) -> None:
    """Return when the client disconnects (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _whole(request: Request, reply: _Reply, stream: RequestStream, engine):
    """Collect every output into one reply, or abort if the client leaves."""

    async def collect():
        async for index, out in stream:
            reply.update(index, out)
        return reply.body()

    work = asyncio.ensure_future(collect())
    gone = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            engine.abort(stream)
    if not work.done() or work.cancelled():
        return Response(status_code=499)  # the client closed the request
    return JSONResponse(work.result())


def _validation_error(exc: RequestValidationError) -> RequestError:
    """A body pydantic refused, as a 400 naming the field."""
    first = exc.errors()[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    field = loc[0] if loc else None
    path = ".".join(loc)
    if first["type"] == "json_invalid":
        detail = first.get("ctx", {}).get("error", first["msg"])
        return RequestError(f"malformed JSON body: {detail}")
    if first["type"] == "extra_forbidden":
        return RequestError(
            f"unsupported field '{path}': this server does not implement it "
            "(GET /docs lists the fields it takes)",
            field,
        )
    if first["type"] == "missing":
        return RequestError(f"missing field '{path}'", field)
    return RequestError(f"{path}: {first['msg']}" if path else first["msg"], field)


def build_app(
    llm: LLM,
    served_model_name: str | list[str],
    max_waiting: int | None = None,
    enable_tokenizer_info: bool = False,
) -> FastAPI:
    """The FastAPI application serving ``llm`` under ``served_model_name``
    (the first name is the one replies carry); ``GET /tokenizer_info`` only
    with ``enable_tokenizer_info`` (vLLM's ``--enable-tokenizer-info-endpoint``:
    it shows the chat template and the tokenizer's settings)."""
    names = (
        [served_model_name]
        if isinstance(served_model_name, str)
        else list(served_model_name)
    )
    metrics = ServerMetrics(names[0], llm.max_model_len)
    engine = EngineLoop(llm, metrics, max_waiting)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        try:
            yield
        finally:
            await engine.shutdown()

    app = FastAPI(title="pagedkv_lab", version=__version__, lifespan=lifespan)
    app.state.engine = engine

    @app.exception_handler(RequestError)
    async def refused(request: Request, err: RequestError):
        return JSONResponse(error_body(err), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        err = _validation_error(exc)
        return JSONResponse(error_body(err), status_code=err.status)

    def model_name(asked: str | None) -> str:
        if asked is None or asked in names:
            return asked or names[0]
        raise RequestError(
            f"The model `{asked}` does not exist. Valid names: {', '.join(names)}.",
            "model",
            404,
            "NotFoundError",
        )

    @app.get("/health")
    async def health():
        if engine.error is not None:
            return JSONResponse(
                error_body(RequestError(str(engine.error), None, 500)), 500
            )
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/v1/models")
    async def models():
        card = {"object": "model", "created": now(), "owned_by": "pagedkv-lab",
                "max_model_len": llm.max_model_len}  # fmt: skip
        return {"object": "list", "data": [{"id": n, **card} for n in names]}

    @app.get("/metrics")
    async def prometheus():
        text = metrics.render(engine.snapshot, engine.num_waiting)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def serve(request: Request, body, prompts: list[dict], chat: bool):
        model = model_name(body.model)
        params = body.to_sampling_params()
        arrival = time.perf_counter()
        echo = not chat and body.echo
        stream = await engine.submit(prompts, params, arrival, echo)
        reply = _Reply(model, body, params.logprobs, chat, stream.echoes)
        if body.stream:
            events = _events(reply, stream, engine, body.stream_options)
            return StreamingResponse(events, media_type="text/event-stream")
        return await _whole(request, reply, stream, engine)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await serve(request, body, body.prompts(), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        messages = [m.as_dict() for m in body.messages]
        prompt = {
            "messages": messages,
            "add_generation_prompt": body.add_generation_prompt,
        }
        return await serve(request, body, [prompt], chat=True)

    @app.post("/tokenize")
    async def tokenize_(body: TokenizeRequest):
        model_name(body.model)
        return await engine.run_in_worker(
            tokenize, llm.tokenizer, body, llm.max_model_len
        )

    @app.post("/detokenize")
    async def detokenize_(body: DetokenizeRequest):
        model_name(body.model)
        vocab_size = llm.model.config.vocab_size
        return await engine.run_in_worker(
            detokenize, llm.tokenizer, body, vocab_size, llm.max_model_len
        )

    if enable_tokenizer_info:

        @app.get("/tokenizer_info")
        async def tokenizer_info_():
            return await engine.run_in_worker(
                tokenizer_info, llm.tokenizer, llm.max_model_len
            )

    return app
