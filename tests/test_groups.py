"""Parallel sampling and beam search on shared blocks."""

import pytest
import torch

from pagedkv_lab.llm import LLM
from pagedkv_lab.models import load_model
from pagedkv_lab.sampling_params import BeamSearchParams, SamplingParams

MODEL, TOKENIZER = load_model("tiny-llama")
BYTES_PER_TOKEN = 512  # tiny-llama, fp32


def _llm(num_blocks=256, block_size=4, **kwargs) -> LLM:
    return LLM(
        (MODEL, TOKENIZER),
        block_size=block_size,
        kv_cache_memory=num_blocks * block_size * BYTES_PER_TOKEN,
        **kwargs,
    )


def _prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [1] + torch.randint(3, 259, (length - 1,), generator=g).tolist()


def hf_beams(prompt, k, max_tokens, eos, length_penalty=1.0, early_stopping=False):
    """transformers' beam search: (generated tokens, score) of all k beams."""
    ids = torch.tensor([prompt])
    out = MODEL.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        num_beams=k,
        num_return_sequences=k,
        do_sample=False,
        max_new_tokens=max_tokens,
        eos_token_id=eos,
        pad_token_id=0,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        output_scores=True,
        return_dict_in_generate=True,
    )
    # beam_indices is -1 past a sequence's end: that gives its true length
    # (a random model may generate the pad id itself).
    lengths = (out.beam_indices != -1).sum(dim=1).tolist()
    seqs = [
        s[len(prompt) : len(prompt) + n].tolist()
        for s, n in zip(out.sequences, lengths)
    ]
    return seqs, out.sequences_scores.tolist()


def _frequent_token(prompt) -> int:
    """A token this prompt's greedy continuation produces, used as EOS so that
    beams really end early."""
    out = LLM((MODEL, TOKENIZER), kv_cache_memory=2**20).generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        use_tqdm=False,
    )[0]
    return out.token_ids[2]


@pytest.mark.parametrize("k", [2, 3, 4, 8])
@pytest.mark.parametrize("prompt_len", [3, 4, 5, 9])
@pytest.mark.parametrize("with_eos", [False, True])
def test_beam_search_equals_transformers(k, prompt_len, with_eos):
    prompt = _prompt(prompt_len, seed=k * 10 + prompt_len)
    llm = _llm()
    eos = _frequent_token(prompt) if with_eos else None
    llm.eos_token_ids = frozenset([eos]) if with_eos else frozenset()
    params = BeamSearchParams(beam_width=k, max_tokens=10, ignore_eos=not with_eos)
    (ours,) = llm.beam_search([prompt], params)
    tokens, scores = hf_beams(prompt, k, 10, eos)
    assert [s.token_ids for s in ours.sequences] == tokens
    assert [s.score for s in ours.sequences] == pytest.approx(scores, abs=1e-4)
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


@pytest.mark.parametrize(
    "length_penalty,early_stopping", [(0.0, False), (2.0, "never"), (1.0, True)]
)
def test_beam_search_options_follow_transformers(length_penalty, early_stopping):
    prompt = _prompt(6, seed=1)
    eos = _frequent_token(prompt)
    llm = _llm()
    llm.eos_token_ids = frozenset([eos])
    params = BeamSearchParams(
        beam_width=3,
        max_tokens=12,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
    )
    (ours,) = llm.beam_search([prompt], params)
    tokens, scores = hf_beams(prompt, 3, 12, eos, length_penalty, early_stopping)
    assert [s.token_ids for s in ours.sequences] == tokens
    assert [s.score for s in ours.sequences] == pytest.approx(scores, abs=1e-4)


def test_beams_share_blocks_and_copy_on_write():
    llm = _llm(block_size=4)
    llm.beam_search([_prompt(6, 0)], BeamSearchParams(beam_width=4, max_tokens=8))
    # The prompt's half-full second block is shared by the beams and copied
    # when they write into it.
    assert llm.stats.block_copies > 0


def test_groups_under_preemption_equal_the_unpressured_run():
    prompts = [_prompt(int(n), seed=i) for i, n in enumerate([3, 9, 17, 25, 31, 12])]
    sampled = [
        SamplingParams(n=3, temperature=0.9, top_p=0.95, seed=i, max_tokens=16)
        for i in range(len(prompts))
    ]
    beams = BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True)
    big = _llm(num_blocks=512)
    small = _llm(num_blocks=48, max_model_len=128)
    for llm in (big, small):
        llm.eos_token_ids = frozenset()
    a = big.generate(prompts, sampled, use_tqdm=False)
    b = small.generate(prompts, sampled, use_tqdm=False)
    assert small.stats.preemptions > 0
    for x, y in zip(a, b):
        assert [c.token_ids for c in x.outputs] == [c.token_ids for c in y.outputs]
    preempted = small.stats.preemptions
    a = big.beam_search(prompts, beams)
    b = small.beam_search(prompts, beams)
    assert small.stats.preemptions > preempted
    for x, y in zip(a, b):
        assert [s.token_ids for s in x.sequences] == [s.token_ids for s in y.sequences]
        assert [s.score for s in x.sequences] == pytest.approx(
            [s.score for s in y.sequences], abs=1e-5
        )
    for llm in (big, small):
        assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_sample_i_is_the_same_alone_and_in_any_batch():
    prompt = _prompt(7, 3)
    params = SamplingParams(
        n=4, temperature=1.0, seed=42, max_tokens=12, ignore_eos=True
    )
    together = _llm().generate([prompt], params, use_tqdm=False)[0]
    crowd = [_prompt(5, s) for s in range(5)]
    mixed = _llm().generate(
        crowd + [prompt],
        [SamplingParams(temperature=1.0, max_tokens=12)] * 5 + [params],
        use_tqdm=False,
    )[-1]
    assert [c.token_ids for c in mixed.outputs] == [
        c.token_ids for c in together.outputs
    ]
    alone = _llm().generate(
        [prompt],
        SamplingParams(temperature=1.0, seed=42, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert together.outputs[0].token_ids == alone.token_ids
    # Distinct streams: the samples differ.
    assert len({tuple(c.token_ids) for c in together.outputs}) > 1
    assert [c.index for c in together.outputs] == [0, 1, 2, 3]


def test_parallel_sampling_prefills_the_prompt_once():
    prompt = _prompt(40, 9)
    n4 = _llm(block_size=8)
    n4.generate([prompt], SamplingParams(n=4, max_tokens=4, seed=0), use_tqdm=False)
    apart = _llm(block_size=8)
    apart.generate(
        [prompt] * 4,
        [SamplingParams(max_tokens=4, seed=i) for i in range(4)],
        use_tqdm=False,
    )
    # 40 prompt tokens = 5 full blocks, shared by the four samples.
    assert n4.stats.peak_blocks_used == 5 + 4
    assert apart.stats.peak_blocks_used == 4 * 6


def test_bad_beam_search_params():
    for kwargs, message in [
        (dict(beam_width=0), "beam_width"),
        (dict(beam_width=2, max_tokens=0), "max_tokens"),
        (dict(beam_width=2, length_penalty=float("nan")), "length_penalty"),
        (dict(beam_width=2, early_stopping="sometimes"), "early_stopping"),
    ]:
        with pytest.raises(ValueError, match=message):
            BeamSearchParams(**kwargs)
    with pytest.raises(ValueError, match="asks for 9 sequences"):
        _llm(max_num_seqs=8).beam_search([[1, 2]], BeamSearchParams(beam_width=9))
