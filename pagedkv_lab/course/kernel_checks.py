"""What the kernel chapters (04a-04d) check their kernels with: random paged
problems (caches whose blocks lie shuffled in the pool, lengths that end
mid-block, the `AttentionMetadata` that reads them), each storage type's
tolerance, output buffers poisoned with NaN, and whether Triton runs here."""

from __future__ import annotations

import contextlib
import textwrap
from unittest import mock

import torch

from pagedkv_lab.kernels import triton_decode, triton_tiled
from pagedkv_lab.kernels.metadata import AttentionMetadata

#: The largest error a kernel may make against the float64 reference, relative
#: to the largest output: the math is fp32, the result rounded to the storage
#: type (about two units in its last place).
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def random_paged_problem(
    seqs: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    max_blocks: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    shared_first_block: bool = False,
    pad_tables: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Generator]:
    """``(k_cache, v_cache, meta, gen)`` for a decode of ``seqs`` sequences of 1
    to ``max_blocks * block_size`` tokens; draw the queries from ``gen``.

    ``shared_first_block``: every sequence's first block is one physical block
    (as a prefix cache shares it). ``pad_tables``: -1 in each table past the
    sequence's last block, as the engine pads them."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = seqs * max_blocks + 3
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[: seqs * max_blocks]
    tables = tables.reshape(seqs, max_blocks).int()
    if shared_first_block:
        tables[:, 0] = tables[0, 0]
    lens = torch.randint(1, max_blocks * block_size + 1, (seqs,), generator=g)
    if pad_tables:
        used = (lens + block_size - 1) // block_size
        tables[torch.arange(max_blocks) >= used[:, None]] = -1
    return k_cache, v_cache, AttentionMetadata(tables, lens), g


def packed_problem(
    seed: int,
    context_lens: list[int],
    new_tokens: list[int] | None,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """``(q, k_cache, v_cache, meta)`` for sequences of exactly ``context_lens``
    tokens, their blocks shuffled in the pool and each table padded with -1 past
    its last block; ``new_tokens[i]`` packed queries each (causal prefill after
    the rest, cached), or with ``new_tokens`` None one query each (decode)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-int(n) // block_size) for n in context_lens]
    num_blocks = sum(need) + 3
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(context_lens), max(need, default=0) + 1), -1, dtype=torch.int32)
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
    starts = None if new_tokens is None else torch.tensor([0, *new_tokens]).cumsum(0)
    rows = len(context_lens) if new_tokens is None else sum(new_tokens)
    q = torch.randn(rows, heads, head_dim, generator=g).to(dtype)
    meta = AttentionMetadata(tables, torch.tensor(context_lens), starts)
    return q, k_cache, v_cache, meta


def with_queries(meta: AttentionMetadata, new_tokens) -> AttentionMetadata:
    """The prefill metadata of ``meta``'s sequences with ``new_tokens[i]`` new
    queries each (at most its context length: the rest is cached), packed in
    sequence order."""
    q_lens = torch.minimum(torch.as_tensor(new_tokens), meta.context_lens)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)])
    return AttentionMetadata(meta.block_tables, meta.context_lens, starts)


def on(device: torch.device, meta: AttentionMetadata) -> AttentionMetadata:
    """``meta`` with its tensors on ``device`` (a fresh workspace)."""
    starts = meta.query_start_loc
    return AttentionMetadata(
        meta.block_tables.to(device), meta.context_lens.to(device),
        None if starts is None else starts.to(device),
    )  # fmt: skip


def error_bound(expected: torch.Tensor, dtype: torch.dtype) -> float:
    """`TOLERANCE` of ``dtype``, relative to the largest expected output."""
    return TOLERANCE[dtype] * max(1.0, expected.abs().max().item())


def _nan_buffer(shape, dtype, device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


@contextlib.contextmanager
def poisoned_buffers():
    """Inside the block the Triton kernels' output buffers start as NaN, so an
    element a kernel forgets to write fails any comparison."""
    with (
        mock.patch.object(triton_decode, "_new_buffer", _nan_buffer),
        mock.patch.object(triton_tiled, "_new_buffer", _nan_buffer),
    ):
        yield


def needs_triton(what: str) -> bool:
    """True when Triton can run here; else print that ``what`` is skipped, and why."""
    if triton_decode.triton is not None:
        return True
    why = (
        f"{what}: skipped, because Triton is not installed here. Its wheels are "
        "published for Linux only, so on macOS and Windows the Triton cells of this "
        "chapter do nothing; the PyTorch and C++ paths run everywhere."
    )
    print(textwrap.fill(why, 88))
    return False
