"""The sampler behind `SamplingParams` (`pagedkv_lab.sampling_params`):
chapter 05's sampler with vLLM's penalties, ``min_p``, ``min_tokens`` and
log-probabilities added for the requests that ask for them.

A request that asks for nothing new is sampled by exactly the operations of
chapter 05, in the same order, so seeded outputs are the same token for
token, and costs nothing more.

Order of operations on a row of logits, as in vLLM: raw log-probabilities;
``min_tokens`` mask; penalties; greedy argmax, or temperature, ``min_p``,
top-k, top-p and a draw from the sequence's own random stream.

On a GPU the engine samples a whole step with `sample_on_device` instead: the
same cuts in the same order, on all rows at once, without reading anything
back until the tokens are chosen (`sample_batch`). Its draws come from the
GPU's random streams, so a seeded request repeats its tokens from run to run
on a GPU, but they are not the tokens it draws on a CPU.

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

import torch

from .engine import Sequence, make_generator, upload
from .outputs import Logprob
from .sampling_params import RequestOutputKind, SamplingParams

__all__ = [
    "Logprob",
    "RequestOutputKind",
    "SampledTokens",
    "SamplingBatch",
    "SamplingParams",
    "process_logits",
    "sample",
    "sample_batch",
    "sample_logprobs",
    "sample_on_device",
    "sample_tokens",
    "top_logprobs",
]


def _params(seq: Sequence):
    """``seq``'s parameters if they are ours (chapter 05's have none of the
    features of this module)."""
    p = seq.params
    return p if isinstance(p, SamplingParams) else None


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
        device = logits.device
        logits[
            torch.tensor(mask_rows, device=device),
            torch.tensor(mask_cols, device=device),
        ] = float("-inf")
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
    logits: torch.Tensor, seqs: list[Sequence], eos_token_ids=None, batch=None
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
            self._ready.synchronize()
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

    On a CPU the tokens are chosen by `sample` (each seeded row from its own
    stream on the CPU); on a GPU by `sample_on_device`, without reading
    anything back: what the host needs comes back later, in one transfer.
    """
    batch = SamplingBatch(seqs) if batch is None else batch
    if logits.device.type != "cpu":
        tokens = sample_on_device(logits, seqs, eos_token_ids, batch)
    elif batch.random or batch.min_tokens or batch.penalised:
        tokens = torch.tensor(sample(logits, seqs, eos_token_ids, batch))
    else:  # all greedy, nothing to mask: `sample` is the argmax
        tokens = logits.argmax(dim=-1)
    logprobs = logits.float().log_softmax(-1)
    values = [tokens.double(), logprobs.gather(1, tokens[:, None])[:, 0].double()]
    tops = None
    if batch.logprobs:
        rows = batch.logprobs
        nums = [min(seqs[i].params.logprobs, logits.shape[-1]) for i in rows]
        index = torch.tensor(rows, device=logits.device)
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
