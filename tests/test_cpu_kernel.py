"""The C++ CPU kernel: built once per session, checked against the float64
reference on awkward shapes, and replaced by the PyTorch path when it cannot be
built. Timings are not asserted: `python -m pagedkv_lab.bench kernel` prints them.
"""

import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv_lab.bench import kernel_benchmark, print_kernel_table, time_calls
from pagedkv_lab.course.kernel_checks import TOLERANCE, random_paged_problem
from pagedkv_lab.kernels import AttentionMetadata, cpu, paged_attention
from pagedkv_lab.kernels.cpu import paged_attention_cpu
from pagedkv_lab.kernels.reference import (
    paged_attention_torch,
    reference_paged_attention,
)

HAS_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None


@pytest.fixture(scope="session")
def kernel():
    """The kernel, built (or found in the cache) once per test session."""
    fn = cpu.load_cpu_kernel()
    if fn is None and HAS_COMPILER:
        pytest.fail("a C++ compiler is installed but the kernel did not build")
    if fn is None:
        pytest.skip("no C++ compiler on this machine")
    return fn


def make_problem(seed, seqs, kv_heads, group, head_dim, block_size, max_blocks, dtype):
    """Shuffled blocks, lengths ending mid-block, -1 past each table's last block:
    ``(k, v, meta, generator)``, ``meta`` a decode's (``group``: the caller's)."""
    return random_paged_problem(seqs, kv_heads, head_dim, block_size, max_blocks, dtype,
                                seed, pad_tables=True)  # fmt: skip


def prefill(meta, starts):
    return AttentionMetadata(meta.block_tables, meta.context_lens, starts)


shapes = st.tuples(
    st.integers(1, 5),  # sequences
    st.integers(1, 3),  # KV heads
    st.integers(1, 8),  # GQA group
    st.sampled_from([16, 32, 64, 80, 128, 256]),  # head_dim
    st.sampled_from([1, 2, 3, 5, 8, 16, 17, 32, 64]),  # block size
    st.integers(1, 6),  # max blocks per sequence
)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    shapes,
    st.sampled_from(list(TOLERANCE)),
    st.integers(1, 4),  # partitions (split-KV)
    st.booleans(),  # q as the engine passes it: a transposed view
    st.integers(0, 2**31 - 1),
)
def test_decode_matches_float64(kernel, monkeypatch, shape, dtype, parts, view, seed):
    seqs, kvh, group, hd, bs, mb = shape
    k, v, meta, g = make_problem(seed, seqs, kvh, group, hd, bs, mb, dtype)
    q = torch.randn(seqs, kvh * group, hd, generator=g).to(dtype)
    if view:  # [heads, seqs, hd] storage, seen as [seqs, heads, hd]
        q = q.transpose(0, 1).contiguous().transpose(0, 1)
    monkeypatch.setattr(cpu, "cpu_decode_partitions", lambda *a: parts)
    ref = reference_paged_attention(q, k, v, meta)
    out = paged_attention_cpu(q, k, v, meta)
    assert out is not None and out.dtype == dtype and out.shape == q.shape
    assert (out.double() - ref).abs().max() <= TOLERANCE[dtype] * max(
        1.0, ref.abs().max().item()
    )


@settings(max_examples=25, deadline=None)
@given(shapes, st.sampled_from(list(TOLERANCE)), st.integers(0, 2**31 - 1))
def test_prefill_matches_float64(kernel, shape, dtype, seed):
    seqs, kvh, group, hd, bs, mb = shape
    k, v, meta, g = make_problem(seed, seqs, kvh, group, hd, bs, mb, dtype)
    # 0 to 12 new queries per sequence (all of a short one); the rest is cached
    new = torch.minimum(torch.randint(0, 13, (seqs,), generator=g), meta.context_lens)
    meta = prefill(meta, torch.cat([torch.zeros(1, dtype=torch.long), new.cumsum(0)]))
    q = torch.randn(int(new.sum()), kvh * group, hd, generator=g).to(dtype)
    ref = reference_paged_attention(q, k, v, meta)
    out = paged_attention(q, k, v, meta)
    assert out.dtype == dtype and out.shape == q.shape
    if q.shape[0]:
        assert (out.double() - ref).abs().max() <= TOLERANCE[dtype] * max(
            1.0, ref.abs().max().item()
        )


def test_decode_and_prefill_agree_with_the_pytorch_path(kernel):
    k, v, meta, g = make_problem(0, 6, 2, 4, 64, 16, 20, torch.float32)
    q = torch.randn(6, 8, 64, generator=g)
    torch.testing.assert_close(
        paged_attention(q, k, v, meta),
        paged_attention_torch(q, k, v, meta),
        atol=2e-6,
        rtol=0,
    )
    lens = meta.context_lens
    starts = torch.tensor([0, 1, 9, 9, 30, 31, 40]).clamp(max=int(lens.sum()))
    new = (starts[1:] - starts[:-1]).clamp(max=lens)
    pm = prefill(meta, torch.cat([torch.zeros(1, dtype=torch.long), new.cumsum(0)]))
    qp = torch.randn(int(new.sum()), 8, 64, generator=g)
    torch.testing.assert_close(
        paged_attention(qp, k, v, pm),
        paged_attention_torch(qp, k, v, pm),
        atol=2e-6,
        rtol=0,
    )


def test_what_the_kernel_cannot_take_falls_back_to_pytorch(kernel):
    k, v, meta, g = make_problem(1, 3, 2, 2, 20, 8, 4, torch.float32)
    q = torch.randn(3, 4, 20, generator=g)  # head_dim 20: not a multiple of 16
    assert paged_attention_cpu(q, k, v, meta) is None
    ref = reference_paged_attention(q, k, v, meta)
    assert (paged_attention(q, k, v, meta).double() - ref).abs().max() < 2e-5


def test_the_build_is_cached(kernel):
    path = cpu.build_cpu_kernel()
    mtime = path.stat().st_mtime_ns
    assert cpu.build_cpu_kernel() == path and path.stat().st_mtime_ns == mtime
    assert path.parent.name == "pagedkv_lab" and path.suffix == ".so"


def test_a_failed_build_warns_once_and_uses_pytorch(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    cpu.load_cpu_kernel.cache_clear()
    try:
        k, v, meta, g = make_problem(2, 2, 2, 2, 64, 16, 3, torch.float32)
        q = torch.randn(2, 4, 64, generator=g)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first = paged_attention(q, k, v, meta)
            second = paged_attention(q, k, v, meta)
        messages = [str(w.message) for w in caught if w.category is RuntimeWarning]
        assert len(messages) == 1 and "PyTorch path" in messages[0]
        expected = paged_attention_torch(q, k, v, meta)
        assert torch.equal(first, expected) and torch.equal(second, expected)
    finally:
        cpu.load_cpu_kernel.cache_clear()


def test_importing_the_package_builds_nothing(tmp_path):
    env = dict(os.environ, CXX="false", TORCH_EXTENSIONS_DIR=str(tmp_path))
    code = "import pagedkv_lab.kernels, pagedkv_lab.bench"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()
    assert not any(tmp_path.iterdir())


def test_time_calls_alternates_the_functions():
    order = []
    calls = {name: (lambda n=name: order.append(n)) for name in "abc"}
    times = time_calls(calls, torch.device("cpu"), repeats=3, warmup=1)
    assert set(times) == set("abc") and all(t >= 0 for t in times.values())
    # a warm-up call each, then rounds that call each function once, the order
    # reversed every other round, so that none is always first
    assert order == list("abc") + list("abc") + list("cba") + list("abc")


def test_kernel_benchmark_times_what_the_engine_runs(kernel, capsys):
    rows = kernel_benchmark(torch.device("cpu"), (1, 3), (40, 130), repeats=2)
    assert len(rows) == 4 and {r["path"] for r in rows} == {"C++ kernel"}
    assert all(r["max_error"] < 1e-4 and r["torch_max_error"] < 1e-4 for r in rows)
    print_kernel_table(rows)
    out = capsys.readouterr().out
    assert "C++ kernel" in out and max(len(line) for line in out.splitlines()) <= 88


@given(st.integers(1, 64), st.integers(0, 8192), st.integers(1, 16))
def test_decode_partitions_only_when_sequences_are_few(seqs, max_tokens, threads):
    parts = cpu.cpu_decode_partitions(seqs, max_tokens, threads)
    assert parts >= 1
    if seqs >= 2 * threads or max_tokens < 512:
        assert parts == 1  # enough items already, or too short to split
    else:  # each partition keeps at least 256 tokens
        assert max_tokens // parts >= 256
        assert seqs * parts >= min(2 * threads, seqs * (max_tokens // 256))
