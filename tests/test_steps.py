"""`bench.steps`: the step clock's spans are tight (the forward pass's starts
after its inputs are prepared, the sampler's after its batch is built), busy
time is the union of the device's activity, and `bench.nanovllm.compare_modes`
(one step in flight or none) and `compare_sampling` (greedy or sampled) alternate
their two modes in one process with the order reversed every round.
No timing is asserted: the clock's marks are replaced by a counter, in order."""

from types import SimpleNamespace

import pytest

from pagedkv_lab.bench.nanovllm import compare_modes, compare_sampling
from pagedkv_lab.bench.steps import StepClock, device_busy_seconds
from pagedkv_lab.llm import LLM
from pagedkv_lab.sampling_params import SamplingParams


class OrderedClock(StepClock):
    """A StepClock whose marks are positions in a shared log of what ran."""

    def __init__(self, llm, log):
        self.log = log
        super().__init__(llm)

    def _mark(self):
        self.log.append("mark")
        return len(self.log) - 1


def test_the_spans_start_after_the_inputs_and_the_sampling_batch(monkeypatch):
    import pagedkv_lab.engine.model_runner as model_runner
    import pagedkv_lab.engine.sampler as sampler

    llm = LLM("tiny-llama", kv_cache_memory=2**22, max_model_len=64, seed=0)
    log = []
    upload, batch = model_runner.upload_step, sampler.SamplingBatch

    def logged_upload(*args, **kwargs):
        log.append("upload")  # the step's inputs, packed and uploaded
        return upload(*args, **kwargs)

    def logged_batch(*args, **kwargs):
        log.append("sampling batch")  # the sampler's inputs, built on the host
        return batch(*args, **kwargs)

    monkeypatch.setattr(model_runner, "upload_step", logged_upload)
    monkeypatch.setattr(sampler, "SamplingBatch", logged_batch)
    forward, own_sampler = llm.runner.forward, llm.runner.sampler
    clock = OrderedClock(llm, log)
    llm.add_request("a", [1, 5, 6, 7], SamplingParams(temperature=0, max_tokens=3,
                                                      ignore_eos=True))  # fmt: skip
    while llm.has_unfinished_requests():
        clock.step()
    assert len(clock.steps) == 3 and "sampling batch" in log
    for step in clock.steps:
        (fwd_start, fwd_end), = step.spans["forward"]
        (smp_start, smp_end), = step.spans["sampling"]
        assert log[fwd_start - 1] == "upload"  # the forward span starts once the inputs are up
        assert "sampling batch" not in log[smp_start:smp_end]  # built before the span
        assert fwd_start < fwd_end < smp_start < smp_end
    clock.detach()
    assert llm.runner.forward is forward and llm.runner.sampler is own_sampler
    assert "sample" not in vars(own_sampler)


def test_busy_time_is_the_union_of_the_devices_activity():
    cuda = SimpleNamespace(name="CUDA")
    cpu = SimpleNamespace(name="CPU")

    def event(start, end, kind=cuda):
        return SimpleNamespace(device_type=kind, time_range=SimpleNamespace(start=start,
                                                                            end=end))  # fmt: skip

    # two overlapping kernels count once, a gap is idle, a CPU op is no device time
    events = [event(0, 10), event(5, 20), event(30, 40), event(0, 100, cpu)]
    assert device_busy_seconds(events) == pytest.approx(30e-6)
    assert device_busy_seconds([event(0, 100, cpu)]) is None


def test_compare_modes_alternates_in_one_process_with_the_order_reversed():
    """One untimed pass in each mode (each pays its own first-pass costs), then
    3 rounds: in flight first, then none first, then in flight first; even
    repeats are refused (a median of two is a mean)."""
    seen = []

    class Engine:
        async_scheduling = True

    engine = Engine()

    def fake_serve(llm, *args):
        seen.append(llm.async_scheduling)
        return {"tok_s": 200.0 if llm.async_scheduling else 100.0}

    import pagedkv_lab.bench.nanovllm as nanovllm

    real, nanovllm.serve_timed = nanovllm.serve_timed, fake_serve
    try:
        out = compare_modes(engine, [], [], 0.6, None, rounds=3)
        with pytest.raises(ValueError, match="odd"):
            compare_modes(engine, [], [], 0.6, None, rounds=2)
    finally:
        nanovllm.serve_timed = real
    assert seen == [True, False, True, False, False, True, True, False]
    assert out["async_over_sync"]["median"] == 2.0 and out["sync"]["min"] == 100.0
    assert engine.async_scheduling is True  # put back as it was


def test_compare_sampling_alternates_greedy_and_sampled_in_one_process():
    """One untimed pass of each (greedy, then sampled), then 3 rounds: greedy
    first, then sampled first, then greedy first; the engine is never told to
    change its scheduling; a greedy run as the "sampled" side is refused."""
    seen = []

    class Engine:
        async_scheduling = True

    def fake_serve(llm, prompts, max_tokens, temperature, floor):
        seen.append(temperature)
        return {"tok_s": 110.0 if temperature == 0 else 100.0}

    import pagedkv_lab.bench.nanovllm as nanovllm

    real, nanovllm.serve_timed = nanovllm.serve_timed, fake_serve
    try:
        out = compare_sampling(Engine(), [], [], 0.6, None, rounds=3)
        with pytest.raises(ValueError, match="greedy"):
            compare_sampling(Engine(), [], [], 0.0, None, rounds=3)
        with pytest.raises(ValueError, match="odd"):
            compare_sampling(Engine(), [], [], 0.6, None, rounds=4)
    finally:
        nanovllm.serve_timed = real
    assert seen == [0.0, 0.6, 0.0, 0.6, 0.6, 0.0, 0.0, 0.6]
    assert out["greedy_over_sampled"]["per_round"] == [1.1, 1.1, 1.1]
    assert out["greedy"]["median"] == 110.0 and out["sampled"]["max"] == 100.0


def test_step_over_floor_measures_decode_steps_against_their_bytes():
    """The decode steps at the largest batch, their wall time over the bytes
    they read at the copy bandwidth (no timing is asserted)."""
    from pagedkv_lab.bench.steps import step_over_floor

    llm = LLM("tiny-llama", kv_cache_memory=2**22, max_model_len=64, seed=0)
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)] * 3
    r = step_over_floor(llm, [[1, 5, 6], [1, 7], [1, 9, 9, 9]], params)
    assert r["batch"] == 3 and r["steps"] >= 4 and r["floor_ms"] > 0
    assert r["ratio"] == r["step_ms"] / r["floor_ms"]
    assert not llm.has_unfinished_requests()
