"""Paged attention over a block pool (chapters 04a-04c), and the kernels of
chapter 05b's layer ops.

    from pagedkv_lab.kernels import AttentionMetadata, paged_attention
    out = paged_attention(q, k_cache, v_cache, AttentionMetadata(tables, lens))

Modules: `metadata` (`AttentionMetadata` and its checks), `reference` (the
PyTorch paths and the float64 reference), `triton_decode` (the first Triton
kernel), `triton_tiled` (the tiled Triton kernel, its launch plan and merge),
`cpu` (the C++ library, built on first use: the attention kernel of chapter
04b, and chapter 05b's layer ops, `CpuLayerOps`, and projections,
`cpu_linear`), `dispatch` (`paged_attention`, the best path for the device,
chosen at every call; `attention_backend`, the path chosen once, which the
engine's runner calls, chapter 05a) and `triton_layers` (`TritonLayerOps`,
chapter 05b). Every attention path takes ``(q, k_cache, v_cache, meta,
scale)``.

**Triton's mode** is chosen here, once, before any of these modules defines a
``@triton.jit`` kernel (Triton reads ``TRITON_INTERPRET`` when a kernel is
defined): `use_interpreter_without_cuda` runs on import of this package. A
chapter's `course.notebook.setup()` has chosen already (it follows the device
the chapter picked), and an environment that sets ``TRITON_INTERPRET`` itself
keeps its choice: ``TRITON_INTERPRET=0`` keeps the kernels compilable on a
machine without a GPU (``triton.compile`` with a ``GPUTarget``).
"""

from __future__ import annotations

import os

import torch


def use_interpreter_without_cuda() -> bool:
    """Without CUDA, Triton kernels can only run in Triton's interpreter: set
    ``TRITON_INTERPRET=1`` unless the environment already says; return whether
    kernels defined from now on are interpreted."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return os.environ.get("TRITON_INTERPRET") == "1"


use_interpreter_without_cuda()  # before the modules below define their kernels

from pagedkv_lab.kernels.dispatch import paged_attention  # noqa: E402
from pagedkv_lab.kernels.metadata import AttentionMetadata  # noqa: E402

__all__ = ["AttentionMetadata", "paged_attention", "use_interpreter_without_cuda"]
