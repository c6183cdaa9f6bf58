"""The scheduler's invariants under random load, and LLM.generate end to end."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import fake_step, greedy_alone

from pagedkv_lab.engine.block_manager import BlockManager
from pagedkv_lab.engine.scheduler import Scheduler
from pagedkv_lab.engine.sequence import Sequence, SequenceGroup
from pagedkv_lab.llm import LLM
from pagedkv_lab.models import load_model
from pagedkv_lab.sampling_params import SamplingParams


@settings(max_examples=80, deadline=None)
@given(
    requests=st.lists(
        st.tuples(st.integers(1, 40), st.integers(1, 30)), min_size=1, max_size=25
    ),
    block_size=st.sampled_from([1, 4, 16]),
    spare_blocks=st.integers(0, 30),
    max_num_seqs=st.integers(1, 8),
    watermark=st.sampled_from([0.0, 0.05]),
    budget=st.integers(1, 80),
)
def test_scheduler_serves_everything_without_deadlock_or_leaks(
    requests, block_size, spare_blocks, max_num_seqs, watermark, budget
):
    largest = max(p + o for p, o in requests)
    bm = BlockManager(-(-largest // block_size) + spare_blocks, block_size)
    sched = Scheduler(
        bm,
        max_model_len=10_000,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        watermark=watermark,
    )
    seqs = [
        Sequence([1] * p, SamplingParams(temperature=0, max_tokens=o, ignore_eos=True))
        for p, o in requests
    ]
    for i, s in enumerate(seqs):
        sched.add(SequenceGroup(i, s))
    for _ in range(20_000):
        if not sched.has_unfinished:
            break
        plan = sched.schedule()
        assert plan.seqs, "the scheduler stalled with work left"
        assert not plan.block_copies
        assert sched.num_running_seqs <= max_num_seqs
        assert sum(plan.num_new_tokens) <= budget
        owned = [b for g in sched.running for s in g.seqs for b in s.block_table]
        assert len(owned) == len(set(owned))
        assert len(owned) + bm.num_free_blocks == bm.num_blocks
        for s, first, n in zip(plan.seqs, plan.starts, plan.num_new_tokens):
            assert n >= 1 and first + n == s.num_computed_tokens <= s.num_tokens
            assert len(s.block_table) * block_size >= first + n
        fake_step(sched, plan)
    assert not sched.has_unfinished and bm.num_free_blocks == bm.num_blocks
    assert all(len(s.output_token_ids) == o for s, (_, o) in zip(seqs, requests))


def test_reserve_mode_admits_fewer_requests_at_once():
    def peak(reserve):
        sched = Scheduler(
            BlockManager(64, 4),
            max_model_len=64,
            reserve_tokens=64 if reserve else 0,
            watermark=0,
        )
        for i in range(10):
            params = SamplingParams(max_tokens=4, ignore_eos=True)
            sched.add(SequenceGroup(i, Sequence([1] * 4, params)))
        sched.schedule()
        return len(sched.running)

    # 64 blocks / 16 blocks per max-length reservation.
    assert peak(False) == 10 and peak(True) == 4


def test_hundreds_of_requests_through_a_small_pool_match_generate_alone():
    g = torch.Generator().manual_seed(11)
    n = 220
    prompts = [
        [1] + torch.randint(3, 259, (int(k),), generator=g).tolist()
        for k in torch.randint(1, 70, (n,), generator=g)
    ]
    max_tokens = torch.randint(1, 40, (n,), generator=g).tolist()
    # 40 blocks of 8 tokens, 256 bytes/token.
    llm = LLM("tiny-qwen2", block_size=8, kv_cache_memory=40 * 8 * 256)
    assert llm.stats.num_blocks == 40
    outs = llm.generate(
        prompts,
        [
            SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
            for m in max_tokens
        ],
        use_tqdm=False,
    )
    assert llm.stats.preemptions > 0
    reference, _ = load_model("tiny-qwen2")
    for p, m, out in zip(prompts, max_tokens, outs):
        assert out.token_ids == greedy_alone(reference, p, m)
        assert out.prompt_token_ids == p
    assert llm.block_manager.num_free_blocks == 40


def test_generate_api_outputs_metrics_and_progress_bar():
    llm = LLM("tiny-llama", kv_cache_memory=2**20)
    outs = llm.generate(
        ["first prompt", "second, longer prompt"],
        SamplingParams(temperature=0, max_tokens=5),
        use_tqdm=True,
    )
    assert [o.prompt for o in outs] == ["first prompt", "second, longer prompt"]
    for o in outs:
        assert o.finish_reason in ("length", "stop") and 1 <= len(o.token_ids) <= 5
        assert o.text == llm.tokenizer.decode(o.token_ids, skip_special_tokens=True)
        assert len(o.outputs) == 1 and o.outputs[0].index == 0 and o.error is None
        m = o.metrics
        assert 0 <= m.time_to_first_token <= m.e2e_latency
        assert m.time_per_output_token >= 0
    single = llm.generate(
        [1, 40, 41], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False
    )
    assert len(single) == 1 and single[0].prompt is None
    s = llm.stats
    assert s.steps > 0 and s.peak_running >= 2 and 0 < s.mean_utilization <= 1


def test_llm_configuration_errors():
    with pytest.raises(ValueError, match="not even one block"):
        LLM("tiny-llama", kv_cache_memory=100)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a CUDA device"):
            LLM("tiny-llama", kv_cache_memory=0.5)
    for kwargs, message in [
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
        (dict(block_size=0), "block_size"),
        (dict(block_size=-4), "block_size"),
        (dict(block_size=2.0), "block_size"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(max_model_len=0), "max_model_len"),
        (dict(max_model_len=4096), "exceeds the model's 2048 positions"),
        (dict(kv_cache_memory=2**16, max_model_len=1024), "do not fit the KV pool"),
        (dict(kv_cache_memory="1GB"), "kv_cache_memory"),
    ]:
        with pytest.raises(ValueError, match=message):
            LLM("tiny-llama", **kwargs)
    # A default max_model_len shrinks to what the pool holds, so a reservation
    # of max_model_len always fits.
    llm = LLM("tiny-llama", kv_cache_memory=2**16, reserve_max_len=True)
    assert llm.max_model_len == 128


def test_chunked_prefill_matches_generate():
    """A step budget smaller than the prompts: prompts are prefilled in chunks."""
    g = torch.Generator().manual_seed(4)
    prompts = [
        [1] + torch.randint(3, 259, (int(n),), generator=g).tolist()
        for n in (3, 17, 40, 61)
    ]
    llm = LLM(
        "tiny-llama", block_size=8, kv_cache_memory=2**20, max_num_batched_tokens=7
    )
    outs = llm.generate(
        prompts,
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
        use_tqdm=False,
    )
    reference, _ = load_model("tiny-llama")
    for p, out in zip(prompts, outs):
        assert out.token_ids == greedy_alone(reference, p, 9)
    # The longest prompt alone needs several steps.
    assert llm.stats.steps > 61 // 7


def test_a_saved_checkpoint_loads_by_path_like_a_hub_model(tmp_path):
    """The real-checkpoint path (from_pretrained + AutoTokenizer) works offline
    on a checkpoint saved to disk."""
    model, tok = load_model("tiny-qwen2")
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), kv_cache_memory=2**20)
    assert llm.model.config.model_type == "qwen2"
    assert llm.eos_token_ids == {tok.eos_token_id}
    out = llm.generate(
        ["checkpoint on disk"],
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert out.token_ids == greedy_alone(model, out.prompt_token_ids, 6)
