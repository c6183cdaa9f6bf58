"""TEMPORARY shim until the kernels package lands (kernels-split branch)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedkv_lab.attention import paged_decode, paged_prefill  # noqa: F401


@dataclass
class AttentionMetadata:
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor | None = None
    workspace: dict = field(default_factory=dict)


def paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale=None, check=True):
    if meta.query_start_loc is None:
        return paged_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                            scale, meta.workspace, check)
    return paged_prefill(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                         meta.query_start_loc, scale, check)


def attention_backend(device, dtype, head_dim: int):
    """The attention entry point for a step's layers on ``device`` (shim: the dispatch)."""
    return paged_attention
