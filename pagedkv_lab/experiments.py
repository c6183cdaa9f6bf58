"""The measurements chapters 07-11 show, as functions, so that chapter 11's
claims audit re-runs exactly what the chapters ran.

Each function serves real requests through the engine (offline models, any
device) and returns plain numbers; none prints or plots.
"""

from __future__ import annotations

import time

import torch

from .engine import SamplingParams, make_generator
from .groups import BeamSearchParams
from .llm import LLM


def prompts_for(lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Random byte-token prompts of the given lengths (BOS first)."""
    g = torch.Generator().manual_seed(seed)
    return [
        [1] + torch.randint(3, 259, (n - 1,), generator=g).tolist() for n in lengths
    ]


# Chapter 07: sharing ---------------------------------------------------------------


def sharing_saving(
    prompts: list[list[int]],
    output_lens: list[int],
    *,
    n: int = 1,
    beam_width: int | None = None,
    block_size: int = 16,
    model: str = "tiny-llama",
    device: str | None = None,
) -> dict:
    """Serve ``prompts`` with ``n`` samples each (or beam search of
    ``beam_width``) in a pool large enough for no preemption; return the memory
    saved by sharing, the vLLM paper's Figure 15 measure: blocks saved over
    blocks without sharing, summed over every step of the run."""
    total = sum(len(p) + o for p, o in zip(prompts, output_lens))
    width = beam_width or n
    llm = LLM(
        model,
        block_size=block_size,
        kv_cache_memory=_bytes_for_tokens(model, 2 * width * total + 64 * block_size),
        device=device,
    )
    llm.eos_token_ids = frozenset()
    if beam_width:
        for p, o in zip(prompts, output_lens):
            llm.beam_search([p], BeamSearchParams(beam_width, o, ignore_eos=True))
    else:
        params = [
            SamplingParams(n=n, temperature=1.0, seed=i, max_tokens=o, ignore_eos=True)
            for i, o in enumerate(output_lens)
        ]
        llm.generate(prompts, params, use_tqdm=False)
    s = llm.stats
    return {
        "saving": s.sharing_saving,
        "copies": s.block_copies,
        "mean_blocks": s.blocks_held_sum / s.steps,
        "mean_blocks_unshared": s.blocks_unshared_sum / s.steps,
    }


def _bytes_for_tokens(model: str, tokens: int) -> int:
    from .kvmath import KVSpec
    from .models import offline_config

    return KVSpec.from_config(offline_config(model), torch.float32).bytes_for(tokens)


SHARING_DESIGNS = ("no sharing", "eager tail copy", "lazy copy-on-write")


def sharing_designs(
    prompts: list[list[int]],
    output_lens: list[int],
    n: int,
    kv_tokens: int,
    *,
    block_size: int = 16,
    model: str = "tiny-llama",
    device: str | None = None,
) -> list[dict]:
    """Serve ``n`` samples of each prompt three ways in one engine, under a KV
    budget of ``kv_tokens`` tokens:

    * no sharing: ``n`` independent requests per prompt (seeded so that they
      draw exactly the samples of the shared run);
    * eager tail copy: one request, forked after the prompt, the partial last
      block copied at the fork (transformers' continuous batching);
    * lazy copy-on-write: the same, the block copied only when a sample first
      writes into it (vLLM v0, this course).

    Returns one dict per design: mean and peak blocks held, block copies,
    tokens computed, steps, preemptions, seconds, and the generated tokens.
    """
    rows = []
    for design in SHARING_DESIGNS:
        llm = LLM(
            model,
            block_size=block_size,
            kv_cache_memory=_bytes_for_tokens(model, kv_tokens),
            max_model_len=min(kv_tokens, 2048),
            device=device,
        )
        llm.eos_token_ids = frozenset()
        llm.block_manager.eager_fork_copy = design == "eager tail copy"
        t0 = time.perf_counter()
        if design == "no sharing":
            seeds = [
                make_generator(i, j).initial_seed()
                for i in range(len(prompts))
                for j in range(n)
            ]
            params = [
                SamplingParams(
                    temperature=1.0, seed=seed, max_tokens=o, ignore_eos=True
                )
                for seed, o in zip(seeds, [o for o in output_lens for _ in range(n)])
            ]
            outs = llm.generate(
                [p for p in prompts for _ in range(n)], params, use_tqdm=False
            )
            tokens = [o.token_ids for o in outs]
        else:
            params = [
                SamplingParams(
                    n=n, temperature=1.0, seed=i, max_tokens=o, ignore_eos=True
                )
                for i, o in enumerate(output_lens)
            ]
            outs = llm.generate(prompts, params, use_tqdm=False)
            tokens = [c.token_ids for o in outs for c in o.outputs]
        seconds = time.perf_counter() - t0
        s = llm.stats
        rows.append(
            {
                "design": design,
                "mean_blocks": s.blocks_held_sum / s.steps,
                "peak_blocks": s.peak_blocks_used,
                "copies": s.block_copies,
                "tokens_computed": s.tokens_computed,
                "steps": s.steps,
                "preemptions": s.preemptions,
                "seconds": seconds,
                "tokens": tokens,
            }
        )
    return rows
