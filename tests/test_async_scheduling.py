"""Asynchronous scheduling (``LLM(..., async_scheduling=True)``): step N+1 is
planned and launched before step N's tokens are read, and nothing a user sees
changes. Every output equals the synchronous loop's (and greedy equals
``model.generate``), through stop conditions, aborts and faults that land
while a step is in flight, preemption, prefix caching, parallel sampling,
beam search and the server's engine loop."""

import asyncio
import time

import pytest
import torch
from reference import greedy_alone

from pagedkv_lab import LLM, RequestOutputKind, SamplingParams
from pagedkv_lab.groups import BeamSearchParams
from pagedkv_lab.models import load_model
from pagedkv_lab.sampling import SampledTokens

MODEL, TOKENIZER = load_model("tiny-llama")
BYTES_PER_TOKEN = 512  # tiny-llama, fp32
PROMPTS = [[1, 5, 6, 7], [1, 9, 9], [1] + list(range(40, 57)), [1, 200, 201, 202, 7],
           [1] + list(range(60, 75)), [1, 3]]  # fmt: skip


def _llm(async_scheduling: bool, num_blocks: int = 256, block_size: int = 4, **kw) -> LLM:
    return LLM((MODEL, TOKENIZER), block_size=block_size, seed=0,
               kv_cache_memory=num_blocks * block_size * BYTES_PER_TOKEN,
               async_scheduling=async_scheduling, **kw)  # fmt: skip


def _greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _view(out) -> tuple:
    """Everything a user reads from a `RequestOutput`, log-probabilities aside
    (`_logprobs`: the two loops may batch a sequence differently, which moves
    its logits' last bits)."""
    completions = tuple(
        (c.index, c.text, tuple(c.token_ids), c.finish_reason, c.stop_reason,
         None if c.logprobs is None else tuple(
             tuple((t, lp.rank) for t, lp in d.items()) for d in c.logprobs))
        for c in out.outputs
    )  # fmt: skip
    prompt = None if out.prompt_logprobs is None else tuple(
        None if d is None else tuple(d) for d in out.prompt_logprobs
    )  # fmt: skip
    return (out.request_id, tuple(out.prompt_token_ids), completions,
            out.num_cached_tokens, prompt)  # fmt: skip


def _logprobs(out) -> list[float]:
    """Every log-probability a `RequestOutput` carries, in order."""
    values = []
    for c in out.outputs:
        values.append(c.cumulative_logprob)
        for d in c.logprobs or []:
            values += [lp.logprob for lp in d.values()]
    for d in out.prompt_logprobs or []:
        values += [lp.logprob for lp in (d or {}).values()]
    return values


def _both(prompts, params, **kw) -> tuple[list, list, LLM]:
    """``generate`` on a synchronous and an asynchronous engine alike."""
    results = []
    for mode in (False, True):
        llm = _llm(mode, **kw)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert not llm.has_unfinished_requests() and llm._inflight is None
        bm = llm.block_manager
        assert bm.num_free_blocks == bm.num_blocks and not llm._requests
        results.append(outs)
    return results[0], results[1], llm


def _assert_same(sync, asyn):
    assert [_view(o) for o in asyn] == [_view(o) for o in sync]
    for a, b in zip(asyn, sync):
        assert _logprobs(a) == pytest.approx(_logprobs(b), abs=1e-3)


# ---- equal to model.generate and to the synchronous loop ---------------------


@pytest.mark.parametrize("budget", [4096, 7])
def test_greedy_equals_generate_and_the_synchronous_loop(budget):
    """Prompts around block boundaries, some chunked (a budget of 7 tokens),
    lengths from 1 token to 20."""
    lengths = [1, 2, 7, 20, 13, 5]
    params = [_greedy(n) for n in lengths]
    sync, asyn, _ = _both(PROMPTS, params, max_num_batched_tokens=budget)
    _assert_same(sync, asyn)
    for prompt, n, out in zip(PROMPTS, lengths, asyn):
        assert out.outputs[0].token_ids == greedy_alone(MODEL, prompt, n)


FEATURES = {
    "stop strings": dict(temperature=0, max_tokens=24, stop=["e", "zz"]),
    "stop token ids": dict(temperature=0, max_tokens=24, stop_token_ids=[268, 140]),
    "min tokens": dict(temperature=0, max_tokens=12, min_tokens=6, stop_token_ids=[268]),
    "penalties": dict(temperature=0, max_tokens=16, repetition_penalty=1.3,
                      presence_penalty=0.5, frequency_penalty=0.3),
    "logprobs": dict(temperature=0, max_tokens=8, logprobs=3, prompt_logprobs=2),
    "seeded sampling": dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.01,
                            max_tokens=12, seed=7),
    "n=3": dict(n=3, temperature=1.0, max_tokens=10, seed=3),
    "n=2 greedy": dict(n=2, temperature=0, max_tokens=9),
    "engine seeds": dict(temperature=1.0, max_tokens=10),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(FEATURES))
def test_every_feature_equals_the_synchronous_loop(name):
    sync, asyn, _ = _both(PROMPTS, SamplingParams(**FEATURES[name]),
                          max_num_batched_tokens=16)  # fmt: skip
    _assert_same(sync, asyn)


def test_stop_tokens_end_requests_in_the_middle_of_a_run():
    """The stop tokens above do stop some requests early (else the test of
    stop conditions would test nothing)."""
    sync, asyn, _ = _both(PROMPTS, SamplingParams(**FEATURES["stop token ids"]))
    _assert_same(sync, asyn)
    reasons = [o.outputs[0].finish_reason for o in asyn]
    assert "stop" in reasons and "length" in reasons


def test_an_eos_id_stops_like_the_synchronous_loop():
    """An end-of-sequence id met halfway (the engine's own EOS set made to hold
    a token greedy decoding meets)."""
    outs = []
    for mode in (False, True):
        llm = _llm(mode)
        llm.eos_token_ids = frozenset({268})
        outs.append(llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20),
                                 use_tqdm=False))  # fmt: skip
    _assert_same(*outs)
    assert "stop" in [o.outputs[0].finish_reason for o in outs[1]]


def test_beam_search_equals_the_synchronous_loop():
    params = BeamSearchParams(beam_width=3, max_tokens=8)
    outs = [_llm(mode).beam_search(PROMPTS[:3], params) for mode in (False, True)]
    for a, b in zip(*outs):
        assert [(s.token_ids, round(s.cum_logprob, 4)) for s in a.sequences] == [
            (s.token_ids, round(s.cum_logprob, 4)) for s in b.sequences
        ]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_equals_the_synchronous_loop(mode):
    """A pool too small for all requests: some are preempted (recomputed, or
    swapped to CPU memory and back) while a step is in flight."""
    kw = dict(num_blocks=24, preemption_mode=mode, max_num_batched_tokens=32)
    if mode == "swap":
        kw["swap_space"] = 64 * 4 * BYTES_PER_TOKEN
    prompts = PROMPTS * 2
    params = [_greedy(12 + i) for i in range(len(prompts))]
    sync, asyn, llm = _both(prompts, params, **kw)
    _assert_same(sync, asyn)
    assert llm.stats.preemptions > 0
    for prompt, p, out in zip(prompts, params, asyn):
        assert out.outputs[0].token_ids == greedy_alone(MODEL, prompt, p.max_tokens)


def test_prefix_caching_equals_the_synchronous_loop():
    """Requests sharing a long prefix: blocks are registered once their tokens
    are read, hits counted alike."""
    shared = [1] + list(range(100, 124))
    prompts = [shared + [7 + i] for i in range(6)]
    sync, asyn, llm = _both(prompts, _greedy(10), enable_prefix_caching=True,
                            max_num_seqs=2)  # fmt: skip
    _assert_same(sync, asyn)
    assert llm.block_manager.stats.hits > 0


def test_streamed_outputs_concatenate_to_the_synchronous_loop():
    """DELTA outputs, read step by step through `add_request` / `step`."""
    texts = []
    for mode in (False, True):
        llm = _llm(mode)
        params = SamplingParams(temperature=0, max_tokens=12, stop=["zz"],
                                output_kind=RequestOutputKind.DELTA)  # fmt: skip
        for i, prompt in enumerate(PROMPTS):
            llm.add_request(f"r{i}", prompt, params)
        got: dict[str, list] = {}
        while llm.has_unfinished_requests():
            for out in llm.step():
                got.setdefault(out.request_id, []).append(out.outputs[0])
        texts.append({rid: ("".join(c.text for c in cs),
                            [t for c in cs for t in c.token_ids], cs[-1].finish_reason)
                      for rid, cs in got.items()})  # fmt: skip
    assert texts[1] == texts[0]


# ---- faults and aborts that land while a step is in flight --------------------


def _decoding(llm, prompts, params) -> list[str]:
    ids = [llm.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    while any(s.num_computed_tokens < s.num_prompt_tokens
              for g in [*llm.scheduler.waiting, *llm.scheduler.running] for s in g.seqs):  # fmt: skip
        llm.step()
    return ids


def _drain(llm) -> dict:
    outs = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                assert out.request_id not in outs, "an output came back twice"
                outs[out.request_id] = out
    return outs


def test_a_request_aborted_while_its_next_step_is_in_flight():
    llm = _llm(True)
    ids = _decoding(llm, PROMPTS[:3], _greedy(12))
    llm.step()
    victim = next(g for g in llm.scheduler.running if g.request_id == llm._internal_id("r1"))
    assert victim.seqs[0] in llm._inflight.plan.seqs, "its next step is in flight"
    assert victim.seqs[0].num_pending == 1
    out = llm.abort("r1")
    assert out.finish_reason == "abort" and out.outputs[0].token_ids == (
        greedy_alone(MODEL, PROMPTS[1], 12)[: len(out.outputs[0].token_ids)]
    )
    outs = _drain(llm)
    assert "r1" not in outs
    for rid, prompt in zip(ids, PROMPTS[:3]):
        if rid != "r1":
            assert outs[rid].outputs[0].token_ids == greedy_alone(MODEL, prompt, 12)
    bm = llm.block_manager
    assert bm.num_free_blocks == bm.num_blocks and llm._inflight is None


def test_a_sequence_that_stops_on_the_step_whose_successor_was_prepared():
    """Its stop token is read after the next step, which computes it once
    more, was launched: that step's row for it is dropped, its blocks are
    freed, and the output is the synchronous loop's."""
    solo = greedy_alone(MODEL, PROMPTS[0], 12)
    params = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[solo[3]])
    llm = _llm(True)
    llm.add_request("stops", PROMPTS[0], params)
    llm.add_request("goes on", PROMPTS[2], _greedy(12))
    while True:
        outs = {o.request_id: o for o in llm.step() if o.finished}
        if "stops" in outs:
            break
    stopped = outs["stops"]
    assert stopped.outputs[0].token_ids == solo[: solo.index(solo[3]) + 1]
    assert stopped.outputs[0].finish_reason == "stop"
    seq = next(s for s in llm.last_plan.seqs if s.finish_reason == "stop")
    assert seq.num_pending == 0 and seq.block_table is None, "freed, its token dropped"
    rest = _drain(llm)
    assert rest["goes on"].outputs[0].token_ids == greedy_alone(MODEL, PROMPTS[2], 12)
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_a_forward_fault_while_a_step_is_in_flight_fails_only_its_request():
    llm = _llm(True)
    ids = _decoding(llm, PROMPTS[:3], _greedy(10))
    llm.step()
    bad = next(g for g in llm.scheduler.running if g.request_id == llm._internal_id(ids[1]))
    assert bad.seqs[0] in llm._inflight.plan.seqs
    real = llm.runner.run

    def run(seqs, *args):
        if bad.seqs[0] in seqs:
            raise RuntimeError("injected fault")
        return real(seqs, *args)

    llm.runner.run = run
    outs = _drain(llm)
    assert outs[ids[1]].finish_reason == "error"
    for i in (0, 2):
        assert outs[ids[i]].outputs[0].token_ids == greedy_alone(MODEL, PROMPTS[i], 10)
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


# ---- the one transfer, after the next launch ----------------------------------


def _events(llm, monkeypatch) -> list[str]:
    log = []
    launch, read = llm._launch, SampledTokens.read

    def logged_launch(*args):
        log.append("launch")
        return launch(*args)

    def logged_read(self):
        log.append("read")
        return read(self)

    monkeypatch.setattr(llm, "_launch", logged_launch)
    monkeypatch.setattr(SampledTokens, "read", logged_read)
    return log


def test_step_n_plus_1_is_launched_before_step_n_is_read_once(monkeypatch):
    llm = _llm(True)
    _decoding(llm, PROMPTS[:4], _greedy(30))
    log = _events(llm, monkeypatch)
    for _ in range(5):
        llm.step()
    assert log == ["launch", "read"] * 5, "launch N+1, then the one read of N"
    assert all(s.num_pending == 1 for s in llm._inflight.plan.seqs)


def test_a_penalty_makes_the_next_step_wait_for_the_tokens(monkeypatch):
    """Penalties read the tokens on the host: their step is read before the
    next one is planned, and the outputs are still the synchronous loop's."""
    llm = _llm(True)
    _decoding(llm, PROMPTS[:2], SamplingParams(temperature=0, max_tokens=30,
                                               repetition_penalty=1.5))  # fmt: skip
    log = _events(llm, monkeypatch)
    for _ in range(3):
        llm.step()
    assert log == ["read", "launch"] * 3


def test_the_synchronous_loop_reads_each_step_before_the_next(monkeypatch):
    llm = _llm(False)
    _decoding(llm, PROMPTS[:4], _greedy(30))
    log = _events(llm, monkeypatch)
    for _ in range(3):
        llm.step()
    assert log == ["launch", "read"] * 3 and llm._inflight is None


# ---- the setting ---------------------------------------------------------------


def test_the_setting_is_off_on_a_cpu_by_default_and_checked():
    assert not LLM((MODEL, TOKENIZER), kv_cache_memory=2**20).async_scheduling
    assert _llm(True).async_scheduling
    with pytest.raises(ValueError, match="async_scheduling must be"):
        _llm("yes")
    from pagedkv_lab.prefix_cache import PrefixCachingBlockManager

    early = PrefixCachingBlockManager(256, 4, register="scheduled")
    with pytest.raises(ValueError, match="register='computed'"):
        _llm(True, block_manager=early)
    assert not _llm(None, block_manager=early).async_scheduling


# ---- the server's engine loop ---------------------------------------------------


def test_the_servers_engine_loop_streams_what_generate_returns():
    """`EngineLoop` (what `python -m pagedkv_lab.serve` runs) on an engine with
    asynchronous scheduling: concurrent streams concatenate to `generate`'s
    outputs, and a stream abandoned halfway frees its blocks."""
    from pagedkv_lab.serve import EngineLoop
    from pagedkv_lab.serve.metrics import ServerMetrics

    llm = _llm(True, max_num_seqs=4)
    refs = _llm(False).generate(PROMPTS, _greedy(10), use_tqdm=False)
    params = _greedy(10, output_kind=RequestOutputKind.DELTA)

    async def collect(loop, prompt):
        stream = await loop.submit([{"prompt_token_ids": prompt}], params, time.perf_counter())
        return [t async for _, out in stream for t in out.outputs[0].token_ids]

    async def abandon(loop):
        stream = await loop.submit([{"prompt_token_ids": PROMPTS[2]}], _greedy(
            200, output_kind=RequestOutputKind.DELTA), time.perf_counter())  # fmt: skip
        async for _ in stream:  # abandoned after its first output
            loop.abort(stream)
            break

    async def run():
        loop = EngineLoop(llm, ServerMetrics("tiny-llama", llm.max_model_len))
        await loop.start()
        try:
            got = await asyncio.gather(abandon(loop), *(collect(loop, p) for p in PROMPTS))
            while llm.has_unfinished_requests():
                await asyncio.sleep(0.01)
            return got[1:]
        finally:
            await loop.shutdown()

    got = asyncio.run(run())
    assert got == [r.outputs[0].token_ids for r in refs]
    bm = llm.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not llm._requests


def test_an_engine_seed_gives_the_same_draws_in_both_modes():
    """Unseeded requests draw their seeds from the engine's seed in the order
    they arrive, which does not depend on the mode."""
    params = SamplingParams(temperature=1.0, max_tokens=8)
    a = _llm(False).generate(PROMPTS, params, use_tqdm=False)
    b = _llm(True).generate(PROMPTS, params, use_tqdm=False)
    _assert_same(a, b)
    assert torch.tensor([len(o.outputs[0].token_ids) for o in b]).sum() > 0
