"""The sampler behind `SamplingParams` (`pagedkv_lab.sampling_params`):
chapter 05's sampler with vLLM's penalties, ``min_p``, ``min_tokens`` and
log-probabilities added for the requests that ask for them.

A request that asks for nothing new is sampled by exactly the operations of
chapter 05, in the same order, so seeded outputs are the same token for
token, and costs nothing more.

Order of operations on a row of logits, as in vLLM: raw log-probabilities;
``min_tokens`` mask; penalties; greedy argmax, or temperature, ``min_p``,
top-k, top-p and a draw from the sequence's own random stream.

The engine samples a step with `sample_batched` instead, on every device: the
same cuts in the same order, on all rows at once, in a fixed number of
operations whatever the batch's size (chapter 05's `engine.sample_batched`,
with ``min_p`` and the logits processing above). Each random row draws one
counter-based number, hashed from its sample's seed (`engine.sample_seed`) and
the position of the token it draws (`engine.counter_uniforms`): a seeded request
draws the same numbers in any batch, after a preemption and on any machine, so
its tokens are the same wherever its logits are (on a GPU the last bits of a
row's logits can change with the batch, which can flip a draw that lands within
rounding of a boundary between two tokens). `sample` is the per-row reference, kept for
the tests and for reading.

The engine samples a step with `sample_tokens`, which returns the tokens as
`SampledTokens`: on the device, with their copy to the host already queued,
so that the engine reads them (`SampledTokens.read`, the step's one transfer)
when it needs them, possibly after it has queued the next step (chapter 06's
asynchronous scheduling). What a batch's parameters ask for is gathered once
per list of sequences (`SamplingBatch`), not at every step.

`SamplingParams`, `RequestOutputKind` and `Logprob` are imported here too, where
earlier versions of the library defined them.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from pagedkv_lab.engine import SamplingColumns, Sequence, upload
from pagedkv_lab.engine import sample_batched as chapter_sample_batched
from pagedkv_lab.outputs import Logprob
from pagedkv_lab.sampling_params import RequestOutputKind, SamplingParams

__all__ = [
    "Logprob",
    "RequestOutputKind",
    "SampledTokens",
    "SamplingBatch",
    "SamplingParams",
    "process_logits",
    "sample",
    "sample_batch",
    "sample_batched",
    "sample_logprobs",
    "sample_tokens",
    "top_logprobs",
]


class SamplingBatch:
    """What the parameters of a list of sequences ask of the sampler, by row:
    which rows draw at random (the rest are greedy), which have a
    ``min_tokens`` mask or penalties, which want log-probabilities.

    A decode step samples the same sequences in the same order as the step
    before, until one finishes or joins; the engine keeps a `SamplingBatch`
    while its list is the same (`matches`), instead of reading every
    sequence's parameters at every step.
    """

    def __init__(self, seqs: list[Sequence]):
        self.seqs = list(seqs)
        params = [s.params for s in seqs]
        ours = [p if isinstance(p, SamplingParams) else None for p in params]
        self.random = [i for i, p in enumerate(params) if not p.greedy]
        self.min_tokens = [i for i, p in enumerate(ours) if p and p.min_tokens]
        self.penalised = [i for i, p in enumerate(ours) if p and p.processes_logits]
        self.logprobs = [i for i, p in enumerate(ours) if p and p.logprobs is not None]
        self._stops = None
        self._columns: ColumnsWithMinP | None = None

    def columns(self, vocab: int, device) -> ColumnsWithMinP:
        """The batch's per-row parameters on ``device`` (uploaded once)."""
        if self._columns is None or self._columns.temperature.device != torch.device(device):
            self._columns = ColumnsWithMinP(self.seqs, vocab, device)
        return self._columns

    def matches(self, seqs: list[Sequence]) -> bool:
        """Whether ``seqs`` are this batch's sequences, in the same order."""
        return seqs == self.seqs  # element by element: identity first, so fast

    def stop_rules(self, eos_token_ids, max_model_len: int) -> tuple[set, list[int]]:
        """The token ids that may stop some row (EOS, stop tokens), and the
        number of tokens at which each row stops by length: `accept_tokens`
        checks a row's stop conditions only when one of them applies."""
        if self._stops is None:
            ids = set() if eos_token_ids is None else (
                {eos_token_ids} if isinstance(eos_token_ids, int) else set(eos_token_ids)
            )  # fmt: skip
            for s in self.seqs:
                ids.update(s.params.stop_token_ids)
            limits = [min(s.num_prompt_tokens + s.params.max_tokens, max_model_len)
                      for s in self.seqs]  # fmt: skip
            self._stops = (ids, limits)
        return self._stops


def _apply_penalties(
    logits: torch.Tensor, seqs: list[Sequence], rows: list[int]
) -> torch.Tensor:
    """Repetition, frequency and presence penalties on ``rows`` of ``logits``,
    batched: the rows' token ids gathered with NumPy and uploaded in one copy,
    then one count tensor and one prompt mask for all of them."""
    vocab, device = logits.shape[-1], logits.device
    chosen = [seqs[i] for i in rows]
    ids = [np.asarray(s.token_ids, dtype=np.int64) for s in chosen]
    lengths = np.array([len(x) for x in ids], dtype=np.int64)
    owner = np.repeat(np.arange(len(rows)), lengths)
    prompt = np.array([s.num_prompt_tokens for s in chosen], dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    is_output = np.arange(lengths.sum()) - starts[owner] >= prompt[owner]
    flat = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    num_out = int(is_output.sum())
    out_and_prompt = np.concatenate([owner[is_output], flat[is_output],
                                     owner[~is_output], flat[~is_output]])  # fmt: skip
    params = np.array([[s.params.repetition_penalty, s.params.frequency_penalty,
                        s.params.presence_penalty] for s in chosen])  # fmt: skip
    index = upload(out_and_prompt, torch.long, device)
    out_rows, out_ids, seen_rows, seen_ids = index.split(
        [num_out, num_out, len(flat) - num_out, len(flat) - num_out]
    )
    rep, freq, pres = upload(params.T, logits.dtype, device)[:, :, None]
    counts = torch.zeros(len(rows), vocab, device=device, dtype=logits.dtype)
    counts.index_put_((out_rows, out_ids), torch.ones_like(out_ids, dtype=logits.dtype),
                      accumulate=True)  # fmt: skip
    seen = torch.zeros(len(rows), vocab, device=device, dtype=torch.bool)
    seen[seen_rows, seen_ids] = True
    seen |= counts > 0
    row_index = upload(rows, torch.long, device)
    sub = logits.index_select(0, row_index)
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - freq * counts - pres * (counts > 0).to(sub.dtype)
    return logits.index_copy(0, row_index, sub)


def process_logits(
    logits: torch.Tensor, seqs: list[Sequence], eos_token_ids, batch=None
) -> torch.Tensor:
    """The logits sampling reads: ``min_tokens`` masks and penalties applied to
    the rows whose requests asked for them (the input itself when none did).
    ``batch``: the `SamplingBatch` of ``seqs``, if the caller keeps one."""
    batch = SamplingBatch(seqs) if batch is None else batch
    mask_rows, mask_cols = [], []
    for i in batch.min_tokens:
        seq = seqs[i]
        p = seq.params
        if seq.num_tokens - seq.num_prompt_tokens < p.min_tokens:
            stops = set(p.stop_token_ids)
            if not p.ignore_eos and eos_token_ids is not None:
                stops |= (
                    {eos_token_ids}
                    if isinstance(eos_token_ids, int)
                    else set(eos_token_ids)
                )
            mask_rows += [i] * len(stops)
            mask_cols += sorted(stops)
    if not mask_rows and not batch.penalised:
        return logits
    logits = logits.clone()
    if batch.penalised:
        logits = _apply_penalties(logits, seqs, batch.penalised)
    if mask_rows:
        mask = upload([mask_rows, mask_cols], torch.long, logits.device)
        logits[mask[0], mask[1]] = float("-inf")
    return logits


def sample(
    logits: torch.Tensor, seqs: list[Sequence], eos_token_ids=None, batch=None
) -> list[int]:
    """Next token per sequence, from ``logits`` ``[num_seqs, vocab]``.

    Greedy rows take the argmax (one for the whole batch); the others are
    divided by their temperature, cut by ``min_p``, top-k and top-p, and drawn
    from the sequence's own random stream: chapter 05's sampler, with
    ``min_tokens``, penalties and ``min_p`` added for the requests that ask.
    """
    batch = SamplingBatch(seqs) if batch is None else batch
    logits = process_logits(logits, seqs, eos_token_ids, batch)
    tokens = logits.argmax(dim=-1).tolist()
    for i in batch.random:
        row, seq = logits[i], seqs[i]
        p = seq.params
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


class ColumnsWithMinP(SamplingColumns):
    """`SamplingColumns` with ``min_p`` (vLLM's order: after the temperature,
    before top-k and top-p): a token goes when its probability is below
    ``min_p`` times the row's largest."""

    def __init__(self, seqs: list[Sequence], vocab: int, device):
        super().__init__(seqs, vocab, device)
        min_p = [getattr(s.params, "min_p", 0.0) for s in seqs]
        self.any_min_p = any(min_p)
        self.min_p = upload(min_p, torch.float32, device) if self.any_min_p else None

    def cut(self, x: torch.Tensor) -> torch.Tensor:
        if self.any_min_p:
            probs = x.softmax(-1)
            floor = self.min_p[:, None] * probs.max(-1, keepdim=True).values
            x = x.masked_fill(probs < floor, float("-inf"))
        return super().cut(x)


def sample_batched(
    logits: torch.Tensor, seqs: list[Sequence], eos_token_ids=None, batch=None
) -> torch.Tensor:
    """`sample`'s choice for every row, as a tensor on ``logits``' device,
    without reading anything back and in a fixed number of operations: the
    logits processed (`process_logits`), then chapter 05's `sample_batched`
    with ``min_p`` among the cuts. ``batch``: the `SamplingBatch` of ``seqs``,
    if the caller keeps one (its columns are uploaded once)."""
    batch = SamplingBatch(seqs) if batch is None else batch
    logits = process_logits(logits, seqs, eos_token_ids, batch)
    columns = batch.columns(logits.shape[-1], logits.device)
    return chapter_sample_batched(logits, seqs, columns)


class SampledTokens:
    """A step's sampled tokens, their raw log-probabilities and the top
    log-probabilities of the rows that asked, on their way to the host.

    ``tokens`` stays on the device, where the next step may read it (chapter
    06's asynchronous scheduling). On a GPU, the copy of everything the host
    needs is queued as soon as the tokens are chosen, into pinned memory, so
    `read` waits for this step's work only, never for a step queued after it:
    that copy is the step's one transfer.
    """

    def __init__(self, tokens: torch.Tensor, values: torch.Tensor, tops=None):
        self.tokens = tokens
        self.tops = tops  # (rows, targets' positions, nums) for top_logprob_dicts
        self._ready = None
        self.waited = 0.0  # seconds `read` waited for the device
        if values.is_cuda:
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._values = host.copy_(values, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._values = values

    def read(self) -> tuple[list[int], list[float], list[dict[int, Logprob] | None]]:
        """Tokens, their log-probabilities, and per row the ``logprobs`` its
        request asked for (None where it did not), as Python objects."""
        if self._ready is not None:
            start = time.perf_counter()
            self._ready.synchronize()
            self.waited = time.perf_counter() - start
        values = self._values.tolist()
        n = len(self.tokens)
        tokens, logprobs = [int(t) for t in values[:n]], values[n : 2 * n]
        tops: list[dict[int, Logprob] | None] = [None] * n
        if self.tops is not None:
            rows, nums = self.tops
            k = max(nums)
            table = [values[2 * n + r * (2 + 2 * k) :][: 2 + 2 * k] for r in range(len(rows))]
            dicts = top_logprob_dicts(table, [tokens[i] for i in rows], nums)
            for i, d in zip(rows, dicts):
                tops[i] = d
        return tokens, logprobs, tops


def sample_tokens(
    logits: torch.Tensor, seqs: list[Sequence], eos_token_ids=None, batch=None
) -> SampledTokens:
    """Sample a whole step: next token per row, its raw log-probability, and
    the top log-probabilities of the rows whose requests asked (``batch``: the
    `SamplingBatch` of ``seqs``, if the caller keeps one).

    The tokens are chosen by `sample_batched`, without reading anything back:
    what the host needs comes back later, in one transfer.
    """
    batch = SamplingBatch(seqs) if batch is None else batch
    tokens = sample_batched(logits, seqs, eos_token_ids, batch)
    # raw log-probabilities: row by row the same in any batch (a reduction
    # over the whole tensor, such as logsumexp, may round by the batch's shape)
    logprobs = logits.float().log_softmax(-1)
    values = [tokens.double(), logprobs.gather(1, tokens[:, None])[:, 0].double()]
    tops = None
    if batch.logprobs:
        rows = batch.logprobs
        nums = [min(seqs[i].params.logprobs, logits.shape[-1]) for i in rows]
        index = upload(rows, torch.long, logits.device)
        table = top_logprob_table(logprobs[index], tokens[index], max(nums))
        values.append(table.ravel())
        tops = (rows, nums)
    return SampledTokens(tokens, torch.cat(values), tops)


def sample_batch(
    logits: torch.Tensor, seqs: list[Sequence], eos_token_ids=None
) -> tuple[list[int], list[float]]:
    """Next token per row and its raw log-probability, for a whole step, as
    lists: `sample_tokens`, read at once."""
    tokens, logprobs, _ = sample_tokens(logits, seqs, eos_token_ids).read()
    return tokens, logprobs


def top_logprob_table(logprobs: torch.Tensor, targets: torch.Tensor, k: int) -> torch.Tensor:
    """Per row of ``logprobs`` ``[rows, vocab]`` (already log-softmaxed): the
    target token's log-probability and rank, then the ``k`` largest
    log-probabilities and their token ids, as one float64 tensor ``[rows, 2 +
    2k]`` on the logits' device (float64 holds every token id exactly)."""
    chosen = logprobs.gather(1, targets[:, None])
    ranks = (logprobs > chosen).sum(-1, keepdim=True) + 1
    top_v, top_i = logprobs.topk(k, dim=-1)
    return torch.cat([x.double() for x in (chosen, ranks, top_v, top_i)], dim=1)


def top_logprob_dicts(table, targets: list[int], nums: list[int]) -> list[dict[int, Logprob]]:
    """`top_logprob_table`'s rows (as lists) as ``{token id: Logprob}``, the
    target first, then the ``nums[row]`` most likely tokens."""
    out = []
    for row, target, n in zip(table, targets, nums):
        k = (len(row) - 2) // 2
        d = {target: Logprob(row[0], int(row[1]))}
        for j in range(n):
            d.setdefault(int(row[2 + k + j]), Logprob(row[2 + j], j + 1))
        out.append(d)
    return out


def top_logprobs(
    logprobs: torch.Tensor, targets: torch.Tensor, nums: list[int]
) -> list[dict[int, Logprob]]:
    """Per row of ``logprobs`` ``[rows, vocab]`` (already log-softmaxed): the
    target token's log-probability and rank, then the ``nums[row]`` most likely
    tokens', as ``{token id: Logprob}`` with the target first."""
    nums = [min(n, logprobs.shape[-1]) for n in nums]
    table = top_logprob_table(logprobs, targets, max(nums, default=0))
    return top_logprob_dicts(table.tolist(), targets.tolist(), nums)


def sample_logprobs(
    logits: torch.Tensor, seqs: list[Sequence], tokens: list[int], batch=None
) -> list[dict[int, Logprob] | None]:
    """The ``logprobs`` each sequence asked for at this step (None where it did
    not), from the raw logits."""
    rows = (SamplingBatch(seqs) if batch is None else batch).logprobs
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
