"""The fused runner: same logits as the hook runner, same tokens as ``generate``,
the model left as it was, and clear refusals."""

import collections
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from reference import greedy_alone
from torch import nn

from pagedkv_lab import fused
from pagedkv_lab.engine import (
    ModelRunner,
    PagedKVCache,
    SamplingParams,
    Sequence,
    run_to_completion,
)
from pagedkv_lab.fused import (
    CountingLib,
    CpuFusedLinear,
    CpuLayerOps,
    FusedLinear,
    FusedModelRunner,
    LayerOps,
    can_pack,
    fused_unsupported_reason,
    layer_ops,
)
from pagedkv_lab.llm import LLM
from pagedkv_lab.models import OFFLINE_MODELS, load_model
from pagedkv_lab.paging import BlockAllocator, BlockTable

BLOCK = 8


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        [1] + torch.randint(3, 259, (n - 1,), generator=g).tolist() for n in lengths
    ]


def _step_logits(runner, prompts, split):
    """Logits of one mixed step: each prompt's first ``split`` tokens were
    computed by an earlier step, the rest now (so chunks and decodes mix)."""
    alloc = BlockAllocator(runner.kv_cache.num_blocks, BLOCK)
    params = SamplingParams(temperature=0, max_tokens=4)
    seqs = [Sequence(p, params, BlockTable(alloc)) for p in prompts]
    for s in seqs:
        s.block_table.append(s.num_tokens)
    first = [min(split, s.num_tokens - 1) for s in seqs]
    todo = [(s, n) for s, n in zip(seqs, first) if n]
    runner.run([s for s, _ in todo], [n for _, n in todo])
    for s, n in zip(seqs, first):
        s.num_computed_tokens = n
    return runner.run(seqs, [s.num_tokens - n for s, n in zip(seqs, first)])


@pytest.mark.parametrize("name", sorted(OFFLINE_MODELS))
@pytest.mark.parametrize(  # F.linear, oneDNN, the C++ loop where it builds
    "pack, cpu_linear", [(False, False), (True, False), (None, None)]
)
def test_fused_logits_match_the_hook_runner(name, pack, cpu_linear):
    model, _ = load_model(name)
    prompts = _prompts([1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5])
    want = _step_logits(ModelRunner(model, 64, BLOCK), prompts, split=BLOCK)
    runner = FusedModelRunner(model, 64, BLOCK, pack=pack, cpu_linear=cpu_linear)
    got = _step_logits(runner, prompts, BLOCK)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_fused_logits_in_bfloat16_stay_within_rounding():
    model, _ = load_model("small-llama", dtype=torch.bfloat16)
    prompts = _prompts([5, 40, 17])
    want = _step_logits(ModelRunner(model, 64, BLOCK), prompts, split=BLOCK)
    got = _step_logits(FusedModelRunner(model, 64, BLOCK), prompts, split=BLOCK)
    # bf16 keeps 8 bits: a few units in the last place of logits of size ~4
    assert (got - want).abs().max() < 0.1


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-mistral"])
def test_engine_with_fused_forward_equals_generate(name):
    model, _ = load_model(name)
    lengths = [1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5, 70]
    prompts = _prompts(lengths, seed=1)
    # a small step budget splits the long prompts into chunks beside decodes
    llm = LLM(
        model,
        block_size=BLOCK,
        kv_cache_memory=2**20,
        max_num_batched_tokens=32,
        fused_forward=True,
    )
    assert isinstance(llm.runner, FusedModelRunner)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for p, out in zip(prompts, outs):
        assert out.token_ids == greedy_alone(model, p, 20)


def test_the_model_is_left_as_it_was():
    model, _ = load_model("tiny-llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    attn = model.config._attn_implementation
    llm = LLM(model, block_size=BLOCK, kv_cache_memory=2**20)
    assert isinstance(llm.runner, FusedModelRunner)
    llm.generate([[1, 5, 6]], SamplingParams(temperature=0, max_tokens=5))
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert model.config._attn_implementation == attn
    assert len(greedy_alone(model, [1, 5, 6], 3)) == 3


class _AdaptedLinear(nn.Linear):
    """Stands for a quantized or LoRA-adapted projection."""


def test_an_unusual_layout_is_refused_with_its_reason_or_served_the_old_way():
    model, _ = load_model("tiny-llama")
    proj = model.model.layers[1].self_attn.k_proj
    adapted = _AdaptedLinear(proj.in_features, proj.out_features, bias=False)
    adapted.weight = proj.weight
    model.model.layers[1].self_attn.k_proj = adapted
    reason = fused_unsupported_reason(model)
    assert reason and "nn.Linear" in reason
    with pytest.raises(ValueError, match="nn.Linear"):
        FusedModelRunner(model, 16, BLOCK)
    with pytest.raises(ValueError, match="fused_forward=True"):
        LLM(model, block_size=BLOCK, kv_cache_memory=2**20, fused_forward=True)
    llm = LLM(model, block_size=BLOCK, kv_cache_memory=2**20)
    assert type(llm.runner) is ModelRunner
    out = llm.generate([[1, 9, 9, 4]], SamplingParams(temperature=0, max_tokens=6))
    assert out[0].token_ids == greedy_alone(model, [1, 9, 9, 4], 6)


def test_partial_rotary_is_refused():
    model, _ = load_model("tiny-llama")
    model.config.partial_rotary_factor = 0.5
    assert "rotary" in fused_unsupported_reason(model)


@pytest.mark.parametrize("bad", ["yes", 1, 0.0])
def test_fused_forward_must_be_a_bool_or_none(bad):
    with pytest.raises(ValueError, match="fused_forward"):
        LLM("tiny-llama", kv_cache_memory=2**20, fused_forward=bad)


@pytest.mark.parametrize("pack", [False, True])
def test_fused_linear_is_the_concatenation_of_its_layers(pack):
    torch.manual_seed(0)
    layers = [nn.Linear(24, 16, bias=True), nn.Linear(24, 8, bias=False)]
    layers.append(nn.Linear(24, 5, bias=True))
    x = torch.randn(7, 24)
    with torch.no_grad():
        want = torch.cat([F.linear(x, lay.weight, lay.bias) for lay in layers], -1)
        got = FusedLinear(layers, pack=pack)(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_packing_is_offered_for_cpu_float_models_only():
    model, _ = load_model("tiny-llama")
    assert can_pack(model) == torch.backends.mkldnn.is_available()
    assert not can_pack(model.to(torch.float16))


@pytest.mark.parametrize("rows", [1, 3, 4, 9])
def test_both_paths_of_a_packed_fused_linear_agree(rows):
    torch.manual_seed(1)
    layers = [nn.Linear(32, 12), nn.Linear(32, 20)]
    x = torch.randn(rows, 32)
    with torch.no_grad():
        want = torch.cat([lay(x) for lay in layers], -1)
        for pack in (False, True):
            got = FusedLinear(layers, pack=pack, min_packed_rows=4)(x)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_checking_for_packing_leaves_the_global_random_stream_alone():
    model, _ = load_model("tiny-llama")
    torch.manual_seed(5)
    can_pack(model)
    after = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(after, torch.rand(3))


def _cache(num_blocks=1, kv_heads=1, head_dim=8, dtype=torch.float32):
    config = SimpleNamespace(
        num_hidden_layers=1,
        num_attention_heads=kv_heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
    )
    return PagedKVCache(config, num_blocks, BLOCK, dtype, "cpu")


def _cpu_ops():
    ops = layer_ops(load_model("tiny-llama")[0], _cache())
    if not isinstance(ops, CpuLayerOps):
        pytest.skip("no C++ compiler on this machine")
    return ops


@pytest.mark.parametrize("rows", [1, 3, 37])
@pytest.mark.parametrize("dim", [8, 40, 72, 512])
@pytest.mark.parametrize("add", [False, True])
def test_cpp_add_rms_norm_matches_torch(rows, dim, add):
    g = torch.Generator().manual_seed(rows * dim)
    x, y = (torch.randn(rows, dim, generator=g) * 3 for _ in range(2))
    norm = (torch.randn(dim, generator=g), 1e-5)
    want_x, got_x = x.clone(), x.clone()
    want = LayerOps().add_rms_norm(want_x, y if add else None, norm)
    got = _cpu_ops().add_rms_norm(got_x, y if add else None, norm)
    # the residual stream is updated in place, exactly
    assert torch.equal(got_x, want_x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("inter", [8, 19, 48, 1408])
def test_cpp_silu_mul_matches_torch(rows, inter):
    g = torch.Generator().manual_seed(inter)
    gate_up = torch.randn(rows, 2 * inter, generator=g) * 8
    # the tails of the exponential: no overflow, no NaN
    gate_up[0, :4] = torch.tensor([-1e4, -90.0, 90.0, 1e4])
    want = LayerOps().act_mul(gate_up, F.silu)
    got = _cpu_ops().act_mul(gate_up, F.silu)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "heads, kv_heads, head_dim", [(4, 2, 8), (6, 1, 16), (8, 4, 64), (3, 3, 40)]
)
def test_cpp_rope_and_store_matches_torch(heads, kv_heads, head_dim):
    """Same q, and the same K/V at the same slots (scattered over the blocks)."""
    g = torch.Generator().manual_seed(head_dim)
    tokens, num_blocks = 11, 6
    slots = torch.randperm(num_blocks * BLOCK, generator=g)[:tokens]
    positions = torch.randint(0, 500, (tokens,), generator=g)
    inv_freq = 1 / 10000 ** (torch.arange(0, head_dim, 2) / head_dim)
    angles = positions[:, None] * inv_freq[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles] * 2, -1).sin()
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=g)
    results = []
    for ops in (LayerOps(), _cpu_ops()):
        cache = _cache(num_blocks, kv_heads, head_dim)
        step = SimpleNamespace(kv_cache=cache, slot_mapping=slots)
        q = ops.rope_and_store(step, 0, qkv.clone(), cos, sin, heads)
        results.append((q, cache.data.clone()))
    (want_q, want_cache), (got_q, got_cache) = results
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_cache, want_cache, rtol=1e-5, atol=1e-5)
    assert got_cache.abs().sum() > 0


def test_layer_ops_fall_back_to_torch_where_the_cpp_ones_do_not_apply(monkeypatch):
    cache = _cache()
    bf16, _ = load_model("tiny-llama", dtype=torch.bfloat16)
    assert type(layer_ops(bf16, cache)) is LayerOps
    gelu, _ = load_model("tiny-llama")
    gelu.config.hidden_act = "gelu"
    assert type(layer_ops(gelu, cache)) is LayerOps
    monkeypatch.setattr(fused, "load_layer_ops", lambda: None)
    assert type(layer_ops(load_model("tiny-llama")[0], cache)) is LayerOps


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "small-llama"])
def test_cpp_and_torch_layer_ops_give_the_same_logits(name):
    model, _ = load_model(name)
    prompts = _prompts([1, BLOCK + 1, 3 * BLOCK + 5, 40])
    want = _step_logits(FusedModelRunner(model, 64, BLOCK, ops=LayerOps()), prompts, 5)
    got = _step_logits(FusedModelRunner(model, 64, BLOCK, ops=_cpu_ops()), prompts, 5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_cpp_layer_ops_hand_inputs_they_cannot_read_to_torch():
    """A strided or bfloat16 input gives LayerOps' results, not garbage."""
    ops, g = _cpu_ops(), torch.Generator().manual_seed(3)
    strided = torch.randn(64, 10, generator=g).t()  # [10, 64], not contiguous
    norm = (torch.randn(64, generator=g), 1e-5)
    want_x, got_x = strided.clone(), strided.clone().t().contiguous().t()
    want = LayerOps().add_rms_norm(want_x, None, norm)
    torch.testing.assert_close(ops.add_rms_norm(got_x, None, norm), want)
    gate_up = torch.randn(5, 32, generator=g).to(torch.bfloat16)
    torch.testing.assert_close(
        ops.act_mul(gate_up, F.silu), LayerOps().act_mul(gate_up, F.silu)
    )


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 8, 13])
@pytest.mark.parametrize(
    "k, outs", [(7, (5,)), (64, (17, 3)), (33, (40,)), (301, (700,))]
)
@pytest.mark.parametrize("bias", [False, True])
def test_cpp_linear_matches_float64(rows, k, outs, bias):
    # tiles cut short (outputs not a multiple of the tile), rows cut into
    # blocks of every size from 1 to 6 (7 = 3 + 4, 8 = 4 + 4, 13 = 4 + 4 + 5),
    # k not a multiple of the unrolling, several layers with and without a
    # bias; the last shape is work enough for every thread, each prefetching
    # the next tile of its range
    lib = _cpu_ops().lib
    g = torch.Generator().manual_seed(rows * k)
    layers = [nn.Linear(k, n, bias=bias) for n in outs]
    for lay in layers:
        with torch.no_grad():
            for p in lay.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(rows, k, generator=g)
    got = CpuFusedLinear(layers, lib)(x)
    want = torch.cat(
        [F.linear(x.double(), lay.weight.double(),
                  None if lay.bias is None else lay.bias.double()) for lay in layers],
        -1,
    )  # fmt: skip
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


def test_cpp_linear_hands_inputs_it_cannot_read_to_fused_linear():
    lib = _cpu_ops().lib
    layer = nn.Linear(16, 24)
    x = torch.randn(16, 5).t()  # not contiguous
    with torch.no_grad():
        torch.testing.assert_close(CpuFusedLinear([layer], lib)(x), layer(x))


def test_the_fused_runner_takes_the_cpp_linear_where_it_applies():
    _cpu_ops()
    model, _ = load_model("tiny-llama")
    runner = FusedModelRunner(model, 16, BLOCK)
    assert isinstance(runner.layers[0].qkv, CpuFusedLinear)
    assert isinstance(runner.lm_head, CpuFusedLinear)
    oned = FusedModelRunner(model, 16, BLOCK, cpu_linear=False)
    assert type(oned.layers[0].qkv) is FusedLinear
    bf16, _ = load_model("tiny-llama", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="cpu_linear=True needs a float32 model"):
        FusedModelRunner(bf16, 16, BLOCK, cpu_linear=True)


# ---- the fused step: weights fused once, GEMMs counted, Qwen3, Triton ops ----


def _qwen3(seed=0):
    """tiny-qwen3 with its norms' weights drawn at random: the offline weights
    of a norm are ones, which would hide q's and k's weights swapped."""
    model, _ = load_model("tiny-qwen3")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
    return model


def _per_layer(counts, model, outside=1):
    """GEMMs per layer of one decode step (``outside`` the layers: the LM head's,
    and with the model's own forward the rotary module's, `fused.rotary_gemms`)."""
    gemms = sum(counts[op] for op in fused.GEMM_OPS)
    return (gemms - outside) / model.config.num_hidden_layers


def test_fused_weights_equal_the_layers_in_float64_and_share_their_memory():
    torch.manual_seed(0)
    shapes = [(48, True), (16, False), (16, True)]
    layers = [nn.Linear(48, n, bias=b, dtype=torch.float64) for n, b in shapes]
    before = [(lay.weight.clone(), lay.bias) for lay in layers]
    before = [(w, None if b is None else b.clone()) for w, b in before]
    x = torch.randn(9, 48, dtype=torch.float64)
    want = torch.cat([F.linear(x, w, b) for w, b in before], -1)
    lin = FusedLinear(layers, pack=False)
    with torch.no_grad():
        torch.testing.assert_close(lin(x), want, rtol=0, atol=1e-12)
    # the fused matrix is the layers' rows in order; zero bias where a layer has none
    assert torch.equal(lin.weight, torch.cat([w for w, _ in before]))
    assert torch.equal(lin.bias[48:64], torch.zeros(16, dtype=torch.float64))
    storage = lin.weight.untyped_storage().data_ptr()
    for lay, (w, b) in zip(layers, before):
        assert torch.equal(lay.weight, w)
        assert lay.weight.untyped_storage().data_ptr() == storage
        if b is not None:
            assert torch.equal(lay.bias, b)
            assert lay.bias.untyped_storage().data_ptr() == lin.bias.untyped_storage().data_ptr()
    with torch.no_grad():  # each layer still computes what it did
        for lay, (w, b) in zip(layers, before):
            torch.testing.assert_close(lay(x), F.linear(x, w, b), rtol=0, atol=0)


def test_fusing_a_model_keeps_no_second_copy_of_its_projections():
    model, _ = load_model("tiny-qwen2")  # q/k/v with biases, tied embeddings
    runner = FusedModelRunner(model, 16, BLOCK, pack=False, cpu_linear=False)
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for layer in runner.layers:
        for lin in (layer.qkv, layer.gate_up):
            assert lin.weight.untyped_storage().data_ptr() in storages
        assert layer.qkv.bias.untyped_storage().data_ptr() in storages
    assert len(greedy_alone(model, [1, 5, 6], 3)) == 3


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "small-llama"])
def test_gemms_per_layer_seven_before_four_after(name):
    """Counted by instrumentation: torch's dispatcher (`count_ops`) and the C++
    library's calls (`CountingLib`)."""
    model, _ = load_model(name)
    own = fused.decode_step_ops(ModelRunner(model, 64, BLOCK))
    assert _per_layer(own, model, outside=1 + fused.rotary_gemms(model)) == 7
    for kwargs in (
        dict(pack=False, cpu_linear=False, ops=LayerOps()),  # the GPU's path
        dict(pack=True, cpu_linear=False, ops=LayerOps()),  # oneDNN
    ):
        runner = FusedModelRunner(model, 64, BLOCK, **kwargs)
        assert _per_layer(fused.decode_step_ops(runner), model) == 4
    lib = _cpu_ops().lib
    calls = collections.Counter()
    runner = FusedModelRunner(model, 64, BLOCK, ops=CpuLayerOps(CountingLib(lib, calls)))
    counts = fused.decode_step_ops(runner, cpp_calls=calls)
    assert _per_layer(counts, model) == 4
    assert counts["pagedkv_linear"] == 4 * model.config.num_hidden_layers + 1


def test_a_counting_wrapper_on_f_linear_agrees(monkeypatch):
    """The same count with another instrument: every call of F.linear."""
    model, _ = load_model("tiny-llama")
    calls = []
    linear = F.linear

    def counted(*args, **kwargs):
        calls.append(args[1].shape)
        return linear(*args, **kwargs)

    runners = [ModelRunner(model, 64, BLOCK)]
    runners.append(FusedModelRunner(model, 64, BLOCK, pack=False, cpu_linear=False))
    found = []
    for runner in runners:
        prompts = _prompts([9, 9])
        alloc = BlockAllocator(64, BLOCK)
        params = SamplingParams(temperature=0, max_tokens=2)
        seqs = [Sequence(p, params, BlockTable(alloc)) for p in prompts]
        for s in seqs:
            s.block_table.append(s.num_tokens)
        runner.run(seqs, [8, 8])
        for s in seqs:
            s.num_computed_tokens = 8
        monkeypatch.setattr(F, "linear", counted)
        calls.clear()
        runner.run(seqs, [1, 1])
        monkeypatch.setattr(F, "linear", linear)
        found.append(len(calls))
    assert found == [7 * 2 + 1, 4 * 2 + 1]


def test_a_fused_decode_step_reads_nothing_back_to_the_host():
    """What a CUDA-graph capture needs: no .item(), no branch on a tensor's
    value, no shape that depends on values (here on the CPU's paths)."""
    model = _qwen3()
    for kwargs in ({}, dict(pack=False, cpu_linear=False, ops=LayerOps())):
        counts = fused.decode_step_ops(FusedModelRunner(model, 64, BLOCK, **kwargs))
        for op in ("item", "_local_scalar_dense", "is_nonzero", "nonzero"):
            assert counts[op] == 0, (op, kwargs)


def test_normed_heads_is_qwen3s_q_and_k_norm():
    model = _qwen3()
    attn = model.model.layers[1].self_attn
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    qk = torch.randn(6, heads + kv_heads, model.config.head_dim)
    with torch.no_grad():
        want = torch.cat([attn.q_norm(qk[:, :heads]), attn.k_norm(qk[:, heads:])], 1)
        weights = torch.stack([attn.q_norm.weight, attn.k_norm.weight])
        got = fused.normed_heads(qk, heads, (weights, attn.q_norm.variance_epsilon))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_qwen3_is_served_with_explicit_head_dim():
    model = _qwen3()
    cfg = model.config
    assert cfg.head_dim != cfg.hidden_size // cfg.num_attention_heads
    assert fused_unsupported_reason(model) is None
    runner = FusedModelRunner(model, 16, BLOCK)
    assert runner.kv_cache.data.shape[-1] == cfg.head_dim
    assert all(layer.qk_norm is not None for layer in runner.layers)


@pytest.mark.parametrize("name", ["tiny-qwen3", "qwen3-random-norms"])
@pytest.mark.parametrize(
    "pack, cpu_linear", [(False, False), (True, False), (None, None)]
)
def test_qwen3_fused_logits_match_the_hook_runner(name, pack, cpu_linear):
    model = load_model(name)[0] if name == "tiny-qwen3" else _qwen3()
    prompts = _prompts([1, BLOCK + 1, 3 * BLOCK + 5, 40])
    want = _step_logits(ModelRunner(model, 64, BLOCK), prompts, split=BLOCK)
    runner = FusedModelRunner(model, 64, BLOCK, pack=pack, cpu_linear=cpu_linear)
    torch.testing.assert_close(_step_logits(runner, prompts, BLOCK), want,
                               rtol=1e-4, atol=1e-4)  # fmt: skip


@pytest.mark.parametrize("fused_forward", [False, True])
def test_qwen3_greedy_equals_generate(fused_forward):
    model = _qwen3()
    prompts = _prompts([1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5, 70], seed=2)
    llm = LLM(model, block_size=BLOCK, kv_cache_memory=2**20,
              max_num_batched_tokens=32, fused_forward=fused_forward)  # fmt: skip
    assert isinstance(llm.runner, FusedModelRunner) == fused_forward
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for p, out in zip(prompts, outs):
        assert out.token_ids == greedy_alone(model, p, 16)


def _interpreting():
    if fused.triton is None or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton's interpreter (no CUDA here)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows, dim", [(1, 8), (5, 40), (3, 96)])
@pytest.mark.parametrize("add", [False, True])
def test_triton_add_rms_norm_matches_torch(dtype, rows, dim, add):
    _interpreting()
    g = torch.Generator().manual_seed(rows * dim)
    x, y = (torch.randn(rows, dim, generator=g).to(dtype) for _ in range(2))
    norm = ((0.5 + torch.rand(dim, generator=g)).to(dtype), 1e-6)
    want_x, got_x = x.clone(), x.clone()
    want = LayerOps().add_rms_norm(want_x, y if add else None, norm)
    got = fused.TritonLayerOps().add_rms_norm(got_x, y if add else None, norm)
    assert torch.equal(got_x, want_x)  # the residual, rounded as torch's add
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows, inter", [(1, 8), (3, 19), (2, 1500)])
def test_triton_silu_mul_matches_torch(dtype, rows, inter):
    _interpreting()
    g = torch.Generator().manual_seed(inter)
    gate_up = (4 * torch.randn(rows, 2 * inter, generator=g)).to(dtype)
    gate_up[0, :4] = torch.tensor([-1e4, -90.0, 90.0, 1e4]).to(dtype)
    want = LayerOps().act_mul(gate_up, F.silu)
    got = fused.TritonLayerOps().act_mul(gate_up, F.silu)
    assert torch.isfinite(got).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "heads, kv_heads, head_dim", [(4, 2, 8), (6, 1, 16), (3, 3, 40), (4, 2, 32)]
)
@pytest.mark.parametrize("qk", [False, True])
@pytest.mark.parametrize("ops", ["triton", "cpp"])
def test_rope_and_store_with_and_without_qk_norms_matches_torch(
    heads, kv_heads, head_dim, qk, ops
):
    """Same q, and the same K/V at the same slots (scattered over the blocks),
    Qwen3's head norms included."""
    if ops == "triton":
        _interpreting()
        ops = fused.TritonLayerOps()
    else:
        ops = _cpu_ops()
    g = torch.Generator().manual_seed(head_dim + qk)
    tokens, num_blocks = 11, 6
    slots = torch.randperm(num_blocks * BLOCK, generator=g)[:tokens]
    positions = torch.randint(0, 500, (tokens,), generator=g)
    inv_freq = 1 / 10000 ** (torch.arange(0, head_dim, 2) / head_dim)
    angles = positions[:, None] * inv_freq[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles] * 2, -1).sin()
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=g)
    qk_norm = (0.5 + torch.rand(2, head_dim, generator=g), 1e-6) if qk else None
    results = []
    for each in (LayerOps(), ops):
        cache = _cache(num_blocks, kv_heads, head_dim)
        step = SimpleNamespace(kv_cache=cache, slot_mapping=slots)
        q = each.rope_and_store(step, 0, qkv.clone(), cos, sin, heads, qk_norm)
        results.append((q, cache.data.clone()))
    (want_q, want_cache), (got_q, got_cache) = results
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_cache, want_cache, rtol=1e-5, atol=1e-5)
    assert got_cache.abs().sum() > 0


@pytest.mark.parametrize("name", ["tiny-llama", "qwen3-random-norms"])
def test_triton_layer_ops_serve_greedy_equal_to_generate(name):
    """The GPU's fused step (one F.linear per group, the Triton layer ops),
    here in Triton's interpreter."""
    _interpreting()
    model = load_model(name)[0] if name == "tiny-llama" else _qwen3()
    runner = FusedModelRunner(model, 64, BLOCK, pack=False, cpu_linear=False,
                              ops=fused.TritonLayerOps())  # fmt: skip
    prompts = _prompts([1, BLOCK + 1, 13], seed=3)
    alloc = BlockAllocator(64, BLOCK)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    seqs = [Sequence(p, params, BlockTable(alloc)) for p in prompts]
    run_to_completion(runner, seqs, None)
    for p, s in zip(prompts, seqs):
        assert s.output_token_ids == greedy_alone(model, p, 6)


def test_layer_ops_pick_triton_on_a_cuda_device_only():
    model, _ = load_model("tiny-llama")
    assert not isinstance(layer_ops(model, _cache()), fused.TritonLayerOps)
    cuda = SimpleNamespace(device=torch.device("cuda"), config=model.config,
                           dtype=torch.bfloat16)  # fmt: skip
    if fused.triton is not None:
        assert isinstance(layer_ops(cuda, _cache()), fused.TritonLayerOps)
    cuda.config = SimpleNamespace(hidden_act="gelu")
    assert type(layer_ops(cuda, _cache())) is not fused.TritonLayerOps


def test_decode_floor_records_the_fused_step_it_runs():
    """scripts/decode_floor.py's count, on the CPU's default fused runner and on
    the GPU's projections with PyTorch layer ops (graphs need a GPU)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "decode_floor.py"
    spec = importlib.util.spec_from_file_location("decode_floor", path)
    decode_floor = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(decode_floor)
    model = _qwen3()
    step = decode_floor.fused_step(
        FusedModelRunner(model, 64, BLOCK, pack=False, cpu_linear=False, ops=LayerOps())
    )
    # Qwen3 with PyTorch layer ops concatenates twice a layer: its q and k
    # norms (`normed_heads`), then RoPE's rotate_half
    assert step == {"runner": "FusedModelRunner", "layer_ops": "LayerOps",
                    "projections": "FusedLinear", "gemms_per_layer": 4.0,
                    "concats_per_layer": 2.0}  # fmt: skip
    assert decode_floor.fused_step(ModelRunner(model, 64, BLOCK)) == {
        "runner": "ModelRunner"
    }


def test_a_model_whose_weights_were_fused_still_saves_and_reloads(tmp_path):
    """Its q/k/v and gate/up weights are views of the fused matrices:
    save_pretrained writes them as the separate tensors a checkpoint holds."""
    from transformers import AutoModelForCausalLM

    model, _ = load_model("tiny-qwen2")
    FusedModelRunner(model, 16, BLOCK, pack=False, cpu_linear=False)
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    want, got = model.state_dict(), again.state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)
