"""How much an idle OpenMP team elsewhere in the process costs this engine on a CPU.

A thread that has run one parallel torch operation keeps an OpenMP thread team of
its own (PyTorch's CPU wheels use GNU libgomp). While it lives, libgomp counts more
OpenMP threads than CPUs and lets a waiting worker spin 100 times instead of
300,000 before it sleeps (libgomp's ``GOMP_SPINCOUNT`` documentation), so each of
the engine's many short parallel regions pays a sleep and a wake-up.
transformers' continuous-batching manager is such a thread, which is why
`pagedkv_lab.bench` starts it only for its own runs.

This script serves chapter 10's W1 trace three ways, taking turns, and prints each
round's throughput and the ratio to "alone" in the same round:

    python scripts/openmp_neighbour.py --num-requests 32 --rounds 2

``cpu/wall`` is process CPU time over wall time: near the thread count when the
workers spin, lower when they sleep between regions.
"""

import argparse
import threading
import time

import torch

from pagedkv_lab.bench import _prompt_ids, scaled_chat_trace
from pagedkv_lab.engine import SamplingParams
from pagedkv_lab.kvmath import KVSpec
from pagedkv_lab.llm import LLM
from pagedkv_lab.models import load_model


def serve(llm: LLM, prompts, params) -> tuple[float, float]:
    """Throughput (tok/s) and CPU time over wall time of one pass over the trace."""
    cpu, t0 = time.process_time(), time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(p.max_tokens for p in params)
    return tokens / wall, (time.process_time() - cpu) / wall


def idle_team() -> threading.Event:
    """Start a thread that runs one parallel torch operation and then waits; set the event to end it."""
    done = threading.Event()

    def body():
        torch.ones(1 << 22).add_(1)  # large enough for ATen to run it in parallel
        done.wait()

    threading.Thread(target=body, daemon=True).start()
    time.sleep(0.2)
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", default="small-llama")
    args = parser.parse_args()

    requests = scaled_chat_trace(args.num_requests, 512)
    prompts = _prompt_ids(requests)
    params = [
        SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
        for r in requests
    ]
    model, tokenizer = load_model(args.model)
    # chapter 10's setup: a KV budget of 8 full-length requests, 512 tokens per step
    budget = KVSpec.from_config(model.config, model.dtype).bytes_for(8 * 512)
    llm = LLM(
        (model, tokenizer),
        block_size=16,
        kv_cache_memory=budget,
        max_model_len=512,
        max_num_batched_tokens=512,
    )
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    print(
        f"{args.model}, W1 {len(requests)} requests, {torch.get_num_threads()} threads"
    )
    for r in range(args.rounds):
        alone, cpu_alone = serve(llm, prompts, params)
        done = idle_team()
        beside, cpu_beside = serve(llm, prompts, params)
        done.set()
        time.sleep(0.2)
        after, cpu_after = serve(llm, prompts, params)
        print(
            f"round {r + 1}: alone {alone:.0f} tok/s (cpu/wall {cpu_alone:.2f}); "
            f"beside an idle team {beside:.0f} ({cpu_beside:.2f}), ratio {beside / alone:.2f}; "
            f"after it ended {after:.0f} ({cpu_after:.2f}), ratio {after / alone:.2f}"
        )


if __name__ == "__main__":
    main()
