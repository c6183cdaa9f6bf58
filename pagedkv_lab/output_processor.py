"""What the engine hands back: text decoded as tokens arrive, stop strings,
log-probabilities and streamed or final `RequestOutput`s (vLLM's
``vllm/v1/engine/output_processor.py`` does this for its ``LLMEngine``).

`OutputProcessor` is the part of `LLMEngine` (chapter 06) that turns the
sequences of a request into its outputs. It needs the engine's ``tokenizer``,
``eos_token_ids``, ``scheduler``, ``stats`` and its request tables (made by
`InputProcessor._init_requests`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .engine import Sequence
from .outputs import CompletionOutput, RequestOutput
from .sampling import top_logprobs
from .sampling_params import RequestOutputKind, SamplingParams
from .tokenizing import IncrementalDetokenizer


@dataclass
class RequestState:
    """What the engine keeps per request, besides its sequences: the id its
    caller gave, its (checked, private) parameters, and per sequence the
    detokenizer, the stop reason and how much a ``DELTA`` stream has sent."""

    request_id: int | str
    params: SamplingParams
    detokenizers: dict[int, IncrementalDetokenizer] = field(default_factory=dict)
    stop_reasons: dict[int, str | int] = field(default_factory=dict)
    # seq_id -> (tokens, characters) a DELTA stream has already sent.
    sent: dict[int, tuple[int, int]] = field(default_factory=dict)
    prompt_logprobs: list | None = None

    @property
    def streams(self) -> bool:
        return self.params.output_kind is not RequestOutputKind.FINAL_ONLY

    @property
    def needs_text(self) -> bool:
        """Whether text is decoded at every step (for streaming or stop strings)."""
        return self.streams or bool(self.params.stop)


class OutputProcessor:
    """Outputs of the engine's requests. A mixin of `LLMEngine`."""

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
        p = state.params
        return (
            seq.finish_reason == "stop"
            and not isinstance(state.stop_reasons.get(seq.seq_id), str)
            and not p.include_stop_str_in_output
            and bool(seq.output_token_ids)
        )

    def _postprocess(self, group, state: RequestState) -> None:
        """After a step: which stop token ended a sequence, and, where text is
        needed at every step (streaming, stop strings), its new text; a stop
        string ends the sequence there."""
        p = state.params
        needs_text = state.needs_text and self.tokenizer is not None
        for seq in group.seqs:
            last = seq.token_ids[-1]
            if (
                seq.finish_reason == "stop"
                and last in p.stop_token_ids
                and seq.num_tokens > seq.num_prompt_tokens
                and not self._is_eos(last, p)
            ):
                state.stop_reasons.setdefault(seq.seq_id, last)
            if not needs_text:
                continue
            out = seq.output_token_ids
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
                    seq.finish_reason = "stop"
                    state.stop_reasons[seq.seq_id] = found

    def _prompt_rows(self, seqs, num_new_tokens, groups) -> list[tuple[int, int, int]]:
        """For each of ``seqs`` whose request still needs prompt log-probabilities
        (``prompt_logprobs``) and computes some of those positions now: (its
        index, the first such position's offset in its chunk, how many).

        Position ``p`` predicts token ``p + 1``; a request preempted halfway
        recomputes its prompt but gets each position's entry once.
        """
        wanted = []
        if not self._prompt_logprob_requests:
            return wanted
        for i, (seq, n, group) in enumerate(zip(seqs, num_new_tokens, groups)):
            if group.request_id not in self._prompt_logprob_requests:
                continue
            state = self._states.get(group.request_id)
            if state is None:
                continue
            first = seq.num_computed_tokens
            # Entries exist for tokens 0 .. have - 1: start at position have - 1.
            start = max(first, len(state.prompt_logprobs) - 1)
            count = min(first + n, seq.num_prompt_tokens - 1) - start
            if count > 0:
                wanted.append((i, start - first, count))
        return wanted

    def _keep_prompt_logprobs(self, plan, failed, prompt_rows) -> None:
        """Turn a step's prompt logits into ``prompt_logprobs`` entries (not for
        the plan indices in ``failed``)."""
        for i, (start, logits) in prompt_rows.items():
            if i in failed:
                continue
            seq = plan.seqs[i]
            state = self._states[plan.groups[i].request_id]
            targets = seq.token_ids[start + 1 : start + 1 + len(logits)]
            entries = top_logprobs(
                logits.log_softmax(-1),
                torch.tensor(targets, device=logits.device),
                [state.params.prompt_logprobs] * len(targets),
            )
            self._name_tokens(entries)
            state.prompt_logprobs += entries

    def _name_tokens(self, entries: list[dict]) -> None:
        """Fill in the text of every `Logprob` in ``entries`` that has none (as
        vLLM's do, each token decoded alone)."""
        if self.tokenizer is None:
            return
        todo = [
            (t, lp) for d in entries for t, lp in d.items() if lp.decoded_token is None
        ]
        texts = self.tokenizer.batch_decode([[t] for t, _ in todo])
        for (_, lp), text in zip(todo, texts):
            lp.decoded_token = text

    def _logprobs(self, group, seq: Sequence):
        """``seq``'s per-token log-probabilities, their tokens' text filled in."""
        entries = group.logprobs.get(seq.seq_id, [])
        self._name_tokens(entries)
        return list(entries)

    def _completion(
        self, index: int, seq: Sequence, group, state: RequestState
    ) -> CompletionOutput:
        """One completion of a request with a `RequestState`, as its
        ``output_kind`` asks (a ``DELTA`` output has only what is new)."""
        p = state.params
        tokens = seq.output_token_ids
        det = state.detokenizers.get(seq.seq_id)
        if det is not None:
            if seq.is_finished:
                det.flush()
            text = det.text
            held = p.output_text_buffer_length
            if held and not seq.is_finished:
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
        return CompletionOutput(
            index,
            text,
            list(tokens),
            seq.cumulative_logprob,
            seq.finish_reason,
            logprobs=logprobs,
            stop_reason=state.stop_reasons.get(seq.seq_id),
        )

    def _output(
        self, group, now: float, error: str | None = None, final: bool = True
    ) -> RequestOutput:
        """The request's output: ``final`` when it is done (then the engine
        forgets it), otherwise a streamed one."""
        rid = group.request_id
        if final:
            _, prompt, metrics = self._requests.pop(rid)
            state = self._states.pop(rid, None)
            for tracked in self._tracked_requests:
                tracked.discard(rid)
            if state is not None and isinstance(state.request_id, str):
                self._external_ids.pop(state.request_id, None)
            metrics.finish_time = now
        else:
            _, prompt, metrics = self._requests[rid]
            state = self._states[rid]
        seq = group.seqs[0]
        prompt_ids = seq.token_ids[: seq.num_prompt_tokens]
        if state is None:
            # Beam search, or a group queued by hand: chapter 06's output.
            results = group.results()
            metrics.num_output_tokens = max((len(r[0]) for r in results), default=0)
            outputs = [
                CompletionOutput(i, self._decode(tokens), tokens, cum, reason, score)
                for i, (tokens, cum, reason, score) in enumerate(results)
            ]
            return RequestOutput(rid, prompt, prompt_ids, outputs, metrics, error)
        seqs = sorted(group.seqs, key=lambda s: s.sample_index)
        metrics.num_output_tokens = max(len(s.output_token_ids) for s in seqs)
        outputs = [self._completion(i, s, group, state) for i, s in enumerate(seqs)]
        return RequestOutput(
            state.request_id,
            prompt,
            prompt_ids,
            outputs,
            metrics,
            error,
            finished=final,
            num_cached_tokens=group.num_cached_tokens or 0,
            prompt_logprobs=state.prompt_logprobs,
        )

    @torch.inference_mode()
    def _prompt_logits(self, seqs, num_new_tokens, wanted, pending=None):
        """The runner's forward pass with extra rows: logits of each sequence's
        last new token, and ``{index: (first position, logits)}`` for the
        prompt positions ``wanted`` (`_prompt_rows`) of this step."""
        step = self.runner.prepare(seqs, num_new_tokens, pending=pending)
        starts = step.query_start_loc.tolist()
        extra = [starts[i] + off + j for i, off, count in wanted for j in range(count)]
        index = torch.tensor(extra, device=step.logits_index.device)
        step.logits_index = torch.cat([step.logits_index, index])
        logits = self.runner.forward(step).float()
        main, rest = logits[: len(seqs)], logits[len(seqs) :]
        prompt, at = {}, 0
        for i, offset, count in wanted:
            start = seqs[i].num_computed_tokens + offset
            prompt[i], at = (start, rest[at : at + count]), at + count
        return main, prompt

    def _mark_scheduled(self, group, seq: Sequence) -> None:
        """Note when a request's prompt is first computed (its metrics)."""
        if seq.num_computed_tokens < seq.num_prompt_tokens:
            metrics = self._requests[group.request_id][2]
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = self._now()

    def _postprocess_groups(self, groups, now: float, outputs: list) -> list:
        """After sampling: text, stop strings and stop reasons of the groups
        that sampled and need them (one that raises here fails alone), and the
        time of each request's first token. Returns the groups a stop string
        ended."""
        ended, texts, first = [], self._text_requests, self._awaiting_first_token
        for group in groups:
            rid = group.request_id
            if rid in texts:
                try:
                    self._postprocess(group, self._states[rid])
                except Exception as err:
                    outputs.append(self._fail(group, err))
                    continue
                if any(s.is_finished for s in group.seqs):
                    ended.append(group)
            if rid in first:
                first.discard(rid)
                self._requests[rid][2].first_token_time = now
        return ended

    def _streamed(self, groups, now: float) -> list[RequestOutput]:
        """The outputs of a step for the unfinished requests among ``groups``
        that stream (``output_kind`` not ``FINAL_ONLY``)."""
        streaming = self._streaming
        return [
            self._output(g, now, final=False)
            for g in groups
            if g.request_id in streaming and not g.is_finished
        ]

    def _fail(self, group, err: BaseException) -> RequestOutput:
        """End ``group`` with ``finish_reason="error"``; nothing else is touched."""
        return self._finish_early(group, "error", f"{type(err).__name__}: {err}")

    def _finish_early(self, group, reason: str, error: str | None = None):
        """End ``group`` now (``"abort"`` or ``"error"``): its blocks go back at
        once, nothing else is touched; returns its output so far."""
        self.scheduler.remove(group)
        for seq in group.seqs:
            if not seq.is_finished:
                seq.finish_reason = reason
        if reason == "abort":
            self.stats.aborts += 1
        else:
            self.stats.errors += 1
        return self._output(group, self._now(), error)


def beam_search_output(out: RequestOutput):
    """A finished beam-search request's output as a `BeamSearchOutput`
    (chapter 07), its ``sequences`` best first."""
    from .groups import BeamSearchOutput, BeamSearchSequence

    seqs = [
        BeamSearchSequence(
            c.token_ids, c.text, c.cumulative_logprob, c.score, c.finish_reason
        )
        for c in out.outputs
    ]
    return BeamSearchOutput(out.request_id, out.prompt_token_ids, seqs)
