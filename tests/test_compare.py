"""`pagedkv_lab.bench.compare`: identity in float32; in 16-bit, every position
of every system judged against the model's own float32 forward pass, with a
tolerance calibrated on the model's own 16-bit rounding. The rule must accept
a flip at a calibrated near-tie, reject an error injected after an early flip
(which a rule that stops at the first difference never sees), and say how many
tokens each check covered."""

import pytest
import torch

from pagedkv_lab.bench.compare import (
    calibrate,
    compare_systems,
    engine_logprobs,
    first_difference,
    float32_copy,
    model_logprobs,
    teacher_forced,
)
from pagedkv_lab.models import load_model

PROMPTS = [[1, 40, 41, 42], [1, 7, 99, 12, 5, 61]]
N = 12


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_moved_module_names_its_new_place():
    with pytest.raises(ImportError, match="pagedkv_lab.bench.compare"):
        import pagedkv_lab.compare  # noqa: F401


@pytest.fixture(scope="module")
def bf16():
    """tiny-llama in bfloat16, its float32 copy, its greedy outputs (transformers')."""
    model = load_model("tiny-llama", dtype=torch.bfloat16)[0]
    ref32 = float32_copy(model)
    outs = []
    for p in PROMPTS:
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N,
                             do_sample=False, eos_token_id=None)  # fmt: skip
        outs.append(out[0, len(p) :].tolist())
    return model, ref32, outs


def test_teacher_forced_rows_are_the_distributions_tokens_came_from(bf16):
    """Greedy tokens are each row's argmax in the model that generated them:
    their gap to the best is 0."""
    model, _, outs = bf16
    f = teacher_forced(model, PROMPTS[0], outs[0], k=3)
    assert len(f.token) == len(f.best) == N and all(len(t) == 3 for t in f.top)
    assert max(f.gaps) == 0 and [t[0] for t in f.top] == outs[0]


def test_calibration_measures_the_models_own_16_bit_rounding(bf16):
    model, ref32, outs = bf16
    cal = calibrate(model, PROMPTS, outs, reference32=ref32)
    assert cal.positions == 2 * N and 0 < cal.deviation < 0.5
    assert cal.tolerance == 3 * cal.deviation and cal.gap_bound == 2 * cal.tolerance
    # float32 against itself: nothing to calibrate
    assert calibrate(ref32, PROMPTS, outs, reference32=ref32).deviation == 0


def near_tie_and_outlier(ref32, prompt, tokens, bound):
    """A position whose float32 runner-up is within ``bound`` of the best (a
    near-tie rounding may flip), and for a later position a token far below the
    best there."""
    for at in range(len(tokens) - 4):
        f = teacher_forced(ref32, prompt, tokens[: at + 1], k=2)
        best, second = f.top[at]
        logp = teacher_forced(ref32, prompt, tokens[:at] + [second], k=1).token[at]
        if f.best[at] - logp <= bound:
            return at, second
    return None, None


def test_a_calibrated_near_tie_is_accepted_and_an_error_after_it_rejected(bf16):
    """System "flip" takes the float32 runner-up at a near-tie, then continues
    greedily on its own prefix: accepted, every token judged. System "bug" makes
    the same flip, then emits one token the model would not consider three
    tokens later: a rule that stops at the first difference passes it; this
    one rejects it, at that token."""
    model, ref32, outs = bf16
    cal = calibrate(model, PROMPTS, outs, reference32=ref32)  # the model's own rounding
    at, second = near_tie_and_outlier(ref32, PROMPTS[0], outs[0], cal.gap_bound)
    assert at is not None, "no near-tie in the base output: pick another prompt"
    flipped = outs[0][:at] + [second]
    while len(flipped) < N:  # the float32 reference's own greedy continuation
        flipped.append(teacher_forced(ref32, PROMPTS[0], flipped + [0], k=1).top[-1][0])
    later = at + 3
    worst = teacher_forced(ref32, PROMPTS[0], flipped[: later + 1], k=1)
    logits_row = ref32(torch.tensor([PROMPTS[0] + flipped[:later]])).logits[0, -1]
    wrong = int(logits_row.argmin())  # the least likely token there
    bug = flipped[:later] + [wrong] + flipped[later + 1 :]
    assert worst.top[later][0] != wrong
    outputs = {"base": outs, "flip": [flipped, outs[1]], "bug": [bug, outs[1]]}
    judged = compare_systems(outputs, [N, N], exact=False, model=model, prompts=PROMPTS,
                             calibration=cal, reference32=ref32)  # fmt: skip
    flip, buggy = judged["flip"], judged["bug"]
    assert flip.sound and flip.first_differences == {0: at} and flip.accepted == 1
    assert flip.generated_positions == 2 * N  # every token, past the flip too
    assert not buggy.sound and buggy.first_differences == {0: at}
    assert [i for i, _ in buggy.rejected] == [0] and f"token {later} " in buggy.rejected[0][1]
    assert judged["base"].sound and judged["base"].identical == 2


def test_the_teacher_forced_check_compares_every_position(bf16):
    """A system scored on the base's tokens: within the tolerance everywhere
    passes; one log-probability pushed off by 0.5 nats late in the sequence is
    rejected there, and the coverage counts every position compared."""
    model, ref32, outs = bf16
    good = model_logprobs(model, PROMPTS, outs)  # the 16-bit forward pass
    bad = [list(s) for s in good]
    bad[1][N - 2] -= 0.5
    outputs = {"base": outs, "good": outs, "bad": outs}
    judged = compare_systems(outputs, [N, N], exact=False, model=model, prompts=PROMPTS,
                             scores={"good": good, "bad": bad}, reference32=ref32)  # fmt: skip
    assert judged["good"].sound and judged["good"].forced_positions == 2 * N
    assert judged["good"].forced_worst <= judged["good"].calibration.deviation
    assert not judged["bad"].sound
    assert judged["bad"].rejected[0][0] == 1 and f"token {N - 2} " in judged["bad"].rejected[0][1]
    assert judged["base"].forced_positions == 0 and "teacher-forced: none" in judged[
        "base"].summary()


def test_this_engine_scores_tokens_through_its_own_forward_pass(bf16):
    """`engine_logprobs` reads the engine's prompt log-probabilities: in
    bfloat16 on a CPU they are within the calibrated tolerance of float32's,
    and a request at max_model_len is scored as far as it fits."""
    from pagedkv_lab.llm import LLM

    model, ref32, outs = bf16
    llm = LLM((model, load_model("tiny-llama")[1]), kv_cache_memory=2**22,
              max_model_len=len(PROMPTS[1]) + N)  # fmt: skip
    scores = engine_logprobs(llm, PROMPTS, outs)
    assert [len(s) for s in scores] == [N, N - 1]  # the second reaches the limit
    judged = compare_systems({"base": outs, "pagedkv": outs}, [N, N], exact=False,
                             model=model, prompts=PROMPTS, scores={"pagedkv": scores},
                             forced_by={"pagedkv": "this engine"}, reference32=ref32)  # fmt: skip
    assert judged["pagedkv"].sound and judged["pagedkv"].forced_positions == 2 * N - 1
    assert "teacher-forced (this engine): 23 positions" in judged["pagedkv"].summary()


def test_float32_is_identity_and_a_short_output_fails(bf16):
    _, ref32, outs = bf16
    other = [outs[0][:5] + [outs[0][5] + 1] + outs[0][6:], outs[1][:-1]]
    exact = compare_systems({"a": outs, "b": other}, [N, N], exact=True)["b"]
    assert exact.identical == 0 and exact.full_length == 1 and not exact.sound
    assert "first at token 5" in exact.rejected[0][1] and "lengths" in exact.rejected[1][1]
    assert compare_systems({"a": outs}, [N, N], exact=True)["a"].sound
    with pytest.raises(ValueError, match="reference model"):
        compare_systems({"a": outs}, [N, N], exact=False)


def test_decode_floor_judges_every_system_on_a_cpu_in_bfloat16(bf16):
    """`scripts/decode_floor.py`'s judging (run on a GPU by the GPU check), on a
    CPU: our engine's tokens and scores against transformers' in bfloat16."""
    import importlib.util
    from pathlib import Path

    from pagedkv_lab.llm import LLM

    path = Path(__file__).resolve().parent.parent / "scripts" / "decode_floor.py"
    spec = importlib.util.spec_from_file_location("decode_floor", path)
    decode_floor = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(decode_floor)
    model, _, outs = bf16
    llm = LLM((model, load_model("tiny-llama")[1]), kv_cache_memory=2**22)
    ours = {i: o.token_ids for i, o in enumerate(llm.generate(
        PROMPTS, decode_floor.SamplingParams(temperature=0, max_tokens=N, ignore_eos=True),
        use_tqdm=False))}  # fmt: skip
    res = {"systems": {"pagedkv": {"tokens": ours, "scores": engine_logprobs(
        llm, PROMPTS, [ours[0], ours[1]])}, "hf": {"tokens": outs}}}  # fmt: skip
    judged = decode_floor.judge_tokens(res, model, PROMPTS, N, 2, "pagedkv")
    assert set(judged) == {"pagedkv", "hf"} and all(a.sound for a in judged.values())
    assert judged["pagedkv"].forced_positions == 2 * N
    assert judged["hf"].generated_positions == 2 * N
