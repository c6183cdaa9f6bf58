"""What the engine hands back: text decoded as tokens arrive, stop strings,
log-probabilities and streamed or final `RequestOutput`s (vLLM's
``vllm/v1/engine/output_processor.py`` does this for its ``LLMEngine``).

`OutputProcessor`, which `LLM` holds, keeps a `RequestState` per request in
flight and reads the requests' sequences after each step; a stop string that
matches is handed back, for the engine core to end that sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv_lab.engine.sequence import Sequence, SequenceGroup
from pagedkv_lab.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    CompletionOutput,
    RequestOutput,
)
from pagedkv_lab.sampling_params import (
    BeamSearchParams,
    RequestOutputKind,
    SamplingParams,
)


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


@dataclass
class RequestState:
    """What the engine keeps per request besides its sequences: the id its
    caller gave, its (checked, private) parameters, its prompt's text, and per
    sequence the detokenizer, the stop reason and how much a ``DELTA`` stream
    has sent. What the parameters ask of every step is worked out once."""

    request_id: int | str
    group: SequenceGroup
    params: SamplingParams | BeamSearchParams
    prompt: str | None = None
    detokenizers: dict[int, IncrementalDetokenizer] = field(default_factory=dict)
    stop_reasons: dict[int, str | int] = field(default_factory=dict)
    # seq_id -> (tokens, characters) a DELTA stream has already sent.
    sent: dict[int, tuple[int, int]] = field(default_factory=dict)

    def __post_init__(self):
        p = self.params
        self.is_beam_search = isinstance(p, BeamSearchParams)
        self.streams = (not self.is_beam_search
                        and p.output_kind is not RequestOutputKind.FINAL_ONLY)  # fmt: skip
        # text decoded at every step: for streaming or stop strings
        self.needs_text = self.streams or bool(getattr(p, "stop", None))
        # characters held back while streaming: a stop string may still be completing
        self.held_chars = 0 if self.is_beam_search else p.output_text_buffer_length


class OutputProcessor:
    """Outputs of the engine's requests, from their sequences."""

    def __init__(self, tokenizer, eos_token_ids):
        self.tokenizer, self.eos_token_ids = tokenizer, eos_token_ids
        self.states: dict[int, RequestState] = {}  # the engine's number -> state
        self.external_ids: dict[str, int] = {}  # the ids callers gave -> numbers
        # Requests that need text or stop reasons at every step, and that
        # stream: a step looks only at these.
        self._watched: set[int] = set()
        self._streaming: set[int] = set()

    def add(self, group: SequenceGroup, params, prompt: str | None,
            request_id=None) -> int | str:  # fmt: skip
        """Track ``group``, made with ``params``; return the id its outputs will carry."""
        rid = group.request_id
        external = rid if request_id is None else request_id
        state = self.states[rid] = RequestState(external, group, params, prompt)
        if state.needs_text or state.params.stop_token_ids:
            self._watched.add(rid)
        if state.streams:
            self._streaming.add(rid)
        if request_id is not None:
            self.external_ids[request_id] = rid
        return external

    def internal_id(self, request_id) -> int | None:
        """The engine's number of a request in flight, from the id its outputs carry."""
        if isinstance(request_id, str):
            return self.external_ids.get(request_id)
        return request_id if request_id in self.states else None

    def update(self, groups: list[SequenceGroup]) -> list[tuple[SequenceGroup, Sequence]]:
        """After a step: for the requests among ``groups`` that need it, which
        stop token ended a sequence, and their new text; return the sequences
        a stop string ends, with their requests."""
        stopped = []
        for group in groups:
            if group.request_id in self._watched:
                stopped += self._update(group, self.states[group.request_id])
        return stopped

    def _update(self, group: SequenceGroup, state: RequestState) -> list:
        p = state.params
        needs_text = state.needs_text and self.tokenizer is not None
        stopped = []
        for seq in group.seqs:
            last = seq.token_ids[-1]
            if (seq.finish_reason == "stop" and last in p.stop_token_ids
                    and len(seq.token_ids) > seq.num_prompt_tokens
                    and not self._is_eos(last, p)):  # fmt: skip
                state.stop_reasons.setdefault(seq.seq_id, last)
            if not needs_text:
                continue
            out = seq.token_ids[seq.num_prompt_tokens :]
            det = state.detokenizers.get(seq.seq_id)
            if det is None:
                det = IncrementalDetokenizer(self.tokenizer, p.skip_special_tokens)
                state.detokenizers[seq.seq_id] = det
            visible = len(out) - self._hides_last_token(seq, state)
            if det.stopped or len(det.ids) >= visible:
                continue
            before = len(det.text)
            det.add(out[len(det.ids) : visible])
            if p.stop and len(out) > p.min_tokens:
                found = det.stop_at(p.stop, before, p.include_stop_str_in_output)
                if found is not None:
                    state.stop_reasons[seq.seq_id] = found
                    if seq.finish_reason is None:
                        stopped.append((group, seq))
        return stopped

    def outputs(self, finished, failed, advanced, now: float) -> list[RequestOutput]:
        """A step's outputs: the final one of every request in ``finished``, of
        every ``(request, error)`` in ``failed``, and a streamed one for every
        unfinished request of ``advanced`` that streams."""
        outputs = [self.final(g, now) for g in dict.fromkeys(finished)
                   if g.request_id in self.states]  # fmt: skip
        outputs += [self.final(g, now, f"{type(e).__name__}: {e}") for g, e in failed
                    if g.request_id in self.states]  # fmt: skip
        streaming = self._streaming
        outputs += [self.output(g, now) for g in dict.fromkeys(advanced)
                    if g.request_id in streaming
                    and any(s.finish_reason is None for s in g.seqs)]  # fmt: skip
        return outputs

    def final(self, group: SequenceGroup, now: float, error: str | None = None) -> RequestOutput:
        """The request's last output; the processor forgets it."""
        state = self.states.pop(group.request_id)
        self._watched.discard(group.request_id)
        self._streaming.discard(group.request_id)
        if isinstance(state.request_id, str):
            self.external_ids.pop(state.request_id, None)
        group.metrics.finish_time = now
        return self.output(group, now, error, state=state)

    def output(self, group: SequenceGroup, now: float, error: str | None = None,
               state: RequestState | None = None) -> RequestOutput:  # fmt: skip
        """The request's output so far (its last, given its popped ``state``)."""
        final = state is not None
        state = state or self.states[group.request_id]
        metrics, seq = group.metrics, group.seqs[0]
        prompt_ids = seq.token_ids[: seq.num_prompt_tokens]
        if state.is_beam_search:
            results = group.results()
            metrics.num_output_tokens = max((len(r[0]) for r in results), default=0)
            outputs = [CompletionOutput(i, self._decode(tokens), tokens, cum, reason, score)
                       for i, (tokens, cum, reason, score) in enumerate(results)]  # fmt: skip
            return RequestOutput(state.request_id, state.prompt, prompt_ids, outputs, metrics,
                                 error)  # fmt: skip
        seqs = group.seqs
        if len(seqs) > 1:  # samples in order
            seqs = sorted(seqs, key=lambda s: s.sample_index)
        metrics.num_output_tokens = max(len(s.token_ids) - s.num_prompt_tokens for s in seqs)
        outputs = [self._completion(i, s, group, state) for i, s in enumerate(seqs)]
        prompt = group.prompt_logprobs  # the prompt's (None where not asked)
        if prompt is not None:
            self._name_tokens([d for d in prompt if d is not None])
        return RequestOutput(state.request_id, state.prompt, prompt_ids, outputs, metrics,
                             error, finished=final,
                             num_cached_tokens=group.num_cached_tokens or 0,
                             prompt_logprobs=prompt)  # fmt: skip

    def _completion(self, index: int, seq: Sequence, group: SequenceGroup,
                    state: RequestState) -> CompletionOutput:  # fmt: skip
        """One completion, as its request's ``output_kind`` asks (a ``DELTA``
        output has only what is new)."""
        p = state.params
        tokens = seq.token_ids[seq.num_prompt_tokens :]
        det = state.detokenizers.get(seq.seq_id)
        if det is not None:
            if seq.finish_reason is not None:
                det.flush()
            text = det.text
            held = state.held_chars
            if held and seq.finish_reason is None:
                text = text[: max(0, len(text) - held)]
        else:
            visible = len(tokens) - self._hides_last_token(seq, state)
            text = self._decode(tokens[:visible], p.skip_special_tokens)
        logprobs = None if p.logprobs is None else self._logprobs(group, seq)
        if p.output_kind is RequestOutputKind.DELTA:
            sent_tokens, sent_chars = state.sent.get(seq.seq_id, (0, 0))
            state.sent[seq.seq_id] = (len(tokens), len(text))
            tokens, text = tokens[sent_tokens:], text[sent_chars:]
            if logprobs is not None:
                logprobs = logprobs[sent_tokens:]
        return CompletionOutput(index, text, list(tokens), seq.cumulative_logprob,
                                seq.finish_reason, logprobs=logprobs,
                                stop_reason=state.stop_reasons.get(seq.seq_id))  # fmt: skip

    def _decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def _is_eos(self, token: int, params) -> bool:
        return not params.ignore_eos and token in self.eos_token_ids

    def _hides_last_token(self, seq: Sequence, state: RequestState) -> bool:
        """Whether the text leaves out the last token: a stop token (EOS or one
        of ``stop_token_ids``) ended the sequence, as in vLLM, unless
        ``include_stop_str_in_output``."""
        return (seq.finish_reason == "stop"
                and not isinstance(state.stop_reasons.get(seq.seq_id), str)
                and not state.params.include_stop_str_in_output
                and len(seq.token_ids) > seq.num_prompt_tokens)  # fmt: skip

    def _logprobs(self, group: SequenceGroup, seq: Sequence):
        """``seq``'s per-token log-probabilities, their tokens' text filled in."""
        entries = group.logprobs.get(seq.seq_id, [])
        self._name_tokens(entries)
        return list(entries)

    def _name_tokens(self, entries: list[dict]) -> None:
        """Fill in the text of every `Logprob` in ``entries`` that has none (as
        vLLM's do, each token decoded alone)."""
        if self.tokenizer is None:
            return
        todo = [(t, lp) for d in entries for t, lp in d.items() if lp.decoded_token is None]
        texts = self.tokenizer.batch_decode([[t] for t, _ in todo])
        for (_, lp), text in zip(todo, texts):
            lp.decoded_token = text


def beam_search_output(out: RequestOutput) -> BeamSearchOutput:
    """A finished beam-search request's output as a `BeamSearchOutput`, its
    ``sequences`` best first."""
    seqs = [BeamSearchSequence(c.token_ids, c.text, c.cumulative_logprob, c.score,
                               c.finish_reason) for c in out.outputs]  # fmt: skip
    return BeamSearchOutput(out.request_id, out.prompt_token_ids, seqs)
