"""nano-vllm's benchmark, as published: ``python -m pagedkv_lab.bench nanovllm``.

nano-vllm's ``bench.py`` (github.com/GeeeekExplorer/nano-vllm) draws its
workload with Python's ``random``: ``seed(0)``; for each of 256 requests a prompt
of ``randint(100, 1024)`` token ids, each ``randint(0, 10000)`` (both ends
included); then, for each request, ``max_tokens = randint(100, 1024)``. It
samples at temperature 0.6, ignores EOS, sets ``max_model_len=4096``, warms up
with one short request, and divides the output tokens (133,966, the count its
README's table shows for vLLM and for nano-vllm) by the wall time of one
``generate`` call over all 256 requests.

Here the same draw runs through this engine with random weights at the real
checkpoint's shape (``configs/real_models.json``: ``Qwen3-0.6B``,
``Qwen2.5-0.5B``); the engine's limits follow nano-vllm's defaults where the
engine has the same knob (``max_num_seqs`` 512, ``max_num_batched_tokens``
16,384); on a GPU every CUDA graph is captured before the clock starts, as
nano-vllm captures its graphs when it starts. Beside the throughput the run
prints the floor it implies: every step must read every weight the step uses
and each of its sequences' K/V, so the sum over the run's steps of those bytes
over the copy bandwidth measured in the same run bounds the run's time from
below (for prefill steps, which are compute-bound, a loose bound). The same
requests then run through transformers' continuous batching, with the same KV
budget and sampling and its own default step budget (``--no-peers`` skips it).

Offline models with a vocabulary smaller than the drawn ids (CPU smoke runs)
take the ids modulo their vocabulary; the draw itself is unchanged.

Two comparisons run in the same process, after the run as published, each
after one more untimed pass of the workload in each mode and in ``rounds`` alternating rounds
(the order reversed every round), so that neither side inherits a colder
machine: ``compare_async`` one step in flight against none (`compare_modes`),
``compare_greedy`` greedy decoding (temperature 0) against the published
temperature (`compare_sampling`), which prices the sampler's random draws.
"""

from __future__ import annotations

import gc
import random
import statistics
import time

import torch

#: Output tokens of nano-vllm's workload: the count in its README's table.
NANOVLLM_OUTPUT_TOKENS = 133_966

#: Issue 52's goals for this engine's run of the benchmark, as a fraction of the
#: run's own physical floor (`serve_timed`), on whatever card runs it. How they
#: were set: a little above the best fraction chapter 10 computes for a published
#: run (vLLM, nano-vllm's Triton port; 0.63 and 0.25), whose floor nobody
#: measured: it is the H100 run's floor scaled by the ratio of datasheet
#: bandwidths, an assumption. They are a yardstick, not evidence of what a card
#: can do: vLLM on the same card in the same session decides that.
FLOOR_GOALS = {"Qwen3-0.6B": 0.65, "Qwen2.5-0.5B": 0.30}


def nanovllm_workload(
    num_seqs: int = 256,
    max_input_len: int = 1024,
    max_output_len: int = 1024,
    min_len: int = 100,
    max_id: int = 10_000,
    seed: int = 0,
) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's draw: ``(prompts, max_tokens)`` as its ``bench.py`` makes
    them (``random.seed(seed)``, all prompts first, then all output lengths).
    A private ``random.Random`` draws the same numbers without moving the
    global stream."""
    rng = random.Random(seed)
    prompts = [
        [rng.randint(0, max_id) for _ in range(rng.randint(min_len, max_input_len))]
        for _ in range(num_seqs)
    ]
    max_tokens = [rng.randint(min_len, max_output_len) for _ in range(num_seqs)]
    return prompts, max_tokens


def weight_bytes_per_step(model) -> int:
    """Bytes of every distinct parameter a decode step reads: all but the input
    embedding table (one row per sequence), unless the output head shares it."""
    params = {id(p): p for p in model.parameters()}
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    if embed is not head:
        params.pop(id(embed))
    return sum(p.numel() * p.element_size() for p in params.values())


def _positions(model: str) -> int:
    """The positions the model's config allows (its ``max_position_embeddings``)."""
    from transformers import AutoConfig

    from pagedkv_lab.models import OFFLINE_MODELS, offline_config, real_model_shapes

    if model in OFFLINE_MODELS:
        config = offline_config(model)
    else:
        config = real_model_shapes().get(model) or AutoConfig.from_pretrained(model)
    return getattr(config, "max_position_embeddings", None) or 2**31


def _requests(prompts, max_tokens, temperature: float) -> list:
    """``(prompt, SamplingParams)`` pairs as nano-vllm's bench asks for them."""
    from pagedkv_lab.sampling_params import RequestOutputKind, SamplingParams

    return [(prompt, SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True,
                                    output_kind=RequestOutputKind.FINAL_ONLY))
            for prompt, n in zip(prompts, max_tokens)]  # fmt: skip


def serve_timed(llm, prompts, max_tokens, temperature: float, floor) -> dict:
    """Serve the requests through ``llm``'s steps; the wall time, the tokens,
    the floor: ``floor(kv_tokens)`` seconds summed over the steps, where
    ``kv_tokens`` is the tokens whose K/V the step's sequences hold after it;
    and where each step's time went (`StepClock`). The floor's bookkeeping is
    not in the wall time."""
    from pagedkv_lab.bench.steps import StepClock

    counts, steps, floor_s, bookkeeping = {}, 0, 0.0, 0.0
    clock = StepClock(llm)
    t0 = time.perf_counter()
    for i, (prompt, params) in enumerate(_requests(prompts, max_tokens, temperature)):
        llm.add_request(str(i), prompt, params)
    while llm.has_unfinished_requests():
        outputs = clock.step()
        t1 = time.perf_counter()
        steps += 1
        floor_s += floor(sum(s.num_computed_tokens for s in llm.last_plan.seqs))
        for out in outputs:
            if out.finished:
                counts[int(out.request_id)] = len(out.outputs[0].token_ids)
        bookkeeping += time.perf_counter() - t1
    seconds = time.perf_counter() - t0 - bookkeeping
    clock.detach()
    tokens = sum(counts.values())
    return {"seconds": seconds, "output_tokens": tokens, "tok_s": tokens / seconds,
            "steps": steps, "floor_seconds": floor_s,
            "floor_tok_s": tokens / floor_s, "breakdown": clock.summary()}  # fmt: skip


def _hf_continuous_peer(setup, temperature: float):
    """transformers' continuous batching (`bench.peers`), sampling as nano-vllm
    does: temperature only, no top-k or top-p cut."""
    from pagedkv_lab.bench.peers import _HFContinuousRunner

    class Sampled(_HFContinuousRunner):
        name = "hf-continuous"

        def _start(self) -> None:
            self._generation.do_sample = temperature > 0
            if temperature > 0:
                self._generation.temperature = temperature
                self._generation.top_k, self._generation.top_p = 0, 1.0
            super()._start()

    return Sampled(setup)


def nanovllm_benchmark(
    model: str = "Qwen3-0.6B",
    device: torch.device | None = None,
    *,
    num_requests: int = 256,
    max_input_len: int = 1024,
    max_output_len: int = 1024,
    min_len: int = 100,
    temperature: float = 0.6,
    max_model_len: int = 4096,
    max_num_seqs: int = 512,
    max_num_batched_tokens: int = 16_384,
    kv_cache_memory: int | float | None = None,
    enforce_eager: bool = False,
    peers: bool = True,
    seed: int = 0,
    async_scheduling: bool | None = None,
    profile: str | None = None,
    compare_async: bool = False,
    compare_greedy: bool = False,
    rounds: int = 3,
) -> dict:
    """Run nano-vllm's benchmark on ``device``; return the result (see
    `print_result`). ``async_scheduling``: None leaves it to the engine (on
    with a GPU); ``profile``: a path, to profile 20 decode steps at full batch
    once the timed run is over (`steps.profile_decode_steps`: the device's busy
    time, and its idle time against the timed run's full-batch decode steps).
    ``compare_async``: then one untimed pass per mode and ``rounds`` (odd, at least 3)
    alternating rounds of each mode (`compare_modes`); ``compare_greedy``: the
    same for greedy decoding against ``temperature`` (`compare_sampling`)."""
    from pagedkv_lab import LLM
    from pagedkv_lab.bench.common import ServeSetup, cpu_model
    from pagedkv_lab.bench.report import copy_bandwidth
    from pagedkv_lab.device import pick_device
    from pagedkv_lab.kvmath import KVSpec

    device = device or pick_device()
    max_model_len = min(max_model_len, _positions(model))
    prompts, max_tokens = nanovllm_workload(
        num_requests, max_input_len, max_output_len, min_len, seed=seed
    )
    t0 = time.perf_counter()
    llm = LLM(model, device=device, seed=seed, kv_cache_memory=kv_cache_memory,
              max_model_len=max_model_len, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=max_num_batched_tokens,
              enforce_eager=enforce_eager,
              async_scheduling=async_scheduling)  # fmt: skip
    vocab = llm.model.config.vocab_size
    prompts = [[t % vocab for t in p] for p in prompts]
    if llm.runner.graphs is not None:  # nano-vllm captures its graphs when it starts
        llm.runner.graphs.capture_all()
    llm.generate([prompts[0][:16]], use_tqdm=False)  # nano-vllm's warm-up request
    startup = time.perf_counter() - t0
    bandwidth = copy_bandwidth(device)
    weights = weight_bytes_per_step(llm.model)
    per_token = KVSpec.from_config(llm.model.config, llm.model.dtype).bytes_per_token
    ours = serve_timed(llm, prompts, max_tokens, temperature,
                       lambda kv: (weights + kv * per_token) / bandwidth)  # fmt: skip
    where = (
        {"gpu": torch.cuda.get_device_name(device)}
        if device.type == "cuda"
        else {"cpu": cpu_model()}
    )
    result = {
        "model": model, "dtype": str(llm.model.dtype).removeprefix("torch."), **where,
        "requests": num_requests, "output_tokens": ours["output_tokens"],
        "seconds": ours["seconds"], "tok_s": ours["tok_s"],
        "floor_tok_s": ours["floor_tok_s"], "peers": {},
        "steps": ours["steps"], "floor_seconds": ours["floor_seconds"],
        "breakdown": ours["breakdown"],
        "copy_GBps": bandwidth / 1e9, "weight_GB": weights / 1e9,
        "startup_s": startup, "runner": type(llm.runner.forward).__name__,
        "cuda_graphs": llm.runner.graphs is not None,
        "async_scheduling": llm.async_scheduling,
        "layer_ops": type(getattr(llm.runner.forward, "ops", None)).__name__,
        "workload": {"max_input_len": max_input_len, "max_output_len": max_output_len,
                     "min_len": min_len, "temperature": temperature,
                     "max_model_len": max_model_len, "seed": seed},
    }  # fmt: skip
    if profile is not None:
        from pagedkv_lab.bench.steps import profile_decode_steps

        requests = _requests(prompts, max_tokens, temperature)
        prof = profile_decode_steps(llm, requests, steps=20, path=profile)
        result["profile"] = str(profile)
        full = ours["breakdown"].get("full_batch_decode_steps") or {}
        result["profile_busy"] = {k: prof[k] for k in ("steps", "batch", "wall_ms", "busy_ms")}
        if prof["busy_ms"] is not None and full.get("mean_batch") == prof["batch"]:
            # the unprofiled run's full-batch decode steps, same batch
            result["profile_busy"]["idle_ms"] = full["wall"] - prof["busy_ms"]
    floor = lambda kv: (weights + kv * per_token) / bandwidth  # noqa: E731
    if compare_async:
        result["async_compare"] = compare_modes(llm, prompts, max_tokens, temperature,
                                                floor, rounds)  # fmt: skip
    if compare_greedy:
        result["greedy_compare"] = compare_sampling(llm, prompts, max_tokens, temperature,
                                                    floor, rounds)  # fmt: skip
    budget_tokens = llm.runner.kv_cache.num_blocks * llm.runner.kv_cache.block_size
    block_size = llm.runner.kv_cache.block_size
    del llm
    gc.collect()  # the engine's pool and graphs go before the peer loads its model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if peers:
        result["peers"]["hf-continuous"] = _run_peer(
            ServeSetup(model, device, max_model_len=max_model_len,
                       budget_tokens=budget_tokens, block_size=block_size,
                       max_num_seqs=max_num_seqs, max_num_batched_tokens=None,
                       threads=torch.get_num_threads()),
            temperature, prompts, max_tokens,
        )  # fmt: skip
    return result


def _alternate(serve, modes: tuple[str, str], rounds: int) -> dict:
    """``serve(mode)`` (tokens/s) once per mode untimed (the warm-up: each
    mode's first pass pays its own one-time costs), then ``rounds`` rounds of
    both modes, the order reversed every round (the first mode first in even
    rounds). Each mode's tokens/s per round, their median and range, and the
    first mode over the second within each round."""
    if rounds < 3 or rounds % 2 == 0:
        raise ValueError(f"rounds={rounds}: an odd number, at least 3 (a median of two is a mean)")
    for mode in modes:  # untimed: the warm-up of each mode
        serve(mode)
    tok_s = {mode: [] for mode in modes}
    for r in range(rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            tok_s[mode].append(serve(mode))
    ratios = [a / b for a, b in zip(*tok_s.values())]

    def stats(xs):
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}

    return {"rounds": rounds, "tok_s": tok_s, **{m: stats(v) for m, v in tok_s.items()},
            f"{modes[0]}_over_{modes[1]}": {"per_round": ratios, **stats(ratios)}}  # fmt: skip


def compare_modes(llm, prompts, max_tokens, temperature: float, floor,
                  rounds: int = 3) -> dict:  # fmt: skip
    """One step in flight against none, in this process, on this engine: one
    untimed pass of the workload in each mode, then ``rounds`` rounds of both
    modes, the order reversed every round (in flight first in even rounds). Returns each
    mode's tokens/s per round and their median and range, and the ratio of the
    two within each round (in flight over none), its median and range."""
    before = llm.async_scheduling

    def serve(mode):
        llm.async_scheduling = mode == "async"
        return serve_timed(llm, prompts, max_tokens, temperature, floor)["tok_s"]

    try:
        return _alternate(serve, ("async", "sync"), rounds)
    finally:
        llm.async_scheduling = before


def compare_sampling(llm, prompts, max_tokens, temperature: float, floor,
                     rounds: int = 3) -> dict:  # fmt: skip
    """Greedy decoding against sampling at ``temperature``, in this process,
    on this engine and in its scheduling mode: one untimed pass of each,
    then ``rounds`` rounds of both, the order reversed every
    round (greedy first in even rounds). The work is otherwise the same (EOS is
    ignored, so every request makes its ``max_tokens``): the ratio within each
    round (greedy over sampled) is what the sampler's draws cost."""
    if not temperature > 0:
        raise ValueError(f"temperature={temperature}: greedy against greedy compares nothing")

    def serve(mode):
        t = 0.0 if mode == "greedy" else temperature
        return serve_timed(llm, prompts, max_tokens, t, floor)["tok_s"]

    return _alternate(serve, ("greedy", "sampled"), rounds)


def _run_peer(setup, temperature, prompts, max_tokens) -> dict:
    """transformers' continuous batching on the same requests, KV budget and
    sequence limit; its step's token budget is its own default (its attention
    masks grow with that budget times the cache's tokens). A failure is
    recorded, not raised: the engine's figures stand without the peer."""
    try:
        peer = _hf_continuous_peer(setup, temperature)
    except Exception as err:  # noqa: BLE001 (any failure of the peer is reported)
        return {"error": repr(err)[:400]}
    try:
        peer.run([prompts[0][:16]], [1])  # warm-up
        run = peer.run(prompts, max_tokens)
    except Exception as err:  # noqa: BLE001
        return {"error": repr(err)[:400]}
    finally:
        peer.close()
    tokens = sum(len(t) for t in run["tokens"])
    return {"seconds": run["seconds"], "output_tokens": tokens,
            "tok_s": tokens / run["seconds"]}  # fmt: skip


def print_result(r: dict, width: int = 88) -> None:
    """The run as nano-vllm prints it, then the floor and the peers, the long
    lines wrapped to ``width`` columns."""
    import textwrap

    from pagedkv_lab.kvmath import format_bytes

    def say(text: str) -> None:
        print(textwrap.fill(text, width, subsequent_indent="  "))

    print(f"{r['model']} ({r['dtype']}, random weights), {r['requests']} requests:")
    print(f"Total: {r['output_tokens']}tok, Time: {r['seconds']:.2f}s, "
          f"Throughput: {r['tok_s']:.2f}tok/s"
          + (" (one step in flight)" if r.get("async_scheduling") else ""))  # fmt: skip
    say(f"floor-bound: {r['floor_tok_s']:.2f} tok/s ({r['steps']} steps, each reading "
        f"{format_bytes(r['weight_GB'] * 1e9)} of weights and its sequences' K/V at "
        f"{r['copy_GBps']:.1f} GB/s); this engine at "
        f"{r['tok_s'] / r['floor_tok_s']:.1%} of it")  # fmt: skip
    from pagedkv_lab.bench.steps import format_breakdown

    for line in format_breakdown(r.get("breakdown", {})):
        say(line)
    if r.get("profile"):
        print(f"profile of 20 decode steps at full batch: {r['profile']}")
    busy = r.get("profile_busy") or {}
    if busy.get("busy_ms") is not None:
        idle = (f", idle {busy['idle_ms']:.2f} ms (the timed run's full-batch step "
                "minus busy)" if "idle_ms" in busy else "")  # fmt: skip
        say(f"profiled decode steps (batch {busy['batch']}): device busy "
            f"{busy['busy_ms']:.2f} ms a step{idle}")
    cmp = r.get("async_compare")
    if cmp:
        a, q = cmp["async_over_sync"], cmp
        say(f"one step in flight vs none, {cmp['rounds']} alternating rounds after an "
            f"untimed pass of each: {q['async']['median']:.0f} vs {q['sync']['median']:.0f} tok/s "
            f"(medians); in flight over none {a['median']:.3f} "
            f"({a['min']:.3f}-{a['max']:.3f} over rounds)")
    cmp = r.get("greedy_compare")
    if cmp:
        g = cmp["greedy_over_sampled"]
        say(f"greedy vs temperature {r['workload']['temperature']:g}, {cmp['rounds']} "
            f"alternating rounds after an untimed pass of each: {cmp['greedy']['median']:.0f} vs "
            f"{cmp['sampled']['median']:.0f} tok/s (medians); greedy over sampled "
            f"{g['median']:.3f} ({g['min']:.3f}-{g['max']:.3f} over rounds)")
    for name, p in r["peers"].items():
        if "error" in p:
            print(f"{name}: failed: {p['error']}")
            continue
        say(f"{name}: {p['output_tokens']} tokens in {p['seconds']:.2f}s, "
            f"{p['tok_s']:.2f} tok/s; this engine {r['tok_s'] / p['tok_s']:.2f}x "
            "its throughput")  # fmt: skip
