"""Each chapter's GPU time, predicted before a run (issue 54): the work a chapter
does at its GPU sizes, counted on a CPU, priced at the committed H100 costs.

    python -m pagedkv_lab.bench.plan          # every chapter: seconds, and what was counted
    python -m pagedkv_lab.bench.plan --tsv    # chapter<TAB>seconds (scripts/gpu_check.sh --plan)

**Counted**, at the sizes a chapter takes on a GPU (read from its own cells: the
``gpu`` value of each ``by_device(cpu, gpu)`` and the literals it assigns,
`gpu_values`), without a model and without a GPU:

* forward passes of the engine and of the peers (`bench.serve.count_steps` runs
  the engine's own scheduler on the requests; a static batch runs as many
  passes as its longest output; ``generate`` alone, one pass a token), and the
  sections of chapters 10 and 11, by `bench.report`'s step counters;
* rows of the kernel benchmarks (`bench.kernel.kernel_benchmark`, the ladders).

**Priced** at what the committed H100 runs measured (`h100_prices`): seconds a
forward pass per system (the run of 2026-11-26, its chapter 10 trace: each
system's median round over the passes counted for that round, as chapter 10
computes it), seconds a kernel-benchmark row (its chapter 10 kernel cell over
the rows of its grid) and the setup cell's seconds (the median over the
committed chapter logs).

**Not seen**: loading and warming the models, compiling Triton kernels and
capturing CUDA graphs outside the timed benchmarks, the small work a chapter
does as it does on a CPU, and any pass dearer than the run's (a larger model, a
longer context): the prediction is a floor for what it counts, not a bound on
the chapter. A chapter with no GPU sizes is priced at its setup alone.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
#: The time a chapter may take on an H100 (scripts/gpu_check.sh's CHAPTER_TIMEOUT).
CHAPTER_LIMIT_S = 60


# ---- a chapter's GPU sizes, read from its cells ---------------------------------


@dataclass(frozen=True)
class Call:
    """A call a chapter assigns, with the arguments that are literals."""

    name: str
    args: tuple
    kwargs: dict = field(default_factory=dict)


_UNKNOWN = object()


def _evaluate(node: ast.AST, names: dict):
    """A literal's value, with ``by_device(cpu, gpu)`` taken at ``gpu``, names
    assigned before, arithmetic, and other calls as `Call`; `_UNKNOWN` else."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return names.get(node.id, _UNKNOWN)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        items = [_evaluate(e, names) for e in node.elts]
        return _UNKNOWN if _UNKNOWN in items else tuple(items)
    if isinstance(node, ast.Dict):
        keys = [_evaluate(k, names) for k in node.keys]
        values = [_evaluate(v, names) for v in node.values]
        return _UNKNOWN if _UNKNOWN in keys else dict(zip(keys, values))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        value = _evaluate(node.operand, names)
        return -value if isinstance(value, (int, float)) else _UNKNOWN
    if isinstance(node, ast.BinOp):
        a, b = _evaluate(node.left, names), _evaluate(node.right, names)
        if not (isinstance(a, (int, float)) and isinstance(b, (int, float))):
            return _UNKNOWN
        ops = {ast.Add: a.__add__, ast.Sub: a.__sub__, ast.Mult: a.__mul__,
               ast.FloorDiv: a.__floordiv__, ast.Div: a.__truediv__}  # fmt: skip
        return ops[type(node.op)](b) if type(node.op) in ops else _UNKNOWN
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        args = tuple(_evaluate(a, names) for a in node.args)
        kwargs = {k.arg: _evaluate(k.value, names) for k in node.keywords if k.arg}
        if node.func.id == "by_device":  # the GPU's value
            return kwargs["gpu"] if "gpu" in kwargs else args[1] if len(args) > 1 else _UNKNOWN
        if node.func.id == "dict":
            return kwargs
        return Call(node.func.id, args, kwargs)
    return _UNKNOWN


def gpu_values(notebook: str | Path) -> dict:
    """``{name: value}`` for every name a chapter assigns (``a = ...`` and
    ``a, b = ...``), evaluated at its GPU sizes (`_evaluate`); the last
    assignment wins, as it would when the chapter runs top to bottom."""
    path = Path(notebook)
    if not path.is_absolute() and not path.exists():
        path = next(NOTEBOOKS.glob(f"{notebook}*.ipynb"))
    names: dict = {}
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        source = "\n".join(x for x in source.splitlines()
                           if not x.lstrip().startswith(("%", "!")))  # fmt: skip
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in tree.body:
            if not isinstance(node, ast.Assign) or len(node.targets) != 1:
                continue
            target, value = node.targets[0], node.value
            if isinstance(target, ast.Name):
                names[target.id] = _evaluate(value, names)
            elif isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
                for t, v in zip(target.elts, value.elts):
                    if isinstance(t, ast.Name):
                        names[t.id] = _evaluate(v, names)
    return {k: v for k, v in names.items() if v is not _UNKNOWN}


# ---- the committed H100 costs -------------------------------------------------


def h100_prices(report: Path | None = None) -> dict:
    """Seconds per unit of work on the committed H100 (``book/reports/h100``):
    ``step_s`` a forward pass per system, ``kernel_row_s`` a kernel-benchmark
    row, ``setup_s`` the setup cell, each with its source in ``sources``."""
    from pagedkv_lab.bench.common import SYSTEMS
    from pagedkv_lab.bench.report import serve_workload
    from pagedkv_lab.bench.serve import count_steps
    from pagedkv_lab.course.committed import report_dir

    report = report or report_dir("h100")
    run = report / "run_20261126"
    trace = (run / "notebook_10_benchmarks.trace.txt").read_text()
    workloads, n, length = ("w1", "w1-pressure", "w3-prefix"), 16, 128  # that run's
    rounds: dict = {}
    for name, part in zip(workloads, trace.split("pagedkv warm-up")[1:]):
        for system, seconds in re.findall(r": (\S+) round \d+: ([\d.]+) s", part):
            rounds.setdefault((name, system), []).append(float(seconds))
    step_s: dict = {}
    for name in workloads:
        w = serve_workload(name, n, length, 8, SYSTEMS)
        passes = count_steps(w["requests"], max_model_len=length,
                             budget_requests=w["budget_requests"], systems=w["systems"])
        for system in w["systems"]:
            s = statistics.median(rounds[name, system]) / passes[system]
            step_s[system] = max(step_s.get(system, 0.0), s)
    log10 = (run / "notebook_10_benchmarks.log").read_text()
    kernel_cell = float(re.search(r"([\d.]+) s  from pagedkv_lab.bench import "
                                  r"print_kernel_table", log10).group(1))  # fmt: skip
    rows10 = _kernel_section_rows(gpu_values("10_benchmarks")["kernel"])
    setups = []
    for log in sorted(report.glob("**/*.log")):
        setups += [float(s) for s in re.findall(r"\[\s*0\]\s+([\d.]+) s  # Setup",
                                                log.read_text())]  # fmt: skip
    return {
        "step_s": step_s, "kernel_row_s": kernel_cell / rows10,
        "setup_s": statistics.median(setups),
        "sources": {
            "step_s": f"{run.name}/notebook_10_benchmarks.trace.txt: median round / "
                      "passes counted (the worst of its three workloads)",
            "kernel_row_s": f"{run.name}/notebook_10_benchmarks.log: the kernel cell, "
                            f"{kernel_cell:.1f} s over {rows10} rows of 30 repeats "
                            "(chapter 10's GPU grid, taken to be that run's)",
            "setup_s": f"the setup cell, median of {len(setups)} committed chapter logs",
        },
    }  # fmt: skip


# ---- what each chapter does on a GPU ------------------------------------------


def _kernel_section_rows(call: Call) -> int:
    """Rows `bench.report.kernel_section` times on a GPU: its grid in fp16 and
    bf16, then one shape at each block size."""
    from pagedkv_lab.bench.report import BLOCK_SIZES

    k = call.kwargs
    return 2 * len(k["batch_sizes"]) * len(k["context_lens"]) + len(
        k.get("block_sizes", BLOCK_SIZES))


@dataclass
class Item:
    """One kind of work a chapter does at its GPU sizes: how many units, at what
    price, and where the count comes from."""

    what: str
    units: float
    unit_s: float
    counted_from: str

    @property
    def seconds(self) -> float:
        return self.units * self.unit_s


def _passes(requests, max_model_len, budget_requests, systems=("pagedkv",), **kw):
    from pagedkv_lab.bench.serve import count_steps

    return count_steps(requests, max_model_len=max_model_len,
                       budget_requests=budget_requests, systems=systems, **kw)  # fmt: skip


def _trace(call: Call):
    """A chapter's ``scaled_chat_trace(n, max_len, seed=...)``, at its GPU size."""
    from pagedkv_lab.bench import scaled_chat_trace

    return scaled_chat_trace(*call.args, **call.kwargs)


def _ch04b(v: dict, p: dict) -> list[Item]:
    grid, sweep = v["grid"], v["sweep_shape"]
    rows = len(grid["batch_sizes"]) * len(grid["context_lens"])
    swept = len(v["block_sizes"]) * len(sweep["batch_sizes"]) * len(sweep["context_lens"])
    return [Item("kernel benchmark rows (the grid, the block sizes)", rows + swept,
                 p["kernel_row_s"], "grid, sweep_shape x block_sizes")]  # fmt: skip


def _ch04c(v: dict, p: dict) -> list[Item]:
    from pagedkv_lab.bench.kernel import LADDER_DECODE_SHAPES
    from pagedkv_lab.course.ladder import DECODE_LADDER

    # a ladder row times one rung (a kernel-benchmark row times three paths)
    rows = len(LADDER_DECODE_SHAPES) * (len(DECODE_LADDER) + 1)
    return [Item("decode ladder: rungs and SDPA timed at each shape", rows,
                 p["kernel_row_s"] / 3, "LADDER_DECODE_SHAPES x DECODE_LADDER")]  # fmt: skip


def _ch06(v: dict, p: dict) -> list[Item]:
    import torch

    from pagedkv_lab.sim.workloads import Request

    step = p["step_s"]
    # "Nothing is lost under pressure": the chapter's own draw of lengths
    n = v["n_requests"]
    gen = torch.Generator().manual_seed(1)
    prompt_lens = torch.randint(1, 80, (n,), generator=gen)
    for k in prompt_lens:  # the prompts' tokens are drawn before the outputs' lengths
        torch.randint(3, 259, (int(k),), generator=gen)
    outputs = torch.randint(1, 48, (n,), generator=gen).tolist()
    pressure = [Request(i, 0.0, int(k) + 1, m) for i, (k, m) in
                enumerate(zip(prompt_lens.tolist(), outputs))]  # fmt: skip
    engine = _passes(pressure, 128, 3, block_size=8)["pagedkv"]  # 48 blocks of 8
    items = [Item("engine passes under a pool of 48 blocks", engine, step["pagedkv"],
                  "n_requests"),
             Item("generate alone, one pass a token", sum(outputs) + n,
                  step["hf-generate"], "n_requests")]  # fmt: skip
    trace, max_len, batch = _trace(v["trace"]), v["MAX_LEN"], v["B"]
    static = sum(max(r.output_len for r in trace[i:i + batch])
                 for i in range(0, len(trace), batch))  # fmt: skip
    cont = _passes(trace, max_len, batch, max_num_seqs=batch)["pagedkv"]
    items.append(Item("static batches and continuous batching", static + cont,
                      step["pagedkv"], "trace, MAX_LEN, B"))  # fmt: skip
    steps = v["ARRIVAL"] + v["LONG"] // v["CHUNK"] + 6
    items.append(Item(f"chunked prefill: {v['LONG']}-token prompt, 2 engines x 7 "
                      "rounds", 2 * 7 * steps, step["pagedkv"], "LONG, CHUNK, ARRIVAL"))
    bench = _trace(v["bench_trace"])
    per = _passes(bench, 512, 8, systems=tuple(step))
    items += [Item(f"serve_benchmark: {s}, warm-up and a round", 2 * per[s], step[s],
                   "bench_trace") for s in per]  # fmt: skip
    return items


def _ch10(v: dict, p: dict) -> list[Item]:
    from pagedkv_lab.bench.report import (
        blocks_section_steps,
        rate_section_steps,
        serve_section_steps,
    )

    s, step = v["GPU_SIZES"], p["step_s"]
    items = [Item("kernel section: rows in fp16 and bf16, and block sizes",
                  _kernel_section_rows(v["kernel"]), p["kernel_row_s"], "kernel")]
    serve = serve_section_steps(s["serve"]["num_requests"], s["serve"]["max_model_len"],
                                repeats=s["serve"]["repeats"], workloads=v["WORKLOADS"])
    for system in step:
        n = sum(per.get(system, 0) for per in serve.values())
        if n:
            items.append(Item(f"serve section: {system}", n, step[system], "GPU_SIZES"))
    rate = rate_section_steps(s["rate"]["num_requests"], s["rate"]["max_model_len"],
                              loads=v["LOADS"], seeds=s["rate"]["seeds"])
    blocks = blocks_section_steps(s["blocks"]["num_requests"],
                                  s["blocks"]["max_model_len"],
                                  repeats=s["blocks"]["repeats"])  # fmt: skip
    items += [Item("rate section (estimate)", rate, step["pagedkv"], "GPU_SIZES"),
              Item("block-size section", blocks, step["pagedkv"], "GPU_SIZES")]
    return items


def _ch11(v: dict, p: dict) -> list[Item]:
    from pagedkv_lab.bench import scaled_chat_trace
    from pagedkv_lab.bench.report import blocks_section_steps, rate_section_steps

    s, step = v["GPU_S2"], p["step_s"]
    serve = _passes(scaled_chat_trace(s["serve"], 256, seed=0), 256, 8,
                    systems=tuple(step))  # fmt: skip
    items = [
        Item("S1 kernel rows (3 runs)", 3 * len(v["S1_CONTEXTS"]), p["kernel_row_s"],
             "S1_CONTEXTS"),
        Item("S2 rate (estimate)", rate_section_steps(s["rate"], 128, budget_requests=2,
                                                      loads=v["S2_LOADS"], seeds=(0,)),
             step["pagedkv"], "GPU_S2"),
        Item("S4 end to end", blocks_section_steps(s["s4"], 128, budget_requests=8,
                                                   repeats=s["s4_rounds"]),
             step["pagedkv"], "GPU_S2"),
        Item("S2 gate", _passes(scaled_chat_trace(s["gate"], 128, seed=5), 128,
                                s["gate"])["pagedkv"], step["pagedkv"], "GPU_S2"),
        Item("S5 kernel rows (block sizes)", len(v["SIZES"]), p["kernel_row_s"],
             "SIZES, shape"),
    ]  # fmt: skip
    items += [Item(f"S2 serve: {k}, warm-up and 3 rounds", 4 * n, step[k], "GPU_S2")
              for k, n in serve.items()]  # fmt: skip
    trace = _trace(v["s3_trace"])
    batch, max_len = v["B"], v["S3_LEN"]
    static = sum(max(r.output_len for r in trace[i:i + batch])
                 for i in range(0, len(trace), batch))  # fmt: skip
    cont = _passes(trace, max_len, batch, max_num_seqs=batch)["pagedkv"]
    items.append(Item("S3 static vs continuous", static + cont, step["pagedkv"],
                      "s3_trace"))  # fmt: skip
    return items


#: Chapters whose GPU sizes are counted; every other chapter is priced at its setup.
COUNTED: dict[str, Callable] = {
    "04b_reading_blocks_in_place": _ch04b,
    "04c_climbing_to_the_copy_bandwidth": _ch04c,
    "06_continuous_batching": _ch06,
    "10_benchmarks": _ch10,
    "11_claims_audit": _ch11,
}


def chapter_plan(chapter: str, prices: dict) -> list[Item]:
    """The setup and the counted work of ``chapter`` (a notebook's stem)."""
    items = [Item("setup cell", 1, prices["setup_s"], "every chapter")]
    if chapter in COUNTED:
        items += COUNTED[chapter](gpu_values(NOTEBOOKS / f"{chapter}.ipynb"), prices)
    return items


def predict(prices: dict | None = None) -> dict[str, list[Item]]:
    """Every chapter's plan (`chapter_plan`), in the book's order."""
    prices = prices or h100_prices()
    chapters = sorted(p.stem for p in NOTEBOOKS.glob("[0-9][0-9]*_*.ipynb"))
    return {c: chapter_plan(c, prices) for c in chapters}


CAVEAT = ("counted: forward passes (the engine's scheduler, no model) and kernel "
          "benchmark rows at each chapter's GPU sizes; not seen: loading and warming "
          "models, Triton compiles and graph captures outside the benchmarks, the "
          "small work a chapter does as on a CPU, passes dearer than the run's. A "
          "floor for what it counts, not a bound on the chapter.")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pagedkv_lab.bench.plan",
                                 description=__doc__.split("\n\n")[0])  # fmt: skip
    ap.add_argument("--tsv", action="store_true", help="chapter<TAB>seconds only")
    args = ap.parse_args(argv)
    prices = h100_prices()
    plans = predict(prices)
    if args.tsv:
        for chapter, items in plans.items():
            print(f"{chapter}\t{sum(i.seconds for i in items):.0f}")
        return
    print("Each chapter's GPU time predicted on an H100 (seconds), before a run:")
    for chapter, items in plans.items():
        total = sum(i.seconds for i in items)
        over = "  OVER" if total > CHAPTER_LIMIT_S else ""
        print(f"{chapter:40} {total:6.0f}{over}")
        for i in items[1:]:
            print(f"    {i.what:54} {i.units:7.0f} x {i.unit_s:6.3f} s = {i.seconds:5.0f}")
    print("prices: " + "; ".join(f"{k}: {v}" for k, v in prices["sources"].items()))
    print(CAVEAT)


if __name__ == "__main__":
    main()
