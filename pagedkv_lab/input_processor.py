"""The engine's door: prompts and sampling parameters checked, completely,
before anything is queued (vLLM's ``InputProcessor``,
``vllm/v1/engine/input_processor.py``, ``processor.py`` in older releases).

`InputProcessor`, which `LLM` holds, takes requests in: it turns a prompt (a
text, token ids, or vLLM's ``{"prompt": ...}`` and ``{"prompt_token_ids":
...}``) into token ids, gives each request its own checked copy of its
`SamplingParams`, refuses what could never be served (a prompt with no room
for output, a request that could never fit the pool), and makes the request's
`SequenceGroup`. Bad input raises ValueError naming the prompt, and disturbs
nothing in flight.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from pagedkv_lab.engine.groups import BeamSearchGroup, ParallelSamplingGroup
from pagedkv_lab.engine.sequence import Sequence, SequenceGroup
from pagedkv_lab.sampling_params import (
    BeamSearchParams,
    RequestOutputKind,
    SamplingParams,
)
from pagedkv_lab.tokenizing import is_token_id


def as_prompt_list(prompts) -> list:
    """Normalise ``generate``'s first argument to a list of prompts.

    Accepts a text, a list of token ids, a 1-D or 2-D tensor or array of token
    ids, a prompt dict (``{"prompt": text}`` or ``{"prompt_token_ids": ids}``,
    as in vLLM), or a list of any of these; anything else is a ValueError.
    """
    if isinstance(prompts, (bytes, bytearray)):
        raise ValueError("prompts must be text or token ids, not bytes: decode first")
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if hasattr(prompts, "tolist") and hasattr(prompts, "ndim"):
        if prompts.ndim not in (1, 2):
            raise ValueError(
                f"a tensor of prompts must be 1-D (one prompt) or 2-D (a batch), "
                f"got {prompts.ndim}-D"
            )
        rows = prompts.tolist()
        return [rows] if prompts.ndim == 1 else rows
    if not hasattr(prompts, "__iter__"):
        raise ValueError(
            f"prompts must be a text, token ids or a list of them, got {prompts!r}"
        )
    prompts = list(prompts)
    if prompts and all(is_token_id(x) for x in prompts):
        return [prompts]
    return [p.tolist() if hasattr(p, "tolist") else p for p in prompts]


@dataclass
class Limits:
    """What the engine can serve, which every request is checked against."""

    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_blocks: int
    reserve_tokens: int = 0


class InputProcessor:
    """Requests into the engine: checked prompts and parameters, then a
    `SequenceGroup` (chapter 07's kinds for ``n`` > 1 and beam search).
    ``seed``: unseeded requests draw their seeds from it (None: they stay
    unseeded)."""

    def __init__(self, tokenizer, limits: Limits, seed: int | None = None):
        self.tokenizer, self.limits = tokenizer, limits
        self._request_ids = itertools.count()
        self._seeds = None if seed is None else torch.Generator().manual_seed(seed)

    def token_ids(self, prompt, where: str) -> tuple[list[int], str | None]:
        """Check one prompt; return its token ids and its text (None for ids)."""
        if isinstance(prompt, dict):
            unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
            if unknown or not prompt:
                raise ValueError(
                    f"{where}: a prompt dict has 'prompt' (text) or "
                    f"'prompt_token_ids', got keys {sorted(prompt)}"
                )
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if isinstance(ids, (str, dict)):
                    raise ValueError(f"{where}: prompt_token_ids must be token ids")
                ids = ids.tolist() if hasattr(ids, "tolist") else ids
                return self.token_ids(ids, where)[0], prompt.get("prompt")
            if not isinstance(prompt["prompt"], str):
                raise ValueError(f"{where}: 'prompt' must be text")
            return self.token_ids(prompt["prompt"], where)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"{where} is text but this LLM has no tokenizer: pass token "
                    "ids, or build it with a (model, tokenizer) pair"
                )
            if not prompt:
                raise ValueError(f"{where} is empty")
            return list(self.tokenizer(prompt).input_ids), prompt
        if isinstance(prompt, (bytes, bytearray)) or not hasattr(prompt, "__iter__"):
            raise ValueError(f"{where} must be text or a list of token ids")
        ids = list(prompt)
        if not ids:
            raise ValueError(f"{where} is empty")
        vocab = self.limits.vocab_size
        for i, t in enumerate(ids):
            if not is_token_id(t) or not 0 <= t < vocab:
                raise ValueError(
                    f"{where}: token ids must be ints in [0, {vocab}), "
                    f"got {t!r} at position {i}"
                )
        return [int(t) for t in ids], None

    def request_params(self, params, token_ids: list[int], where: str) -> SamplingParams:
        """The request's own copy of ``params``, checked again (a field changed
        after construction is caught here): ``max_tokens=None`` becomes the room
        left in the model, an unseeded request gets a seed from the engine's
        ``seed``."""
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"{where}: expected SamplingParams, got {params!r}")
        changes = {}
        if params.max_tokens is None:
            changes["max_tokens"] = max(1, self.limits.max_model_len - len(token_ids))
        if params.seed is None and self._seeds is not None:
            changes["seed"] = int(torch.randint(2**62, (), generator=self._seeds))
        try:
            return params.clone(**changes)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None

    def check_request(self, token_ids: list[int], params, where: str) -> None:
        """Refuse what could never be served, before anything is queued."""
        lim = self.limits
        if len(token_ids) >= lim.max_model_len:
            raise ValueError(
                f"{where} has {len(token_ids)} tokens; max_model_len="
                f"{lim.max_model_len} leaves no room for output"
            )
        bad = [t for t in params.stop_token_ids if t >= lim.vocab_size]
        if bad:
            raise ValueError(f"{where}: stop token ids {bad} are outside [0, {lim.vocab_size})")
        if getattr(params, "stop", None) and self.tokenizer is None:
            raise ValueError(f"{where}: stop strings need a tokenizer; this LLM has none")
        width = params.n
        if width > min(lim.max_num_seqs, lim.max_num_batched_tokens):
            raise ValueError(
                f"{where} asks for {width} sequences; max_num_seqs="
                f"{lim.max_num_seqs} and max_num_batched_tokens="
                f"{lim.max_num_batched_tokens} must both allow them"
            )
        bs, pool = lim.block_size, lim.num_blocks
        total = min(len(token_ids) + params.max_tokens, lim.max_model_len)
        # Worst case: the prompt's full blocks are shared; every sequence owns
        # the rest (its copy of a partial prompt block, then its own tokens).
        shared = len(token_ids) // bs
        need = shared + width * -(-(total - shared * bs) // bs)
        need = max(need, -(-lim.reserve_tokens // bs))
        if need > pool:
            raise ValueError(
                f"{where} may need {need} KV blocks; the pool has {pool} "
                f"({pool * bs} tokens)"
            )

    def check_batch(self, prompts, sampling_params, beams: bool = False) -> list:
        """`generate`'s requests (`beam_search`'s with ``beams``), every one
        checked before any is queued: ``(token ids, parameters, text)`` per
        prompt; `generate`'s parameters ask for whole outputs (``FINAL_ONLY``)."""
        prompts = as_prompt_list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            params = list(sampling_params)
        else:
            params = [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling parameters")
        checked = []
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            where = f"prompt {i}"
            token_ids, text = self.token_ids(prompt, where)
            if beams:
                if not isinstance(sp, BeamSearchParams):
                    raise ValueError(f"beam search parameters {i}: got {sp!r}")
            else:
                if sp is not None and not isinstance(sp, SamplingParams):
                    raise ValueError(f"sampling parameters {i}: got {sp!r}")
                sp = self.request_params(sp, token_ids, where)
                sp.output_kind = RequestOutputKind.FINAL_ONLY
            self.check_request(token_ids, sp, where)
            checked.append((token_ids, sp, text))
        return checked

    def new_group(self, token_ids: list[int], params, now: float,
                  cache_salt: str | None = None) -> SequenceGroup:  # fmt: skip
        """The request object for ``params``: one sequence, ``n`` samples that
        share their prompt's blocks, or a beam search (chapter 07)."""
        rid = next(self._request_ids)
        if isinstance(params, BeamSearchParams):
            return BeamSearchGroup(rid, token_ids, params, now)
        seq = Sequence(token_ids, params)
        seq.cache_salt = cache_salt
        if params.n == 1:
            return SequenceGroup(rid, seq, now)
        return ParallelSamplingGroup(rid, seq, now)
