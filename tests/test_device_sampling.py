"""`sample_batched`, the sampler the engine uses on every device, checked on every
device at hand (on a CPU it runs the same tensor code): it chooses what the
chapter's `sample` would, up to the random draw, and draws from the right
distribution."""

import pytest
import torch
from reference import sample_batched, sample_per_row, sample_step

from pagedkv_lab.engine.sequence import Sequence
from pagedkv_lab.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def seqs_for(params: list[SamplingParams]) -> list[Sequence]:
    return [Sequence([1, 2, 3], p) for p in params]


@pytest.mark.parametrize("device", DEVICES)
def test_cuts_that_leave_one_token_agree_with_greedy(device):
    """Greedy, top-k 1, a tiny top-p and min-p near 1 all pick the argmax, row by
    row, in one mixed batch; so does the chapter's sampler."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 300, generator=g).to(device)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, top_k=1),
        SamplingParams(temperature=1.3, top_p=1e-6),
        SamplingParams(temperature=1.0, min_p=0.999),
        SamplingParams(temperature=0.5, top_k=1, seed=3),
    ]
    seqs = seqs_for(params)
    want = logits.argmax(-1).tolist()
    assert sample_batched(logits, seqs).tolist() == want
    assert sample_per_row(logits, seqs) == want
    out = sample_step(logits, seqs)
    tokens, logprobs = out.tokens, out.logprobs
    assert tokens == want
    exact = logits.double().log_softmax(-1)[range(5), want]
    assert max(abs(a - b) for a, b in zip(logprobs, exact.tolist())) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_per_row_and_batched_samplers_draw_the_same_tokens(device):
    """Chapter 05's per-row sampler and the engine's batched one, on seeded
    rows of every kind, choose the same token in every row."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 80, generator=g).to(device)
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, seed=7 + i)
              for i, (t, k, p, m) in enumerate([(1.0, 0, 1.0, 0.0), (0.7, 20, 1.0, 0.0),
                                                (1.3, 0, 0.9, 0.0), (1.0, 0, 1.0, 0.05),
                                                (0.9, 10, 0.8, 0.02), (0, 0, 1.0, 0.0)])]
    assert sample_batched(logits, seqs_for(params)).tolist() == sample_per_row(
        logits, seqs_for(params))


@pytest.mark.parametrize("device", DEVICES)
def test_draws_follow_the_cut_distribution(device):
    """4,000 draws per setting: each token's frequency is within 0.03 of its
    probability after temperature and top-k/top-p (about 6 standard errors),
    and no token outside the cut is ever drawn."""
    row = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -3.0])
    n = 4000
    for params, keep in [
        (SamplingParams(temperature=1.0), 6),
        (SamplingParams(temperature=0.5, top_k=3), 3),
        (SamplingParams(temperature=1.0, top_p=0.8), 3),
    ]:
        seqs = seqs_for([params] * n)
        logits = row.expand(n, -1).contiguous().to(device)
        torch.manual_seed(0)
        if device == "cuda":
            torch.cuda.manual_seed(0)
        drawn = sample_batched(logits, seqs).cpu()
        probs = torch.zeros(6)
        probs[:keep] = (row[:keep] / params.temperature).softmax(-1)
        freq = torch.bincount(drawn, minlength=6).double() / n
        assert (freq - probs).abs().max() < 0.03, (params, freq, probs)
        assert freq[keep:].sum() == 0


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_rows_repeat_whatever_the_batch(device):
    """A seeded sequence draws the same tokens alone or among others."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 50, generator=g).to(device)
    p = SamplingParams(temperature=1.0, seed=42)

    def draws(rows, others):
        seq = Sequence([1], p)
        batch = [seq] + seqs_for([SamplingParams(temperature=1.0)] * others)
        return [sample_batched(logits[rows][: 1 + others], batch)[0].item()
                for _ in range(20)]  # fmt: skip

    assert draws([0], 0) == draws([0, 1, 2], 2)
