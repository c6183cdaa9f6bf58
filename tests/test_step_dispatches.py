"""A decode step dispatches the same torch operations at batch 8, 64 and 256,
outside the model's forward pass (`bench.steps.step_ops`): on a GPU each is a
launch the host pays for, so a count that grows with the batch is a per-row
loop that costs milliseconds a step (issue 44's 20 ms). Checked for every kind
of sampling a request can ask for."""

import pytest

from pagedkv_lab import LLM, RequestOutputKind, SamplingParams
from pagedkv_lab.bench.steps import step_ops
from pagedkv_lab.models import load_model

MODEL, TOKENIZER = load_model("tiny-llama")

MIXES = {
    "greedy": dict(temperature=0),
    "temperature, seeded": dict(temperature=0.6, seed=1),
    "temperature, unseeded": dict(temperature=0.6),
    "top-p with logprobs": dict(temperature=0.8, top_p=0.9, logprobs=2),
    "penalties": dict(temperature=0.8, repetition_penalty=1.2, frequency_penalty=0.1,
                      presence_penalty=0.2, min_p=0.05),
    "n=4": dict(temperature=0.8, n=4, top_k=20),
}  # fmt: skip


def steady_decode_ops(num_seqs: int, mix: dict) -> dict:
    """The operations of a decode step of ``num_seqs`` sequences, once the
    batch has stayed the same for a step (a step that admits or finishes a
    sequence rebuilds the batch's columns once)."""
    n = mix.get("n", 1)
    llm = LLM((MODEL, TOKENIZER), max_num_seqs=256, max_model_len=128, seed=0,
              kv_cache_memory=2**22)  # fmt: skip
    params = SamplingParams(max_tokens=32, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY, **mix)  # fmt: skip
    for i in range(num_seqs // n):
        llm.add_request(str(i), [1, 5 + i % 200, 7, 9 + i % 50], params)
    seqs = None
    for _ in range(8):
        llm.step()
        same = decoding(llm.last_plan, num_seqs) and seqs == ids(llm.last_plan)
        seqs = ids(llm.last_plan)
        if same:
            break
    assert decoding(llm.last_plan, num_seqs)
    counts = step_ops(llm)
    assert decoding(llm.last_plan, num_seqs) and ids(llm.last_plan) == seqs
    return counts


def ids(plan) -> list[int]:
    return [s.seq_id for s in plan.seqs]


def decoding(plan, num_seqs: int) -> bool:
    """Whether ``plan`` is a decode step of ``num_seqs`` sequences."""
    return len(plan.seqs) == num_seqs and set(plan.num_new_tokens) == {1}


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_a_decode_step_dispatches_the_same_ops_at_any_batch(mix):
    counts = {b: steady_decode_ops(b, MIXES[mix]) for b in (8, 64, 256)}
    totals = {b: sum(c.values()) for b, c in counts.items()}
    grown = {op: [counts[b][op] for b in counts] for op in counts[256]
             if counts[256][op] != counts[8][op]}  # fmt: skip
    assert len(set(totals.values())) == 1, f"{mix}: {totals}; per op {grown}"
    assert totals[8] > 0


def test_the_count_sees_a_per_row_loop(monkeypatch):
    """The instrument itself: the chapter's per-row sampler, put in the step's
    place, makes the count grow (a test that could not fail would prove nothing)."""
    import torch
    from reference import sample_per_row

    from pagedkv_lab.engine.model_runner import ModelRunner
    from pagedkv_lab.engine.sampler import SampledTokens

    class PerRow:
        batch = None

        def __call__(self, logits, plan):
            tokens = torch.tensor(sample_per_row(logits, plan.sample_seqs))
            values = torch.cat([tokens.double(), tokens.double() * 0])
            return SampledTokens(tokens, values, {"n": len(tokens), "tops": None,
                                                  "prompt": [], "beams": []})  # fmt: skip

    real_init = ModelRunner.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.sampler = PerRow()

    monkeypatch.setattr(ModelRunner, "__init__", init)
    small = sum(steady_decode_ops(8, MIXES["temperature, seeded"]).values())
    large = sum(steady_decode_ops(64, MIXES["temperature, seeded"]).values())
    assert large > small
