"""The scheduler's invariants under random load, and LLM.generate end to end."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import greedy_alone

from pagedkv_lab.engine import SamplingParams, Sequence
from pagedkv_lab.llm import LLM
from pagedkv_lab.models import load_model
from pagedkv_lab.paging import BlockAllocator, BlockTable
from pagedkv_lab.scheduler import Scheduler


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
    alloc = BlockAllocator(-(-largest // block_size) + spare_blocks, block_size)
    sched = Scheduler(
        alloc,
        max_model_len=10_000,
        eos_token_id=None,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        watermark=watermark,
    )
    seqs = [
        Sequence(
            [1] * p,
            SamplingParams(temperature=0, max_tokens=o, ignore_eos=True),
            BlockTable(alloc),
        )
        for p, o in requests
    ]
    for s in seqs:
        sched.add(s)
    for _ in range(20_000):
        if not sched.has_unfinished:
            break
        batch, num_new = sched.schedule()
        assert batch, "the scheduler stalled with work left"
        assert len(sched.running) <= max_num_seqs and sum(num_new) <= budget
        owned = [b for s in sched.running for b in s.block_table.blocks]
        assert len(owned) == len(set(owned))
        assert len(owned) + alloc.num_free == alloc.num_blocks
        for s, n in zip(batch, num_new):
            assert n >= 1 and s.num_computed_tokens + n <= s.num_tokens
            assert s.block_table.num_tokens >= s.num_computed_tokens + n
            s.num_computed_tokens += n  # what the model runner would do
        ready = [s for s in batch if s.num_computed_tokens == s.num_tokens]
        sched.postprocess(ready, [5] * len(ready))
    assert not sched.has_unfinished and alloc.num_free == alloc.num_blocks
    assert all(len(s.output_token_ids) == o for s, (_, o) in zip(seqs, requests))


def test_reserve_mode_admits_fewer_requests_at_once():
    def peak(reserve):
        alloc = BlockAllocator(64, 4)
        sched = Scheduler(
            alloc,
            max_model_len=64,
            eos_token_id=None,
            reserve_tokens=64 if reserve else None,
            watermark=0,
        )
        for _ in range(10):
            sched.add(
                Sequence(
                    [1] * 4,
                    SamplingParams(max_tokens=4, ignore_eos=True),
                    BlockTable(alloc),
                )
            )
        sched.schedule()
        return len(sched.running)

    assert (
        peak(False) == 10 and peak(True) == 4
    )  # 64 blocks / 16 blocks per max-length reservation


def test_hundreds_of_requests_through_a_small_pool_match_generate_alone():
    g = torch.Generator().manual_seed(11)
    n = 220
    prompts = [
        [1] + torch.randint(3, 259, (int(k),), generator=g).tolist()
        for k in torch.randint(1, 70, (n,), generator=g)
    ]
    max_tokens = torch.randint(1, 40, (n,), generator=g).tolist()
    llm = LLM(
        "tiny-qwen2", block_size=8, kv_cache_memory=40 * 8 * 256
    )  # 40 blocks of 8 tokens, 256 bytes/token
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
    assert llm.runner.allocator.num_free == 40


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
        m = o.metrics
        assert (
            0 <= m.time_to_first_token <= m.e2e_latency and m.time_per_output_token >= 0
        )
    single = llm.generate(
        [1, 40, 41], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False
    )
    assert len(single) == 1 and single[0].prompt is None
    s = llm.stats
    assert s.steps > 0 and s.peak_running >= 2 and 0 < s.mean_utilization <= 1


def test_bad_requests_fail_at_the_door_and_disturb_nothing():
    llm = LLM(
        "tiny-llama", kv_cache_memory=2**18, max_model_len=1024
    )  # 512 tokens of KV
    good = llm.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=4))
    for prompt, params, message in [
        ("", None, "empty"),
        ([], None, "empty"),
        ([1] * 1024, None, "no room"),
        ([1, 400], None, "token ids"),
        ([1, 2], SamplingParams(max_tokens=900), "whole pool holds 512"),
    ]:
        with pytest.raises(ValueError, match=message):
            llm.add_request(prompt, params)
    with pytest.raises(ValueError, match="2 prompts but 1"):
        llm.generate(["a", "b"], [SamplingParams()])
    finished = []
    while llm.scheduler.has_unfinished:
        finished += llm.step()
    assert [o.request_id for o in finished] == [good]


def test_llm_configuration_errors():
    with pytest.raises(ValueError, match="not even one block"):
        LLM("tiny-llama", kv_cache_memory=100)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a CUDA device"):
            LLM("tiny-llama", kv_cache_memory=0.5)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM("tiny-llama", max_num_batched_tokens=0)


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
    assert llm.stats.steps > 61 // 7  # the longest prompt alone needs several steps


def test_a_saved_checkpoint_loads_by_path_like_a_hub_model(tmp_path):
    """The real-checkpoint path (from_pretrained + AutoTokenizer) works offline on a checkpoint saved to disk."""
    model, tok = load_model("tiny-qwen2")
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), kv_cache_memory=2**20)
    assert (
        llm.model.config.model_type == "qwen2"
        and llm.tokenizer.eos_token_id == tok.eos_token_id
    )
    out = llm.generate(
        ["checkpoint on disk"],
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert out.token_ids == greedy_alone(model, out.prompt_token_ids, 6)
