"""What a request gives back, with vLLM's names: `RequestOutput`, one
`CompletionOutput` per sequence, its `RequestMetrics`, and `Logprob` entries.

vLLM keeps these in ``vllm/outputs.py`` (``RequestOutput``,
``CompletionOutput``), ``vllm/logprobs.py`` (``Logprob``) and its metrics
module; here they are plain data classes, built by the engine
(`pagedkv_lab.output_processor`) and read by the user.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    """A token's log-probability at one position, its rank in the vocabulary
    (1 = most likely) and its text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class RequestMetrics:
    """Times in seconds since the engine started."""

    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    num_output_tokens: int = 0
    # When the request was first scheduled (left the waiting queue).
    first_scheduled_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float:
        """Mean gap between output tokens after the first (0 for a single token)."""
        gaps = self.num_output_tokens - 1
        if gaps <= 0 or self.first_token_time is None:
            return 0.0
        return (self.finish_time - self.first_token_time) / gaps

    @property
    def e2e_latency(self) -> float | None:
        if self.finish_time is None:
            return None
        return self.finish_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One generated sequence of a request (a request with ``n`` > 1 has several)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float
    finish_reason: str | None
    # Beam search: the length-penalised score the beams were ranked by.
    score: float | None = None
    # Per generated token, with SamplingParams(logprobs=N): {token id: Logprob},
    # the sampled token first, then the N most likely.
    logprobs: list[dict[int, Logprob]] | None = None
    # The stop string or stop token id that ended it (None: EOS, length...).
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's prompt, its completions and its timings.

    ``finish_reason`` is ``"stop"`` (EOS, a stop token or a stop string),
    ``"length"``, ``"abort"`` (`LLM.abort`) or ``"error"`` (then ``error`` says
    what failed); None while ``finished`` is False (a streamed output of
    `LLM.step`). ``text``, ``token_ids`` and ``finish_reason`` are those
    of ``outputs[0]``. ``request_id`` is the id given to `add_request`, or the
    engine's own number. ``num_cached_tokens`` counts the prompt tokens whose
    K/V came from the prefix cache; ``prompt_logprobs`` (with
    ``SamplingParams(prompt_logprobs=N)``) has one entry per prompt token, None
    for the first.
    """

    request_id: int | str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics
    error: str | None = None
    finished: bool = True
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


@dataclass
class BeamSearchSequence:
    """One finished hypothesis of a beam search: generated tokens, their text
    and scores (vLLM keeps it in ``vllm/beam_search.py``)."""

    token_ids: list[int]
    text: str
    cum_logprob: float
    score: float
    finish_reason: str


@dataclass
class BeamSearchOutput:
    """The result of one prompt's beam search (`LLM.beam_search`): its
    ``sequences``, best first."""

    request_id: int
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence]
