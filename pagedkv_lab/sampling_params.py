"""vLLM's sampling settings, `SamplingParams`, and what `LLM.step` streams,
`RequestOutputKind` (vLLM keeps both in ``vllm/sampling_params.py``).

Chapter 05a's sampler reads what the course needs (greedy, temperature, top-k,
top-p, seeds, stop token ids); a user arriving from vLLM expects more, and
the same class has it. Beam search takes `BeamSearchParams` instead.

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

Fields of vLLM's `SamplingParams` that this library does not implement
(`UNSUPPORTED_FIELDS`) are refused with a TypeError that says why, lists the
fields that are supported and points to the appendix "From pagedkv_lab to
vLLM" (``book/vllm.md``).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import enum
import math
import numbers
from dataclasses import dataclass

#: Temperatures below this are treated as greedy: dividing logits by a smaller
#: number overflows float32 (vLLM uses the same threshold).
GREEDY_EPSILON = 1e-5

#: Where a reader finds what is supported and what vLLM offers instead.
SEE_ALSO = 'see "From pagedkv_lab to vLLM" (book/vllm.md), section "The settings"'

#: vLLM's sampling fields that are not implemented here, and why.
UNSUPPORTED_FIELDS: dict[str, str] = {
    "best_of": "vLLM v1 removed it too; ask for n samples and rank them yourself",
    "logit_bias": "not implemented",
    "allowed_token_ids": "not implemented",
    "bad_words": "not implemented",
    "logits_processors": "not implemented",
    "guided_decoding": "structured output (guided decoding) is out of scope",
    "structured_outputs": "structured output (guided decoding) is out of scope",
    "truncate_prompt_tokens": "not implemented: prompts are never truncated",
    "detokenize": "text is always decoded when the engine has a tokenizer",
    "spaces_between_special_tokens": "not implemented",
    "extra_args": "not implemented",
    "use_beam_search": "use LLM.beam_search with BeamSearchParams",
}


def refuse_unsupported(
    what: str, given, supported, reasons: dict[str, str]
) -> None:
    """Raise a TypeError naming the arguments in ``given`` that ``what`` does not
    take: for each, why (``reasons``) or the closest supported name; then every
    supported name and where to read more."""
    unknown = [name for name in given if name not in supported]
    if not unknown:
        return
    parts = []
    for name in unknown:
        if name in reasons:
            parts.append(f"{name} ({reasons[name]})")
        else:
            close = difflib.get_close_matches(name, supported, n=1)
            parts.append(f"{name}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise TypeError(
        f"{what} does not support {', '.join(parts)}. Supported: "
        f"{', '.join(supported)}; {SEE_ALSO}"
    )


class RequestOutputKind(enum.Enum):
    """What `LLM.step` returns for a request that is still running
    (vLLM's names): every step the whole output so far (``CUMULATIVE``, the
    default), only what is new since the last step (``DELTA``), or nothing
    until it finishes (``FINAL_ONLY``; `LLM.generate` uses this)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def check_int(name: str, value, low: int | None = None, none_ok: bool = False):
    """``value`` as a Python int (NumPy integers included), or a ValueError naming it."""
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


def check_float(name: str, value, low: float, high: float, low_open: bool = False):
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


def check_bool(name: str, value, none_ok: bool = False) -> bool | None:
    """``value`` if it is True or False (or None with ``none_ok``), else a ValueError."""
    if value is None and none_ok:
        return None
    if not isinstance(value, bool):
        allowed = "None, True or False" if none_ok else "True or False"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return value


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop, per request, with vLLM's names.

    Chapter 05a's fields (``n``, ``temperature``, ``top_p``, ``top_k``,
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
    fields accept NumPy integers. A field of vLLM's that is not implemented
    here (``best_of``, ``logit_bias``, ``logits_processors``,
    ``guided_decoding``...) is a TypeError that lists the supported ones.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    max_tokens: int | None = 16
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
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

    def __new__(cls, *args, **kwargs):
        # Runs before the generated __init__, so an unsupported field gets a
        # sentence, not Python's bare "unexpected keyword argument".
        names = [f.name for f in dataclasses.fields(cls)]
        refuse_unsupported("SamplingParams", kwargs, names, UNSUPPORTED_FIELDS)
        return super().__new__(cls)

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Check every field (ValueError naming it) and normalise: NumPy
        integers become ints, ``stop`` and ``stop_token_ids`` tuples."""
        self.n = check_int("n", self.n, 1)
        self.temperature = check_float("temperature", self.temperature, 0.0, math.inf)
        self.top_p = check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        self.top_k = check_int("top_k", self.top_k, -1)
        self.min_p = check_float("min_p", self.min_p, 0.0, 1.0)
        self.max_tokens = check_int("max_tokens", self.max_tokens, 1, none_ok=True)
        self.min_tokens = check_int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens "
                f"({self.max_tokens})"
            )
        self.seed = check_int("seed", self.seed, 0, none_ok=True)
        for name in ("presence_penalty", "frequency_penalty"):
            setattr(self, name, check_float(name, getattr(self, name), -2.0, 2.0))
        self.repetition_penalty = check_float(
            "repetition_penalty", self.repetition_penalty, 0.0, math.inf, True
        )
        ids = self.stop_token_ids
        if ids is None:
            ids = ()
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {ids!r}")
        self.stop_token_ids = tuple(
            check_int(f"stop_token_ids[{i}]", t, 0) for i, t in enumerate(ids)
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
        self.logprobs = check_int("logprobs", self.logprobs, 0, none_ok=True)
        self.prompt_logprobs = check_int(
            "prompt_logprobs", self.prompt_logprobs, 0, none_ok=True
        )
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            check_bool(name, getattr(self, name))
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

    @property
    def greedy(self) -> bool:
        """Whether the request takes the most likely token (temperature ~ 0)."""
        return self.temperature < GREEDY_EPSILON

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


#: transformers' three meanings of `early_stopping` (see `BeamSearchParams`).
EARLY_STOPPING = (True, False, "never")


@dataclass
class BeamSearchParams:
    """Beam search settings, with transformers' meanings (chapter 07).

    The search equals ``model.generate(num_beams=beam_width, do_sample=False,
    max_new_tokens=max_tokens, length_penalty=length_penalty,
    early_stopping=early_stopping)``: at each step the ``2 * beam_width`` best
    continuations of all beams are ranked by cumulative log-probability; those
    ending in EOS among the first ``beam_width`` become finished hypotheses,
    scored ``cum_logprob / generated_len ** length_penalty``; the best
    ``beam_width`` others go on.
    """

    beam_width: int
    max_tokens: int = 16
    length_penalty: float = 1.0
    ignore_eos: bool = False
    early_stopping: bool | str = False

    def __post_init__(self):
        self.beam_width = check_int("beam_width", self.beam_width, 1)
        self.max_tokens = check_int("max_tokens", self.max_tokens, 1)
        self.length_penalty = check_float("length_penalty", self.length_penalty, -math.inf,
                                     math.inf)  # fmt: skip
        check_bool("ignore_eos", self.ignore_eos)
        if self.early_stopping not in EARLY_STOPPING:
            raise ValueError("early_stopping must be True, False or 'never'")

    @property
    def n(self) -> int:
        return self.beam_width

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return ()
