"""W1's physical floor on this CPU: the weight bytes every step reads, over the
measured copy bandwidth, times the steps our engine takes.

    python scripts/cpu_w1_floor.py                      # W1, 32 requests, as bench serve
    python scripts/cpu_w1_floor.py --tok-s 465 400      # also: each rate's share of it

Each engine step (prefill chunks and decode alike) runs every projection and the
LM head once, so it reads their weights at least once: `small-llama`'s are 119
MB in fp32 (the input embedding is read one row per token and is left out, as in
decode_floor.py, whose count this reuses). A
256 MiB tensor copy measures the bandwidth (bytes read plus written, the median
of 5). The floor leaves out K/V reads and arithmetic, so no engine reaches it;
it says how far from the memory bound a throughput is.
"""

import argparse

import torch
from decode_floor import weight_bytes_per_step  # this folder: on the path as a script

from pagedkv_lab import LLM, SamplingParams
from pagedkv_lab.bench.common import _prompt_ids, scaled_chat_trace
from pagedkv_lab.bench.report import copy_bandwidth
from pagedkv_lab.kvmath import KVSpec
from pagedkv_lab.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small-llama")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--budget-requests", type=int, default=8)
    ap.add_argument("--tok-s", type=float, nargs="*", default=[],
                    help="measured throughputs to place against the floor")  # fmt: skip
    args = ap.parse_args()

    device = torch.device("cpu")
    bandwidth = copy_bandwidth(device)
    pair = load_model(args.model)
    weights = weight_bytes_per_step(pair[0])
    requests = scaled_chat_trace(args.num_requests, args.max_model_len)
    spec = KVSpec.from_config(pair[0].config, pair[0].dtype)
    llm = LLM(
        pair,
        block_size=16,
        kv_cache_memory=spec.bytes_for(args.budget_requests * args.max_model_len),
        max_model_len=args.max_model_len,
    )
    for prompt, r in zip(_prompt_ids(requests), requests):
        llm.add_request(
            prompt,
            SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True),
        )
    steps = 0
    while llm.has_unfinished_requests():
        llm.step()
        steps += 1
    tokens = sum(r.output_len for r in requests)
    floor_s = steps * weights / bandwidth
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write); "
          f"weights read per step {weights / 1e6:.0f} MB")  # fmt: skip
    print(f"W1: {steps} steps, {tokens} output tokens; floor {floor_s:.2f} s, "
          f"{tokens / floor_s:,.0f} tok/s")  # fmt: skip
    for rate in args.tok_s:
        print(f"{rate:.0f} tok/s is {rate * floor_s / tokens:.2f} of the floor")


if __name__ == "__main__":
    main()
