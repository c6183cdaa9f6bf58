"""The vLLM peer of ``python -m pagedkv_lab.bench serve``, run by the python that has vLLM.

This file imports nothing from ``pagedkv_lab`` (only the standard library, and
vLLM once asked to start), so the virtual environment that holds vLLM needs
nothing else: `pagedkv_lab.bench` starts it as
``<vllm python> _vllm_peer.py`` and talks to it over pipes, one JSON object per
line. vLLM's own log lines go to stderr; replies come on the original stdout.

Requests (each answered by one line):

* ``{"cmd": "init", "model": dir, "block_size", "kv_cache_bytes", "max_model_len",
  "max_num_seqs", "max_num_batched_tokens", "enforce_eager"}``: build a
  ``vllm.LLM`` (``dtype`` as asked, vLLM's ``"auto"`` by default; prefix caching
  off unless asked) whose KV cache is exactly
  ``kv_cache_bytes``; answers its version, block count and threads.
* ``{"cmd": "run", "prompts": [[ids]], "max_tokens": [n]}``: serve the
  token-id prompts with greedy sampling, EOS ignored, stepping the engine and
  reading its block pool after every step; answers the wall time, the tokens,
  per-request TTFT/TPOT and the most blocks held by requests after a step.
* ``{"cmd": "quit"}``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback


def _init(msg: dict):
    import torch
    import vllm
    from vllm import LLM

    llm = LLM(
        model=msg["model"],
        tokenizer=msg["model"],
        dtype=msg.get("dtype", "auto"),
        block_size=msg["block_size"],
        kv_cache_memory_bytes=msg["kv_cache_bytes"],
        max_model_len=msg["max_model_len"],
        max_num_seqs=msg["max_num_seqs"],
        max_num_batched_tokens=msg["max_num_batched_tokens"],
        enable_prefix_caching=msg.get("enable_prefix_caching", False),
        enforce_eager=msg.get("enforce_eager", False),
        seed=0,
    )
    pool = _block_pool(llm)
    kv_config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    info = {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "num_blocks": pool.num_gpu_blocks,
        "kv_cache_bytes": sum(t.size for t in kv_config.kv_cache_tensors),
        "block_size": msg["block_size"],
        "threads": torch.get_num_threads(),
    }
    return llm, info


def _block_pool(llm):
    """The engine core's block pool (in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    core = llm.llm_engine.engine_core.engine_core
    return core.scheduler.kv_cache_manager.block_pool


def _run(llm, msg: dict) -> dict:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine, pool = llm.llm_engine, _block_pool(llm)
    tag = f"r{time.monotonic_ns()}-"
    prompts, max_tokens = msg["prompts"], msg["max_tokens"]
    tokens: dict[str, list[int]] = {}
    arrival, first, finish = {}, {}, {}
    peak = 0
    t0 = time.perf_counter()
    for i, (p, n) in enumerate(zip(prompts, max_tokens)):
        rid = f"{tag}{i}"
        params = SamplingParams(
            temperature=0.0,
            max_tokens=n,
            ignore_eos=True,
            output_kind=RequestOutputKind.DELTA,
        )
        engine.add_request(rid, {"prompt_token_ids": p}, params)
        arrival[rid], tokens[rid] = time.perf_counter(), []
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        # Blocks held by requests: all but the free ones and vLLM's one null block.
        peak = max(peak, pool.num_gpu_blocks - 1 - pool.get_num_free_blocks())
        for out in outs:
            new = out.outputs[0].token_ids
            if new and out.request_id not in first:
                first[out.request_id] = now
            tokens[out.request_id].extend(new)
            if out.finished:
                finish[out.request_id] = now
    wall = time.perf_counter() - t0
    ids = [f"{tag}{i}" for i in range(len(prompts))]
    ttft = [first[r] - arrival[r] for r in ids]
    tpot = [
        (finish[r] - first[r]) / (len(tokens[r]) - 1) if len(tokens[r]) > 1 else 0.0
        for r in ids
    ]
    return {
        "seconds": wall,
        "tokens": [tokens[r] for r in ids],
        "ttft": ttft,
        "tpot": tpot,
        "peak_blocks": peak,
    }


def main() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # Replies go on the original stdout; everything printed (vLLM's logs) goes to stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    llm = None
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["cmd"] == "quit":
            break
        try:
            if msg["cmd"] == "init":
                llm, reply = _init(msg)
            elif msg["cmd"] == "run":
                reply = _run(llm, msg)
            else:
                reply = {"error": f"unknown command {msg['cmd']!r}"}
        except Exception as err:  # report, keep serving
            traceback.print_exc()
            reply = {"error": f"{type(err).__name__}: {err}"}
        proto.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
