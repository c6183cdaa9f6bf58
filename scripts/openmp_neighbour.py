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

from pagedkv_lab.bench.common import ServeSetup, _prompt_ids, scaled_chat_trace
from pagedkv_lab.bench.serve import _OursRunner


def serve(runner: _OursRunner, prompts, max_tokens) -> tuple[float, float]:
    """Throughput (tok/s) and CPU time over wall time of one pass over the trace."""
    cpu = time.process_time()
    seconds = runner.run(prompts, max_tokens)["seconds"]
    return sum(max_tokens) / seconds, (time.process_time() - cpu) / seconds


def idle_team() -> threading.Event:
    """Start a thread that runs one parallel torch operation and then waits; set the event to end it."""
    done = threading.Event()

    def body():
        # large enough for ATen to run it in parallel
        torch.ones(1 << 22).add_(1)
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
    max_tokens = [r.output_len for r in requests]
    # `bench serve`'s engine for W1: a KV budget of 8 full-length requests
    setup = ServeSetup(
        args.model,
        torch.device("cpu"),
        max_model_len=512,
        budget_tokens=8 * 512,
        block_size=16,
        max_num_seqs=256,
        max_num_batched_tokens=512,
        threads=torch.get_num_threads(),
    )
    runner = _OursRunner(setup, reserve=False)
    runner.run(prompts[:2], [16, 16])  # warm-up
    print(f"{args.model}, W1 {len(requests)} requests, {setup.threads} threads")
    for r in range(args.rounds):
        alone, cpu_alone = serve(runner, prompts, max_tokens)
        done = idle_team()
        beside, cpu_beside = serve(runner, prompts, max_tokens)
        done.set()
        time.sleep(0.2)
        after, cpu_after = serve(runner, prompts, max_tokens)
        print(
            f"round {r + 1}: alone {alone:.0f} tok/s (cpu/wall {cpu_alone:.2f}); "
            f"beside an idle team {beside:.0f} ({cpu_beside:.2f}), ratio {beside / alone:.2f}; "
            f"after it ended {after:.0f} ({cpu_after:.2f}), ratio {after / alone:.2f}"
        )


if __name__ == "__main__":
    main()
