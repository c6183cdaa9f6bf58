"""Paged attention paths against a float64 reference, on fresh random shapes
(Triton in its interpreter, or compiled where there is a GPU). The C++ kernel has
its own file, test_cpu_kernel.py."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv_lab.course.kernel_checks import (
    TOLERANCE,
    on,
    packed_problem,
    poisoned_buffers,
    random_paged_problem,
)
from pagedkv_lab.kernels import (
    AttentionMetadata,
    paged_attention,
    triton_decode,
    triton_tiled,
)
from pagedkv_lab.kernels.cpu import paged_attention_cpu
from pagedkv_lab.kernels.reference import (
    _length_buckets,
    merge_partial_attention,
    paged_attention_torch,
    reference_paged_attention,
)
from pagedkv_lab.kernels.triton_decode import paged_attention_triton, prefill_as_decode
from pagedkv_lab.kernels.triton_tiled import paged_attention_tiled

# The Triton tests run compiled on a GPU when there is one (`make gpu-check`),
# else in the interpreter; the float64 reference always runs on the CPU.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def on_device(q, k, v, meta):
    """The problem's tensors on `DEVICE`, with a metadata of its own."""
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), on(DEVICE, meta)


def problem(seed, seqs, heads, kv_heads, head_dim, block_size, max_blocks,
            dtype=torch.float32, share=False):  # fmt: skip
    """``(q, k_cache, v_cache, meta)`` of a decode: shuffled blocks, lengths that
    end mid-block, with ``share`` one physical block first in every table."""
    k, v, meta, g = random_paged_problem(seqs, kv_heads, head_dim, block_size, max_blocks,
                                         dtype, seed, shared_first_block=share)  # fmt: skip
    return torch.randn(seqs, heads, head_dim, generator=g).to(dtype), k, v, meta


@pytest.fixture
def poisoned():
    """Kernel output buffers start as NaN, so unwritten elements fail the
    comparison (the patch holds for every generated example)."""
    with poisoned_buffers():
        yield


shapes = st.tuples(
    st.integers(1, 4),  # seqs
    st.sampled_from([(4, 4), (8, 2), (6, 1), (2, 1), (12, 4)]),  # (heads, kv_heads)
    st.sampled_from([16, 64, 80, 128]),  # head_dim
    st.sampled_from([8, 16, 32, 64, 128]),  # block size
    st.integers(1, 4),  # max blocks per sequence
)


def close_to(out, ref, dtype):
    assert out.dtype == dtype and out.shape == ref.shape and out.isfinite().all()
    bound = TOLERANCE[dtype] * max(1.0, ref.abs().max().item())
    assert (out.double().cpu() - ref).abs().max().item() <= bound


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    shapes,
    st.sampled_from(list(TOLERANCE)),
    st.integers(0, 2**31 - 1),
    st.booleans(),
    st.sampled_from([None, 1, 2]),
)
def test_triton_decode_matches_float64(
    poisoned, shape, dtype, seed, share, blocks_per_part
):
    seqs, (heads, kvh), head_dim, bs, mb = shape
    q, k, v, meta = problem(seed, seqs, heads, kvh, head_dim, bs, mb, dtype, share)
    ref = reference_paged_attention(q, k, v, meta)
    out = paged_attention_triton(*on_device(q, k, v, meta), blocks_per_part=blocks_per_part)
    close_to(out, ref, dtype)


def with_queries(meta, q_lens):
    starts = torch.cat([torch.zeros(1, dtype=torch.long), torch.as_tensor(q_lens).cumsum(0)])
    return AttentionMetadata(meta.block_tables, meta.context_lens, starts)


@settings(max_examples=25, deadline=None)
@given(shapes, st.integers(0, 2**31 - 1), st.booleans())
def test_torch_decode_and_prefill_match_float64(shape, seed, share):
    seqs, (heads, kvh), head_dim, bs, mb = shape
    q, k, v, meta = problem(seed, seqs, heads, kvh, head_dim, bs, mb, share=share)
    ref = reference_paged_attention(q, k, v, meta)
    meta.workspace = {}
    assert (paged_attention_torch(q, k, v, meta).double() - ref).abs().max() < 2e-5
    g = torch.Generator().manual_seed(seed + 1)
    qlens = torch.minimum(torch.randint(0, 40, (seqs,), generator=g), meta.context_lens)
    prefill = with_queries(meta, qlens)
    qp = torch.randn(int(qlens.sum()), heads, head_dim, generator=g)
    ref_p = reference_paged_attention(qp, k, v, prefill)
    out_p = paged_attention_torch(qp, k, v, prefill)
    assert out_p.shape == qp.shape  # sequences with no new queries contribute no rows
    torch.testing.assert_close(out_p.double(), ref_p, atol=2e-5, rtol=0)


def test_prefill_of_a_whole_prompt_equals_causal_sdpa():
    torch.manual_seed(0)
    L, H, D, bs = 37, 4, 16, 8
    q, k, v = torch.randn(L, H, D), torch.randn(L, H, D), torch.randn(L, H, D)
    blocks = -(-L // bs)
    k_cache = torch.zeros(blocks + 2, bs, H, D)
    v_cache = torch.zeros_like(k_cache)
    table = torch.tensor([[5, 0, 3, 1, 2]], dtype=torch.int32)[:, :blocks]
    slots = table[0].long()[torch.arange(L) // bs] * bs + torch.arange(L) % bs
    k_cache.view(-1, H, D)[slots], v_cache.view(-1, H, D)[slots] = k, v
    meta = AttentionMetadata(table, torch.tensor([L]), torch.tensor([0, L]))
    out = paged_attention_torch(q, k_cache, v_cache, meta)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    ).transpose(0, 1)
    assert torch.allclose(out, expected, atol=1e-5)


def test_merge_is_exact_for_any_split():
    g = torch.Generator().manual_seed(1)
    s = torch.randn(50, dtype=torch.float64, generator=g) * 4
    v = torch.randn(50, 3, dtype=torch.float64, generator=g)
    exact = torch.softmax(s, 0) @ v
    for cuts in ([25], [1, 2, 49], [10, 20, 30, 40]):
        bounds = [0, *cuts, 50]
        parts = [
            (torch.softmax(s[a:b], 0) @ v[a:b], torch.logsumexp(s[a:b], 0))
            for a, b in zip(bounds, bounds[1:])
        ]
        outs = torch.stack([o for o, _ in parts])
        lses = torch.stack([lse for _, lse in parts])
        assert torch.allclose(merge_partial_attention(outs, lses), exact, atol=1e-13)
    empty = merge_partial_attention(
        torch.stack([exact, torch.zeros(3, dtype=torch.float64)]),
        torch.tensor([0.0, -math.inf], dtype=torch.float64),
    )
    assert torch.allclose(empty, exact)


def test_merge_of_an_empty_part_needs_a_finite_output():
    """The docstring's contract: an empty part (lse -inf) weighs 0 when its output
    is finite, wherever it sits; a NaN output, or no non-empty part, gives NaN
    (the kernels write zeros for an empty part, and every sequence has a key)."""
    out = torch.tensor([[1.0, -2.0], [0.0, 0.0], [3.0, 4.0]], dtype=torch.float64)
    lse = torch.tensor([0.5, -math.inf, 0.5], dtype=torch.float64)
    assert torch.allclose(merge_partial_attention(out, lse), out[[0, 2]].mean(0))
    nan_out = out.clone()
    nan_out[1] = math.nan
    assert merge_partial_attention(nan_out, lse).isnan().all()
    assert merge_partial_attention(out, torch.full((3,), -math.inf)).isnan().all()


def test_bad_arguments_fail_with_clear_messages():
    q, k, v, meta = problem(0, 2, 4, 2, 16, 8, 2)
    tables, lens = meta.block_tables, meta.context_lens
    with pytest.raises(ValueError, match="cannot share"):
        paged_attention_torch(q[:, :3], k, v, meta)
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention_torch(q[..., :8], k, v, meta)
    with pytest.raises(ValueError, match="one query per sequence"):
        paged_attention_torch(q[:1], k, v, meta)
    with pytest.raises(ValueError, match="fit the sequence's block table"):
        paged_attention_torch(q, k, v, AttentionMetadata(tables, lens + 100))
    with pytest.raises(ValueError, match="must match"):
        paged_attention_torch(q, k, v.half(), meta)
    with pytest.raises(ValueError, match="2-D int"):
        paged_attention_torch(q, k, v, AttentionMetadata(tables.float(), lens))
    with pytest.raises(ValueError, match="context_lens has shape"):
        paged_attention_torch(q, k, v, AttentionMetadata(tables, lens[:1]))
    with pytest.raises(ValueError, match="power-of-two block size"):
        paged_attention_triton(*on_device(*problem(0, 2, 4, 2, 16, 12, 2)))
    with pytest.raises(ValueError, match="share one of"):
        paged_attention_triton(*on_device(q.half(), k, v, meta))
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_attention_torch(q, k, v, AttentionMetadata(tables, lens, torch.tensor([0, 1])))
    with pytest.raises(ValueError, match="query_start_loc"):  # ends past q's rows
        paged_attention_torch(q, k, v, AttentionMetadata(tables, lens, torch.tensor([0, 1, 5])))
    with pytest.raises(ValueError, match="queries <= context length"):
        too_many = torch.tensor([0, 1, int(lens[1]) + 2])
        paged_attention_torch(torch.randn(int(too_many[-1]), 4, 16), k, v,
                              AttentionMetadata(tables, lens, too_many))  # fmt: skip


def test_dispatch_on_cpu_uses_the_cpp_kernel_else_pytorch(monkeypatch):
    from pagedkv_lab.kernels import cpu

    q, k, v, meta = problem(3, 3, 8, 2, 64, 16, 3)
    fast = paged_attention_cpu(q, k, v, meta)
    expected = fast if fast is not None else paged_attention_torch(q, k, v, meta)
    assert torch.equal(paged_attention(q, k, v, meta), expected)
    monkeypatch.setattr(cpu, "load_cpu_kernel", lambda: None)
    assert torch.equal(paged_attention(q, k, v, meta), paged_attention_torch(q, k, v, meta))


def test_out_of_range_block_ids_are_rejected_but_padding_is_not():
    q, k, v, meta = problem(5, 2, 4, 2, 16, 8, 3)
    padded = meta.block_tables.clone()
    used = (meta.context_lens + 7) // 8
    padded[torch.arange(3) >= used[:, None]] = -1
    # -1 past each sequence's end is fine
    paged_attention_torch(q, k, v, AttentionMetadata(padded, meta.context_lens))
    for bad in (-1, k.shape[0]):
        broken = meta.block_tables.clone()
        broken[0, 0] = bad
        with pytest.raises(ValueError, match="outside the cache"):
            paged_attention(q, k, v, AttentionMetadata(broken, meta.context_lens))


def test_length_buckets_pad_no_sequence_to_twice_its_length():
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        blocks = torch.randint(
            1, 300, (int(torch.randint(1, 20, (1,))),), generator=gen
        )
        blocks = blocks.tolist()
        buckets = _length_buckets(blocks)
        assert sorted(i for b in buckets for i in b) == list(range(len(blocks)))
        for b in buckets:
            width = max(blocks[i] for i in b)
            assert blocks[b[0]] == width and all(2 * blocks[i] > width for i in b)


def test_heavy_tailed_decode_batch_matches_float64():
    q, k, v, meta = problem(9, 9, 4, 2, 16, 4, 160)
    meta.context_lens = torch.tensor([640, 3, 17, 1, 40, 600, 9, 2, 33])
    assert len(_length_buckets(((meta.context_lens + 3) // 4).tolist())) > 1
    ref = reference_paged_attention(q, k, v, meta)
    out = paged_attention_torch(q, k, v, meta)
    assert (out.double() - ref).abs().max() < 2e-5
    assert {"k", "v"} <= set(meta.workspace)  # the gather's buffers, kept for the next call


def test_triton_accepts_block_tables_and_lengths_of_any_strides():
    q, k, v, meta = on_device(*problem(11, 3, 4, 2, 32, 8, 5))
    ref = reference_paged_attention(q, k, v, meta)
    tables, lens = meta.block_tables, meta.context_lens
    column_major = tables.t().contiguous().t()  # transposed, then viewed back
    assert column_major.stride() == (1, 3)
    wide = torch.full((3, 10), -1, dtype=torch.int32, device=DEVICE)
    wide[:, ::2] = tables  # every other column: a stride of 2 along the table
    every_other = wide[:, ::2]
    strided_lens = torch.stack([lens, lens * 0], 1)[:, 0]
    for t in (column_major, every_other):
        for bpp in (None, 2):
            strided = AttentionMetadata(t, strided_lens)
            out = paged_attention_triton(q, k, v, strided, blocks_per_part=bpp)
            assert (out.double().cpu() - ref).abs().max() < 2e-5


def test_triton_specialisations_stay_bounded_as_tables_grow(monkeypatch):
    """Triton compiles one kernel per set of constexprs and of integer properties
    (== 1, divisible by 16) of the arguments: count those sets while the block
    table grows, as a decoding batch's does."""
    kernel, keys = triton_decode._paged_decode_kernel, set()

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **constexprs):
                ints = tuple((a == 1, a % 16 == 0) for a in args if type(a) is int)
                dtypes = tuple(a.dtype for a in args if isinstance(a, torch.Tensor))
                keys.add((tuple(sorted(constexprs.items())), ints, dtypes))
                return kernel[grid](*args, **constexprs)

            return launch

    monkeypatch.setattr(triton_decode, "_paged_decode_kernel", Recorder())
    gen = torch.Generator().manual_seed(0)
    bs, widths = 8, [1, 2, 3, 5, 8, 13, 16, 17, 21, 32, 33, 48]
    k = torch.randn(2 * max(widths), bs, 1, 16, generator=gen)
    v = torch.randn(2 * max(widths), bs, 1, 16, generator=gen)
    for width in widths:
        tables = torch.randperm(2 * max(widths), generator=gen)[: 2 * width]
        tables = tables.reshape(2, width).int()
        # the table is as wide as the batch's longest sequence; these two read
        # at most two blocks, which keeps the interpreter quick
        lens = torch.tensor([min(width * bs, 13), 1 + width % 5])
        q = torch.randn(2, 2, 16, generator=gen)
        meta = AttentionMetadata(tables, lens)
        ref = reference_paged_attention(q, k, v, meta)
        out = paged_attention_triton(*on_device(q, k, v, meta))
        assert (out.double().cpu() - ref).abs().max() < 2e-5
    assert len(keys) <= 3, f"{len(keys)} specialisations for {len(widths)} widths"


def prefill_problem(seed, new, cached, heads, kv_heads, head_dim, bs, dtype):
    """``(q, k_cache, v_cache, meta)``: packed queries for sequences with
    ``new[i]`` new tokens after ``cached[i]`` cached ones; tables padded with -1
    past each sequence's last block."""
    ctx = [n + c for n, c in zip(new, cached)]
    return packed_problem(seed, ctx, new, heads, kv_heads, head_dim, bs, dtype)


# new tokens, cached tokens, heads, kv_heads, head_dim, block size
PREFILL_SHAPES = [
    ([1, 7, 19], [0, 5, 30], 4, 2, 40, 16),  # the chapter's check
    ([3, 0, 12], [4, 9, 0], 4, 4, 64, 8),  # a sequence with no new tokens, MHA
    ([0, 0], [3, 8], 8, 2, 40, 8),  # no queries at all
    ([33, 2], [0, 40], 8, 2, 64, 32),  # GQA 4, rows across blocks of 32
    ([5, 1, 9, 2], [11, 0, 23, 70], 2, 1, 40, 32),  # GQA 2, mixed decode rows
]


@pytest.mark.parametrize("shape", PREFILL_SHAPES)
def test_triton_prefill_matches_float64(poisoned, shape):
    q, k, v, meta = prefill_problem(3, *shape, torch.float32)
    ref = reference_paged_attention(q, k, v, meta)
    out = paged_attention_triton(*on_device(q, k, v, meta))
    assert out.shape == q.shape and out.dtype == q.dtype and out.isfinite().all()
    scale = max([1.0, *ref.abs().flatten().tolist()])
    torch.testing.assert_close(out.double().cpu(), ref, atol=2e-5 * scale, rtol=0)


tiled_shapes = st.tuples(
    st.integers(1, 4),  # seqs
    st.sampled_from([(4, 4), (8, 2), (6, 1), (2, 1), (12, 4), (32, 8)]),  # heads
    st.sampled_from([16, 24, 64, 80, 128]),  # head_dim
    st.sampled_from([1, 5, 8, 16, 32, 128]),  # block size: any, not only 2^k
    st.integers(1, 5),  # max blocks per sequence
)


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    tiled_shapes,
    st.sampled_from(list(TOLERANCE)),
    st.integers(0, 2**31 - 1),
    st.booleans(),
    st.sampled_from([None, 1, 2, 5]),  # KV segments
    st.sampled_from([None, (16, 16), (32, 64)]),  # (rows, keys) per program
)
def test_tiled_decode_matches_float64(
    poisoned, shape, dtype, seed, share, segments, tile_sizes
):
    seqs, (heads, kvh), head_dim, bs, mb = shape
    q, k, v, meta = problem(seed, seqs, heads, kvh, head_dim, bs, mb, dtype, share)
    ref = reference_paged_attention(q, k, v, meta)
    out = paged_attention_tiled(*on_device(q, k, v, meta), num_segments=segments,
                                tile_sizes=tile_sizes)  # fmt: skip
    close_to(out, ref, dtype)


@pytest.mark.parametrize("shape, segments", [
    pytest.param(shape, segments, marks=() if segments is None or i == 0 else pytest.mark.gpu_sweep)
    for i, shape in enumerate(PREFILL_SHAPES + [([2, 40, 1], [0, 3, 60], 6, 2, 24, 5)])
    for segments in (None, 3)])  # fmt: skip
def test_tiled_prefill_matches_float64(poisoned, shape, segments):
    """Chunks after cached prefixes, sequences with no new tokens, block size 5."""
    q, k, v, meta = prefill_problem(3, *shape, torch.float32)
    ref = reference_paged_attention(q, k, v, meta)
    out = paged_attention_tiled(*on_device(q, k, v, meta), num_segments=segments)
    assert out.shape == q.shape and out.dtype == q.dtype and out.isfinite().all()
    scale = max([1.0, *ref.abs().flatten().tolist()])
    torch.testing.assert_close(out.double().cpu(), ref, atol=2e-5 * scale, rtol=0)


def test_tiled_kernel_checks_its_arguments():
    q, k, v, meta = on_device(*problem(0, 2, 4, 2, 64, 5, 3))
    with pytest.raises(ValueError, match="head_dim <= 256"):
        big = torch.zeros(1, 5, 2, 320, device=DEVICE)
        paged_attention_tiled(q.new_zeros(2, 4, 320), big, big, meta)
    with pytest.raises(ValueError, match="share one of"):
        paged_attention_tiled(q.half(), k, v, meta)
    with pytest.raises(ValueError, match="query_start_loc"):
        bad = torch.tensor([0, 1], device=DEVICE)
        paged_attention_tiled(q, k, v, AttentionMetadata(meta.block_tables,
                                                         meta.context_lens, bad))  # fmt: skip
    none = AttentionMetadata(meta.block_tables[:0], meta.context_lens[:0],
                             torch.zeros(1, dtype=torch.long, device=DEVICE))  # fmt: skip
    assert paged_attention_tiled(q[:0], k, v, none).shape == (0, 4, 64)


def test_the_tiled_grid_covers_every_query_once():
    """The program numbering the kernel's binary search inverts, in Python."""
    g = torch.Generator().manual_seed(1)
    for block_q in (1, 2, 4, 16):
        for _ in range(20):
            n = int(torch.randint(1, 9, (1,), generator=g))
            q_lens = torch.randint(0, 40, (n,), generator=g).tolist()
            starts = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
            first = [s // block_q + i for i, s in enumerate(starts[:-1])]
            seen = []
            for pid in range(starts[-1] // block_q + n):
                seq = max(i for i, b in enumerate(first) if b <= pid)
                lo = (pid - first[seq]) * block_q
                seen += [(seq, j) for j in range(lo, min(lo + block_q, q_lens[seq]))]
            assert sorted(seen) == [(i, j) for i, m in enumerate(q_lens) for j in range(m)]


def test_prefill_rows_are_decode_problems_with_causal_lengths():
    tables = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    ctx, starts = torch.tensor([4, 9, 6]), torch.tensor([0, 2, 2, 5])
    row_tables, row_lens = prefill_as_decode(tables, ctx, starts, 5)
    # sequence 0: 2 new of 4 tokens; sequence 1: none; sequence 2: 3 new of 6
    assert row_lens.tolist() == [3, 4, 4, 5, 6]
    assert row_tables.tolist() == [tables[i].tolist() for i in (0, 0, 2, 2, 2)]


def test_triton_prefill_of_an_empty_batch_and_its_checks():
    k, v, q = (t.to(DEVICE) for t in (torch.zeros(4, 8, 2, 16), torch.zeros(4, 8, 2, 16),
                                      torch.zeros(0, 4, 16)))  # fmt: skip
    empty, lens = torch.zeros(0, 3, dtype=torch.int32), torch.zeros(0, dtype=torch.long)
    _, _, _, none = on_device(q, k, v, AttentionMetadata(empty, lens, torch.tensor([0])))
    assert paged_attention_triton(q, k, v, none).shape == (0, 4, 16)
    _, _, _, bad = on_device(q, k, v, AttentionMetadata(empty, lens, torch.tensor([0, 1])))
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_attention_triton(q, k, v, bad)


# On a GPU each case compiles kernels of its own: the GPU check's tests step
# leaves the ``gpu_sweep`` cases out (tests/test_gpu.py says why); on a CPU
# every case runs, in the interpreter.
SWEEP = pytest.mark.gpu_sweep


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape, dtype", [
    pytest.param(shape, dtype, marks=() if dtype == torch.bfloat16 or i == 0 else SWEEP)
    for i, shape in enumerate(PREFILL_SHAPES) for dtype in TOLERANCE])  # fmt: skip
def test_triton_prefill_on_cuda_matches_float64(shape, dtype):
    """Compiled for the GPU; the tolerance is the storage type's, relative to the
    largest output, as for decode (fp32 math, the result rounded to ``dtype``)."""
    if dtype == torch.bfloat16 and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("bf16 needs sm_80 or newer")
    q, k, v, meta = prefill_problem(5, *shape, dtype)
    ref = reference_paged_attention(q, k, v, meta)
    args = on_device(q, k, v, meta)
    scale = max([1.0, *ref.abs().flatten().tolist()])
    atol = TOLERANCE[dtype] * scale
    for out in (paged_attention_triton(*args), paged_attention_tiled(*args)):
        assert out.dtype == dtype and out.isfinite().all()
        torch.testing.assert_close(out.double().cpu(), ref, atol=atol, rtol=0)
    # the dispatcher takes the tiled kernel on CUDA
    assert torch.equal(paged_attention(*args), out)


# ---- chapters 04c and 04d's ladders: every rung a variant of the kernels above --

from pagedkv_lab.course.attention_plots import tile_plan  # noqa: E402
from pagedkv_lab.course.ladder import (  # noqa: E402
    DECODE_LADDER,
    PREFILL_LADDER,
    predict_rung,
    rung_settings,
)


@pytest.fixture
def split_everywhere(monkeypatch):
    """Nothing splits by itself in the interpreter: force the first kernel's
    partitions (2 blocks) and the tiled kernel's segments (3), so that every
    rung's merge runs."""
    monkeypatch.setattr(triton_decode, "decode_partitions", lambda *a: 2)
    monkeypatch.setattr(triton_tiled, "tiled_segments", lambda *a: 3)


def rung_cases(ladder, shapes=(None,)):
    """Every rung in fp32 and bf16 (and every shape); on a GPU the check keeps
    the bf16 cases of the first shape (`SWEEP` marks the rest)."""
    return [pytest.param(rung, *([] if shape is None else [shape]), dtype,
                         id=f"{rung.name}-{str(dtype)[6:]}" + ("" if shape is None else f"-{i}"),
                         marks=() if dtype == torch.bfloat16 and i == 0 else SWEEP)
            for rung in ladder for i, shape in enumerate(shapes)
            for dtype in (torch.float32, torch.bfloat16)]  # fmt: skip


@pytest.mark.parametrize("rung, dtype", rung_cases(DECODE_LADDER))
def test_every_decode_rung_matches_float64(poisoned, split_everywhere, rung, dtype):
    """Odd and tiny: a group of 3 (padded to 4 rows), head_dim 24, a shared block."""
    q, k, v, meta = problem(7, 3, 6, 2, 24, 8, 5, dtype, share=True)
    ref = reference_paged_attention(q, k, v, meta)
    close_to(rung(*on_device(q, k, v, meta)), ref, dtype)


# new tokens, cached tokens, heads, kv_heads, head_dim, block size
RUNG_PREFILL_SHAPES = [
    ([5, 1, 19, 0], [11, 0, 30, 4], 6, 2, 24, 8),  # chunks, a decode row, no queries
    ([33, 2], [0, 40], 8, 2, 64, 32),  # a whole prompt; a tile inside one block
]


@pytest.mark.parametrize("rung, shape, dtype", rung_cases(PREFILL_LADDER, RUNG_PREFILL_SHAPES))
def test_every_prefill_rung_matches_float64(poisoned, split_everywhere, rung, shape, dtype):
    """Prefix-cache hits and chunks (new tokens after cached ones), a sequence
    with no new tokens, tiles that span blocks and tiles inside one block."""
    q, k, v, meta = prefill_problem(4, *shape, dtype)
    ref = reference_paged_attention(q, k, v, meta)
    close_to(rung(*on_device(q, k, v, meta)), ref, dtype)


@pytest.mark.parametrize("segments", [1, 3])
def test_masks_and_lookups_change_no_result(poisoned, segments):
    """Masking only the diagonal and looking blocks up once per run compute the
    same numbers as masking every tile and looking up every key."""
    q, k, v, meta = prefill_problem(6, [40, 3, 70], [9, 0, 21], 8, 2, 64, 16, torch.float32)
    args = on_device(q, k, v, meta)
    outs = [
        paged_attention_tiled(*args, num_segments=segments, mask_every_tile=m, block_runs=r)
        for m in (True, False)
        for r in (False, True)
    ]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=1e-6, rtol=0)


def test_block_runs_take_any_block_size_and_tile():
    """Runs inside one block (a tile shorter than a block), one key per block,
    and block sizes that are not powers of two (per-key lookups instead)."""
    for bs, tile_n in [(32, 16), (1, 16), (5, 32), (16, 64)]:
        q, k, v, meta = prefill_problem(8, [12, 30], [7, 0], 4, 2, 16, bs, torch.float32)
        ref = reference_paged_attention(q, k, v, meta)
        out = paged_attention_tiled(*on_device(q, k, v, meta), tile_sizes=(16, tile_n),
                                    block_runs=True)  # fmt: skip
        close_to(out, ref, torch.float32)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 300),  # context length
    st.integers(1, 300),  # queries
    st.sampled_from([1, 4, 16, 32]),  # BLOCK_Q
    st.sampled_from([16, 64, 128]),  # TILE_N
    st.data(),
)
def test_tile_plan_reads_whole_masks_the_diagonal_and_skips_the_rest(
    ctx, q_len, block_q, tile_n, data
):
    """`tile_plan` (the kernel's loop bounds, in Python): every key of a whole tile
    is visible to every row of the Q-block, a skipped tile to none, and the
    masked tiles are only those the diagonal (or the last key) crosses."""
    q_len = min(q_len, ctx)
    first_q = data.draw(st.sampled_from(range(0, q_len, block_q)))
    prefix = ctx - q_len
    first_pos = prefix + first_q
    last_pos = prefix + min(first_q + block_q, q_len) - 1
    whole, masked, skipped = tile_plan(ctx, q_len, first_q, block_q, tile_n)
    assert list(whole) + list(masked) + list(skipped) == list(range(-(-ctx // tile_n)))
    for t in whole:  # seen whole by the block's first row, so by every row
        assert (t + 1) * tile_n - 1 <= first_pos
    for t in skipped:  # past the block's last row
        assert t * tile_n > last_pos
    for t in masked:
        assert t * tile_n <= last_pos and (t + 1) * tile_n - 1 > first_pos or (
            (t + 1) * tile_n > ctx
        )
    every = tile_plan(ctx, q_len, first_q, block_q, tile_n, mask_every_tile=True)
    assert not every[0] and list(every[1]) == list(whole) + list(masked)


def test_unknown_switches_are_an_error():
    q, k, v, meta = on_device(*problem(0, 2, 4, 2, 16, 8, 2))
    with pytest.raises(TypeError, match="unknown switches"):
        paged_attention_tiled(q, k, v, meta, fast=True)


def test_tuned_launch_reads_the_committed_file(monkeypatch, tmp_path):
    import json

    tuned_launch = triton_tiled.tuned_launch
    assert "devices" in json.loads(triton_tiled.TUNED_TILES.read_text())  # shipped, valid
    path = tmp_path / "tuned_tiles.json"
    entry = {"prefill": {"tile_sizes": [128, 64], "num_warps": 8, "num_stages": 3,
                         "source": "a sweep"}}  # fmt: skip
    path.write_text(json.dumps({"devices": {"NVIDIA H100 80GB HBM3": entry}}))
    monkeypatch.setattr(triton_tiled, "TUNED_TILES", path)
    tuned_launch.cache_clear()
    try:
        got = tuned_launch("NVIDIA H100 80GB HBM3", "prefill")
        assert got == {"tile_sizes": (128, 64), "num_warps": 8, "num_stages": 3}
        assert tuned_launch("NVIDIA H100 80GB HBM3", "decode") == {}
        assert tuned_launch("Tesla T4", "prefill") == {}
        path.write_text("not json")
        tuned_launch.cache_clear()
        assert tuned_launch("NVIDIA H100 80GB HBM3", "prefill") == {}
    finally:
        tuned_launch.cache_clear()


#: What one rung may change at once: tl.dot needs its 16 rows.
ONE_CHANGE = [{"dot", "rows"}, {"keys"}, {"split"}, {"fused_merge"}, {"mask_every_tile"},
              {"block_runs"}, {"rows"}, {"num_warps"}, {"num_stages"}, {"fold_scale"},
              {"dot_acc"}, {"program_map"}, {"heads_fastest"}, {"heavy_first"},
              {"dim_masks"}, {"inf_guard"}]  # fmt: skip


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_every_tiled_rung_changes_one_setting(kind):
    """Each rung changes one setting of the one below (`rung_settings`, what the
    model reads); the last prefill entry is the library's own launch (a
    committed winner, or the defaults), not a rung."""
    ladder = DECODE_LADDER if kind == "decode" else PREFILL_LADDER
    assert len(ladder) >= 6 and ladder[-1].options == {}  # the top: the default
    assert [r.kernel for r in ladder[:2]] == ["torch", "first"]
    rungs = [r for r in ladder if r.kernel == "tiled" and not r.tuned]
    assert [r for r in ladder if r.tuned] == ([] if kind == "decode" else ladder[-1:])
    for below, rung in zip(rungs, rungs[1:]):
        a, b = rung_settings(below, kind), rung_settings(rung, kind)
        changed = {key for key in a if a[key] != b[key]}
        assert changed and any(changed <= group for group in ONE_CHANGE), (rung.name, changed)


#: A committed winner for the card (issue 52), with tiles and stages no rung
#: uses, and most levers on: a rung that read it would launch with it, whatever
#: its own change.
WINNER = {"tile_sizes": (32, 32), "num_warps": 8, "num_stages": 4,
          "switches": dict(fold_scale=True, dot_acc=True, program_map=True,
                           heads_fastest=True, dim_masks=False, inf_guard=False,
                           mask_every_tile=False, block_runs=True)}  # fmt: skip
#: Each setting of `ONE_CHANGE` in the launch's own terms: the kernel's constants
#: (as `_tiled_plan` produces them), Triton's options, the merge that ran and the
#: program map the kernel reads.
LAUNCHED = {"dot": {"DOT"}, "rows": {"BLOCK_Q"}, "keys": {"TILE_N"},
            "split": {"NUM_SEGMENTS"}, "fused_merge": {"merge"},
            "mask_every_tile": {"MASK_EVERY_TILE"}, "block_runs": {"RUN"},
            "num_warps": {"num_warps"}, "num_stages": {"num_stages"},
            "fold_scale": {"FOLD"}, "dot_acc": {"DOT_ACC"},
            "program_map": {"PROGRAM_MAP", "map"}, "heads_fastest": {"HEADS_FASTEST"},
            "heavy_first": {"map"}, "dim_masks": {"DIM_MASK"},
            "inf_guard": {"INF_GUARD"}}  # fmt: skip


def _launches(monkeypatch, ladder, q, k, v, meta):
    """Each tiled entry of ``ladder`` run once, its kernels recorded instead of
    launched: the constants and Triton's options of the attention kernel, the
    program map it was given, and which merge ran."""
    seen = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append((self.name, args, kwargs))

            return launch

    monkeypatch.setattr(triton_tiled, "_tiled_attention_kernel", Recorder("tiled"))
    monkeypatch.setattr(triton_tiled, "_merge_segments_kernel", Recorder("merge"))
    out = []
    for rung in ladder:
        if rung.kernel != "tiled":
            continue
        seen.clear()
        rung(q, k, v, AttentionMetadata(meta.block_tables, meta.context_lens,
                                        meta.query_start_loc))  # fmt: skip
        (_, args, got), *merges = seen
        got = dict(got, merge="fused" if merges else "torch", map=repr(args[6].tolist()))
        out.append((rung, got))
    return out


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_every_rung_launches_one_change_even_with_a_committed_tuning(
    monkeypatch, split_everywhere, kind
):
    """Issue 52: with a committed winner for the card, every rung still launches
    with constants (as `_tiled_plan` produces them, tuning included) that differ
    from the rung below's in one setting; only the library's own entry takes
    the winner."""
    monkeypatch.setattr(triton_tiled, "tuned_launch", lambda name, k: WINNER)
    if kind == "decode":  # 8 blocks: 4 partitions of 2, against 3 forced segments
        ladder, (q, k, v, meta) = DECODE_LADDER, problem(2, 3, 8, 2, 128, 16, 8)
    else:
        ladder = PREFILL_LADDER
        q, k, v, meta = prefill_problem(2, [40, 9], [3, 30], 8, 2, 128, 16, torch.float32)
    launches = _launches(monkeypatch, ladder, q, k, v, meta)
    allowed = [set().union(*(LAUNCHED[s] for s in group)) for group in ONE_CHANGE]
    rungs = [(r, got) for r, got in launches if not r.tuned]
    for (_, a), (rung, b) in zip(rungs, rungs[1:]):
        changed = {key for key in a | b if a.get(key) != b.get(key)}
        assert changed and any(changed <= group for group in allowed), (rung.name, changed)
    for rung, got in launches:  # the winner reaches the library's launch alone
        assert (got.get("num_stages") == 4 and got["TILE_N"] == 32) == rung.tuned


@pytest.mark.parametrize("heavy", [False, True])
def test_the_program_map_numbers_programs_as_the_binary_search(heavy):
    """`tiled_program_map` gives every program the (sequence, first query) the
    kernel's binary search finds (`query_blocks` of chapter 04c, in Python);
    heavy_first reorders them, the heaviest Q-block first."""
    q_lens, cached, block_q = [1, 1, 37, 0, 300, 5, 1, 180], [9, 0, 3, 4, 0, 20, 7, 0], 16
    starts = torch.tensor([0, *q_lens]).cumsum(0)
    ctx = torch.tensor(q_lens) + torch.tensor(cached)
    got = triton_tiled.tiled_program_map(starts, ctx, int(starts[-1]), block_q, heavy)
    got = got.tolist()
    first_block = [int(s) // block_q + i for i, s in enumerate(starts[:-1])]
    want = []
    for pid in range(int(starts[-1]) // block_q + len(q_lens)):
        seq = max(i for i, b in enumerate(first_block) if b <= pid)
        want.append([seq, (pid - first_block[seq]) * block_q])
    assert sorted(got) == sorted(want) and (got == want) != heavy
    if heavy:
        reads = [cached[s] + f + block_q if f < q_lens[s] else -1 for s, f in got]
        assert reads == sorted(reads, reverse=True)


@pytest.mark.parametrize("segments, dtype", [(1, torch.float32), (1, torch.bfloat16),
                                             (3, torch.float32)])  # fmt: skip
def test_the_prefill_levers_change_no_result(poisoned, segments, dtype):
    """Each lever of the prefill climb alone, on a padded head (40) and an
    unpadded one (64), chunks after cached prefixes and a sequence with no
    queries: the float64 reference within the dtype's rounding. Split into
    segments (3), one head size only: in the interpreter each head size costs
    about fifteen seconds there (on a GPU the same cases run compiled)."""
    levers = [dict(fold_scale=True), dict(dot_acc=True), dict(program_map=True),
              dict(program_map=True, heads_fastest=True),
              dict(program_map=True, heavy_first=True), dict(dim_masks=False),
              dict(inf_guard=False)]  # fmt: skip
    for head_dim in (40, 64) if segments == 1 else (64,):
        q, k, v, meta = prefill_problem(9, [21, 1, 0, 70], [5, 16, 3, 0], 8, 2,
                                        head_dim, 16, dtype)  # fmt: skip
        ref = reference_paged_attention(q, k, v, meta)
        args = on_device(q, k, v, meta)
        for lever in levers:
            out = paged_attention_tiled(*args, num_segments=segments,
                                        tile_sizes=(32, 16), **lever)  # fmt: skip
            close_to(out, ref, dtype)


def test_heavy_first_needs_the_program_map():
    q, k, v, meta = prefill_problem(1, [4], [0], 4, 2, 16, 8, torch.float32)
    with pytest.raises(ValueError, match="program_map"):
        paged_attention_tiled(*on_device(q, k, v, meta), heavy_first=True)


def test_the_model_predicts_every_rung_at_every_ladder_shape():
    """`predict_rung` gives a positive time for every rung and shape, and moves
    where the chapter says it must: 128 rows on 4 warps spill registers."""
    from pagedkv_lab.bench.kernel import LADDER_DECODE_SHAPES, LADDER_PREFILL_SHAPES

    for kind, ladder, shapes in (("decode", DECODE_LADDER, LADDER_DECODE_SHAPES),
                                 ("prefill", PREFILL_LADDER, LADDER_PREFILL_SHAPES)):  # fmt: skip
        for rung in ladder:
            for shape in shapes:
                assert predict_rung(rung, kind, shape)["ms"] > 0
    spill = predict_rung(PREFILL_LADDER[5], "prefill", (4, 1024))
    assert spill["registers"] > 255
    assert predict_rung(PREFILL_LADDER[6], "prefill", (4, 1024))["ms"] < spill["ms"]


def test_the_ladder_smoke_run_covers_every_rung(tmp_path):
    """``kernel_ladder.py --smoke --sections ladder``: every rung of both ladders
    runs (in the interpreter on a CPU) and kernel_ladder.json holds each row
    with its prediction beside its measurement."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "kernel_ladder.py"
    spec = importlib.util.spec_from_file_location("kernel_ladder", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--smoke", "--sections", "ladder", "--out", str(tmp_path)]) == 0
    found = json.loads((tmp_path / "kernel_ladder.json").read_text())
    for kind, ladder in (("decode", DECODE_LADDER), ("prefill", PREFILL_LADDER)):
        rows = [r for r in found["rows"] if r["kind"] == kind]
        assert sorted({r["rung"] for r in rows}) == list(range(len(ladder)))
        assert all("ms" in r and r["predicted_ms"] > 0 and "resources" in r for r in rows)


def test_the_old_module_path_names_the_new_one():
    with pytest.raises(ModuleNotFoundError, match="pagedkv_lab.kernels"):
        import pagedkv_lab.attention  # noqa: F401
