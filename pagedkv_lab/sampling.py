"""vLLM's sampling settings on top of chapter 05's sampler: penalties, ``min_p``,
``min_tokens``, stop strings, log-probabilities and streaming output kinds.

Chapter 05's `pagedkv_lab.engine.SamplingParams` has what the course needs
(greedy, temperature, top-k, top-p, seeds, stop token ids). A user arriving
from vLLM expects more; this module adds it without changing what the
chapters' settings do: a request that asks for nothing new is sampled by
exactly the operations of chapter 05, in the same order, so seeded outputs
are the same token for token, and costs nothing more.

Definitions follow vLLM (v1):

* ``repetition_penalty`` (> 0): a logit of a token seen in the prompt or the
  output is divided by it when positive and multiplied by it otherwise (this is
  also transformers' ``repetition_penalty``).
* ``frequency_penalty`` and ``presence_penalty`` (in [-2, 2]): subtracted from a
  token's logit, once per occurrence in the output, and once if it occurs in the
  output at all.
* ``min_p`` (in [0, 1]): after temperature, tokens whose probability is below
  ``min_p`` times the most likely token's are dropped.
* ``min_tokens``: until that many tokens are generated, end-of-sequence and
  ``stop_token_ids`` are masked and stop strings are not checked.
* ``logprobs`` / ``prompt_logprobs``: the model's raw log-probabilities (vLLM
  v1's default ``logprobs_mode="raw_logprobs"``: before penalties, temperature
  and truncation) of the ``N`` most likely tokens plus the sampled (or prompt)
  token, per position.

Order of operations on a row of logits, as in vLLM: raw log-probabilities;
``min_tokens`` mask; penalties; greedy argmax, or temperature, ``min_p``,
top-k, top-p and a draw from the sequence's own random stream.

On a GPU the engine samples a whole step with `sample_on_device` instead: the
same cuts in the same order, on all rows at once, without reading anything
back until the tokens are chosen (`sample_batch`). Its draws come from the
GPU's random streams, so a seeded request repeats its tokens from run to run
on a GPU, but they are not the tokens it draws on a CPU.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import math
import numbers
from dataclasses import dataclass

import torch

from .engine import SamplingParams as _ChapterSamplingParams
from .engine import Sequence, make_generator, token_logprobs, upload


class RequestOutputKind(enum.Enum):
    """What `LLMEngine.step` returns for a request that is still running
    (vLLM's names): every step the whole output so far (``CUMULATIVE``, the
    default), only what is new since the last step (``DELTA``), or nothing
    until it finishes (``FINAL_ONLY``; `LLM.generate` uses this)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class Logprob:
    """A token's log-probability at one position, its rank in the vocabulary
    (1 = most likely) and its text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


def _int(name: str, value, low: int | None = None, none_ok: bool = False):
    """``value`` as a Python int (NumPy integers included), or a ValueError."""
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


def _float(name: str, value, low: float, high: float, low_open: bool = False):
    """``value`` as a Python float in [low, high] (``(low, high]`` with
    ``low_open``), or a ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if value < low or (low_open and value == low) or value > high:
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be in {bracket}{low}, {high}], got {value}")
    return value


def _bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


@dataclass
class SamplingParams(_ChapterSamplingParams):
    """How to pick tokens and when to stop, per request, with vLLM's names.

    Chapter 05's fields (``n``, ``temperature``, ``top_p``, ``top_k``,
    ``max_tokens``, ``seed``, ``stop_token_ids``, ``ignore_eos``) keep their
    meaning, with vLLM's conventions: ``top_k`` 0 or -1 means no cut;
    ``max_tokens=None`` means up to the model's length. The rest is described
    in this module's docstring; ``stop`` is a string or a list of strings
    (``CompletionOutput.stop_reason`` says which one stopped a request; the text
    ends before it unless ``include_stop_str_in_output``), ``skip_special_tokens``
    drops special tokens from the text, ``output_kind`` is a
    `RequestOutputKind`.

    Every field is checked when the parameters are made, and again when a
    request is added (a field changed in between is caught there); integer
    fields accept NumPy integers.
    """

    max_tokens: int | None = 16
    min_tokens: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Check every field (ValueError naming it) and normalise: NumPy
        integers become ints, ``stop`` and ``stop_token_ids`` tuples."""
        self.n = _int("n", self.n, 1)
        self.temperature = _float("temperature", self.temperature, 0.0, math.inf)
        self.top_p = _float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        self.top_k = _int("top_k", self.top_k, -1)
        self.min_p = _float("min_p", self.min_p, 0.0, 1.0)
        self.max_tokens = _int("max_tokens", self.max_tokens, 1, none_ok=True)
        self.min_tokens = _int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens "
                f"({self.max_tokens})"
            )
        self.seed = _int("seed", self.seed, 0, none_ok=True)
        for name in ("presence_penalty", "frequency_penalty"):
            setattr(self, name, _float(name, getattr(self, name), -2.0, 2.0))
        self.repetition_penalty = _float(
            "repetition_penalty", self.repetition_penalty, 0.0, math.inf, True
        )
        ids = self.stop_token_ids
        if ids is None:
            ids = ()
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {ids!r}")
        self.stop_token_ids = tuple(
            _int(f"stop_token_ids[{i}]", t, 0) for i, t in enumerate(ids)
        )
        stop = self.stop
        stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
        if not hasattr(stop, "__iter__") or isinstance(stop, bytes):
            raise ValueError(
                f"stop must be a string or a list of strings, got {stop!r}"
            )
        stop = tuple(stop)
        for i, s in enumerate(stop):
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop[{i}] must be a non-empty string, got {s!r}")
        self.stop = stop
        self.logprobs = _int("logprobs", self.logprobs, 0, none_ok=True)
        self.prompt_logprobs = _int(
            "prompt_logprobs", self.prompt_logprobs, 0, none_ok=True
        )
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            _bool(name, getattr(self, name))
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(
                f"output_kind must be a RequestOutputKind, got {self.output_kind!r}"
            )

    def clone(self, **changes) -> SamplingParams:
        """A checked copy (with ``changes``), owned by one request."""
        new = copy.copy(self)
        for name, value in changes.items():
            setattr(new, name, value)
        new.validate()
        return new

    @classmethod
    def from_params(cls, params) -> SamplingParams:
        """These parameters from chapter 05's `SamplingParams` (or a checked
        copy of ours)."""
        if isinstance(params, cls):
            return params.clone()
        if not isinstance(params, _ChapterSamplingParams):
            raise ValueError(f"expected SamplingParams, got {params!r}")
        base = dataclasses.fields(_ChapterSamplingParams)
        return cls(**{f.name: getattr(params, f.name) for f in base})

    @property
    def processes_logits(self) -> bool:
        """Whether a penalty changes this request's logits before sampling."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def output_text_buffer_length(self) -> int:
        """Characters held back while streaming: a stop string may still be
        completing there (vLLM's rule)."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.stop) - 1


def _params(seq: Sequence):
    """``seq``'s parameters if they are ours (chapter 05's have none of the
    features of this module)."""
    p = seq.params
    return p if isinstance(p, SamplingParams) else None


def _apply_penalties(
    logits: torch.Tensor, seqs: list[Sequence], rows: list[int]
) -> torch.Tensor:
    """Repetition, frequency and presence penalties on ``rows`` of ``logits``,
    batched: one count tensor for the rows, built from their token ids."""
    vocab, device = logits.shape[-1], logits.device
    out_rows, out_ids, seen_rows, seen_ids = [], [], [], []
    for j, i in enumerate(rows):
        seq = seqs[i]
        out = seq.output_token_ids
        out_rows += [j] * len(out)
        out_ids += out
        seen_rows += [j] * seq.num_prompt_tokens
        seen_ids += seq.token_ids[: seq.num_prompt_tokens]
    counts = torch.zeros(len(rows), vocab, device=device, dtype=logits.dtype)
    if out_ids:
        index = (
            torch.tensor(out_rows, device=device),
            torch.tensor(out_ids, device=device),
        )
        counts.index_put_(index, torch.ones(len(out_ids), device=device), True)
    in_prompt = torch.zeros(len(rows), vocab, device=device, dtype=torch.bool)
    in_prompt[
        torch.tensor(seen_rows, device=device), torch.tensor(seen_ids, device=device)
    ] = True
    ps = [seqs[i].params for i in rows]

    def column(name: str) -> torch.Tensor:
        values = [getattr(p, name) for p in ps]
        return torch.tensor(values, device=device, dtype=logits.dtype)[:, None]

    sub = logits[rows]
    rep = column("repetition_penalty")
    seen = in_prompt | (counts > 0)
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - column("frequency_penalty") * counts
    sub = sub - column("presence_penalty") * (counts > 0).to(sub.dtype)
    logits[rows] = sub
    return logits


def process_logits(
    logits: torch.Tensor, seqs: list[Sequence], eos_token_ids
) -> torch.Tensor:
    """The logits sampling reads: ``min_tokens`` masks and penalties applied to
    the rows whose requests asked for them (the input itself when none did)."""
    mask_rows, mask_cols, penalised = [], [], []
    for i, seq in enumerate(seqs):
        p = _params(seq)
        if p is None:
            continue
        if p.min_tokens and seq.num_tokens - seq.num_prompt_tokens < p.min_tokens:
            stops = set(p.stop_token_ids)
            if not p.ignore_eos and eos_token_ids is not None:
                stops |= (
                    {eos_token_ids}
                    if isinstance(eos_token_ids, int)
                    else set(eos_token_ids)
                )
            mask_rows += [i] * len(stops)
            mask_cols += sorted(stops)
        if p.processes_logits:
            penalised.append(i)
    if not mask_rows and not penalised:
        return logits
    logits = logits.clone()
    if penalised:
        logits = _apply_penalties(logits, seqs, penalised)
    if mask_rows:
        device = logits.device
        logits[
            torch.tensor(mask_rows, device=device),
            torch.tensor(mask_cols, device=device),
        ] = float("-inf")
    return logits


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids=None) -> list[int]:
    """Next token per sequence, from ``logits`` ``[num_seqs, vocab]``.

    Greedy rows take the argmax (one for the whole batch); the others are
    divided by their temperature, cut by ``min_p``, top-k and top-p, and drawn
    from the sequence's own random stream: chapter 05's sampler, with
    ``min_tokens``, penalties and ``min_p`` added for the requests that ask.
    """
    logits = process_logits(logits, seqs, eos_token_ids)
    tokens = logits.argmax(dim=-1).tolist()
    for i, (row, seq) in enumerate(zip(logits, seqs)):
        p = seq.params
        if p.greedy:
            continue
        row = row / p.temperature
        min_p = getattr(p, "min_p", 0.0)
        if min_p > 0:
            probs = row.softmax(-1)
            row = row.masked_fill(probs < min_p * probs.max(), float("-inf"))
        if p.top_k > 0:
            kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1:
            sorted_logits, order = row.sort(descending=True)
            probs = sorted_logits.softmax(-1)
            # Keep the smallest prefix whose probability reaches top_p.
            drop = probs.cumsum(-1) - probs >= p.top_p
            row = row.scatter(0, order[drop], float("-inf"))
        probs = row.softmax(-1).cpu()
        tokens[i] = int(torch.multinomial(probs, 1, generator=seq.generator))
    return tokens


def _device_generator(seq: Sequence, device: torch.device) -> torch.Generator | None:
    """The random stream of a seeded ``seq`` for draws on ``device`` (None: the
    device's global stream), made on first use from the same seed and sample
    index as its CPU stream; the streams differ, so a seeded request samples
    the same tokens on every run on one kind of device, not across kinds."""
    gen = seq.device_generator
    if gen is None or gen.device != device:
        gen = make_generator(seq.params.seed, seq.sample_index, device)
        seq.device_generator = gen
    return gen


def sample_on_device(
    logits: torch.Tensor, seqs: list[Sequence], eos_token_ids=None
) -> torch.Tensor:
    """`sample`'s choice per row, as a tensor on ``logits``' device, computed
    without reading anything back: every sampled row is cut in one batch
    (temperature, ``min_p``, top-k, top-p, with per-row values), unseeded rows
    are drawn together and seeded rows each from its own device stream."""
    logits = process_logits(logits, seqs, eos_token_ids)
    tokens = logits.argmax(dim=-1)
    rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if not rows:
        return tokens
    device = logits.device
    ps = [seqs[i].params for i in rows]

    def column(values, dtype=torch.float32) -> torch.Tensor:
        return upload(values, dtype, device)[:, None]

    index = column(rows, torch.long)[:, 0]
    sub = logits[index].float() / column([p.temperature for p in ps])
    min_p = [getattr(p, "min_p", 0.0) for p in ps]
    if any(min_p):
        probs = sub.softmax(-1)
        cut = column(min_p) * probs.max(-1, keepdim=True).values
        sub = sub.masked_fill(probs < cut, float("-inf"))
    vocab = sub.shape[-1]
    if any(p.top_k > 0 or p.top_p < 1 for p in ps):
        # one sort serves top-k (the k-th largest logit) and top-p (the prefix)
        sorted_logits, order = sub.sort(dim=-1, descending=True)
        ks = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in ps]
        kth = sorted_logits.gather(1, column(ks, torch.long) - 1)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= column([p.top_p for p in ps])
        drop &= column([p.top_p < 1 for p in ps], torch.bool)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        sub = torch.empty_like(sub).scatter_(1, order, sorted_logits)
    probs = sub.softmax(-1)
    drawn = torch.empty(len(rows), dtype=torch.long, device=device)
    free = [j for j, i in enumerate(rows) if seqs[i].params.seed is None]
    if free:
        at = column(free, torch.long)[:, 0]
        drawn[at] = torch.multinomial(probs[at], 1)[:, 0]
    for j, i in enumerate(rows):
        gen = _device_generator(seqs[i], device)
        if gen is not None:
            drawn[j : j + 1] = torch.multinomial(probs[j], 1, generator=gen)
    tokens[index] = drawn
    return tokens


def sample_batch(
    logits: torch.Tensor, seqs: list[Sequence], eos_token_ids=None
) -> tuple[list[int], list[float]]:
    """Next token per row and its raw log-probability, for a whole step.

    On a CPU this is `sample` and the chosen tokens' log-probabilities. On a
    GPU the tokens are chosen there (`sample_on_device`) and both lists come
    back in one transfer: the only moment a decode step waits for the GPU.
    """
    if logits.device.type == "cpu":
        tokens = sample(logits, seqs, eos_token_ids)
        return tokens, token_logprobs(logits, tokens)
    tokens = sample_on_device(logits, seqs, eos_token_ids)
    chosen = logits.float().log_softmax(-1).gather(1, tokens[:, None])[:, 0]
    ids, logprobs = torch.stack([tokens.double(), chosen.double()]).tolist()
    return [int(t) for t in ids], logprobs


def top_logprobs(
    logprobs: torch.Tensor, targets: torch.Tensor, nums: list[int]
) -> list[dict[int, Logprob]]:
    """Per row of ``logprobs`` ``[rows, vocab]`` (already log-softmaxed): the
    target token's log-probability and rank, then the ``nums[row]`` most likely
    tokens', as ``{token id: Logprob}`` with the target first."""
    nums = [min(n, logprobs.shape[-1]) for n in nums]
    k = max(nums, default=0)
    chosen = logprobs.gather(1, targets[:, None])
    ranks = (logprobs > chosen).sum(-1) + 1
    top_v, top_i = logprobs.topk(k, dim=-1) if k else (None, None)
    chosen, ranks, targets = chosen[:, 0].tolist(), ranks.tolist(), targets.tolist()
    top_v = top_v.tolist() if k else None
    top_i = top_i.tolist() if k else None
    out = []
    for r, n in enumerate(nums):
        d = {targets[r]: Logprob(chosen[r], ranks[r])}
        for j in range(n):
            d.setdefault(top_i[r][j], Logprob(top_v[r][j], j + 1))
        out.append(d)
    return out


def sample_logprobs(
    logits: torch.Tensor, seqs: list[Sequence], tokens: list[int]
) -> list[dict[int, Logprob] | None]:
    """The ``logprobs`` each sequence asked for at this step (None where it did
    not), from the raw logits."""
    rows = [
        i for i, s in enumerate(seqs) if getattr(s.params, "logprobs", None) is not None
    ]
    result: list[dict[int, Logprob] | None] = [None] * len(seqs)
    if not rows:
        return result
    device = logits.device
    lp = logits[torch.tensor(rows, device=device)].log_softmax(-1)
    targets = torch.tensor([tokens[i] for i in rows], device=device)
    for i, d in zip(
        rows, top_logprobs(lp, targets, [seqs[i].params.logprobs for i in rows])
    ):
        result[i] = d
    return result
