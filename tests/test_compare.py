"""`pagedkv_lab.compare`: vLLM's rule for outputs that may differ at near-ties,
and the exact comparison in float32. The rule must accept a flip between two
nearly tied tokens and reject a token the other side would not consider."""

import pytest
import torch

from pagedkv_lab.compare import (
    check_logprobs_close,
    compare_systems,
    first_difference,
    teacher_forced_top_k,
)
from pagedkv_lab.models import load_model


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_the_rule_accepts_a_near_tie_and_stops_there():
    top = [[7, 1], [4, 9, 2], [3, 8]]  # each side's top-k at each position
    d = check_logprobs_close([7, 4, 3], top, [7, 9, 0], top)
    assert d.position == 1 and d.tokens == (4, 9) and d.accepted
    # what follows the first difference is not compared: token 0 is in no top-k
    assert check_logprobs_close([7, 4, 3], top, [7, 4, 3], top) is None


def test_the_rule_rejects_a_token_outside_the_others_top_k():
    """A real mismatch: at the first difference, side a's token 5 is not among
    side b's most likely tokens there."""
    top_a = [[7, 1], [5, 4]]
    top_b = [[7, 1], [4, 9]]
    d = check_logprobs_close([7, 5], top_a, [7, 4], top_b)
    assert d.position == 1 and not d.accepted
    assert "token 5 not in the other's top-2" in d.reason
    # and the other way round
    d = check_logprobs_close([7, 4], top_b, [7, 5], top_a)
    assert not d.accepted and "token 5" in d.reason


def test_a_short_output_is_never_accepted():
    d = check_logprobs_close([7], [[7]], [7, 4], [[7], [4]])
    assert d.position == 1 and not d.accepted and "lengths" in d.reason


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-llama")[0]


def test_teacher_forced_top_k_gives_the_greedy_token_first(model):
    """Row i of the teacher-forced top-k is the distribution tokens[i] came
    from: greedy decoding picks its first entry."""
    prompt = [1, 40, 41, 42]
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                         do_sample=False, eos_token_id=None)  # fmt: skip
    tokens = out[0, len(prompt) :].tolist()
    top = teacher_forced_top_k(model, prompt, tokens, 3)
    assert [row[0] for row in top] == tokens and all(len(r) == 3 for r in top)


def test_compare_systems_judges_each_request(model):
    prompt = [1, 40, 41, 42]
    ids = torch.tensor([prompt])
    greedy = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                            do_sample=False, eos_token_id=None)[0, 4:].tolist()  # fmt: skip
    top = teacher_forced_top_k(model, prompt, greedy, 5)
    second = top[2][1]  # the runner-up at position 2: a plausible flip
    outside = next(t for t in range(300) if t not in top[2])  # not even considered
    outputs = {
        "base": [greedy, greedy, greedy, greedy],
        "other": [greedy, greedy[:2] + [second, 1, 1, 1], greedy[:2] + [outside, 1, 1, 1],
                  greedy[:5]],
    }  # fmt: skip
    lengths = [6, 6, 6, 6]
    judged = compare_systems(outputs, lengths, exact=False, model=model,
                             prompts=[prompt] * 4, k=5)["other"]  # fmt: skip
    assert (judged.identical, judged.accepted, judged.full_length) == (1, 1, 3)
    assert [i for i, _ in judged.rejected] == [2, 3] and not judged.sound
    assert judged.positions == [2]
    # in float32 the comparison is exact: a flip is a failure too
    exact = compare_systems(outputs, lengths, exact=True)["other"]
    assert exact.identical == 1 and len(exact.rejected) == 3
    assert compare_systems({"a": [greedy]}, [6], exact=True)["a"].sound
