"""What every served system shares: the trace, the setup (weights, requests,
KV budget, limits) and the shape of a run's result."""

from __future__ import annotations

import torch

# ----------------------------------------------------------------------------------------------------------
# Serving: our engine against transformers (and vLLM where it is installed), like for like: the same
# model weights, requests, warm-up, KV budget, per-step token budget and batch limit for every system.

SYSTEMS = ("pagedkv", "contiguous", "hf-generate", "hf-continuous")
#: Every system `serve_benchmark` knows. ``"vllm"`` needs a python with vLLM (see `find_vllm_python`).
ALL_SYSTEMS = SYSTEMS + ("vllm",)

#: What the "peak KV" column measures, the same way for every system.
PEAK_KV = (
    "peak KV = the most KV-cache bytes held by unfinished requests at the end of a step, "
    "read from each system's own cache: blocks held x bytes per block (pagedkv, contiguous, "
    "hf-continuous, vllm), the cache tensors of the largest static batch (hf-generate)"
)


def peak_kv_note(systems: list[str] | tuple[str, ...] = ALL_SYSTEMS) -> str:
    """`PEAK_KV`, naming only ``systems`` (the rows a table printed)."""
    blocks = [s for s in ("pagedkv", "contiguous", "hf-continuous", "vllm") if s in systems]
    parts = []
    if blocks:
        parts.append(f"blocks held x bytes per block ({', '.join(blocks)})")
    if "hf-generate" in systems:
        parts.append("the cache tensors of the largest static batch (hf-generate)")
    return (
        "peak KV = the most KV-cache bytes held by unfinished requests at the end of a "
        "step, read from each system's own cache: " + ", ".join(parts)
    )


def cpu_model() -> str:
    """The CPU's model name and widest vector extension, e.g. ``"AMD EPYC, AVX2
    (no AVX-512)"``: CPU ratios differ between CPU models, so reports name it."""
    import platform
    from pathlib import Path

    name, flags = platform.processor() or "unknown CPU", set()
    info = Path("/proc/cpuinfo")
    if info.exists():
        for line in info.read_text().splitlines():
            key, _, value = line.partition(":")
            generic = name in ("unknown CPU", platform.machine())
            if key.strip() == "model name" and generic:
                name = value.strip()
            elif key.strip() in ("flags", "Features") and not flags:
                flags = set(value.split())
    if "avx512f" in flags:
        isa = "AVX-512"
    elif "avx2" in flags:
        isa = "AVX2 (no AVX-512)"
    else:
        isa = "no AVX2" if flags else "vector extensions unknown"
    return f"{name}, {isa}"


def scaled_chat_trace(num_requests: int, max_model_len: int, seed: int = 0) -> list:
    """W1 with lengths scaled to ``max_model_len`` (means 161 and 338 at 2048, proportionally less below)."""
    from pagedkv_lab.sim.workloads import (
        SHAREGPT_MEAN_OUTPUT,
        SHAREGPT_MEAN_PROMPT,
        chat_workload,
    )

    f = max_model_len / 2048
    return chat_workload(
        num_requests,
        seed=seed,
        max_model_len=max_model_len,
        mean_prompt=SHAREGPT_MEAN_PROMPT * f,
        mean_output=SHAREGPT_MEAN_OUTPUT * f,
    )


def _prompt_ids(requests, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        [1] + torch.randint(3, 259, (r.prompt_len - 1,), generator=g).tolist()
        for r in requests
    ]


def static_batches(
    prompt_lens: list[int],
    output_lens: list[int],
    budget_tokens: int,
    max_batch: int,
    policy: str = "padded",
    max_model_len: int | None = None,
) -> list[range]:
    """Split requests, in trace order, into the static batches ``generate`` runs within a KV budget.

    ``"padded"`` (the default): each batch is the longest run of the next requests
    whose cache fits ``budget_tokens``, counted as ``generate`` allocates it: every
    row is left-padded to the batch's longest prompt and decoded until its longest
    output is done, so n requests hold ``n * (longest prompt + longest output - 1)``
    tokens. This is static batching at its best: it knows every output length in
    advance (EOS is ignored), which a real server does not.

    ``"max-len"``: ``budget_tokens // max_model_len`` requests per batch, what a
    server that reserves ``max_model_len`` tokens per request can run (chapter 02);
    our engine's ``contiguous`` row measures that scheme with continuous batching.

    Both are capped at ``max_batch`` (the ``max_num_seqs`` the other systems get).
    """
    n = len(prompt_lens)
    if policy == "max-len":
        if not max_model_len:
            raise ValueError("policy 'max-len' needs max_model_len")
        size = max(1, min(max_batch, budget_tokens // max_model_len))
        return [range(i, min(i + size, n)) for i in range(0, n, size)]
    if policy != "padded":
        raise ValueError(
            f"unknown static batching policy {policy!r}; use 'padded' or 'max-len'"
        )
    batches, start = [], 0
    while start < n:
        end, width, longest = start, 0, 0
        while end < n and end - start < max_batch:
            w, o = max(width, prompt_lens[end]), max(longest, output_lens[end])
            if end > start and (end - start + 1) * (w + o - 1) > budget_tokens:
                break
            end, width, longest = end + 1, w, o
        batches.append(range(start, end))
        start = end
    return batches


class ServeSetup:
    """What every system of `serve_benchmark` gets: one model, one KV budget, one set of limits."""

    def __init__(
        self,
        model_name: str,
        device: torch.device,
        *,
        max_model_len: int,
        budget_tokens: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        threads: int,
        static_policy: str = "padded",
        prefix_caching: bool = False,
        dtype: torch.dtype | None = None,
    ):
        self.model_name, self.device = model_name, device
        self.max_model_len, self.block_size = max_model_len, block_size
        self.max_num_seqs, self.max_num_batched_tokens = (
            max_num_seqs,
            max_num_batched_tokens,
        )
        self.threads, self.static_policy = threads, static_policy
        self.prefix_caching = prefix_caching
        self.spec = _kv_spec(model_name, device, dtype)
        #: what every system loads the weights in: ``dtype``, or None: as `load_model`
        #: loads them on ``device`` (offline models in fp32, real shapes in the
        #: library's dtype); a 16-bit dtype on a CPU runs a GPU's number format there
        self.dtype = dtype
        self.budget_tokens = budget_tokens
        self.budget_bytes = self.spec.bytes_for(budget_tokens)


def _run_result(seconds, tokens, ttft, tpot, peak_kv_bytes, **extra) -> dict:
    return {
        "seconds": seconds,
        "tokens": tokens,
        "ttft": ttft,
        "tpot": tpot,
        "peak_kv_bytes": peak_kv_bytes,
        **extra,
    }



def _kv_spec(
    model_name: str, device: torch.device | None = None, dtype: torch.dtype | None = None
):
    """KV bytes per token of the model as `load_model` will load it on ``device``
    in ``dtype`` (by default: offline models in fp32; real shapes in the
    library's dtype for the device: bf16 on sm_80+, fp16 on older GPUs, fp32 on
    a CPU)."""
    from transformers import AutoConfig

    from pagedkv_lab.device import default_dtype
    from pagedkv_lab.kvmath import KVSpec
    from pagedkv_lab.models import OFFLINE_MODELS, offline_config, real_model_shapes

    if model_name in OFFLINE_MODELS:
        return KVSpec.from_config(offline_config(model_name), dtype or torch.float32)
    shapes = real_model_shapes()
    if model_name in shapes:
        if dtype is None:
            dtype = default_dtype(device) if device is not None else torch.float32
        return KVSpec.from_config(shapes[model_name], dtype)
    config = AutoConfig.from_pretrained(model_name)
    if dtype is None:
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype or torch.float32
    return KVSpec.from_config(config, dtype)
