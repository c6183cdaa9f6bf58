"""The engine never loses a request and never wedges: bad input, aborts, faults."""

from collections import Counter
from functools import cache

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from reference import greedy_alone

from pagedkv_lab.llm import LLM
from pagedkv_lab.models import load_model
from pagedkv_lab.sampling_params import SamplingParams

MODEL, TOKENIZER = load_model("tiny-llama")
BYTES_PER_TOKEN = 512  # tiny-llama, fp32
# A prompt that starts with this token (instead of BOS) breaks the forward pass.
# Only a prompt can hold it at position 0: generated tokens never do.
POISON = 0


class FaultyForward:
    """Wraps the runner's forward pass: raises once on demand, or whenever the
    batch holds a poisoned prompt's first token (a request that breaks the
    forward)."""

    def __init__(self, forward):
        self.forward, self.fail_next = forward, False

    def __call__(self, step):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected one-off fault")
        first = step.input_ids[step.positions == 0]
        if (first == POISON).any():
            raise RuntimeError("injected fault: poisoned token")
        return self.forward(step)


def _llm(num_blocks=64, block_size=4, **kwargs) -> LLM:
    llm = LLM(
        (MODEL, TOKENIZER),
        block_size=block_size,
        kv_cache_memory=num_blocks * block_size * BYTES_PER_TOKEN,
        **kwargs,
    )
    llm.runner.forward = FaultyForward(llm.runner.forward)
    return llm


def _greedy(max_tokens):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@cache
def _solo(prompt: tuple, max_tokens: int) -> list[int]:
    return greedy_alone(MODEL, list(prompt), max_tokens)


def _assert_pool_consistent(llm: LLM) -> None:
    """Every block is held by live sequences exactly as often as its count says."""
    bm = llm.block_manager
    held = Counter(
        b
        for g in llm.scheduler.running
        for s in g.seqs
        if s.block_table is not None
        for b in s.block_table
    )
    assert all(s.block_table is None for g in llm.scheduler.waiting for s in g.seqs)
    for block, count in enumerate(bm.ref_counts):
        assert count == held.get(block, 0)
    assert len(held) + bm.num_free_blocks == bm.num_blocks


def _drain(llm: LLM) -> list:
    """Step to the end; the finished outputs (a step also streams the others)."""
    outs = []
    while llm.has_unfinished_requests():
        outs += [o for o in llm.step() if o.finished]
    assert llm.step() == []
    return outs


# Bad input at the door -----------------------------------------------------------


@pytest.mark.parametrize(
    "bad,message",
    [
        ("", "prompt 1 is empty"),
        ([], "prompt 1 is empty"),
        ([1, 400], r"prompt 1: token ids must be ints in \[0, 320\), got 400"),
        ([1, True], "prompt 1: token ids must be ints.*got True"),
        ([1, 2.0], "prompt 1: token ids must be ints.*got 2.0"),
        ([[1, 2]], "prompt 1: token ids must be ints"),
        (b"bytes", "prompt 1 must be text or a list of token ids"),
        ([1] * 2048, "prompt 1 has 2048 tokens"),
    ],
)
def test_a_bad_prompt_rejects_the_whole_call_and_queues_nothing(bad, message):
    llm = _llm()
    with pytest.raises(ValueError, match=message):
        llm.generate([[1, 5], bad, [1, 6]], _greedy(3), use_tqdm=False)
    assert not llm.scheduler.has_unfinished and not llm.output_processor.states
    out = llm.generate([[1, 5]], _greedy(3), use_tqdm=False)
    assert out[0].token_ids == _solo((1, 5), 3)


@pytest.mark.parametrize(
    "prompts,expected",
    [
        (torch.tensor([1, 5, 6]), [[1, 5, 6]]),
        (torch.tensor([[1, 5], [1, 6]]), [[1, 5], [1, 6]]),
        (np.array([1, 5, 6]), [[1, 5, 6]]),
        ([np.int64(1), np.int64(7)], [[1, 7]]),
        ([torch.tensor([1, 5]), [1, 6]], [[1, 5], [1, 6]]),
    ],
)
def test_tensors_and_arrays_are_accepted_as_prompts(prompts, expected):
    outs = _llm().generate(prompts, _greedy(2), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == expected


@pytest.mark.parametrize(
    "prompts,message",
    [
        (b"abc", "not bytes"),
        (torch.ones(1, 2, 3, dtype=torch.long), "1-D .* or 2-D"),
        ({"a": 1}, "a prompt dict has 'prompt'"),
        (5, "prompts must be"),
    ],
)
def test_unusable_prompt_arguments_are_refused(prompts, message):
    with pytest.raises(ValueError, match=message):
        _llm().generate(prompts, use_tqdm=False)


def test_request_checks_that_need_the_engine():
    llm = _llm(num_blocks=16, block_size=4)
    for params, message in [
        (SamplingParams(stop_token_ids=[999]), r"stop token ids \[999\]"),
        (SamplingParams(n=2, max_tokens=100), "may need 32 KV blocks"),
        (SamplingParams(n=300, max_tokens=1), "asks for 300 sequences"),
    ]:
        with pytest.raises(ValueError, match=message):
            llm.add_request([1, 2, 3], params)
    with pytest.raises(ValueError, match="expected SamplingParams"):
        llm.add_request([1, 2], {"temperature": 0})
    assert not llm.scheduler.has_unfinished


# Outputs go to whoever asked ---------------------------------------------------------


def test_generate_returns_its_own_outputs_and_keeps_the_others():
    llm = _llm()
    mine = llm.add_request([1, 9, 9], _greedy(20))
    outs = llm.generate([[1, 5], [1, 6]], _greedy(2), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [[1, 5], [1, 6]]
    rest = _drain(llm)
    assert [o.request_id for o in rest] == [mine]
    assert rest[0].token_ids == _solo((1, 9, 9), 20)


def test_an_interrupted_generate_leaves_no_orphan():
    llm = _llm()
    other = llm.add_request([1, 8], _greedy(30))
    calls = {"n": 0}
    inner = llm.runner.forward

    def interrupt_third_step(step):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return inner(step)

    llm.runner.forward = interrupt_third_step
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[1, 5], [1, 6]], _greedy(10), use_tqdm=False)
    llm.runner.forward = inner
    # The interrupted call's requests are gone, their blocks free; the other
    # request goes on and the next call works.
    assert [g.request_id for g in llm.scheduler.running] == [other]
    _assert_pool_consistent(llm)
    assert llm.generate([[1, 7]], _greedy(4), use_tqdm=False)[0].token_ids == _solo(
        (1, 7), 4
    )
    (out,) = _drain(llm)
    assert out.request_id == other and out.token_ids == _solo((1, 8), 30)
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_abort_frees_blocks_at_once():
    llm = _llm()
    rid = llm.add_request([1] + [5] * 20, _greedy(50))
    llm.step()
    assert llm.block_manager.num_free_blocks < llm.block_manager.num_blocks
    out = llm.abort(rid)
    assert out.finish_reason == "abort" and out.request_id == rid
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    assert llm.abort(rid) is None and llm.abort(12345) is None
    assert llm.stats.aborts == 1
    waiting = llm.add_request([1, 2], _greedy(3))
    assert llm.abort(waiting).finish_reason == "abort"
    assert not llm.scheduler.has_unfinished


# Faults in flight ----------------------------------------------------------------


def test_a_request_that_breaks_the_forward_fails_alone():
    llm = _llm(num_blocks=24, block_size=4)
    prompts = [[1, 5, 6], [POISON, 7, 8], [1, 9], [1] + [4] * 30]
    outs = llm.generate(prompts, _greedy(12), use_tqdm=False)
    assert outs[1].finish_reason == "error" and "poisoned" in outs[1].error
    for i in (0, 2, 3):
        assert outs[i].error is None
        assert outs[i].token_ids == _solo(tuple(prompts[i]), 12)
    assert llm.stats.errors == 1
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_a_one_off_forward_fault_fails_nobody():
    llm = _llm()
    rids = [llm.add_request([1, 5 + i], _greedy(6)) for i in range(3)]
    llm.step()
    llm.runner.forward.fail_next = True
    outs = {o.request_id: o for o in _drain(llm)}
    for i, rid in enumerate(rids):
        assert outs[rid].token_ids == _solo((1, 5 + i), 6)


@pytest.mark.parametrize("where", ["group", "batch"])
def test_a_sampler_fault_fails_only_its_request_and_nothing_wedges(where, monkeypatch):
    """The fault is in the group's own sampling hook (`samplers`, which the
    engine asks of every group that does not keep the default), or in the
    batched sampler whenever the bad request's rows are in the batch (then
    every group is sampled alone, and only the bad one fails)."""
    llm = _llm()
    rids = [llm.add_request([1, 5 + i], _greedy(6)) for i in range(3)]
    bad = next(g for g in llm.scheduler.waiting if g.request_id == rids[1])

    def broken_sampler(*args, **kwargs):
        raise FloatingPointError("injected sampler fault")

    if where == "group":

        class BrokenGroup(type(bad)):
            samplers = broken_sampler

        bad.__class__ = BrokenGroup
    else:
        real = llm.runner.sampler

        class BrokenSampler:
            batch = property(lambda self: real.batch)

            def __call__(self, logits, plan):
                if any(s in bad.seqs for s in plan.sample_seqs):
                    broken_sampler()
                return real(logits, plan)

        llm.runner.sampler = BrokenSampler()
    outs = {o.request_id: o for o in _drain(llm)}
    assert outs[rids[1]].finish_reason == "error"
    assert "FloatingPointError: injected sampler fault" == outs[rids[1]].error
    for i in (0, 2):
        assert outs[rids[i]].token_ids == _solo((1, 5 + i), 6)
    # The engine is usable afterwards: same call, same answer.
    again = llm.generate([[1, 6]], _greedy(6), use_tqdm=False)[0]
    assert again.token_ids == _solo((1, 6), 6)
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_the_users_model_still_generates_after_an_llm_is_built():
    model, tok = load_model("tiny-qwen2")
    before = greedy_alone(model, [1, 20, 21], 8)
    llm = LLM((model, tok), kv_cache_memory=2**20)
    llm.generate([[1, 20, 21]], _greedy(8), use_tqdm=False)
    assert greedy_alone(model, [1, 20, 21], 8) == before
    bare = LLM(model, kv_cache_memory=2**20)
    assert bare.generate([1, 20, 21], _greedy(8), use_tqdm=False)[0].token_ids == before
    with pytest.raises(ValueError, match="has no tokenizer"):
        bare.generate("text needs a tokenizer", use_tqdm=False)


# A state machine over the public API -------------------------------------------------

prompt_ids = st.lists(st.integers(3, 258), min_size=0, max_size=14).map(
    lambda t: [1, *t]
)


class EngineMachine(RuleBasedStateMachine):
    """Random mixes of good and bad requests, aborts, one-off and per-request
    faults, and add_request / step / generate interleavings, in tiny pools."""

    async_scheduling = False

    @initialize(
        num_blocks=st.integers(8, 24),
        block_size=st.sampled_from([2, 4, 8]),
        max_num_seqs=st.integers(1, 6),
        budget=st.integers(4, 40),
    )
    def setup(self, num_blocks, block_size, max_num_seqs, budget):
        self.llm = _llm(
            num_blocks,
            block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=num_blocks * block_size,
            async_scheduling=self.async_scheduling,
        )
        self.expected: dict[int, tuple | None] = {}
        self.outputs: dict[int, object] = {}

    def _collect(self, outs):
        for out in outs:
            if not out.finished:
                assert out.error is None and out.finish_reason is None
                continue
            assert out.request_id not in self.outputs, "an output came back twice"
            self.outputs[out.request_id] = out

    def _fits(self, prompt, max_tokens) -> bool:
        bs, pool = self.llm.block_manager.block_size, self.llm.block_manager.num_blocks
        total = min(len(prompt) + max_tokens, self.llm.max_model_len)
        return len(prompt) < self.llm.max_model_len and -(-total // bs) <= pool

    @rule(prompt=prompt_ids, max_tokens=st.integers(1, 8), poison=st.booleans())
    def add(self, prompt, max_tokens, poison):
        if poison:
            prompt = [POISON] + prompt[1:]
        if self._fits(prompt, max_tokens):
            rid = self.llm.add_request(prompt, _greedy(max_tokens))
            self.expected[rid] = None if poison else (prompt, max_tokens)
        else:
            with pytest.raises(ValueError):
                self.llm.add_request(prompt, _greedy(max_tokens))

    @rule(
        prompts=st.lists(prompt_ids, min_size=1, max_size=4),
        max_tokens=st.integers(1, 6),
        bad_at=st.none() | st.integers(0, 3),
    )
    def generate(self, prompts, max_tokens, bad_at):
        if bad_at is not None:
            prompts.insert(min(bad_at, len(prompts)), [1, 999])
        queued = len(self.llm.output_processor.states)
        if bad_at is not None or not all(self._fits(p, max_tokens) for p in prompts):
            with pytest.raises(ValueError, match="prompt"):
                self.llm.generate(prompts, _greedy(max_tokens), use_tqdm=False)
            assert len(self.llm.output_processor.states) == queued
            return
        outs = self.llm.generate(prompts, _greedy(max_tokens), use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            assert out.prompt_token_ids == prompt
            assert out.token_ids == self._reference(prompt, max_tokens)

    def _reference(self, prompt, max_tokens):
        # The engine stops at max_model_len, whatever max_tokens says.
        room = self.llm.max_model_len - len(prompt)
        return _solo(tuple(prompt), min(max_tokens, room))

    @rule()
    def step(self):
        self._collect(self.llm.step())

    @precondition(lambda self: self.llm.output_processor.states)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.llm.output_processor.states)))
        out = self.llm.abort(rid)
        assert out.finish_reason == "abort"
        self.expected[rid] = "abort"
        self._collect([out])

    @rule()
    def one_off_forward_fault(self):
        self.llm.runner.forward.fail_next = True

    @precondition(lambda self: self.llm.scheduler.waiting)
    @rule(data=st.data())
    def break_a_sampler(self, data):
        group = data.draw(st.sampled_from(list(self.llm.scheduler.waiting)))
        if group.request_id not in self.expected:
            return

        def broken(*args, **kwargs):
            raise RuntimeError("injected sampler fault")

        class BrokenGroup(type(group)):
            samplers = broken

        group.__class__ = BrokenGroup
        self.expected[group.request_id] = None

    @invariant()
    def pool_is_consistent(self):
        if hasattr(self, "llm"):
            _assert_pool_consistent(self.llm)

    def teardown(self):
        if not hasattr(self, "llm"):
            return
        self._collect(_drain(self.llm))
        bm = self.llm.block_manager
        assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)
        for rid, want in self.expected.items():
            out = self.outputs[rid]
            if want == "abort":
                assert out.finish_reason == "abort"
            elif want is None:
                assert out.finish_reason in ("error", "abort")
            else:
                assert out.error is None, out.error
                assert out.token_ids == self._reference(*want)


TestEngineMachine = EngineMachine.TestCase
TestEngineMachine.settings = settings(
    max_examples=100, stateful_step_count=12, deadline=None
)


class AsyncEngineMachine(EngineMachine):
    """The same, with each step scheduled before the last one's tokens are read
    (``async_scheduling``): aborts and faults land while a step is in flight."""

    async_scheduling = True


TestAsyncEngineMachine = AsyncEngineMachine.TestCase
TestAsyncEngineMachine.settings = settings(
    max_examples=100, stateful_step_count=12, deadline=None
)
