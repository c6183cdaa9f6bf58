"""Comparing what systems generated, soundly in every dtype (chapter 10).

In float32 two correct systems generate the same greedy tokens, and the
comparison is identity. In bfloat16 or float16 they need not: two systems that
add the same numbers in another order (another attention kernel, another GEMM
tile, a padded batch) round differently, and where two tokens are nearly tied,
which random weights make common, the argmax flips; every token after the flip
differs too. Identity would fail correct systems at random; stopping at the
first difference, as vLLM's tests do (``check_logprobs_close`` in its
``tests/models/utils.py``: at the first differing token each side's token must
be among the other side's own top-N log-probabilities, then the loop breaks),
leaves every later token unchecked.

`compare_systems` judges 16-bit outputs against an independent reference: the
model's own ``transformers`` forward pass in float32, on the same weights
(`float32_copy`). Both of its checks cover every position and say how many
they covered:

1. **teacher-forced** (`Agreement.forced_positions`): a system that can score a
   given token sequence (this engine, through ``prompt_logprobs``) is fed the
   base system's prompt + output in one forward pass, and at every position its
   log-probability of the token there must be within the *tolerance* of the
   float32 reference's. A wrong block table or a wrong K/V after a flip shows
   here, since every system is forced onto the same tokens.
2. **generated** (`Agreement.generated_positions`): each system's own tokens,
   with the float32 reference teacher-forced on them: at every position the
   system's token must be the reference's most likely token there, or within
   the *gap bound* of it in log-probability (a near-tie that rounding can
   flip). At a system's first difference from the base this is a
   first-difference check with a log-probability gap instead of vLLM's top-N
   rank; after it the check goes on, each system judged on its own
   continuation.

The tolerance is calibrated (`calibrate`): the largest distance between the
reference model's own 16-bit log-probabilities and its float32 ones, over the
float32 top-``k`` tokens at every position of the base outputs, times
``factor`` (3 by default: another kernel's rounding is of the same order as
transformers' own, and the factor leaves room for a different summation order).
A greedy token's float32 gap to the best token can then be at most twice the
tolerance (both log-probabilities may be off by one tolerance), which is the
gap bound.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

__all__ = [
    "Agreement",
    "Calibration",
    "Forced",
    "calibrate",
    "compare_systems",
    "engine_logprobs",
    "first_difference",
    "float32_copy",
    "model_logprobs",
    "teacher_forced",
]

#: The tolerance over the reference's own 16-bit deviation from float32.
FACTOR = 3.0


def first_difference(a: Seq[int], b: Seq[int]) -> int | None:
    """The first index at which ``a`` and ``b`` differ (the shorter one's
    length if one is a prefix of the other), or None if they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass
class Forced:
    """A model teacher-forced on ``prompt + tokens``: at each position ``i``
    of ``tokens``, the log-probability of ``tokens[i]`` (``token``), the largest
    log-probability there (``best``) and the ``top`` most likely token ids."""

    token: list[float]
    best: list[float]
    top: list[list[int]]

    @property
    def gaps(self) -> list[float]:
        """How far each token is below the most likely one (0 for the argmax)."""
        return [b - t for b, t in zip(self.best, self.token)]


@torch.inference_mode()
def teacher_forced(model, prompt: Seq[int], tokens: Seq[int], k: int = 5) -> Forced:
    """One forward pass of ``model`` (a ``transformers`` causal LM) over
    ``prompt + tokens[:-1]``; row ``i`` is the distribution ``tokens[i]`` was
    drawn from, as float32 log-probabilities."""
    if not tokens:
        return Forced([], [], [])
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt) + list(tokens[:-1])], device=device)
    logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 :]
    logp = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(list(tokens), device=device)[:, None]
    return Forced(
        logp.gather(1, index)[:, 0].tolist(),
        logp.max(dim=-1).values.tolist(),
        logp.topk(min(k, logp.shape[-1]), dim=-1).indices.tolist(),
    )


def model_logprobs(model, prompts: Seq[Seq[int]], outputs: Seq[Seq[int]]) -> list[list[float]]:
    """A ``transformers`` model as a system that scores token sequences: the
    log-probability of each output token, teacher-forced (`teacher_forced`)."""
    return [teacher_forced(model, p, t, k=1).token for p, t in zip(prompts, outputs)]


def engine_logprobs(llm, prompts: Seq[Seq[int]], outputs: Seq[Seq[int]]) -> list[list[float]]:
    """This engine as a system that scores token sequences: ``prompt + output``
    served as one prompt with ``prompt_logprobs=0`` (one forward pass through
    the engine's own runner, kernels and paged cache; prefix caching is not
    used for such requests), each output token's log-probability read back. A
    request at the engine's ``max_model_len`` scores all but the tokens that
    leave no room for the one token every request must ask for."""
    from pagedkv_lab.sampling_params import SamplingParams

    limit = llm.max_model_len
    cut = [max(0, min(len(t), limit - len(p) - 1)) for p, t in zip(prompts, outputs)]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    served = [(list(p) + list(t[:n]), i) for i, (p, t, n) in enumerate(zip(prompts, outputs, cut))
              if n > 0]  # fmt: skip
    scores: list[list[float]] = [[] for _ in prompts]
    if not served:
        return scores
    outs = llm.generate([s for s, _ in served], params, use_tqdm=False)
    for (seq, i), out in zip(served, outs):
        n, entries = cut[i], out.prompt_logprobs
        start = len(prompts[i])
        scores[i] = [entries[start + j][seq[start + j]].logprob for j in range(n)]
    return scores


def float32_copy(model):
    """The same weights, upcast exactly to float32, on the same device: the
    reference every 16-bit system is judged against."""
    if next(model.parameters()).dtype == torch.float32:
        return model
    return copy.deepcopy(model).to(torch.float32)


@dataclass(frozen=True)
class Calibration:
    """How far the reference model's own 16-bit log-probabilities are from
    float32's (``deviation``, the largest over ``positions`` positions and the
    float32 top-``k`` tokens at each), and the rule built on it."""

    deviation: float
    positions: int
    factor: float = FACTOR

    @property
    def tolerance(self) -> float:
        """Check 1's bound on a log-probability's distance from float32's."""
        return self.factor * self.deviation

    @property
    def gap_bound(self) -> float:
        """Check 2's bound on a generated token's float32 gap to the best."""
        return 2 * self.tolerance


@torch.inference_mode()
def calibrate(
    model16,
    prompts: Seq[Seq[int]],
    outputs: Seq[Seq[int]],
    *,
    reference32=None,
    k: int = 5,
    factor: float = FACTOR,
) -> Calibration:
    """The reference's own 16-bit rounding, measured: ``model16`` and its
    float32 copy teacher-forced on ``outputs``; at every position, the
    log-probabilities of float32's ``k`` most likely tokens in both."""
    reference32 = reference32 if reference32 is not None else float32_copy(model16)
    device = next(model16.parameters()).device
    worst, positions = 0.0, 0
    for prompt, tokens in zip(prompts, outputs):
        if not tokens:
            continue
        ids = torch.tensor([list(prompt) + list(tokens[:-1])], device=device)
        rows = slice(len(prompt) - 1, None)
        low = torch.log_softmax(model16(input_ids=ids, use_cache=False).logits[0, rows].float(), -1)
        high = torch.log_softmax(reference32(input_ids=ids, use_cache=False).logits[0, rows].float(), -1)
        top = high.topk(min(k, high.shape[-1]), dim=-1).indices
        worst = max(worst, (low.gather(1, top) - high.gather(1, top)).abs().max().item())
        positions += len(tokens)
    return Calibration(worst, positions, factor)


@dataclass
class Agreement:
    """How one system's outputs compare with the base system's, request by
    request, and what each check covered (see the module's docstring)."""

    requests: int = 0
    full_length: int = 0  # generated exactly the tokens asked for
    identical: int = 0
    exact: bool = True  # float32: identity is the check
    calibration: Calibration | None = None
    forced_positions: int = 0  # check 1: teacher-forced positions compared
    forced_worst: float = 0.0  # the largest distance from float32 seen there
    forced_by: str = ""  # whose forward pass check 1 ran ("" for none)
    generated_positions: int = 0  # check 2: generated positions judged
    generated_worst: float = 0.0  # the largest float32 gap seen there
    first_differences: dict[int, int] = field(default_factory=dict)  # request -> token
    rejected: list[tuple[int, str]] = field(default_factory=list)

    @property
    def sound(self) -> bool:
        """Every request full length, and nothing rejected by either check."""
        return self.full_length == self.requests and not self.rejected

    @property
    def accepted(self) -> int:
        """Requests that differ from the base's and passed both checks."""
        bad = {i for i, _ in self.rejected}
        return len(set(self.first_differences) - bad)

    def summary(self) -> str:
        """One sentence: what matched, what each check covered, what failed."""
        n = self.requests
        text = f"{self.identical}/{n} identical"
        if self.exact:
            text += " (float32: identity is the check)"
        else:
            c = self.calibration
            at = self.first_differences.values()
            where = f", first at token {min(at)}-{max(at)}" if at else ""
            text += (f", {len(self.first_differences)} differ{where}; generated: "
                     f"{self.generated_positions} tokens judged, largest float32 gap "
                     f"{self.generated_worst:.3f} (bound {c.gap_bound:.3f})")  # fmt: skip
            if self.forced_by:
                text += (f"; teacher-forced ({self.forced_by}): {self.forced_positions} "
                         f"positions, largest distance {self.forced_worst:.3f} "
                         f"(tolerance {c.tolerance:.3f})")  # fmt: skip
            else:
                text += "; teacher-forced: none (no scorer for this system)"
        if self.full_length != n:
            text += f"; {n - self.full_length} of the wrong length"
        if self.rejected:
            i, why = self.rejected[0]
            text += f"; {len(self.rejected)} rejected (request {i}: {why})"
        return text


def _forced_cache(reference32, k: int):
    """`teacher_forced` on ``reference32``, each (prompt, tokens) computed once."""
    seen: dict[tuple, Forced] = {}

    def forced(prompt, tokens) -> Forced:
        key = (tuple(prompt), tuple(tokens))
        if key not in seen:
            seen[key] = teacher_forced(reference32, prompt, tokens, k)
        return seen[key]

    return forced


def compare_systems(
    outputs: dict[str, list[list[int]]],
    max_tokens: Seq[int],
    *,
    base: str | None = None,
    exact: bool,
    model=None,
    prompts: Seq[Seq[int]] | None = None,
    scores: dict[str, list[list[float]] | None] | None = None,
    forced_by: dict[str, str] | None = None,
    calibration: Calibration | None = None,
    reference32=None,
    k: int = 5,
    factor: float = FACTOR,
) -> dict[str, Agreement]:
    """Every system's outputs against ``base``'s (the first system by
    default), request by request: each must have exactly ``max_tokens[i]``
    tokens. With ``exact`` (float32) they must be identical. Otherwise
    ``model`` (the reference: ``transformers``, in the systems' 16-bit dtype,
    over ``prompts``) is copied to float32 (or ``reference32`` is used) and
    calibrated on the base's outputs, and both checks of the module's
    docstring run: ``scores[name]`` holds a system's teacher-forced
    log-probabilities of the base's output tokens (`engine_logprobs`; a list
    may stop early, and only what it holds is compared; a missing entry: no
    teacher-forced check for that system), ``forced_by[name]`` says whose
    forward pass produced them."""
    base = base or next(iter(outputs))
    want = outputs[base]
    scores, forced_by = scores or {}, forced_by or {}
    if not exact:
        if model is None or prompts is None:
            raise ValueError("a 16-bit comparison needs the reference model and the prompts")
        reference32 = reference32 if reference32 is not None else float32_copy(model)
        if calibration is None:
            calibration = calibrate(model, prompts, want, reference32=reference32, k=k,
                                    factor=factor)  # fmt: skip
        forced = _forced_cache(reference32, k)
    result = {}
    for name, got in outputs.items():
        agree = Agreement(requests=len(got), exact=exact, calibration=calibration)
        for i, (tokens, ref) in enumerate(zip(got, want)):
            agree.full_length += len(tokens) == max_tokens[i]
            at = first_difference(tokens, ref)
            if at is None:
                agree.identical += 1
            elif exact:
                why = "float32 outputs differ" if at < min(len(tokens), len(ref)) else (
                    f"lengths {len(tokens)} and {len(ref)}")
                agree.rejected.append((i, f"{why}, first at token {at}"))
            else:
                agree.first_differences[i] = at
            if exact or not tokens:
                continue
            # check 2: every generated token against float32, on its own prefix
            gaps = forced(prompts[i], tokens).gaps
            agree.generated_positions += len(gaps)
            agree.generated_worst = max(agree.generated_worst, max(gaps))
            bad = [p for p, g in enumerate(gaps) if g > calibration.gap_bound]
            if bad:
                agree.rejected.append((i, f"token {bad[0]} is {gaps[bad[0]]:.3f} below "
                                          f"float32's best there (bound "
                                          f"{calibration.gap_bound:.3f})"))  # fmt: skip
        mine = scores.get(name)
        if not exact and mine is not None:
            agree.forced_by = forced_by.get(name, "its own forward pass")
            for i, lps in enumerate(mine):
                if not lps:
                    continue
                truth = forced(prompts[i], want[i]).token[: len(lps)]
                dist = [abs(a - b) for a, b in zip(lps, truth)]
                agree.forced_positions += len(dist)
                agree.forced_worst = max(agree.forced_worst, max(dist))
                bad = [p for p, d in enumerate(dist) if d > calibration.tolerance]
                if bad:
                    agree.rejected.append((i, f"teacher-forced log-probability at token "
                                              f"{bad[0]} is {dist[bad[0]]:.3f} from "
                                              f"float32's (tolerance "
                                              f"{calibration.tolerance:.3f})"))  # fmt: skip
        result[name] = agree
    return result
