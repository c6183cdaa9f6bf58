"""The engine's door: prompts and sampling parameters checked, completely,
before anything is queued (vLLM's ``vllm/v1/engine/processor.py`` does this
for its ``LLMEngine``).

`InputProcessor` is the part of `LLMEngine` (chapter 06) that takes requests
in: it turns a prompt (a text, token ids, or vLLM's ``{"prompt": ...}`` and
``{"prompt_token_ids": ...}``) into token ids, gives each request its own
checked copy of its `SamplingParams`, refuses what could never be served (a
prompt with no room for output, a request that could never fit the pool),
and queues a `SequenceGroup` with the scheduler. Bad input raises ValueError
naming the prompt, and disturbs nothing in flight.
"""

from __future__ import annotations

import itertools
import time

import torch

from pagedkv_lab.engine import SamplingParams as BaseSamplingParams
from pagedkv_lab.engine import Sequence
from pagedkv_lab.output_processor import RequestState
from pagedkv_lab.outputs import RequestMetrics
from pagedkv_lab.sampling_params import RequestOutputKind, SamplingParams
from pagedkv_lab.scheduler import SequenceGroup
from pagedkv_lab.tokenizing import is_token_id

_NOT_GIVEN = object()


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


class InputProcessor:
    """Requests into the engine. A mixin of `LLMEngine`, which provides
    ``model``, ``tokenizer``, ``block_manager``, ``scheduler``,
    ``max_model_len`` and ``seed``."""

    def _init_requests(self) -> None:
        # engine's number -> (group, prompt text, metrics), while in flight
        self._requests: dict[int, tuple[SequenceGroup, str | None, RequestMetrics]] = {}
        self._states: dict[int, RequestState] = {}
        # The ids callers gave -> the engine's own numbers.
        self._external_ids: dict[str, int] = {}
        self._request_ids = itertools.count()
        # Outputs another caller's `generate` finished for `step`'s caller.
        self._unclaimed: list = []
        # Requests in flight that need text at every step (or stop-token
        # reasons), that stream, that have no token yet, that want their
        # prompt's log-probabilities: a step looks only at these.
        self._text_requests: set[int] = set()
        self._streaming: set[int] = set()
        self._awaiting_first_token: set[int] = set()
        self._prompt_logprob_requests: set[int] = set()
        self._tracked_requests = (self._text_requests, self._streaming,
                                  self._awaiting_first_token,
                                  self._prompt_logprob_requests)  # fmt: skip
        self._t0 = time.perf_counter()
        # Unseeded requests get a seed from this stream when the engine has one.
        self._seeds = (
            None if self.seed is None else torch.Generator().manual_seed(self.seed)
        )

    def _now(self) -> float:
        return time.perf_counter() - self._t0

    def _token_ids(self, prompt, where: str) -> tuple[list[int], str | None]:
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
                return self._token_ids(ids, where)[0], prompt.get("prompt")
            if not isinstance(prompt["prompt"], str):
                raise ValueError(f"{where}: 'prompt' must be text")
            return self._token_ids(prompt["prompt"], where)
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
        vocab = self.model.config.vocab_size
        for i, t in enumerate(ids):
            if not is_token_id(t) or not 0 <= t < vocab:
                raise ValueError(
                    f"{where}: token ids must be ints in [0, {vocab}), "
                    f"got {t!r} at position {i}"
                )
        return [int(t) for t in ids], None

    def _request_params(self, params, token_ids: list[int], where: str):
        """The request's own copy of ``params``, checked again (a field changed
        after construction is caught here): ``max_tokens=None`` becomes the room
        left in the model, an unseeded request gets a seed from the engine's
        ``seed``. Beam search parameters pass as they are."""
        if params is None:
            params = SamplingParams()
        if hasattr(params, "beam_width"):
            return params
        try:
            params = SamplingParams.from_params(params)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
        changes = {}
        if params.max_tokens is None:
            changes["max_tokens"] = max(1, self.max_model_len - len(token_ids))
        if params.seed is None and self._seeds is not None:
            changes["seed"] = int(torch.randint(2**62, (), generator=self._seeds))
        if changes:
            params = params.clone(**changes)
        return params

    def _check_request(self, token_ids: list[int], params, where: str) -> None:
        """Refuse what could never be served, before anything is queued."""
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"{where} has {len(token_ids)} tokens; max_model_len="
                f"{self.max_model_len} leaves no room for output"
            )
        vocab = self.model.config.vocab_size
        bad = [t for t in getattr(params, "stop_token_ids", ()) if t >= vocab]
        if bad:
            raise ValueError(f"{where}: stop token ids {bad} are outside [0, {vocab})")
        if getattr(params, "stop", None) and self.tokenizer is None:
            raise ValueError(
                f"{where}: stop strings need a tokenizer; this LLM has none"
            )
        width = getattr(params, "n", 1)
        sched = self.scheduler
        if width > min(sched.max_num_seqs, sched.max_num_batched_tokens):
            raise ValueError(
                f"{where} asks for {width} sequences; max_num_seqs="
                f"{sched.max_num_seqs} and max_num_batched_tokens="
                f"{sched.max_num_batched_tokens} must both allow them"
            )
        bs, pool = self.block_manager.block_size, self.block_manager.num_blocks
        total = min(len(token_ids) + params.max_tokens, self.max_model_len)
        # Worst case: the prompt's full blocks are shared; every sequence owns
        # the rest (its copy of a partial prompt block, then its own tokens).
        shared = len(token_ids) // bs
        need = shared + width * -(-(total - shared * bs) // bs)
        need = max(need, -(-sched.reserve_tokens // bs))
        if need > pool:
            raise ValueError(
                f"{where} may need {need} KV blocks; the pool has {pool} "
                f"({pool * bs} tokens)"
            )

    def _check_batch(self, prompts, sampling_params, beams: bool = False) -> list:
        """`generate`'s requests (`beam_search`'s with ``beams``), every one
        checked before any is queued: ``(token ids, parameters, text)`` per
        prompt; `generate`'s parameters ask for whole outputs (``FINAL_ONLY``)."""
        prompts = as_prompt_list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            params = list(sampling_params)
        else:
            params = [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(
                f"{len(prompts)} prompts but {len(params)} sampling parameters"
            )
        checked = []
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            where = f"prompt {i}"
            if beams:
                token_ids, text = self._token_ids(prompt, where)
            else:
                if sp is not None and not isinstance(sp, BaseSamplingParams):
                    raise ValueError(f"sampling parameters {i}: got {sp!r}")
                token_ids, text = self._token_ids(prompt, where)
                sp = self._request_params(sp, token_ids, where)
                sp.output_kind = RequestOutputKind.FINAL_ONLY
            self._check_request(token_ids, sp, where)
            checked.append((token_ids, sp, text))
        return checked

    def _new_group(self, token_ids: list[int], params) -> SequenceGroup:
        """The request object for ``params`` (chapter 07 adds the sharing kinds)."""
        seq, rid = Sequence(token_ids, params), next(self._request_ids)
        if params.n == 1:
            return SequenceGroup(rid, seq, self._now())
        from pagedkv_lab.groups import ParallelSamplingGroup

        return ParallelSamplingGroup(rid, seq, self._now())

    def _enqueue(
        self, group: SequenceGroup, text: str | None, request_id=None
    ) -> int | str:
        """Queue ``group``; return the id its outputs will carry."""
        rid = group.request_id
        self._requests[rid] = (group, text, RequestMetrics(self._now()))
        self._awaiting_first_token.add(rid)
        if isinstance(group.params, SamplingParams):
            external = rid if request_id is None else request_id
            state = self._states[rid] = RequestState(external, group.params)
            if state.needs_text or state.params.stop_token_ids:
                self._text_requests.add(rid)
            if state.streams:
                self._streaming.add(rid)
            if group.params.prompt_logprobs is not None:
                # The first prompt token has no log-probability (vLLM: None).
                state.prompt_logprobs = [None]
                self._prompt_logprob_requests.add(rid)
            if request_id is not None:
                self._external_ids[request_id] = rid
        self.scheduler.add(group)
        return rid if request_id is None else request_id

    def _internal_id(self, request_id) -> int | None:
        """The engine's number of a request, from the id its outputs carry."""
        if isinstance(request_id, str):
            return self._external_ids.get(request_id)
        return request_id if request_id in self._requests else None

    def _check_request_id(self, request_id) -> None:
        if request_id is None:
            return
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(
                f"request_id must be a non-empty string, got {request_id!r}"
            )
        if request_id in self._external_ids:
            raise ValueError(f"request_id {request_id!r} is already in flight")

    def add_request(
        self,
        request_id,
        prompt=_NOT_GIVEN,
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
    ) -> int | str:
        """Queue one request; its outputs come from `step`. Returns its id.

        vLLM's shape, ``add_request("req-1", prompt, params)``, takes a string
        id; the shape of earlier chapters, ``add_request(prompt, params)``,
        numbers the request itself. A prompt is a text, token ids, or
        ``{"prompt": ...}`` / ``{"prompt_token_ids": ...}``. Bad input raises
        ValueError here and disturbs nothing in flight. Requests with different
        ``cache_salt`` never share cached blocks.
        """
        vllm_shape = params is not None or (
            isinstance(request_id, str)
            and prompt is not _NOT_GIVEN
            and prompt is not None
            and not isinstance(prompt, BaseSamplingParams)
        )
        if not vllm_shape:
            request_id, prompt, params = None, request_id, (
                None if prompt is _NOT_GIVEN else prompt
            )
        self._check_request_id(request_id)
        if params is not None and not isinstance(params, BaseSamplingParams):
            raise ValueError(f"expected SamplingParams, got {params!r}")
        token_ids, text = self._token_ids(prompt, "the prompt")
        params = self._request_params(params, token_ids, "the prompt")
        self._check_request(token_ids, params, "the prompt")
        group = self._new_group(token_ids, params)
        group.seqs[0].cache_salt = cache_salt
        return self._enqueue(group, text, request_id)
