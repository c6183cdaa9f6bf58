"""The host's share of a decode step: the engine's own Python, with no model.

    python scripts/host_step_time.py                 # 128 sequences, 1,000-token prompts
    python scripts/host_step_time.py --seqs 256 --prompt-len 500
    python scripts/host_step_time.py --seqs 256 --json out.json --async-scheduling
    python scripts/host_step_time.py --seqs 256 --temperature 0.6 --seed 0   # sampling too

On a GPU a decode step costs its kernels' time plus whatever the host does
while the GPU waits: scheduling, packing the inputs, sampling's bookkeeping,
appending tokens, freeing what finished. This measures the second part on any
machine. `tiny-llama` serves the prompts (on the CPU); then the runner's
`forward` is replaced by a stand-in that returns fixed logits at once, and the
engine's decode steps are timed, whole and by phase (median over the steps
after the first two). Everything else runs as in a real step: the scheduler's
`schedule` and `postprocess`, the runner's block copies and its input packing
(`pack_arrays`, `upload_step`) included, and the `Sampler` over the stand-in's
logits: an argmax by default, and with
``--temperature`` a draw per row (``--seed``: every request seeded, as
``bench nanovllm``'s engine seeds them).

With ``--async-scheduling`` the engine schedules step N+1 before it reads step
N's tokens (vLLM's ``async_scheduling``): on a CPU, where the forward pass runs
in the host's own thread, there is nothing to hide behind, and what the
reordering adds (stand-ins for the tokens still on the device, packed and
resolved) shows as a cost; chapter 06 times both. What it hides behind a GPU's
step can only be measured on a GPU.

Run it with ``OMP_NUM_THREADS=1`` on a shared machine: an operation this small
split over two threads mostly waits for the second core.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pagedkv_lab import LLM, SamplingParams
from pagedkv_lab.kvmath import KVSpec
from pagedkv_lab.models import load_model
from pagedkv_lab.sampling_params import RequestOutputKind

# The phases timed: the engine core's launch and finish, the scheduler's two
# halves, the runner's inputs-and-forward and its sampler.
CORE_PHASES = ("_launch_next", "_finish")
SCHEDULER_PHASES = ("schedule", "postprocess")
RUNNER_PHASES = ("logits", "sampler")


class Timed:
    """Stands in for a method or a callable object (the runner's sampler):
    each call adds its seconds to ``phases[name]``; any other attribute is the
    target's (``runner.sampler.batch``...)."""

    def __init__(self, target, phases: dict, name: str):
        self.target, self.phases, self.name = target, phases, name

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.target(*args, **kwargs)
        finally:
            self.phases[self.name][-1] += time.perf_counter() - t0

    def __getattr__(self, attr: str):
        return getattr(self.target, attr)


def timed(phases: dict, obj, name: str) -> None:
    """Replace ``obj.name`` by a `Timed` stand-in for it."""
    setattr(obj, name, Timed(getattr(obj, name), phases, name))


def decoding_engine(n: int, length: int, steps: int, async_scheduling: bool,
                    temperature: float = 0.0, seed: int | None = None) -> LLM:  # fmt: skip
    """An `LLM` whose ``n`` requests of ``length`` prompt tokens are all
    decoding, with room for ``steps`` more tokens each (and some to spare),
    sampling at ``temperature`` (``seed``: the engine's, which seeds every
    request)."""
    max_len = length + steps + 256
    model, tokenizer = load_model("tiny-llama", device="cpu")
    spec = KVSpec.from_config(model.config, model.dtype)
    settings = dict(max_num_seqs=n, max_model_len=max_len,
                    kv_cache_memory=spec.bytes_for(2 * n * max_len))  # fmt: skip
    if async_scheduling:
        settings["async_scheduling"] = True
    llm = LLM((model, tokenizer), seed=seed, **settings)
    params = SamplingParams(temperature=temperature, max_tokens=max_len - length,
                            ignore_eos=True,
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
    return llm


def measure(n: int, length: int, steps: int, async_scheduling: bool = False,
            temperature: float = 0.0, seed: int | None = None) -> dict:  # fmt: skip
    """Milliseconds per decode step, whole and by phase (medians)."""
    llm = decoding_engine(n, length, steps, async_scheduling, temperature, seed)
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(n, llm.model.config.vocab_size, generator=gen)
    runner = llm.runner
    runner.forward = lambda step: logits[: len(step.logits_index)]
    phases: dict[str, list[float]] = {}
    for obj, names in ((llm.engine_core, CORE_PHASES), (llm.scheduler, SCHEDULER_PHASES),
                       (runner, RUNNER_PHASES)):  # fmt: skip
        for name in names:
            if hasattr(obj, name):
                phases[name] = []
                timed(phases, obj, name)
    whole = []
    for _ in range(steps):
        for values in phases.values():
            values.append(0.0)
        t0 = time.perf_counter()
        llm.step()
        whole.append(time.perf_counter() - t0)
        assert len(llm.last_plan.seqs) == n, "every sequence decodes every step"
    ms = lambda xs: 1e3 * statistics.median(xs[2:])  # noqa: E731 (the first steps warm up)
    return {"seqs": n, "prompt_len": length, "steps": steps,
            "async_scheduling": async_scheduling, "temperature": temperature,
            "seed": seed, "whole_ms": ms(whole),
            "phases_ms": {k: ms(v) for k, v in phases.items()}}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--async-scheduling", action="store_true")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sample at this temperature (default 0: greedy)")
    parser.add_argument("--seed", type=int, default=None,
                        help="the engine's seed, which seeds every request")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    r = measure(args.seqs, args.prompt_len, args.steps, args.async_scheduling,
                args.temperature, args.seed)  # fmt: skip
    mode = "async scheduling" if r["async_scheduling"] else "synchronous"
    sampling = ("greedy" if not args.temperature else f"temperature {args.temperature}"
                + ("" if args.seed is None else ", seeded"))  # fmt: skip
    print(f"{r['seqs']} sequences at {r['prompt_len']} tokens, decode steps, "
          f"no model, {mode}, {sampling} (median ms):")  # fmt: skip
    print(f"  whole step          {r['whole_ms']:6.3f}")
    for name, value in sorted(r["phases_ms"].items(), key=lambda kv: -kv[1]):
        print(f"  {name:19} {value:6.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
