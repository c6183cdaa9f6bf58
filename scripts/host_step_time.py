"""The host's share of a decode step: the engine's own Python, with no model.

    python scripts/host_step_time.py                 # 128 sequences, 1,000-token prompts
    python scripts/host_step_time.py --seqs 256 --prompt-len 500

On a GPU a decode step costs its kernels' time plus whatever the host does
while the GPU waits: scheduling, packing the inputs, sampling's bookkeeping,
appending tokens, freeing what finished. This measures the second part on any
machine. `tiny-llama` serves the prompts (on the CPU); then the runner's
forward pass is replaced by a stand-in that returns fixed logits at once, and
the engine's decode steps are timed, whole and by phase (median of the
repeats). The stand-in still runs the runner's copy-on-write check, as the
graphed runner does.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedkv_lab import LLM, SamplingParams
from pagedkv_lab.kvmath import KVSpec
from pagedkv_lab.models import load_model
from pagedkv_lab.sampling import RequestOutputKind


def timed(phases: dict, obj, name: str) -> None:
    """Wrap ``obj.name`` so that each call adds its seconds to ``phases[name]``."""
    call = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            phases[name][-1] += time.perf_counter() - t0

    setattr(obj, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    n, length = args.seqs, args.prompt_len
    # room for the tokens the first prompts decode while later ones prefill
    max_len = length + args.steps + 256
    model, tokenizer = load_model("tiny-llama", device="cpu")
    spec = KVSpec.from_config(model.config, model.dtype)
    llm = LLM((model, tokenizer), max_num_seqs=n, max_model_len=max_len,
              kv_cache_memory=spec.bytes_for(2 * n * max_len))  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=max_len - length, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    for i in range(n):
        prompt = [1] + torch.randint(3, 250, (length - 1,), generator=gen).tolist()
        llm.add_request(str(i), prompt, params)
    while any(
        s.num_computed_tokens < s.num_prompt_tokens
        for g in [*llm.scheduler.waiting, *llm.scheduler.running]
        for s in g.seqs
    ):
        llm.step()  # the prompts, with the real model

    logits = torch.randn(n, llm.model.config.vocab_size, generator=gen)
    runner = llm.runner

    def no_model(seqs, num_new_tokens, ref_counts=None):
        if ref_counts is not None:
            runner.check_writes(seqs, num_new_tokens, ref_counts)
        return logits[: len(seqs)]

    runner.run = no_model
    engine_parts = ("_forward", "_sample", "_update_stats", "_record_held_blocks")
    scheduler_parts = ("schedule", "free_finished")
    phases: dict[str, list[float]] = {n: [] for n in engine_parts + scheduler_parts}
    for name in engine_parts:
        timed(phases, llm, name)
    for name in scheduler_parts:
        timed(phases, llm.scheduler, name)
    whole = []
    for _ in range(args.steps):
        for values in phases.values():
            values.append(0.0)
        t0 = time.perf_counter()
        llm.step()
        whole.append(time.perf_counter() - t0)
        assert len(llm.last_plan.seqs) == n, "every sequence decodes every step"
    ms = lambda xs: 1e3 * statistics.median(xs[2:])  # noqa: E731 (the first steps warm up)
    print(f"{n} sequences at {length} tokens, decode steps, no model (median ms):")
    print(f"  whole step          {ms(whole):6.3f}")
    for name, values in sorted(phases.items(), key=lambda kv: -ms(kv[1])):
        print(f"  {name:19} {ms(values):6.3f}")
    print(f"  (the rest of step)  {ms(whole) - sum(ms(v) for v in phases.values()):6.3f}")


if __name__ == "__main__":
    main()
