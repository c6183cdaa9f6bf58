"""Decode speed against the physical floor, on a CUDA GPU, in one run.

    python scripts/decode_floor.py --out decode-report            # Llama-3-8B shape on 40 GB+, ~2 min on an H100
    python scripts/decode_floor.py --model Qwen2.5-0.5B --smoke   # small sizes, still on a GPU

A random-weight model at a real checkpoint's shape serves ``--prompts``
prompts of ``--prompt-len`` tokens, ``--new-tokens`` greedy tokens
each, ignoring EOS. For every system the time of a decode step is measured:

- ``pagedkv``: our engine (`LLM`, CUDA graphs), each `step` timed (a step ends
  when the sampled tokens reach the host, so its wall time is its GPU time plus
  the host's), after a first untimed pass; the decode steps that run every
  sequence count (the floor is computed for that batch).
- ``pagedkv eager``: the same with ``enforce_eager=True`` (no CUDA graphs).
- ``hf generate``: transformers' ``generate`` (SDPA, its dynamic cache), all
  prompts in one batch: (time for N new tokens - time for 1) / (N - 1).

The floor of a decode step is the bytes it must read (every weight but the
input embedding, which is read one row per sequence, and every sequence's K/V
at its current length) over the copy bandwidth measured here (a large
device-to-device copy, bytes read plus written).

The tokens are judged (`pagedkv_lab.bench.compare`) on the first ``--judge``
requests: identical to transformers' in float32; in 16 bits every generated
token of every system against the model's own float32 forward pass, and each
of our systems teacher-forced on the first system's tokens through its own
forward pass, with a tolerance calibrated on the model's own 16-bit rounding.
The float32 copy needs four bytes a weight free on the GPU; where they are not
free the tokens are reported as not judged.

For each of our systems ``results.json`` also holds the fused step as it ran:
``fused_step`` (GEMMs and concatenations per layer of one eager decode step,
counted by `pagedkv_lab.bench.ops.decode_step_ops`; the layer ops and projections in
use) and, with graphs, what capturing every bucket cost (``capture_s``,
``graph_pool_bytes``). ``--layer-ops torch`` runs the small steps in PyTorch
instead of Triton (the step before the Triton layer ops), to measure them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from pagedkv_lab import LLM, SamplingParams
from pagedkv_lab.bench.compare import compare_systems, engine_logprobs, float32_copy
from pagedkv_lab.bench.nanovllm import weight_bytes_per_step  # cpu_w1_floor.py too
from pagedkv_lab.bench.ops import GEMM_OPS, decode_step_ops
from pagedkv_lab.device import gpu_spec
from pagedkv_lab.engine.fused import FusedModel
from pagedkv_lab.engine.layer_ops import LayerOps
from pagedkv_lab.kvmath import KVSpec
from pagedkv_lab.models import largest_real_shape, load_model
from pagedkv_lab.sampling_params import RequestOutputKind


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Bytes per second of a device-to-device copy (read + written), median of 20."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(25):
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * nbytes / statistics.median(times[5:])


def fused_step(runner) -> dict:
    """The fused step as ``runner`` runs it (its forward a `FusedModel`, graphed
    or not): one eager decode step counted (`decode_step_ops`, in the runner's
    own cache before it serves anything), and the layer ops and projections in use."""
    fused = runner.forward
    if not isinstance(fused, FusedModel):
        return {"runner": type(fused).__name__}
    counts = decode_step_ops(runner)
    layers = len(fused.layers)
    return {"runner": type(fused).__name__, "layer_ops": type(fused.ops).__name__,
            "projections": type(fused.layers[0].qkv).__name__,
            "gemms_per_layer": (sum(counts[op] for op in GEMM_OPS) - 1) / layers,
            "concats_per_layer": (counts["cat"] - 1) / layers}  # fmt: skip


def time_ours(model, tokenizer, prompts, new_tokens, kv_bytes, eager,
              layer_ops="default", judge=0, base_tokens=None) -> dict:  # fmt: skip
    """Capture every graph bucket (timed), then serve the prompts twice (the
    first pass compiles kernels); from the second, time every step and keep the
    pure decode steps that run every sequence. In 16 bits, the first ``judge``
    prompts are then scored teacher-forced on ``base_tokens`` (by default this
    system's own tokens) through the engine's own forward pass."""
    extra = {"enforce_eager": True} if eager else {}
    llm = LLM((model, tokenizer), kv_cache_memory=kv_bytes,
              max_num_seqs=len(prompts), **extra)  # fmt: skip
    if layer_ops == "torch" and isinstance(llm.runner.forward, FusedModel):
        llm.runner.forward.ops = LayerOps()  # before any graph is captured
    info = {"fused_step": fused_step(llm.runner)}
    graphs = llm.runner.graphs
    if graphs is not None:
        torch.cuda.synchronize()
        # a capture empties the allocator's cache first (torch.cuda.graph does):
        # empty it before the baseline too, or the pool's size comes out negative
        torch.cuda.empty_cache()
        reserved, t0 = torch.cuda.memory_reserved(), time.perf_counter()
        graphs.capture_all()
        info["capture_s"] = time.perf_counter() - t0
        info["graph_pool_bytes"] = torch.cuda.memory_reserved() - reserved
        info["graph_buckets"] = len(graphs.graphs)
    # as LLM.generate asks: outputs when a request finishes, not at every step
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)  # fmt: skip
    for rnd in range(2):
        for i, p in enumerate(prompts):
            llm.add_request(f"{rnd}-{i}", p, params)
        full, other, prefill, tokens = [], [], [], {}
        while llm.has_unfinished_requests():
            t0 = time.perf_counter()
            outs = llm.step()
            dt = time.perf_counter() - t0
            plan = llm.last_plan.num_new_tokens
            if any(n != 1 for n in plan):
                prefill.append(dt)
            else:
                (full if len(plan) == len(prompts) else other).append(dt)
            for o in outs:
                tokens[int(o.request_id.split("-")[1])] = list(o.outputs[0].token_ids)
    if judge and model.dtype != torch.float32:
        mine = [tokens.get(i, []) for i in range(judge)]
        info["scores"] = engine_logprobs(llm, prompts[:judge], base_tokens or mine)
    del llm
    torch.cuda.empty_cache()
    return {"decode_ms": [1e3 * t for t in full], "smaller_batch_ms": [1e3 * t for t in other],
            "prefill_s": sum(prefill), "tokens": tokens, **info}  # fmt: skip


def time_hf(model, prompts, new_tokens) -> dict:
    ids = torch.tensor(prompts, device=model.device)
    mask = torch.ones_like(ids)
    model.config._attn_implementation = "sdpa"

    def run(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False)  # fmt: skip
        torch.cuda.synchronize()
        return time.perf_counter() - t0, out

    run(2)  # warm-up
    one, _ = run(1)
    full, out = run(new_tokens)
    torch.cuda.empty_cache()
    return {"decode_ms_mean": 1e3 * (full - one) / (new_tokens - 1), "prefill_s": one,
            "tokens": out[:, ids.shape[1]:].tolist()}  # fmt: skip


def profile_ours(model, tokenizer, prompts, kv_bytes, out: Path, layer_ops) -> dict:
    """A torch profile of a few decode steps: the top operations by GPU time."""
    from torch.profiler import ProfilerActivity, profile

    llm = LLM((model, tokenizer), kv_cache_memory=kv_bytes, max_num_seqs=len(prompts))
    if layer_ops == "torch" and isinstance(llm.runner.forward, FusedModel):
        llm.runner.forward.ops = LayerOps()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for p in prompts:
        llm.add_request(p, params)
    llm.step()
    while any(n != 1 for n in llm.last_plan.num_new_tokens):  # until prefill is done
        llm.step()
    for _ in range(3):
        llm.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            llm.step()
    events = prof.key_averages()
    table = events.table(sort_by="cuda_time_total", row_limit=25)
    cpu = events.table(sort_by="cpu_time_total", row_limit=25)
    (out / "profile.txt").write_text(table + "\n\n" + cpu)
    print(table)
    # GEMM kernels by name (cuBLAS's nvjet on sm_90, *gemm* elsewhere), one LM head a step
    gemm = sum(e.count for e in events if e.device_type.name == "CUDA"
               and ("nvjet" in e.key or "gemm" in e.key.lower()))  # fmt: skip
    layers = llm.model.config.num_hidden_layers
    del llm
    torch.cuda.empty_cache()
    return {"steps": 5, "gemm_kernels": gemm,
            "gemm_kernels_per_layer": (gemm - 5) / (5 * layers)}  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the largest shape that fits")
    ap.add_argument("--prompts", type=int, default=None, help="default: up to 128 that fit")
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--systems", nargs="+", default=["pagedkv", "pagedkv-eager", "hf"])
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--layer-ops", choices=["default", "torch"], default="default",
                    help="default: layer_ops chooses (Triton on a GPU); torch: LayerOps")
    ap.add_argument("--judge", type=int, default=8,
                    help="requests whose tokens are judged (pagedkv_lab.bench.compare)")
    ap.add_argument("--out", default="decode-report")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        args.prompts, args.prompt_len, args.new_tokens = 4, 40, 8
    device = torch.device("cuda")
    # the card decides: the largest real shape whose weights take at most half its
    # memory (in the library's dtype: bf16 from sm_80, fp16 before)
    args.model = args.model or largest_real_shape(device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bw = copy_bandwidth(device)
    model, tokenizer = load_model(args.model, device=device)
    spec = KVSpec.from_config(model.config, model.dtype)
    if args.prompts is None:  # as many as 128 whose K/V fit beside the weights
        free = 0.8 * gpu_spec(device).total_memory  # an emulated card's, if any
        free -= sum(p.numel() * p.element_size() for p in model.parameters())
        per_prompt = 1.3 * (args.prompt_len + args.new_tokens) * spec.bytes_per_token
        args.prompts = max(1, min(128, int(free // per_prompt)))
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(
        3, 4000, (args.prompts, args.prompt_len), generator=g
    ).tolist()
    contexts = [args.prompt_len + t for t in range(1, args.new_tokens)]
    kv_read = args.prompts * spec.bytes_per_token * statistics.mean(contexts)
    weights = weight_bytes_per_step(model)
    floor_ms = 1e3 * (weights + kv_read) / bw
    kv_bytes = int(1.3 * args.prompts * (args.prompt_len + args.new_tokens)
                   * spec.bytes_per_token) + (64 << 20)  # fmt: skip
    res = {"model": args.model, "dtype": str(model.dtype), "gpu": torch.cuda.get_device_name(),
           "copy_GBps": bw / 1e9, "weight_GB": weights / 1e9, "kv_GB_per_step": kv_read / 1e9,
           "floor_ms": floor_ms, "layer_ops": args.layer_ops, "systems": {}}  # fmt: skip
    print(json.dumps({k: v for k, v in res.items() if k != "systems"}, indent=1))
    judge = min(args.judge, args.prompts)
    base = None  # the first of our systems: its tokens are the teacher-forced ones
    for name in args.systems:
        t0 = time.perf_counter()
        try:
            if name == "hf":
                r = time_hf(model, prompts, args.new_tokens)
            else:
                first = [] if base is None else res["systems"][base]["tokens"]
                r = time_ours(model, tokenizer, prompts, args.new_tokens, kv_bytes,
                              eager=name.endswith("eager"), layer_ops=args.layer_ops,
                              judge=judge, base_tokens=[first.get(i, [])
                              for i in range(judge)] if first else None)  # fmt: skip
                base = base or name
        except Exception as err:  # every system runs; the failure is reported
            import traceback

            traceback.print_exc()
            res["systems"][name] = {"error": repr(err)}
            continue
        if "decode_ms" in r:
            ms = r["decode_ms"]
            r["decode_ms_median"], r["decode_ms_min"], r["decode_ms_max"] = (
                statistics.median(ms),
                min(ms),
                max(ms),
            )
        res["systems"][name] = r
        print(f"{name}: {time.perf_counter() - t0:.0f} s")
    if args.profile:
        res["profile"] = profile_ours(model, tokenizer, prompts, kv_bytes, out,
                                      args.layer_ops)
    judged = judge_tokens(res, model, prompts, args.new_tokens, judge, base)
    lines = [f"\n{args.model} {res['dtype']}, {args.prompts} x {args.prompt_len} tokens, "
             f"{args.new_tokens} new; floor {floor_ms:.1f} ms/step "
             f"(weights {weights / 1e9:.1f} GB + K/V {kv_read / 1e9:.1f} GB at {bw / 1e12:.2f} TB/s)",
             f"{'system':16} {'decode ms/step':>16} {'x floor':>8} {'prefill s':>10} "
             f"{'tokens judged':>14}"]  # fmt: skip
    agreements = []
    for name, r in res["systems"].items():
        if "error" in r:
            lines.append(f"{name:16} error: {r['error'][:80]}")
            continue
        ms = r.get("decode_ms_median", r.get("decode_ms_mean"))
        spread = (f" ({r['decode_ms_min']:.1f}-{r['decode_ms_max']:.1f})"
                  if "decode_ms_min" in r else "")  # fmt: skip
        verdict = "n/a"
        if name in judged:
            agree = judged[name]
            r["agreement"], r["sound"] = agree.summary(), agree.sound
            verdict = f"{judge}, " + ("sound" if agree.sound else "FAIL")
            agreements.append(f"{name} against {base}: {agree.summary()}")
        elif judged is None and name != "hf":
            verdict = "not judged"
        lines.append(f"{name:16} {ms:9.1f}{spread:>7} {ms / floor_ms:8.2f} "
                     f"{r['prefill_s']:10.2f} {verdict:>14}")  # fmt: skip
    if judged is None:
        agreements.append("tokens not judged: the float32 reference does not fit in the "
                          "GPU's free memory (or no system of ours ran)")
    for name, r in res["systems"].items():
        step = r.get("fused_step", {})
        if "gemms_per_layer" in step:
            lines.append(f"{name}: {step['gemms_per_layer']:.0f} GEMMs and "
                         f"{step['concats_per_layer']:.0f} concatenations a layer, "
                         f"{step['projections']}, {step['layer_ops']}"
                         + (f"; {r['graph_buckets']} graphs captured in {r['capture_s']:.1f} s, "
                            f"{r['graph_pool_bytes'] / 2**30:.2f} GiB" if "capture_s" in r else ""))  # fmt: skip
    lines += agreements
    if "profile" in res:
        lines.append(f"profile: {res['profile']['gemm_kernels_per_layer']:.1f} GEMM kernels "
                     "a layer and step")  # fmt: skip
    for r in res["systems"].values():
        r.pop("tokens", None)
        r.pop("scores", None)
    (out / "results.json").write_text(json.dumps(res, indent=1))
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    # every judged system's tokens sound (pagedkv_lab.bench.compare); a failure fails the step
    return 0 if all(r.get("sound", True) for r in res["systems"].values()) else 1


def judge_tokens(res: dict, model, prompts, new_tokens: int, n: int, base: str | None):
    """`compare_systems` on the first ``n`` requests of every system that ran,
    against ``base`` (the first of ours): identity in float32; in 16 bits both
    checks against the float32 copy of ``model`` (None if it does not fit)."""
    runs = {k: r for k, r in res["systems"].items() if "tokens" in r}
    if base is None or not n or base not in runs:
        return None
    tokens = {k: (r["tokens"] if isinstance(r["tokens"], list) else
                  [r["tokens"].get(i, []) for i in range(len(prompts))])[:n]
              for k, r in runs.items()}  # fmt: skip
    tokens = {base: tokens.pop(base), **tokens}
    if model.dtype == torch.float32:
        return compare_systems(tokens, [new_tokens] * n, exact=True)
    need = 4 * sum(p.numel() for p in model.parameters())
    if model.device.type == "cuda" and torch.cuda.mem_get_info()[0] < 1.2 * need:
        return None
    scores = {k: r["scores"] for k, r in runs.items() if "scores" in r}
    reference32 = float32_copy(model)
    try:
        return compare_systems(tokens, [new_tokens] * n, exact=False, model=model,
                               prompts=prompts[:n], scores=scores, reference32=reference32,
                               forced_by={k: "this engine" for k in scores})  # fmt: skip
    finally:
        del reference32
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
