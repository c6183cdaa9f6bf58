"""The paged engine against transformers' own generate, token for token."""

import pytest
import torch
from reference import greedy_alone
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    Qwen2Config,
    Qwen3Config,
)

from pagedkv_lab.engine import (
    ModelRunner,
    SamplingParams,
    Sequence,
    run_to_completion,
    sample,
)
from pagedkv_lab.models import load_model
from pagedkv_lab.paging import BlockAllocator, BlockTable

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _synthetic(config_cls, **fields):
    base = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        max_position_embeddings=512,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    base.update(fields)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config_cls(**base)).eval()


def _random_norms(model):
    """Every RMSNorm weight drawn at random (they start as ones)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
    return model


MODELS = {
    "tiny-llama": lambda: load_model("tiny-llama")[0],
    "tiny-qwen2": lambda: load_model("tiny-qwen2")[0],
    "tiny-mistral": lambda: load_model("tiny-mistral")[0],
    "llama-mha-hd32": lambda: _synthetic(
        LlamaConfig, num_attention_heads=2, num_key_value_heads=2
    ),
    "llama-mqa-bias": lambda: _synthetic(
        LlamaConfig, num_attention_heads=4, num_key_value_heads=1, attention_bias=True
    ),
    "qwen2-untied-gqa2": lambda: _synthetic(
        Qwen2Config,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    ),
    "tiny-qwen3": lambda: load_model("tiny-qwen3")[0],
    # head_dim 24 is not 64 / 4; q/k norms with weights that are not ones
    "qwen3-hd24-norms": lambda: _random_norms(
        _synthetic(Qwen3Config, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=24, tie_word_embeddings=False)
    ),
}


def _table(runner):
    """A fresh block table over the runner's pool (one allocator per runner)."""
    if not hasattr(runner, "_test_allocator"):
        runner._test_allocator = BlockAllocator(
            runner.kv_cache.num_blocks, runner.block_size
        )
    return BlockTable(runner._test_allocator)


def _reference(model, prompt, n):
    return greedy_alone(model, prompt, n)


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        [1] + torch.randint(3, 259, (n - 1,), generator=g).tolist() for n in lengths
    ]


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("block_size", [4, 16])
def test_greedy_matches_generate_around_block_boundaries(name, block_size):
    reference, paged = MODELS[name](), MODELS[name]()
    lengths = [1, block_size - 1, block_size, block_size + 1, 2 * block_size + 3, 70]
    prompts = _prompts(lengths, seed=block_size)
    runner = ModelRunner(paged, num_blocks=256, block_size=block_size)
    seqs = run_to_completion(
        runner, [Sequence(p, GREEDY, _table(runner)) for p in prompts], None
    )
    for p, seq in zip(prompts, seqs):
        assert seq.output_token_ids == _reference(reference, p, 12), (
            f"prompt of {len(p)} tokens"
        )
        assert (
            seq.num_computed_tokens == seq.num_tokens - 1
            and seq.finish_reason == "length"
        )


def test_many_prompts_together_and_mixed_prefill_decode():
    reference, paged = load_model("tiny-llama")[0], load_model("tiny-llama")[0]
    runner = ModelRunner(paged, num_blocks=512, block_size=8)
    g = torch.Generator().manual_seed(5)
    prompts = _prompts(torch.randint(1, 60, (16,), generator=g).tolist(), seed=5)
    seqs = [Sequence(p, GREEDY, _table(runner)) for p in prompts]
    # Start half of them two steps early, so later steps mix prefills with decodes.
    early, late = seqs[:8], seqs[8:]
    for _ in range(2):
        num_new = [s.num_tokens - s.num_computed_tokens for s in early]
        for s, n in zip(early, num_new):
            s.block_table.append(s.num_computed_tokens + n - s.block_table.num_tokens)
        for s, n, t in zip(early, num_new, sample(runner.run(early, num_new), early)):
            s.num_computed_tokens += n
            s.append_token(t, None, 2048)
    run_to_completion(runner, early + late, None)
    for p, s in zip(prompts, seqs):
        assert s.output_token_ids == _reference(reference, p, 12)


def test_stop_conditions():
    model, tok = load_model("tiny-llama")
    runner = ModelRunner(model, num_blocks=64, block_size=8)
    probe = run_to_completion(
        runner, [Sequence([1, 5, 6], GREEDY, _table(runner))], None
    )[0]
    third = probe.output_token_ids[2]
    stop = Sequence(
        [1, 5, 6],
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[third]),
        _table(runner),
    )
    eos = Sequence(
        [1, 5, 6],
        SamplingParams(temperature=0, max_tokens=12),
        _table(runner),
    )
    run_to_completion(runner, [stop, eos], eos_token_id=probe.output_token_ids[0])
    assert stop.output_token_ids[-1] == third and stop.finish_reason == "stop"
    assert (
        eos.output_token_ids == probe.output_token_ids[:1]
        and eos.finish_reason == "stop"
    )
    short = run_to_completion(
        runner,
        [Sequence([1, 5], SamplingParams(max_tokens=3, seed=1), _table(runner))],
        None,
    )[0]
    assert len(short.output_token_ids) == 3 and short.finish_reason == "length"


def test_seeded_sampling_does_not_depend_on_the_batch():
    model, _ = load_model("tiny-llama")
    runner = ModelRunner(model, num_blocks=128, block_size=8)
    params = SamplingParams(
        temperature=0.9, top_p=0.9, top_k=50, max_tokens=10, seed=123
    )
    alone = run_to_completion(
        runner, [Sequence([1, 7, 8], params, _table(runner))], None
    )[0]
    others = [
        Sequence(
            [1, 9],
            SamplingParams(temperature=1.0, max_tokens=10),
            _table(runner),
        )
        for _ in range(3)
    ]
    together = Sequence([1, 7, 8], params, _table(runner))
    run_to_completion(runner, [others[0], together, *others[1:]], None)
    assert together.output_token_ids == alone.output_token_ids


def test_sampler_respects_top_k_and_top_p():
    logits = torch.tensor([[5.0, 4.0, 0.0, -1.0]])
    for params, allowed in [
        (SamplingParams(top_k=2, seed=0), {0, 1}),
        (SamplingParams(top_p=0.5, seed=0), {0}),
    ]:
        seq = Sequence([1], params, None)
        assert {sample(logits, [seq])[0] for _ in range(50)} <= allowed


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(top_k=2.5), "top_k"),
        (dict(top_k=True), "top_k"),
        (dict(max_tokens=True), "max_tokens"),
        (dict(max_tokens=3.0), "max_tokens"),
        (dict(seed=1.5), "seed"),
        (dict(seed=-1), "seed"),
        (dict(n=0), "n"),
        (dict(stop_token_ids=5), "stop_token_ids"),
        (dict(stop_token_ids=["a"]), "stop token"),
        (dict(ignore_eos=1), "ignore_eos"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_runner_refuses_what_it_cannot_serve():
    model = load_model("tiny-llama")[0]
    with pytest.raises(ValueError, match="exceeds the model's 2048 positions"):
        ModelRunner(model, 8, max_model_len=4096)
    windowed = load_model("tiny-mistral")[0]
    windowed.config.sliding_window = 64
    with pytest.raises(ValueError, match="sliding-window"):
        ModelRunner(windowed, 8, max_model_len=128)
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2))
    with pytest.raises(ValueError, match="not supported"):
        ModelRunner(gpt2, 8)
    runner = ModelRunner(load_model("tiny-llama")[0], 8, block_size=4)
    seq = Sequence([1, 2, 3], GREEDY, _table(runner))
    with pytest.raises(ValueError, match="cannot compute tokens"):
        # The block table has not grown yet.
        runner.prepare([seq], [3])


def test_tiny_temperatures_are_greedy_not_overflow():
    logits = torch.tensor([[0.0, 30.0, 29.0]])
    for t in (1e-9, 1e-6, 0.0):
        seq = Sequence([1], SamplingParams(temperature=t, seed=0))
        assert seq.params.greedy and sample(logits, [seq]) == [1]


def test_runner_leaves_the_model_as_it_was():
    model, _ = load_model("tiny-llama")
    before = model.config._attn_implementation
    expected = greedy_alone(model, [1, 5, 6, 7], 6)
    runner = ModelRunner(model, num_blocks=16, block_size=4)
    seq = Sequence([1, 5, 6, 7], GREEDY, _table(runner))
    run_to_completion(runner, [seq], None)
    assert model.config._attn_implementation == before
    assert greedy_alone(model, [1, 5, 6, 7], 6) == expected
    assert seq.output_token_ids[:6] == expected


def test_block_copies_move_every_layer_and_read_before_writing():
    model, _ = load_model("tiny-llama")
    runner = ModelRunner(model, num_blocks=6, block_size=4)
    data = runner.kv_cache.data
    data.copy_(torch.randn(data.shape))
    before = data.clone()
    # 1 -> 4 and 4 -> 5 in one call: 5 must get 4's old content.
    runner.kv_cache.copy_blocks([(1, 4), (4, 5)])
    assert torch.equal(data[:, :, 4], before[:, :, 1])
    assert torch.equal(data[:, :, 5], before[:, :, 4])
    assert torch.equal(data[:, :, :4], before[:, :, :4])


def test_a_step_may_not_write_into_a_shared_block():
    """`run` with the block manager's reference counts refuses a step whose new
    tokens land in a block another table also holds (checked on the host, from
    the tables), and accepts one that only reads shared blocks."""
    model, _ = load_model("tiny-llama")
    runner = ModelRunner(model, num_blocks=8, block_size=4)
    seq = Sequence(list(range(3, 10)), SamplingParams(temperature=0), BlockTable(
        BlockAllocator(8, 4)))  # fmt: skip
    seq.block_table.append(7)  # blocks 0 and 1; the new tokens 4..6 go to block 1
    seq.num_computed_tokens = 4
    counts = [2, 1] + [0] * 6  # block 0 shared: it is only read
    assert runner.run([seq], [3], counts).shape[0] == 1
    with pytest.raises(AssertionError, match=r"shared or free blocks \[1\]"):
        runner.run([seq], [3], [1, 2] + [0] * 6)
