"""One loop owns the engine: HTTP handlers enqueue requests and read their outputs.

vLLM's server splits the work the same way (its ``AsyncLLM`` and engine core):
the handlers never touch the engine. They hand a request to `EngineLoop.submit`,
which queues it and returns a `RequestStream`; one asyncio task, `EngineLoop._run`,
takes everything queued since the last step, and in one worker thread adds it
to the `LLM` (`LLM.add_request`), applies the aborts (`LLM.abort`), runs one
`LLM.step` and reads the engine's counters. Back on the event loop it hands
each output to its request's stream. So:

* only the worker thread touches the `LLM` (its tokenizer included), one call
  at a time, and no lock is held while a step runs: the event loop keeps
  accepting, answering ``/metrics`` and streaming while the worker steps
  (``/tokenize`` and ``/detokenize`` run there too, between two steps:
  `run_in_worker`; so does the decoding of an echoed prompt);
* requests join the engine in arrival order at the next step boundary, and
  the engine's own FCFS scheduler serves them, so none is starved;
* a request whose client is gone is aborted at the next step boundary, and
  its blocks go back to the pool (`abort`);
* a bad request is refused by `LLM.add_request` before anything is queued,
  so it disturbs nothing in flight; the refusal reaches its handler as a
  `RequestError` (HTTP 400).

Requests are added with ``RequestOutputKind.DELTA``: every step yields only
what is new, which both streaming and the metrics (time to first token) use.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from pagedkv_lab.llm import LLM, RequestOutput
from pagedkv_lab.sampling_params import SamplingParams
from pagedkv_lab.serve.metrics import EngineSnapshot, ServerMetrics
from pagedkv_lab.serve.protocol import RequestError
from pagedkv_lab.tokenizing import chat_prompts

logger = logging.getLogger("pagedkv_lab.serve")


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True):
    """A conversation as the engine's prompt, exactly as `LLM.chat` renders it
    (`tokenizing.chat_prompts`); a template problem is the request's error."""
    try:
        (prompt,) = chat_prompts(tokenizer, messages, None, add_generation_prompt)
    except ValueError as err:
        raise RequestError(str(err), "messages") from None
    return {"prompt": prompt["prompt"], "prompt_token_ids": list(prompt["prompt_token_ids"])}


@dataclass
class PromptEcho:
    """What a completion's ``echo`` returns of a prompt besides its
    log-probabilities: its text (a token-id prompt decoded) and the text of
    its first token, which has no log-probability to carry one. Both are
    decoded in the worker thread, when the prompt joins the engine."""

    text: str
    first_token: str


class RequestStream:
    """The outputs of one HTTP request: one engine request per prompt (a
    completion may carry several prompts), each output tagged with its
    prompt's index. Iterate it to get ``(prompt index, RequestOutput)`` until
    every engine request has finished; if the engine fails, iterating raises
    its `RequestError`. With ``echo``, ``echoes`` holds each prompt's
    `PromptEcho`."""

    def __init__(self, request_ids: list[str], arrival: float):
        self.request_ids = request_ids
        self.arrival = arrival
        self.unfinished = set(request_ids)
        self.echoes: dict[int, PromptEcho] = {}
        self._queue: asyncio.Queue = asyncio.Queue()

    @property
    def finished(self) -> bool:
        return not self.unfinished

    def put(self, index: int, output: RequestOutput) -> None:
        if output.finished:
            self.unfinished.discard(self.request_ids[index])
        self._queue.put_nowait((index, output))

    def fail(self, error: RequestError) -> None:
        self.unfinished.clear()
        self._queue.put_nowait((None, error))

    def __aiter__(self):
        return self._outputs()

    async def _outputs(self):
        done = 0
        while done < len(self.request_ids):
            index, output = await self._queue.get()
            if isinstance(output, RequestError):
                raise output
            done += output.finished
            yield index, output


@dataclass
class _Submission:
    """Requests waiting to join the engine at the next step boundary."""

    stream: RequestStream
    prompts: list[dict]
    params: SamplingParams
    added: asyncio.Future
    echo: bool = False
    error: Exception | None = None


@dataclass
class _Route:
    """Where a request's outputs go, and what the metrics need of it."""

    stream: RequestStream
    index: int
    first_token: float | None = None
    tokens: dict[int, int] = field(default_factory=dict)


class EngineLoop:
    """Owns an `LLM` and steps it while any request is unfinished.

    ``max_waiting`` bounds the requests that wait for the engine (queued here
    or in the scheduler's waiting queue); past it `submit` raises a 503
    `RequestError`.
    """

    def __init__(
        self,
        llm: LLM,
        metrics: ServerMetrics,
        max_waiting: int | None = None,
    ):
        self.llm = llm
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.snapshot = self._read_engine()
        self.error: BaseException | None = None
        self._pending: list[_Submission] = []
        self._aborts: list[str] = []
        self._in_transit = 0
        self._routes: dict[str, _Route] = {}
        self._ids = itertools.count()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._closing = False

    # ---- the event loop's side -------------------------------------------

    async def start(self) -> None:
        """Start the loop task (inside the server's event loop)."""
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="engine-loop")

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: queued here, on their way into the
        engine, or in its waiting queue at the last step."""
        queued = sum(len(s.prompts) for s in self._pending)
        return queued + self._in_transit + self.snapshot.num_waiting

    async def submit(
        self,
        prompts: list[dict],
        params: SamplingParams,
        arrival: float,
        echo: bool = False,
    ) -> RequestStream:
        """Queue one request per prompt; return their stream once the engine has
        taken them, or raise `RequestError` (400 if the engine refused them, 503
        if the waiting queue is full or the server is stopping). With ``echo``
        the stream carries each prompt's `PromptEcho`."""
        self._check_open()
        if self.error is not None:
            raise RequestError(f"the engine failed: {self.error}", None, 500)
        if self.max_waiting is not None and self.num_waiting >= self.max_waiting:
            raise RequestError(
                f"the waiting queue is full ({self.max_waiting} requests); retry later",
                None,
                503,
                "ServiceUnavailableError",
            )
        base = f"req-{next(self._ids)}"
        stream = RequestStream([f"{base}-{i}" for i in range(len(prompts))], arrival)
        for i, rid in enumerate(stream.request_ids):
            self._routes[rid] = _Route(stream, i)
        sub = _Submission(
            stream, prompts, params, asyncio.get_running_loop().create_future(), echo
        )
        self._pending.append(sub)
        self._wake.set()
        try:
            await sub.added
        except asyncio.CancelledError:
            self.abort(stream)
            raise
        return stream

    async def run_in_worker(self, fn, *args):
        """``fn(*args)`` in the worker thread, between two steps: the one place
        the engine's tokenizer is used (``/tokenize``, ``/detokenize``)."""
        self._check_open()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, fn, *args)

    def _check_open(self) -> None:
        if self._closing:
            raise RequestError("the server is shutting down", None, 503)

    def abort(self, stream: RequestStream) -> None:
        """Abort what is unfinished of ``stream`` at the next step boundary."""
        self._aborts += sorted(stream.unfinished)
        self._wake.set()

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Refuse new requests, abort those in flight, stop the loop."""
        self._closing = True
        for route in list(self._routes.values()):
            self.abort(route.stream)
        if self._task is not None:
            self._wake.set()
            try:
                await asyncio.wait_for(self._task, timeout)
            except TimeoutError:
                logger.warning("the engine loop did not stop in %.0f s", timeout)
        self._executor.shutdown(wait=True)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not (self._pending or self._aborts or self.snapshot.has_unfinished):
                if self._closing:
                    return
                await self._wake.wait()
                self._wake.clear()
                continue
            subs, self._pending = self._pending, []
            aborts, self._aborts = self._aborts, []
            self._in_transit = sum(len(s.prompts) for s in subs)
            try:
                outputs, snapshot, seconds = await loop.run_in_executor(
                    self._executor, self._work, subs, aborts
                )
            except Exception as err:  # the engine itself broke: fail everything
                logger.exception("engine step failed")
                self._fail_all(subs, err)
                return
            finally:
                self._in_transit = 0
            self._deliver(subs, outputs, snapshot, seconds)

    def _deliver(self, subs, outputs, snapshot, seconds) -> None:
        """Back on the event loop: answer the submissions, route the outputs."""
        previous, self.snapshot = self.snapshot, snapshot
        self.metrics.observe_step(
            seconds, snapshot.tokens_computed - previous.tokens_computed
        )
        for sub in subs:
            if sub.error is not None:
                for rid in sub.stream.request_ids:
                    self._routes.pop(rid, None)
                if not sub.added.done():
                    sub.added.set_exception(sub.error)
            elif not sub.added.done():
                sub.added.set_result(None)
        now = time.perf_counter()
        for out in outputs:
            route = self._routes.get(out.request_id)
            if route is None:
                continue
            self._observe(route, out, now)
            if out.finished:
                del self._routes[out.request_id]
            route.stream.put(route.index, out)

    def _observe(self, route: _Route, out: RequestOutput, now: float) -> None:
        """Token counters and the request's latency histograms."""
        new = sum(len(c.token_ids) for c in out.outputs)
        if route.first_token is None and new:
            route.first_token = now
            self.metrics.observe_first_token(
                now - route.stream.arrival, len(out.prompt_token_ids)
            )
        for c in out.outputs:
            route.tokens[c.index] = route.tokens.get(c.index, 0) + len(c.token_ids)
        self.metrics.generation_tokens += new
        if out.finished:
            longest = max(route.tokens.values(), default=0)
            self.metrics.observe_finished(
                out.finish_reason or "abort",
                now - route.stream.arrival,
                None if route.first_token is None else now - route.first_token,
                longest,
            )

    def _fail_all(self, subs, err: BaseException) -> None:
        self.error = err
        failure = RequestError(
            f"the engine failed: {err}", None, 500, "InternalServerError"
        )
        for sub in subs + self._pending:
            if not sub.added.done():
                sub.added.set_exception(failure)
        for stream in {id(r.stream): r.stream for r in self._routes.values()}.values():
            stream.fail(failure)
        self._routes.clear()

    # ---- the worker thread's side ------------------------------------------

    def _work(self, subs: list[_Submission], aborts: list[str]):
        """Add, abort, step once, read the counters (in the worker thread)."""
        for sub in subs:
            try:
                self._add(sub)
            except RequestError as err:
                sub.error = err
        outputs = [o for rid in aborts if (o := self.llm.abort(rid)) is not None]
        seconds = None
        if self.llm.has_unfinished_requests():
            start = time.perf_counter()
            outputs += self.llm.step()
            seconds = time.perf_counter() - start
        return outputs, self._read_engine(), seconds

    def _add(self, sub: _Submission) -> None:
        """Add every prompt of ``sub`` to the engine, or none of them. Whatever
        the engine, the tokenizer or a chat template refuses is the request's
        fault (a 400), never the loop's."""
        added = []
        try:
            for i, (rid, prompt) in enumerate(zip(sub.stream.request_ids, sub.prompts)):
                prompt = self._tokenize(prompt)
                self._check_length(prompt["prompt_token_ids"], sub.params)
                self.llm.add_request(rid, prompt, sub.params)
                added.append(rid)
                if sub.echo:  # the ids are checked: decode what echo returns
                    sub.stream.echoes[i] = self._echo(prompt)
        except Exception as err:
            for rid in added:
                self.llm.abort(rid)
            if isinstance(err, RequestError):
                raise
            param = "messages" if "messages" in sub.prompts[0] else "prompt"
            raise RequestError(str(err), param) from None

    def _tokenize(self, prompt: dict) -> dict:
        """The prompt with its token ids (a chat through the chat template)."""
        tokenizer = self.llm.tokenizer
        if "messages" in prompt:
            return render_chat(
                tokenizer, prompt["messages"], prompt.get("add_generation_prompt", True)
            )
        if "prompt_token_ids" in prompt:
            return prompt
        text = prompt["prompt"]
        if not text:
            raise RequestError("prompt must not be empty", "prompt")
        return {"prompt": text, "prompt_token_ids": list(tokenizer(text).input_ids)}

    def _echo(self, prompt: dict) -> PromptEcho:
        """A prompt's text and its first token's, as echo returns them."""
        tokenizer, ids = self.llm.tokenizer, prompt["prompt_token_ids"]
        if tokenizer is None:
            raise RequestError("echo needs a tokenizer; this model has none", "echo")
        text = prompt.get("prompt")
        if text is None:
            text = tokenizer.decode(ids)
        return PromptEcho(text, tokenizer.decode(ids[:1]))

    def _check_length(self, ids: list[int], params: SamplingParams) -> None:
        """vLLM's rule: the prompt and ``max_tokens`` must fit ``max_model_len``."""
        limit = self.llm.max_model_len
        if len(ids) >= limit:
            raise RequestError(
                f"the prompt has {len(ids)} tokens; this model's maximum context "
                f"length is {limit} tokens, which leaves no room for output",
                "prompt",
            )
        if params.max_tokens is not None and len(ids) + params.max_tokens > limit:
            raise RequestError(
                f"max_tokens={params.max_tokens} is too large: this model's maximum "
                f"context length is {limit} tokens and the prompt has {len(ids)} "
                f"({params.max_tokens} > {limit} - {len(ids)})",
                "max_tokens",
            )

    def _read_engine(self) -> EngineSnapshot:
        """The engine's queues, blocks and counters, read between steps."""
        llm = self.llm
        sched, bm = llm.scheduler, llm.block_manager
        prefix = getattr(bm, "stats", None)
        return EngineSnapshot(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting) + len(getattr(sched, "swapped", ())),
            num_blocks=bm.num_blocks,
            num_free_blocks=bm.num_free_blocks,
            prefix_cache_queries=getattr(prefix, "queries", 0),
            prefix_cache_hits=getattr(prefix, "hits", 0),
            preemptions=llm.stats.preemptions,
            tokens_computed=llm.stats.tokens_computed,
            has_unfinished=llm.has_unfinished_requests(),
        )
