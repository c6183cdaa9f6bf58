"""Comparing what two systems generated, soundly on every device.

In float32 two correct systems generate the same tokens, and a comparison is
exact. In float16 or bfloat16 they need not: two systems that add the same
numbers in another order (another attention kernel, another GEMM tile, a
padded batch) round differently, and where two tokens are nearly tied, which
random weights make common, the argmax flips; every token after the flip
differs too. vLLM's tests compare such outputs with a rule
(``check_logprobs_close`` in its ``tests/models/utils.py``): walk the two
token lists together; at the first position where they differ, each side's
token must be among the other side's top-k most likely tokens there, and the
comparison stops, since what follows a flip no longer compares like with like.

`check_logprobs_close` is that rule, on each side's own top-k lists.
`compare_systems` applies a simplification of it to every request of a
benchmark, and says where each divergence fell: both sides are judged by one
teacher-forced forward pass of the reference model (`teacher_forced_top_k`)
over the prefix they share up to their first difference, so both tokens must
be among that one distribution's top k (vLLM's rule reads each side's own
log-probabilities instead).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

__all__ = [
    "Divergence",
    "check_logprobs_close",
    "compare_systems",
    "first_difference",
    "teacher_forced_top_k",
]


def first_difference(a: Seq[int], b: Seq[int]) -> int | None:
    """The first index at which ``a`` and ``b`` differ (the shorter one's
    length if one is a prefix of the other), or None if they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass
class Divergence:
    """Where two token lists first differ, and whether vLLM's rule accepts it:
    ``accepted`` when each token there is in the other side's ``top_k``."""

    position: int
    tokens: tuple[int, int]
    accepted: bool
    reason: str = ""


def check_logprobs_close(
    tokens_a: Seq[int],
    top_a: Seq[Seq[int]],
    tokens_b: Seq[int],
    top_b: Seq[Seq[int]],
) -> Divergence | None:
    """vLLM's rule for one request: None when the two lists are equal; else
    the first difference, accepted when ``tokens_a[i]`` is among ``top_b[i]``
    (side b's most likely tokens at that position) and ``tokens_b[i]`` among
    ``top_a[i]``. A list that stops early is never accepted: every system must
    generate the tokens it was asked for."""
    at = first_difference(tokens_a, tokens_b)
    if at is None:
        return None
    if at >= min(len(tokens_a), len(tokens_b)):
        return Divergence(at, (-1, -1), False, f"lengths {len(tokens_a)} and {len(tokens_b)}")
    a, b = tokens_a[at], tokens_b[at]
    a_in_b, b_in_a = a in set(top_b[at]), b in set(top_a[at])
    reason = "" if a_in_b and b_in_a else (
        f"token {a} not in the other's top-{len(top_b[at])}" if not a_in_b
        else f"token {b} not in the other's top-{len(top_a[at])}")  # fmt: skip
    return Divergence(at, (a, b), a_in_b and b_in_a, reason)


@torch.inference_mode()
def teacher_forced_top_k(model, prompt: Seq[int], tokens: Seq[int], k: int) -> list[list[int]]:
    """The ``k`` most likely next tokens of ``model`` at each generated
    position, with ``prompt + tokens`` fed in (teacher forcing): row ``i`` is
    the distribution from which ``tokens[i]`` was drawn."""
    if not tokens:
        return []
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt) + list(tokens[:-1])], device=device)
    logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 :]
    return logits.float().topk(k, dim=-1).indices.tolist()


@dataclass
class SystemAgreement:
    """How one system's outputs compare with the base system's, over requests."""

    requests: int = 0
    full_length: int = 0  # generated exactly the tokens asked for
    identical: int = 0
    accepted: int = 0  # differ, at a near-tie vLLM's rule accepts
    rejected: list[tuple[int, Divergence]] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)  # where accepted ones diverged

    @property
    def sound(self) -> bool:
        """Every request full length, and identical or accepted."""
        return self.full_length == self.requests and not self.rejected

    def summary(self) -> str:
        where = (f", first difference at token {min(self.positions)}-{max(self.positions)}"
                 if self.positions else "")  # fmt: skip
        text = (f"{self.identical}/{self.requests} identical, {self.accepted} differ at a "
                f"near-tie (both tokens in the reference's top-k){where}")  # fmt: skip
        if self.full_length != self.requests:
            text += f"; {self.requests - self.full_length} of the wrong length"
        if self.rejected:
            i, d = self.rejected[0]
            text += f"; {len(self.rejected)} rejected (request {i}: {d.reason})"
        return text


def compare_systems(
    outputs: dict[str, list[list[int]]],
    max_tokens: Seq[int],
    *,
    base: str | None = None,
    exact: bool,
    model=None,
    prompts: Seq[Seq[int]] | None = None,
    k: int = 5,
) -> dict[str, SystemAgreement]:
    """Every system's outputs against ``base``'s (the first system by
    default), request by request: each must have exactly ``max_tokens[i]``
    tokens; with ``exact`` (float32) they must be identical; otherwise a
    difference is judged by vLLM's rule, with top-``k`` lists from
    `teacher_forced_top_k` on ``model`` over ``prompts`` (needed only then)."""
    base = base or next(iter(outputs))
    want = outputs[base]
    result = {}
    for name, got in outputs.items():
        agree = SystemAgreement(requests=len(got))
        for i, (tokens, ref) in enumerate(zip(got, want)):
            agree.full_length += len(tokens) == max_tokens[i]
            at = first_difference(tokens, ref)
            if at is None:
                agree.identical += 1
                continue
            if exact or model is None or at >= min(len(tokens), len(ref)):
                why = "float32 outputs differ" if exact else "no model to judge by"
                if at >= min(len(tokens), len(ref)):
                    why = f"lengths {len(tokens)} and {len(ref)}"
                a, b = (tokens[at], ref[at]) if at < min(len(tokens), len(ref)) else (-1, -1)
                agree.rejected.append((i, Divergence(at, (a, b), False, why)))
                continue
            # both lists share tokens [:at], so one forward pass judges both sides
            top = teacher_forced_top_k(model, prompts[i], tokens[: at + 1], k)
            d = check_logprobs_close(tokens[: at + 1], top, ref[: at + 1], top)
            if d.accepted:
                agree.accepted += 1
                agree.positions.append(d.position)
            else:
                agree.rejected.append((i, d))
        result[name] = agree
    return result
