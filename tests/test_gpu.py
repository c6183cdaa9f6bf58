"""The CUDA path, on a real GPU: the Triton kernels compiled (not interpreted) for
fp32/fp16/bf16 against the float64 reference, and the engine against transformers.

Every test skips without CUDA; ``make gpu-check`` runs this file on a GPU machine.
The exhaustive parametrizations carry the ``gpu_sweep`` mark, which the GPU
check's tests step leaves out (``-m "not gpu_sweep"``) to stay within its 90
seconds: each case compiles kernels of its own, and what they vary (KV
segments, tile sizes, partitions, dtypes on every shape) runs on a CPU too, in
Triton's interpreter (tests/test_attention.py's property tests). Each test
below keeps one case of every kind a bug could hide in.
"""

import pytest
import torch
from reference import greedy_alone

from pagedkv_lab.course.kernel_checks import on, packed_problem
from pagedkv_lab.engine.block_manager import BlockAllocator
from pagedkv_lab.engine.fused import FusedModel
from pagedkv_lab.engine.model_runner import ModelRunner
from pagedkv_lab.engine.sequence import Sequence
from pagedkv_lab.kernels import AttentionMetadata, paged_attention
from pagedkv_lab.kernels.reference import reference_paged_attention
from pagedkv_lab.kernels.triton_decode import paged_attention_triton
from pagedkv_lab.kernels.triton_tiled import paged_attention_tiled
from pagedkv_lab.kvmath import KVSpec
from pagedkv_lab.llm import LLM
from pagedkv_lab.models import OFFLINE_MODELS, load_model
from pagedkv_lab.sampling_params import SamplingParams


def HookRunner(model, num_blocks, block_size):  # noqa: N802
    """The model's own layers with the paged attention plugged in."""
    return ModelRunner(model, num_blocks, block_size, fused=False)


def FusedModelRunner(model, num_blocks, block_size, **options):  # noqa: N802
    """Chapter 05's fused step, eager."""
    return ModelRunner(model, num_blocks, block_size, forward=FusedModel(model, **options),
                       enforce_eager=True)  # fmt: skip

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"
)

# fp32 math in the kernel; the result is rounded to the storage type, so the
# tolerance (relative to the largest output) is about two units in its last place
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def dtypes():
    """The storage types this GPU runs: bf16 needs sm_80 (a T4 is sm_75)."""
    if not torch.cuda.is_available():
        return list(TOLERANCE)
    ok = torch.cuda.get_device_capability() >= (8, 0)
    return [d for d in TOLERANCE if d != torch.bfloat16 or ok]


@pytest.fixture(autouse=True)
def exact_fp32_matmuls():
    """TF32 would make fp32 matmuls round to 10 mantissa bits; keep it off."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def paged_problem(seed, ctx, new, heads, kv_heads, head_dim, bs, dtype):
    """``(q, k_cache, v_cache, meta)``: caches with shuffled blocks, -1 padding
    past each sequence's last block, and packed queries (``new[i]`` per
    sequence; ``None``: one each, decode)."""
    return packed_problem(seed, ctx, new, heads, kv_heads, head_dim, bs, dtype)


def on_cuda(q, k, v, meta):
    return q.cuda(), k.cuda(), v.cuda(), on(torch.device("cuda"), meta)


def close_to_reference(out, ref, dtype):
    assert out.dtype == dtype and out.isfinite().all()
    scale = max([1.0, *ref.abs().flatten().tolist()])
    atol = TOLERANCE[dtype] * scale
    torch.testing.assert_close(out.double().cpu(), ref, atol=atol, rtol=0)


#: exhaustive cases, left out of the GPU check's default run (see the docstring)
SWEEP = pytest.mark.gpu_sweep


def cases(*axes, core):
    """Every combination of ``axes`` as a pytest case; those for which
    ``core(*combination)`` is false carry the `SWEEP` mark."""
    import itertools

    for combo in itertools.product(*axes):
        yield pytest.param(*combo, marks=() if core(*combo) else SWEEP)


def first_half_dtype():
    """bf16 where the card has it, else fp16: the dtype the library serves in."""
    return [d for d in dtypes() if d != torch.float32][-1]


# context lengths, heads, kv_heads, head_dim, block size: odd on purpose
DECODE_SHAPES = [
    ([1, 17, 100, 1000], 4, 4, 64, 16),
    ([37, 3, 513], 8, 2, 128, 16),
    ([5, 300], 6, 1, 80, 32),  # group 6, padded to 8; head_dim 80, padded
    ([4097, 12], 8, 2, 40, 8),  # long enough to split into partitions
    ([260, 129, 1], 2, 1, 96, 128),
]


LONG = DECODE_SHAPES[3]  # the shape long enough to split into partitions


@pytest.mark.parametrize("shape, dtype, blocks_per_part", cases(
    DECODE_SHAPES, dtypes(), [None, 1, 3],
    core=lambda shape, dtype, parts: (parts is None and dtype == first_half_dtype())
    or (shape is LONG and dtype != torch.float32)))  # fmt: skip
def test_triton_decode_compiled_matches_float64(shape, dtype, blocks_per_part):
    ctx, heads, kvh, hd, bs = shape
    q, k, v, meta = paged_problem(0, ctx, None, heads, kvh, hd, bs, dtype)
    ref = reference_paged_attention(q, k, v, meta)
    out = paged_attention_triton(*on_cuda(q, k, v, meta), blocks_per_part=blocks_per_part)
    close_to_reference(out, ref, dtype)


@pytest.mark.parametrize("shape, dtype, segments, tile_sizes", cases(
    DECODE_SHAPES, dtypes(), [None, 1, 3, 16], [None, (64, 32), (16, 128)],
    core=lambda shape, dtype, segments, tiles: ((segments, tiles) == (None, None)
                                                and (dtype == first_half_dtype() or shape is LONG))
    or (shape is LONG and dtype == first_half_dtype()
        and (segments, tiles) in {(3, (64, 32)), (16, (16, 128)), (1, None)})))  # fmt: skip
def test_tiled_decode_compiled_matches_float64(shape, dtype, segments, tile_sizes):
    ctx, heads, kvh, hd, bs = shape
    q, k, v, meta = paged_problem(0, ctx, None, heads, kvh, hd, bs, dtype)
    ref = reference_paged_attention(q, k, v, meta)
    args = on_cuda(q, k, v, meta)
    out = paged_attention_tiled(*args, num_segments=segments, tile_sizes=tile_sizes)
    close_to_reference(out, ref, dtype)
    if segments is None and tile_sizes is None:
        assert torch.equal(paged_attention(*args), out)  # the dispatcher's path


# context lengths, new tokens, heads, kv_heads, head_dim, block size
PREFILL_SHAPES = [
    ([1, 12, 49], [1, 7, 19], 4, 2, 40, 16),
    ([9, 70, 33], [0, 70, 2], 8, 2, 64, 32),  # no new tokens; a whole prompt
    ([300, 5, 130], [150, 5, 1], 6, 1, 128, 16),
    ([600], [600], 8, 8, 64, 8),  # one long prompt, MHA
    ([1000, 1, 7, 2000], [1000, 1, 1, 1500], 32, 8, 128, 16),  # Llama-3-8B's heads
    ([45, 90], [40, 2], 4, 2, 64, 5),  # block size 5: the tiled kernel only
]


@pytest.mark.parametrize("shape, dtype", cases(
    PREFILL_SHAPES, dtypes(),
    core=lambda shape, dtype: dtype == first_half_dtype() or shape is PREFILL_SHAPES[4]))
def test_triton_prefill_compiled_matches_float64(shape, dtype):
    ctx, new, heads, kvh, hd, bs = shape
    q, k, v, meta = paged_problem(1, ctx, new, heads, kvh, hd, bs, dtype)
    ref = reference_paged_attention(q, k, v, meta)
    args = on_cuda(q, k, v, meta)
    if bs & (bs - 1) == 0:  # the first kernel takes power-of-two blocks only
        close_to_reference(paged_attention_triton(*args), ref, dtype)
    for segments in (None, 4):
        out = paged_attention_tiled(*args, num_segments=segments)
        close_to_reference(out, ref, dtype)
        if segments is None:
            assert torch.equal(paged_attention(*args), out)  # the dispatcher's path


def test_kernels_never_wait_for_the_gpu():
    """With ``check=False`` the entry point reads no value back to the host,
    prefill or decode (CUDA's sync debug mode raises on any synchronising call)."""
    q, k, v, meta = on_cuda(*paged_problem(
        2, [40, 9, 77], [40, 1, 20], 8, 2, 64, 16, torch.float16))  # fmt: skip
    decode = AttentionMetadata(meta.block_tables, meta.context_lens)
    paged_attention(q, k, v, meta, check=False)  # compile first, outside the watch
    paged_attention(q[:3], k, v, decode, check=False)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        paged_attention(q, k, v, meta, check=False)
        paged_attention(q[:3], k, v, decode, check=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        [1] + torch.randint(3, 259, (n - 1,), generator=g).tolist() for n in lengths
    ]


@pytest.mark.parametrize("name", sorted(OFFLINE_MODELS))
def test_engine_on_cuda_fp32_equals_generate(name):
    """Token for token, as tests/test_engine.py checks on a CPU: prompts around
    block boundaries, served together (prefill and decode in one step), and
    again with a step budget of 7 tokens (chunked prefill, mixed steps)."""
    reference, _ = load_model(name, device="cuda")
    batch = prompts([1, 15, 16, 17, 35, 70], seed=3)
    expected = [greedy_alone(reference, p, GREEDY.max_tokens) for p in batch]
    for budget in (None, 7):
        llm = LLM(
            name,
            device="cuda",
            dtype=torch.float32,
            block_size=16,
            kv_cache_memory=64 * 2**20,
            max_num_batched_tokens=budget,
        )
        outs = llm.generate(batch, GREEDY, use_tqdm=False)
        for p, out, want in zip(batch, outs, expected):
            assert out.token_ids == want, f"{name}, prompt of {len(p)} tokens"


@pytest.mark.parametrize("name, dtype, runner_cls", cases(
    sorted(OFFLINE_MODELS), [d for d in dtypes() if d != torch.float32],
    [HookRunner, FusedModelRunner],
    core=lambda name, dtype, runner: dtype == first_half_dtype()
    and (runner is FusedModelRunner or name == "tiny-llama")))  # fmt: skip
def test_engine_logits_in_half_precision_track_the_models_own(name, dtype, runner_cls):
    """In fp16/bf16, greedy tokens are not a robust check: random-weight models
    have near-ties that rounding flips, so one flip and every later token
    differs. We compare logits instead, teacher-forced (the same tokens fed to
    both), at every prefill end and decode step. The yardstick is measured, not
    guessed: ``noise``, how far the model's own fp16/bf16 logits (transformers'
    attention) are from its fp32 logits. The engine must be no further from
    fp32 than twice that, plus 0.1% of the largest logit; so it is within three
    times the noise of the model's own low-precision logits."""
    model, _ = load_model(name, dtype=dtype, device="cuda")
    fp32, _ = load_model(name, device="cuda")
    lengths, steps = [5, 16, 37], 6
    batch = prompts([n + steps for n in lengths], seed=4)
    runner = runner_cls(model, num_blocks=64, block_size=16)
    allocator = BlockAllocator(64, 16)
    seqs = [Sequence(p, GREEDY) for p in batch]
    for seq in seqs:
        seq.block_table = []
    engine = []  # [step][seq] logits
    num_new = lengths
    for _ in range(steps + 1):
        for seq, n in zip(seqs, num_new):
            need = -(-(seq.num_computed_tokens + n) // 16) - len(seq.block_table)
            seq.block_table += [allocator.allocate() for _ in range(need)]
        engine.append(runner.run(seqs, num_new))
        for seq, n in zip(seqs, num_new):
            seq.num_computed_tokens += n
        num_new = [1] * len(seqs)
    engine = torch.stack(engine, 1)  # [seq, step, vocab]
    with torch.inference_mode():
        own, exact = [], []
        for p, n in zip(batch, lengths):
            ids = torch.tensor([p], device="cuda")
            own.append(model(ids).logits[0, n - 1 :].float())
            exact.append(fp32(ids).logits[0, n - 1 :].float())
    own, exact = torch.stack(own), torch.stack(exact)
    scale = exact.abs().max().item()
    noise = (own - exact).abs().max().item()
    engine_err = (engine - exact).abs().max().item()
    assert noise < 0.1 * scale, "the yardstick itself is broken"
    assert engine_err <= 2 * noise + 1e-3 * scale, (engine_err, noise, scale)
    assert (engine - own).abs().max().item() <= 3 * noise + 1e-3 * scale


@pytest.mark.parametrize("dtype", [d for d in dtypes() if d != torch.float32])
def test_llm_serves_in_half_precision(dtype):
    """End to end through `LLM` in fp16/bf16: every request finishes with its
    tokens and nothing leaks, and its tokens are judged against transformers'
    own greedy generate in the same dtype by `pagedkv_lab.bench.compare`: every
    generated token of both within the calibrated gap of the model's float32
    best on its own prefix, and the engine teacher-forced on transformers'
    tokens within the calibrated tolerance of float32 at every position."""
    from pagedkv_lab.bench.compare import compare_systems, engine_logprobs

    llm = LLM("small-llama", device="cuda", dtype=dtype, kv_cache_memory=64 * 2**20)
    batch = prompts([3, 20, 64, 100, 17, 33, 48, 90], seed=5)
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [GREEDY.max_tokens] * len(batch)
    assert llm.block_manager.num_free_blocks == llm.stats.num_blocks
    theirs = [greedy_alone(llm.model, p, GREEDY.max_tokens) for p in batch]
    judged = compare_systems(
        {"generate": theirs, "pagedkv": [o.token_ids for o in outs]},
        [GREEDY.max_tokens] * len(batch), exact=False, model=llm.model, prompts=batch,
        scores={"pagedkv": engine_logprobs(llm, batch, theirs)},
    )["pagedkv"]  # fmt: skip
    assert judged.sound, judged.summary()
    assert judged.generated_positions == judged.forced_positions == len(batch) * GREEDY.max_tokens


def test_graphed_decode_equals_eager_and_generate():
    """CUDA graphs change nothing: the same greedy tokens as eager steps and as
    transformers, for staggered requests whose batch moves through several
    graph buckets, in a pool small enough to preempt (blocks freed and reused
    between captures)."""
    reference, _ = load_model("tiny-llama", device="cuda")
    batch = prompts([3, 17, 30, 9, 44, 1, 25, 60, 12, 33, 5, 70, 16, 8, 21, 40, 2], 7)
    lengths = [4 + 3 * (i % 5) for i in range(len(batch))]
    expected = [greedy_alone(reference, p, n) for p, n in zip(batch, lengths)]
    outputs = {}
    for eager in (True, False):
        # 40 blocks of 4 tokens: far fewer than the requests want at once
        budget = KVSpec.from_config(reference.config, torch.float32).bytes_per_token
        llm = LLM("tiny-llama", device="cuda", dtype=torch.float32, block_size=4,
                  kv_cache_memory=160 * budget, enforce_eager=eager)  # fmt: skip
        assert (llm.runner.graphs is not None) != eager
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                  for n in lengths]  # fmt: skip
        outs = llm.generate(batch, params, use_tqdm=False)
        outputs[eager] = [o.outputs[0].token_ids for o in outs]
        assert llm.block_manager.num_free_blocks == llm.stats.num_blocks
        if not eager:
            assert len(llm.runner.graphs.graphs) >= 3, sorted(llm.runner.graphs.graphs)
            assert llm.stats.preemptions > 0, "the pool was meant to preempt"
    assert outputs[True] == expected
    assert outputs[False] == expected


def test_one_step_in_flight_equals_the_synchronous_loop_on_cuda():
    """``async_scheduling=True`` (step N+1 planned and launched before step N's
    tokens reach the host) gives the tokens of the plain loop, graphed, with a
    pool small enough to preempt, greedy and seeded; every block comes back."""
    reference, _ = load_model("tiny-llama", device="cuda")
    batch = prompts([3, 17, 30, 9, 44, 1, 25, 60, 12, 33, 5, 70, 16], 7)
    budget = KVSpec.from_config(reference.config, torch.float32).bytes_per_token
    params = [SamplingParams(temperature=0, max_tokens=4 + 3 * (i % 5), ignore_eos=True)
              for i in range(len(batch))]  # fmt: skip
    params += [SamplingParams(temperature=1.0, top_k=40, max_tokens=9, seed=i)
               for i in range(4)]  # fmt: skip
    batch += batch[:4]
    outputs = {}
    for in_flight in (False, True):
        llm = LLM("tiny-llama", device="cuda", dtype=torch.float32, block_size=4,
                  kv_cache_memory=160 * budget, async_scheduling=in_flight)  # fmt: skip
        assert llm.async_scheduling == in_flight
        outs = llm.generate(batch, params, use_tqdm=False)
        outputs[in_flight] = [o.outputs[0].token_ids for o in outs]
        assert llm.block_manager.num_free_blocks == llm.stats.num_blocks
    assert outputs[True] == outputs[False]
    expected = [greedy_alone(reference, p, sp.max_tokens)
                for p, sp in zip(batch, params) if sp.temperature == 0]  # fmt: skip
    assert outputs[True][: len(expected)] == expected


def test_a_decode_step_waits_only_for_its_tokens():
    """In a graphed decode step the host waits for the GPU once: the transfer
    of the sampled tokens (CUDA's sync debug mode warns at every wait)."""
    import warnings

    llm = LLM("tiny-llama", device="cuda", kv_cache_memory=2**24)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for p in prompts([5, 9, 14], 8):
        llm.add_request(p, params)
    for _ in range(4):  # prefill, then decode steps that capture the graph
        llm.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            llm.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(n == 1 for n in llm.last_plan.num_new_tokens)
    waits = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert len(waits) == 1, waits


def test_sampling_on_the_gpu_is_seeded_and_cut():
    """Seeded requests repeat on the GPU; top-k of 1 is greedy decoding (in
    fp32: bf16 logits tie often, and top-k keeps every tied token, as vLLM's)."""
    llm = LLM("tiny-llama", device="cuda", dtype=torch.float32, kv_cache_memory=2**24)
    batch = prompts([5, 9, 14, 20], 9)
    seeded = SamplingParams(temperature=1.0, top_k=40, max_tokens=10, seed=11)
    first = [o.token_ids for o in llm.generate(batch, seeded, use_tqdm=False)]
    again = [o.token_ids for o in llm.generate(batch, seeded, use_tqdm=False)]
    assert first == again
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    top1 = SamplingParams(temperature=1.0, top_k=1, max_tokens=10, ignore_eos=True)
    want = [o.token_ids for o in llm.generate(batch, greedy, use_tqdm=False)]
    assert [o.token_ids for o in llm.generate(batch, top1, use_tqdm=False)] == want


# ---- the fused step on the GPU: Triton layer ops compiled, four GEMMs a layer ----


@pytest.mark.parametrize("dtype", dtypes())
def test_triton_layer_ops_compiled_match_torch(dtype):
    """The three Triton kernels, compiled, against `LayerOps` (PyTorch): the
    add with RMSNorm, SiLU with the product, Qwen3's q/k norms with RoPE and
    the cache write. Tolerance relative to the largest output, as above."""
    from types import SimpleNamespace

    import torch.nn.functional as F

    from pagedkv_lab.engine.kv_cache import PagedKVCache
    from pagedkv_lab.engine.layer_ops import LayerOps
    from pagedkv_lab.kernels.triton_layers import TritonLayerOps

    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cuda").to(dtype)

    def close(got, want):
        scale = want.float().abs().max().clamp_min(1)
        assert (got.float() - want.float()).abs().max() <= 2 * TOLERANCE[dtype] * scale

    ref, tri = LayerOps(), TritonLayerOps(LayerOps())
    x, y = randn(37, 4096), randn(37, 4096)
    norm = ((0.5 + torch.rand(4096, generator=g, device="cuda")).to(dtype), 1e-6)
    x_ref, x_tri = x.clone(), x.clone()
    close(tri.add_rms_norm(x_tri, y, norm), ref.add_rms_norm(x_ref, y, norm))
    assert torch.equal(x_tri, x_ref)
    gate_up = 4 * randn(37, 2 * 3000)
    close(tri.act_mul(gate_up, F.silu), ref.act_mul(gate_up, F.silu))
    config = SimpleNamespace(num_hidden_layers=1, num_attention_heads=16,
                             num_key_value_heads=8, head_dim=128)  # fmt: skip
    qkv = randn(37, 16 + 2 * 8, 128)
    angles = torch.rand(37, 64, generator=g, device="cuda") * 100
    cos, sin = (f(torch.cat([angles, angles], -1)).to(dtype) for f in (torch.cos, torch.sin))
    slots = torch.randperm(8 * 16, generator=g, device="cuda")[:37]
    for qk_norm in (None, ((0.5 + torch.rand(2, 128, device="cuda")).to(dtype), 1e-6)):
        results = []
        for ops in (ref, tri):
            cache = PagedKVCache(config, 8, 16, dtype, "cuda")
            step = SimpleNamespace(kv_cache=cache, slot_mapping=slots)
            q = ops.rope_and_store(step, 0, qkv.clone(), cos, sin, 16, qk_norm)
            results.append((q, cache.data))
        close(results[1][0], results[0][0])
        close(results[1][1], results[0][1])


def test_the_fused_step_on_cuda_runs_four_gemms_and_no_concatenation():
    from pagedkv_lab.bench.ops import GEMM_OPS, decode_step_ops
    from pagedkv_lab.kernels.triton_layers import TritonLayerOps

    model, _ = load_model("tiny-qwen3", device="cuda")
    runner = FusedModelRunner(model, 64, 16)
    assert isinstance(runner.forward.ops, TritonLayerOps)
    counts = decode_step_ops(runner)
    layers = model.config.num_hidden_layers
    assert (sum(counts[op] for op in GEMM_OPS) - 1) / layers == 4
    assert counts["cat"] == 1  # RoPE's cos and sin, once a step
    for op in ("item", "_local_scalar_dense", "is_nonzero", "nonzero"):
        assert counts[op] == 0, op


def test_graphed_qwen3_captures_every_bucket_and_equals_generate():
    """Qwen3 (q/k norms in the Triton kernel) graphed, every bucket captured up
    front, in fp32: the same greedy tokens as transformers."""
    reference, _ = load_model("tiny-qwen3", device="cuda")
    batch = prompts([3, 17, 30, 9, 44, 1, 25], 11)
    expected = [greedy_alone(reference, p, 12) for p in batch]
    llm = LLM("tiny-qwen3", device="cuda", dtype=torch.float32,
              kv_cache_memory=2**24, max_num_seqs=8)  # fmt: skip
    graphs = llm.runner.graphs
    assert graphs is not None
    graphs.capture_all()
    assert sorted(graphs.graphs) == graphs.batch_sizes
    assert all(s > 0 for s in graphs.capture_seconds.values())
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(batch, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
