"""What the engine is checked against: transformers' own greedy generate, one prompt alone."""

import torch


def greedy_alone(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Tokens ``model.generate`` produces greedily for ``prompt`` alone, EOS ignored."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
    )
    return out[0, len(prompt) :].tolist()


# The sampler, as the tests drive it ------------------------------------------------

def _pending(seqs) -> None:
    """The token a step samples is pending from its scheduling on: the
    sampler's position of the draw counts it."""
    for seq in seqs:
        seq.num_pending = max(seq.num_pending, 1)


def sample_plan(seqs):
    """A plan in which each of ``seqs`` computes its last token and samples
    from its own row."""
    from pagedkv_lab.engine.sequence import SchedulerOutput

    n = len(seqs)
    return SchedulerOutput(seqs=list(seqs), num_new_tokens=[1] * n, groups=[None] * n,
                           starts=[s.num_computed_tokens for s in seqs],
                           sample_seqs=list(seqs), sample_rows=list(range(n)))  # fmt: skip


def sample_step(logits, seqs, eos_token_ids=()):
    """The engine's `Sampler` on a whole step: `SampledOutput` (tokens, their
    log-probabilities, top log-probabilities...)."""
    from pagedkv_lab.engine.sampler import Sampler

    _pending(seqs)
    return Sampler(eos_token_ids)(logits.float(), sample_plan(seqs)).read()


def sample_batched(logits, seqs, eos_token_ids=()):
    """The engine's choice for every row, as a tensor on ``logits``' device."""
    from pagedkv_lab.engine.sampler import Sampler, SamplingBatch

    _pending(seqs)
    batch = SamplingBatch(seqs, logits.shape[-1], logits.device)
    return Sampler(eos_token_ids).sample(logits.float(), batch)


def sample_per_row(logits, seqs) -> list[int]:
    """Chapter 05's first sampler, one row at a time (no penalties): greedy
    rows take the argmax; the others are divided by their temperature, cut by
    min_p, top-k and top-p, and drawn by inverse transform from the same
    counter-based number the engine's batched sampler uses."""
    import numpy as np

    from pagedkv_lab.engine.sampler import counter_uniforms
    from pagedkv_lab.engine.sequence import sample_seed

    _pending(seqs)
    tokens = logits.argmax(dim=-1).tolist()
    for i, (row, seq) in enumerate(zip(logits.float(), seqs)):
        p = seq.params
        if p.greedy:
            continue
        row = row / p.temperature
        if p.min_p > 0:
            probs = row.softmax(-1)
            row = row.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        if p.top_k > 0:
            kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1:
            sorted_logits, order = row.sort(descending=True)
            probs = sorted_logits.softmax(-1)
            drop = probs.cumsum(-1) - probs >= p.top_p  # keep the prefix reaching top_p
            row = row.scatter(0, order[drop], float("-inf"))
        probs = row.softmax(-1).double().cpu()
        position = len(seq.token_ids) + seq.num_pending - 1
        if p.seed is None:
            u = float(torch.rand((), dtype=torch.float64))
        else:
            u = float(counter_uniforms([sample_seed(p.seed, seq.sample_index)], [position])[0])
        cdf = probs.cumsum(0)
        tokens[i] = int(np.searchsorted(cdf.numpy(), u * float(cdf[-1])))
    return tokens


def fake_step(scheduler, plan, token: int = 5):
    """What the engine does after a forward pass, without a model: every
    sampled row gets ``token`` (log-probability 0); returns the requests that
    finished."""
    from pagedkv_lab.engine.sampler import SampledOutput

    n = len(plan.sample_seqs)
    beams = {}
    for group, rows in plan.beam_rows.items():  # each beam goes on with ``token``
        seqs = [plan.seqs[r] for r in rows]
        beams[group] = (seqs, [(s.cumulative_logprob, i, token) for i, s in enumerate(seqs)])
    prompt = [[{}] * count for _, _, count, _ in plan.prompt_logprobs]
    out = SampledOutput([token] * n, [0.0] * n, [None] * n, beams, prompt)
    return scheduler.postprocess(plan, out)
