"""The compile matrix (issue 54): every Triton kernel the course launches, in every
configuration the device rule picks for each card it knows, compiled on this
machine by Triton's own compiler for that card's target. No GPU is needed:
Triton lowers a kernel to PTX and its bundled ``ptxas`` assembles the PTX for
any NVIDIA architecture.

    python -m pagedkv_lab.bench compile --json book/reports/compiled/kernels.json

**What is launched** is found by running the library's own launch code, not a
copy of it: `paged_attention_tiled` (the library's default, decode and prefill),
`paged_attention_triton` (the first kernel), each rung of chapter 04c's and
appendix 04d's ladders, and `TritonLayerOps` (chapter 05b), on CPU tensors of
GPU sizes, with the card's rules put in place of a real card's (`_on_card`: its
compute capability, name and multiprocessors, as `device.gpu_spec` would read
them) and each ``@triton.jit`` kernel replaced by a recorder of its arguments.
Triton's own binder then turns those arguments into what a launch compiles
(types, constants, the integers it specialises as 1 or as multiples of 16, the
options), and `triton.compile` compiles it for the card's `GPUTarget`.

**What is recorded** per card, kernel and configuration: whether it compiled
(else the compiler's error), registers a thread, spill stores and loads and the
stack frame (bytes a thread, from ``ptxas -v``, which Triton runs), shared
memory (Triton's dynamic share plus any static) against the most one block may
use on the card, whether the PTX multiplies on the tensor cores (``wgmma``,
Hopper's warpgroup instruction, or ``mma.sync``) or not at all, and the
programs a multiprocessor holds at once (`programs_per_sm`, by CUDA's occupancy
rules). Compiling needs ``TRITON_INTERPRET=0`` before the kernels are defined:
the ``compile`` command of ``python -m pagedkv_lab.bench`` restarts itself
with it where the package chose the interpreter.

**What it cannot see**: time. A kernel that compiles, fits and does not spill
may still be slow; only a run on the card measures that. Pointers are taken as
16-byte aligned (as PyTorch's allocator returns them); a launch on a slice at
another offset compiles one more variant, which differs in its loads only.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import torch

from pagedkv_lab.bench.kernel import (
    LADDER_DECODE_SHAPES,
    LADDER_HEADS,
    LADDER_PREFILL_SHAPES,
)
from pagedkv_lab.device import KNOWN_GPUS, GPUSpec, default_dtype

#: Where the committed matrix lives (`make compile-matrix` writes it).
COMMITTED = Path("book/reports/compiled/kernels.json")


@dataclass(frozen=True)
class Card:
    """A card the matrix compiles for: the device rule's `GPUSpec` and the limits
    that decide whether a compiled kernel launches and how many of its programs
    a multiprocessor holds (CUDA C++ Programming Guide, "Technical
    Specifications per Compute Capability"; the allocation units and the
    per-block reservation as CUDA's occupancy calculator, ``cuda_occupancy.h``,
    counts them)."""

    name: str
    spec: GPUSpec
    shared_per_block: int  # the most shared memory one block may use (opt-in)
    shared_per_sm: int
    shared_reserved: int  # the runtime's own shared memory per block (sm_80 on)
    shared_unit: int  # shared memory is allocated in units of this many bytes
    warps_per_sm: int
    blocks_per_sm: int
    registers_per_sm: int = 65536
    register_unit: int = 256  # registers are allocated per warp in these units
    partitions: int = 4  # a multiprocessor's register file is split in four

    @property
    def target(self) -> str:
        major, minor = self.spec.capability
        return f"sm_{major}{minor}"

    @property
    def dtype(self) -> torch.dtype:
        """The library's dtype on this card (`device.default_dtype`)."""
        return default_dtype(self.spec)


KIB = 1024
#: The cards of the matrix. The H200 is not among `device.KNOWN_GPUS`; its spec
#: here: sm_90 and 132 multiprocessors as the H100 SXM, and the 143,771 MiB
#: `nvidia-smi` reports for its 141 GB.
CARDS = {
    "T4": Card("T4", KNOWN_GPUS["T4"], 64 * KIB, 64 * KIB, 0, 256, 32, 16),
    "A100": Card("A100", KNOWN_GPUS["A100-40GB"], 163 * KIB, 164 * KIB, KIB, 128, 64, 32),
    "L4": Card("L4", KNOWN_GPUS["L4"], 99 * KIB, 100 * KIB, KIB, 128, 48, 24),
    "H100": Card("H100", KNOWN_GPUS["H100-80GB"], 227 * KIB, 228 * KIB, KIB, 128, 64, 32),
    "H200": Card("H200", GPUSpec("NVIDIA H200", (9, 0), 143_771 * 2**20, 132),
                 227 * KIB, 228 * KIB, KIB, 128, 64, 32),
}  # fmt: skip


def programs_per_sm(card: Card, registers: int, warps: int, shared: int) -> tuple[int, str]:
    """Programs (CTAs) of ``warps`` warps that one multiprocessor of ``card`` holds
    at once, and what limits them: registers (allocated per warp in units of
    256, in each of the four partitions of the register file), shared memory
    (in the card's units, plus the runtime's reservation per block), warps,
    or the card's most blocks. 0 when one program does not fit at all."""
    if shared > card.shared_per_block or registers > 255:
        return 0, "shared memory" if shared > card.shared_per_block else "registers"
    per_warp = -(-registers * 32 // card.register_unit) * card.register_unit
    per_partition = card.registers_per_sm // card.partitions
    by_regs = (per_partition // per_warp) * card.partitions // warps if per_warp else 99
    used = -(-shared // card.shared_unit) * card.shared_unit + card.shared_reserved
    limits = {"warps": card.warps_per_sm // warps, "blocks": card.blocks_per_sm,
              "registers": by_regs,
              "shared memory": card.shared_per_sm // used if used else 99}  # fmt: skip
    fewest = min(limits.values())
    return fewest, next(k for k, v in limits.items() if v == fewest)


# ---- what the course launches ------------------------------------------------

#: Models whose shapes the chapters and scripts run on a GPU (real checkpoints'
#: architectures, and chapter 06's small-llama); the tiny test models that the
#: chapters also run there are left out.
MODELS = ("Llama-3-8B", "Llama-3.2-1B", "Qwen2.5-0.5B", "Qwen3-0.6B", "small-llama")
#: (batch, context) of decode and (prompts, tokens) of prefill: the ladders' shapes
#: (`bench.kernel`), and one sequence alone, where decode splits its keys most.
DECODE_SHAPES = ((1, 4096), *LADDER_DECODE_SHAPES)
PREFILL_SHAPES = LADDER_PREFILL_SHAPES
BLOCK_SIZE = 16  # the engine's default


@dataclass(frozen=True)
class Shape:
    """What a model gives the kernels: heads, KV heads, head size, hidden size
    and whether it normalises q and k (Qwen3)."""

    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    qk_norm: bool


def model_shape(name: str) -> Shape:
    """A model's `Shape`, from its config (`models.real_model_shapes`, or the
    offline configs for the small ones)."""
    from pagedkv_lab.models import offline_config, real_model_shapes

    shapes = real_model_shapes()
    c = shapes[name] if name in shapes else offline_config(name)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return Shape(c.num_attention_heads, c.num_key_value_heads, head_dim, c.hidden_size,
                 c.model_type == "qwen3")  # fmt: skip


def _decode_problem(s: Shape, batch: int, ctx: int, dtype: torch.dtype):
    """Decode tensors of the engine's types and strides, on the CPU: a cache of one
    block (no kernel runs, and the tables are never read)."""
    from pagedkv_lab.kernels import AttentionMetadata

    q = torch.empty(batch, s.heads, s.head_dim, dtype=dtype)
    k = torch.empty(1, BLOCK_SIZE, s.kv_heads, s.head_dim, dtype=dtype)
    tables = torch.zeros(batch, -(-ctx // BLOCK_SIZE), dtype=torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.long)
    return q, k, torch.empty_like(k), AttentionMetadata(tables, lens)


def _prefill_problem(s: Shape, seqs: int, length: int, dtype: torch.dtype):
    from pagedkv_lab.kernels import AttentionMetadata

    q = torch.empty(seqs * length, s.heads, s.head_dim, dtype=dtype)
    k = torch.empty(1, BLOCK_SIZE, s.kv_heads, s.head_dim, dtype=dtype)
    tables = torch.zeros(seqs, -(-length // BLOCK_SIZE), dtype=torch.int32)
    lens = torch.full((seqs,), length, dtype=torch.long)
    starts = torch.arange(seqs + 1, dtype=torch.long) * length
    return q, k, torch.empty_like(k), AttentionMetadata(tables, lens, starts)


def _layer_calls(s: Shape, tokens: int, dtype: torch.dtype) -> dict[str, Callable]:
    """Chapter 05b's three layer ops as the fused engine calls them."""
    from pagedkv_lab.kernels.triton_layers import TritonLayerOps

    ops = TritonLayerOps(fallback=None)
    x = torch.empty(tokens, s.hidden, dtype=dtype)
    norm = (torch.empty(s.hidden, dtype=dtype), 1e-6)
    inter = 4 * s.hidden  # silu_mul's columns: a runtime argument
    qkv = torch.empty(tokens, s.heads + 2 * s.kv_heads, s.head_dim, dtype=dtype)
    cos = torch.empty(tokens, s.head_dim, dtype=dtype)
    k = torch.empty(1, BLOCK_SIZE, s.kv_heads, s.head_dim, dtype=dtype)
    step = SimpleNamespace(kv_cache=SimpleNamespace(layers=[(k, torch.empty_like(k))]),
                           slot_mapping=torch.zeros(tokens, dtype=torch.long))  # fmt: skip
    qk_norm = (torch.empty(2, s.head_dim, dtype=dtype), 1e-6) if s.qk_norm else None
    return {
        "rms norm": lambda: ops.add_rms_norm(x, None, norm),
        "add + rms norm": lambda: ops.add_rms_norm(x, x, norm),
        "silu x up": lambda: ops.act_mul(torch.empty(tokens, 2 * inter, dtype=dtype), "silu"),
        "rope + cache write": lambda: ops.rope_and_store(step, 0, qkv, cos, cos, s.heads,
                                                         qk_norm),
    }  # fmt: skip


def course_launches(card: Card) -> Iterator[tuple[str, Callable]]:
    """(label, call) for every launch the course makes on ``card``, in the card's
    dtype: the library's defaults and the first kernel for each of `MODELS` at
    each shape, both ladders at their own shapes, and the layer ops."""
    from pagedkv_lab.course.ladder import DECODE_LADDER, PREFILL_LADDER
    from pagedkv_lab.kernels.triton_decode import paged_attention_triton
    from pagedkv_lab.kernels.triton_tiled import paged_attention_tiled

    dtype = card.dtype
    for name in MODELS:
        s = model_shape(name)
        for batch, ctx in DECODE_SHAPES:
            args = _decode_problem(s, batch, ctx, dtype)
            where = f"{name}, batch {batch} x {ctx}"
            yield f"decode (library): {where}", lambda a=args: paged_attention_tiled(
                *a, check=False)
            yield f"first kernel decode: {where}", lambda a=args: paged_attention_triton(
                *a, check=False)
        for seqs, length in PREFILL_SHAPES:
            args = _prefill_problem(s, seqs, length, dtype)
            yield f"prefill (library): {name}, {seqs} x {length}", (
                lambda a=args: paged_attention_tiled(*a, check=False))
        for what, call in _layer_calls(s, 256, dtype).items():
            yield f"{what}: {name}", call
    heads, kv_heads, head_dim = LADDER_HEADS
    ladder = Shape(heads, kv_heads, head_dim, heads * head_dim, False)
    for kind, rungs, shapes, problem in (
        ("decode", DECODE_LADDER, LADDER_DECODE_SHAPES, _decode_problem),
        ("prefill", PREFILL_LADDER, LADDER_PREFILL_SHAPES, _prefill_problem),
    ):
        for shape in shapes:
            args = problem(ladder, *shape, dtype)
            for i, rung in enumerate(rungs):
                if rung.kernel != "torch":
                    yield (rung_label(kind, i, rung, shape),
                           lambda r=rung, x=args: r(*x))  # fmt: skip
    yield from _ladder_checks()


def _ladder_checks() -> Iterator[tuple[str, Callable]]:
    """Every rung of both ladders as chapters 04c and 04d check it against
    float64 on any device: fp32, head_dim 24, a group of 3, blocks of 8, the
    keys split (partitions of 2 blocks, 3 segments) so that the merges run."""
    import torch

    from pagedkv_lab.course.kernel_checks import random_paged_problem
    from pagedkv_lab.course.ladder import DECODE_LADDER, PREFILL_LADDER
    from pagedkv_lab.kernels import AttentionMetadata, triton_decode, triton_tiled

    kc, vc, meta, gen = random_paged_problem(3, 2, 24, 8, 7, seed=21,
                                             shared_first_block=True)  # fmt: skip
    decode = (torch.randn(3, 6, 24, generator=gen), kc, vc, meta)
    ctx, new = torch.tensor([16, 1, 49]), [5, 1, 19]
    starts = torch.tensor([0, *new]).cumsum(0)
    prefill = (torch.randn(sum(new), 6, 24, generator=gen), kc, vc,
               AttentionMetadata(meta.block_tables, ctx, starts))  # fmt: skip

    def forced(rung, args):
        with mock.patch.object(triton_decode, "decode_partitions", lambda *a: 2), \
                mock.patch.object(triton_tiled, "tiled_segments", lambda *a: 3):  # fmt: skip
            rung(*args)

    for kind, rungs, args in (("decode", DECODE_LADDER, decode),
                              ("prefill", PREFILL_LADDER, prefill)):  # fmt: skip
        for i, rung in enumerate(rungs):
            if rung.kernel != "torch":
                yield f"check of {kind} rung {i}", lambda r=rung, a=args: forced(r, a)


def rung_label(kind: str, i: int, rung, shape: tuple[int, int]) -> str:
    """The launch label of ladder rung ``i`` at ``shape`` in the matrix."""
    return f"{kind} rung {i} ({rung.name}): {shape[0]} x {shape[1]}"


KERNELS = {  # the module of every kernel the course launches
    "_paged_decode_kernel": "triton_decode",
    "_tiled_attention_kernel": "triton_tiled", "_merge_segments_kernel": "triton_tiled",
    "_add_rms_norm_kernel": "triton_layers", "_silu_mul_kernel": "triton_layers",
    "_rope_store_kernel": "triton_layers",
}  # fmt: skip


@contextlib.contextmanager
def _on_card(card: Card, seen: list):
    """The library's launch code, on CPU tensors, as it would launch on ``card``:
    the card's capability, name and multiprocessors where the code reads a card
    (`triton_tiled._card`, `_multiprocessors`), a CUDA device where it asks for
    one (`_tiled_plan`, `decode_partitions`; the tensors stay on the CPU), and
    each kernel a recorder: ``seen`` gets (kernel, args, kwargs) per launch."""
    from pagedkv_lab.kernels import triton_decode, triton_layers, triton_tiled

    cuda = torch.device("cuda", 0)
    plan, partitions = triton_tiled._tiled_plan, triton_decode.decode_partitions

    def planned(q, *rest):  # the plan reads q's shape, dtype and device only
        return plan(SimpleNamespace(shape=q.shape, dtype=q.dtype, device=cuda), *rest)

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append((self.name, args, kwargs))

    modules = {"triton_decode": triton_decode, "triton_tiled": triton_tiled,
               "triton_layers": triton_layers}  # fmt: skip
    patches = [
        mock.patch.object(triton_decode, "interpreting", lambda: True),  # CPU tensors pass
        mock.patch.object(triton_tiled, "interpreting", lambda: False),
        mock.patch.object(triton_tiled, "_tiled_plan", planned),
        mock.patch.object(triton_tiled, "_card", lambda i: (card.spec.capability,
                                                            card.spec.name)),
        mock.patch.object(triton_tiled, "_multiprocessors",
                          lambda i: card.spec.multiprocessors),
        mock.patch.object(triton_decode, "_multiprocessors",
                          lambda i: card.spec.multiprocessors),
        mock.patch.object(triton_decode, "decode_partitions",
                          lambda s, h, b, device: partitions(s, h, b, cuda)),
        mock.patch.object(triton_layers, "triton_takes", lambda *t: True),
        *(mock.patch.object(modules[m], k, Recorder(k)) for k, m in KERNELS.items()),
    ]  # fmt: skip
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield


def record_launches(card: Card, calls=None) -> list:
    """``[(label, kernel, args, kwargs)]``: every kernel launch of ``calls``
    (default: `course_launches`) on ``card``, recorded, not run."""
    out, seen = [], []
    with _on_card(card, seen), warnings_quiet():
        for label, call in course_launches(card) if calls is None else calls:
            seen.clear()
            call()
            out += [(label, kernel, args, kwargs) for kernel, args, kwargs in seen]
    return out


@contextlib.contextmanager
def warnings_quiet():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# ---- what each launch compiles -----------------------------------------------


def _triton():
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import MockTensor, create_function_from_signature

    return SimpleNamespace(triton=triton, GPUTarget=GPUTarget, ASTSource=ASTSource,
                           make_backend=make_backend, MockTensor=MockTensor,
                           binder=create_function_from_signature)  # fmt: skip


def _kernel(name: str):
    import importlib

    module = importlib.import_module(f"pagedkv_lab.kernels.{KERNELS[name]}")
    return getattr(module, name)


def specialise(card: Card, kernel: str, args: tuple, kwargs: dict):
    """What Triton compiles for this launch on ``card``, as its own launcher
    decides it (`JITFunction.run`: the binder, then `_pack_args`): ``(src,
    options, config)``; ``config`` describes it in plain values."""
    from triton import knobs

    t = _triton()
    fn = _kernel(kernel)
    backend = t.make_backend(t.GPUTarget("cuda", _cc(card), 32))
    kwargs = dict(kwargs, debug=fn.debug or knobs.runtime.debug,
                  instrumentation_mode=knobs.compilation.instrumentation_mode,
                  fpsan_homomorphic_casts=knobs.compilation.fpsan_homomorphic_casts)  # fmt: skip
    stand_ins = [t.MockTensor(a.dtype) if isinstance(a, torch.Tensor) else a for a in args]
    bound, specialization, options = t.binder(fn.signature, fn.params, backend)(
        *stand_ins, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(
        backend, kwargs, bound, specialization, options)
    names = fn.arg_names
    constants = {names[i[0]]: _plain(v) for i, v in constexprs.items()}
    config = {
        "constants": dict(sorted(constants.items())),
        "pointers": {k: v[1:] for k, v in signature.items() if v.startswith("*")},
        "divisible_by_16": sorted(names[i[0]] for i, a in attrs.items()
                                  if ["tt.divisibility", 16] in a),
        "num_warps": options.num_warps, "num_stages": options.num_stages,
        "source": fn.cache_key[:16],  # the kernel's code and what it calls
    }  # fmt: skip
    return t.ASTSource(fn, signature, constexprs, attrs), options, config


def _plain(value):
    return value if isinstance(value, (bool, int, float, str)) or value is None else str(value)


def _cc(card: Card) -> int:
    major, minor = card.spec.capability
    return 10 * major + minor


def config_key(kernel: str, config: dict) -> str:
    """A configuration's short name: a hash of the kernel and what it compiles."""
    text = json.dumps([kernel, config], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


_PTXAS = {
    "registers": re.compile(r"Used (\d+) registers"),
    "static_shared": re.compile(r"(\d+) bytes smem"),
    "stack": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
}


def compile_one(card: Card, src, options) -> dict:
    """Compile for ``card``'s target: registers, spills and stack from ``ptxas
    -v`` (Triton runs it; its log is read here), shared memory, and which
    tensor-core instruction the PTX uses; or the compiler's error."""
    from triton import knobs

    t = _triton()
    log = io.StringIO()
    start = time.perf_counter()
    try:
        with knobs.nvidia.scope(), knobs.compilation.scope(), \
                contextlib.redirect_stdout(log), warnings_quiet():  # fmt: skip
            knobs.nvidia.dump_ptxas_log = True
            knobs.compilation.always_compile = True  # so that ptxas runs, and logs
            k = t.triton.compile(src, target=t.GPUTarget("cuda", _cc(card), 32),
                                 options=options.__dict__)  # fmt: skip
    except Exception as err:  # noqa: BLE001  (the compiler's error is the result)
        lines = [line for line in str(err).splitlines() if line.strip()]
        return {"compiled": False, "error": " / ".join(lines[:3])[:400],
                "seconds": time.perf_counter() - start}  # fmt: skip
    text = log.getvalue()
    got = {k: int(m.group(1)) if (m := p.search(text)) else 0 for k, p in _PTXAS.items()}
    ptx = k.asm["ptx"]
    cores = "wgmma" if "wgmma.mma_async" in ptx else "mma" if "mma.sync" in ptx else "none"
    return {"compiled": True, "error": None, **got,
            "shared": k.metadata.shared + got["static_shared"], "tensor_cores": cores,
            "seconds": time.perf_counter() - start}  # fmt: skip


def card_facts(card: Card, compiled: dict, num_warps: int) -> dict:
    """What a compiled kernel means on ``card``: whether its shared memory fits a
    block there, and the programs a multiprocessor holds (`programs_per_sm`)."""
    if not compiled["compiled"]:
        return {"fits": False, "programs_per_sm": 0, "limited_by": "compile error"}
    n, limit = programs_per_sm(card, compiled["registers"], num_warps, compiled["shared"])
    return {"shared_limit": card.shared_per_block,
            "fits": compiled["shared"] <= card.shared_per_block,
            "programs_per_sm": n, "limited_by": limit}  # fmt: skip


#: The fields of an entry that a re-run must reproduce (`tests/test_compile_matrix.py`).
COMPARED = ("compiled", "error", "registers", "spill_stores", "spill_loads", "stack",
            "shared", "tensor_cores", "fits", "programs_per_sm", "limited_by")  # fmt: skip

#: Tiles (rows, keys) compiled for a T4 beside the rule's own, 4 warps, to see which
#: spill there (`candidate_launches`): what `TILE_SIZES_PRE_AMPERE` is chosen from.
T4_CANDIDATES = ((16, 16), (16, 32), (16, 64), (32, 32), (32, 64))


def candidate_launches(card: Card) -> Iterator[tuple[str, Callable]]:
    """The tiled kernel with each of `T4_CANDIDATES`' tiles, decode (batch 64 x
    4,096) and prefill (4 x 1,024), at head_dim 128 and 64."""
    from pagedkv_lab.kernels.triton_tiled import paged_attention_tiled

    for name in ("Llama-3-8B", "Llama-3.2-1B"):
        s = model_shape(name)
        for kind, args in (("decode", _decode_problem(s, 64, 4096, card.dtype)),
                           ("prefill", _prefill_problem(s, 4, 1024, card.dtype))):
            for rows, keys in T4_CANDIDATES:
                yield (f"candidate {kind} {rows}x{keys}: {name}",
                       lambda a=args, t=(rows, keys): paged_attention_tiled(
                           *a, check=False, tuned=False, tile_sizes=t))  # fmt: skip


class _Compiler:
    """Each configuration compiled once per target (a card sharing another's
    target reuses its result), or taken from ``reuse``, a matrix written before
    by the same Triton, or from ``cache``: a file of one result a line, which
    every compile appends to, so that a run cut short loses nothing."""

    def __init__(self, reuse: dict | None, log, cache: Path | None = None):
        import triton

        self.done, self.log, self.cache = {}, log, cache
        if reuse and reuse.get("triton") == triton.__version__:
            for e in reuse.get("entries", []) + reuse.get("candidates", []):
                self.done[(e["target"], e["config"])] = {k: e[k] for k in _RESULT}
        if cache is not None and cache.exists():
            for line in cache.read_text().splitlines():
                r = json.loads(line)
                if r.pop("triton") == triton.__version__:
                    self.done[(r.pop("target"), r.pop("config"))] = r

    def __call__(self, card: Card, kernel: str, key: str, src, options) -> dict:
        if (card.target, key) not in self.done:
            got = compile_one(card, src, options)
            self.log(f"  {kernel:24} {key} {_summary(got)} ({got.pop('seconds'):.1f} s)")
            got = {k: got[k] for k in _RESULT}
            self.done[(card.target, key)] = got
            if self.cache is not None:
                import triton

                line = {"triton": triton.__version__, "target": card.target,
                        "config": key, **got}  # fmt: skip
                with self.cache.open("a") as f:
                    f.write(json.dumps(line) + "\n")
        return self.done[(card.target, key)]


_RESULT = ("compiled", "error", "registers", "stack", "spill_stores", "spill_loads",
           "shared", "tensor_cores")  # fmt: skip


def _entries(card: Card, launches, compiler: _Compiler, keep=None) -> list[dict]:
    """One entry per kernel and configuration of ``launches`` (recorded on
    ``card``), each with the labels of the launches that compile it; ``keep``:
    which (label, kernel) to compile at all."""
    entries = {}
    for label, kernel, args, kwargs in launches:
        if keep is not None and not keep(label, kernel):
            continue
        src, options, config = specialise(card, kernel, args, kwargs)
        key = config_key(kernel, config)
        if key not in entries:
            got = compiler(card, kernel, key, src, options)
            entries[key] = {"card": card.name, "target": card.target, "kernel": kernel,
                            "config": key, **config, **got,
                            **card_facts(card, got, config["num_warps"]),
                            "launches": []}  # fmt: skip
        entries[key]["launches"].append(label)
    return sorted(entries.values(), key=lambda e: (e["kernel"], e["config"]))


def build_matrix(cards=tuple(CARDS), keep=None, reuse: dict | None = None,
                 log=print, cache: Path | None = None) -> dict:  # fmt: skip
    """The matrix: for each card, one entry per kernel and configuration the
    course launches there, with the launches that compile it; and the T4's
    candidate tiles (`candidate_launches`). ``keep(label, kernel)``: only these
    launches (the sample); ``reuse``: results of an earlier matrix."""
    import triton

    compiler = _Compiler(reuse, log, cache)
    entries, candidates = [], []
    for name in cards:
        card = CARDS[name]
        launches = record_launches(card)
        log(f"{name} ({card.target}, {str(card.dtype)[6:]}): {len(launches)} launches")
        entries += _entries(card, launches, compiler, keep)
        if name == "T4" and keep is None:
            seen = record_launches(card, calls=candidate_launches(card))
            candidates += _entries(card, seen, compiler)
    return {
        "about": "python -m pagedkv_lab.bench compile (pagedkv_lab/bench/compile.py): "
        "every Triton kernel the course launches, compiled on a CPU by Triton for "
        "each card's target, in the configurations the device rule picks there. "
        "Sizes in bytes (registers and the stack: per thread). Compiled, not run: "
        "nothing here measures time.",
        "triton": triton.__version__,
        "cards": {n: _card_json(CARDS[n]) for n in cards},
        "models": {m: vars(model_shape(m)) for m in MODELS},
        "decode_shapes": DECODE_SHAPES, "prefill_shapes": PREFILL_SHAPES,
        "block_size": BLOCK_SIZE,
        "entries": entries,
        "candidates": candidates,
    }  # fmt: skip


def _summary(got: dict) -> str:
    if not got["compiled"]:
        return f"FAILED: {got['error'][:120]}"
    return (f"{got['registers']:3} regs, stack {got['stack']:5}, spills "
            f"{got['spill_stores']}/{got['spill_loads']}, shared {got['shared']:6}, "
            f"{got['tensor_cores']}")  # fmt: skip


def _card_json(card: Card) -> dict:
    return {"gpu": card.spec.name, "target": card.target, "dtype": str(card.dtype)[6:],
            "multiprocessors": card.spec.multiprocessors,
            "shared_per_block": card.shared_per_block, "shared_per_sm": card.shared_per_sm,
            "warps_per_sm": card.warps_per_sm, "blocks_per_sm": card.blocks_per_sm,
            "registers_per_sm": card.registers_per_sm}  # fmt: skip


# ---- reading the committed matrix ----------------------------------------------


def load_matrix(path: str | Path | None = None) -> dict | None:
    """The committed matrix (`COMMITTED` in a clone, else the installed copy's
    report folder), or None where there is none."""
    if path is None:
        from pagedkv_lab.course.committed import report_dir

        path = report_dir("compiled") / "kernels.json"
    path = Path(path)
    return json.loads(path.read_text()) if path.exists() else None


def entry_for(matrix: dict, card: str, label: str, kernel: str | None = None) -> dict:
    """The entry of ``card`` whose launches include ``label`` (and, given, of
    ``kernel``: a launch may run two kernels, the attention and its merge)."""
    for e in matrix["entries"]:
        if e["card"] == card and label in e["launches"]:
            if kernel is None or e["kernel"] == kernel:
                return e
    raise KeyError(f"no entry of {card} launches {label!r}")


def rung_resources(matrix: dict | None, card: str, kind: str, i: int, rung,
                   shape: tuple[int, int]) -> dict | None:  # fmt: skip
    """What chapter 04c's model (`course.ladder.predict_rung`) takes from the
    compiled attention kernel of ladder rung ``i`` at ``shape`` on ``card``:
    ``n_regs``, ``n_spills`` (the stack, in 32-bit words, as Triton counts
    spills), ``shared``, ``programs_per_sm`` and ``tensor_cores``; None for the
    PyTorch rung, or without a matrix."""
    if matrix is None or rung.kernel == "torch":
        return None
    kernel = "_paged_decode_kernel" if rung.kernel == "first" else "_tiled_attention_kernel"
    e = entry_for(matrix, card, rung_label(kind, i, rung, shape), kernel)
    return {"n_regs": e["registers"], "n_spills": e["stack"] // 4, "shared": e["shared"],
            "programs_per_sm": e["programs_per_sm"], "tensor_cores": e["tensor_cores"]}


def headline(matrix: dict) -> list[str]:
    """Per card: configurations compiled and failed, those that do not fit, the
    worst stack (spills), and which tensor-core instructions appear."""
    lines = []
    for name, c in matrix["cards"].items():
        es = [e for e in matrix["entries"] if e["card"] == name]
        ok = [e for e in es if e["compiled"]]
        worst = max(ok, key=lambda e: (e["stack"], e["spill_stores"]), default=None)
        cores = sorted({e["tensor_cores"] for e in ok if e["constants"].get("DOT")
                        and not all(x.startswith("check of") for x in e["launches"])})
        spilled = sum(1 for e in ok if e["spill_stores"] or e["stack"])
        lines.append(
            f"{name:5} {c['target']} {c['dtype']:8}: {len(ok)}/{len(es)} compiled, "
            f"{sum(not e['fits'] for e in ok)} too big for shared memory, "
            f"{spilled} with a stack; worst stack {worst['stack'] if worst else 0} B "
            f"({worst['kernel'] if worst else '-'}); tl.dot in its dtype: "
            f"{', '.join(cores)}")
    return lines


# ---- the command ---------------------------------------------------------------

#: The fixed sample CI compiles again (seconds): (card, launch label, kernel).
SAMPLE = (
    ("T4", "decode (library): Llama-3-8B, batch 8 x 1024", "_tiled_attention_kernel"),
    ("H100", "decode (library): Llama-3-8B, batch 8 x 1024", "_merge_segments_kernel"),
    ("L4", "rms norm: Qwen3-0.6B", "_add_rms_norm_kernel"),
)


def sample_matrix(log=print) -> dict:
    """The `SAMPLE` entries, compiled again here (`tests/test_compile_matrix.py`
    compares them with the committed matrix)."""
    entries = []
    for name in dict.fromkeys(card for card, _, _ in SAMPLE):
        wanted = {(label, kernel) for card, label, kernel in SAMPLE if card == name}
        launches = [x for x in record_launches(CARDS[name]) if x[:2] in wanted]
        entries += _entries(CARDS[name], launches, _Compiler(None, log))
    return {"entries": entries}


def launched_configs(cards=tuple(CARDS)) -> dict:
    """``{(card, kernel, config): [labels]}`` of today's launches (and the T4's
    candidates), recorded and specialised, none compiled: seconds."""
    out = {}
    for name in cards:
        card = CARDS[name]
        calls = [*course_launches(card)]
        if name == "T4":
            calls += [*candidate_launches(card)]
        for label, kernel, args, kwargs in record_launches(card, calls):
            config = specialise(card, kernel, args, kwargs)[2]
            out.setdefault((name, kernel, config_key(kernel, config)), []).append(label)
    return out


def check_matrix(matrix: dict, log=print) -> list[str]:
    """What is wrong with a committed ``matrix`` today: a launch whose
    configuration it lacks, an entry no launch compiles any more, or a `SAMPLE`
    entry that compiles differently now (compiled again here). Empty: it holds."""
    import triton

    if matrix is None:
        return ["no matrix there: run `make compile-matrix`"]
    if matrix.get("triton") != triton.__version__:
        return [f"the matrix was compiled by Triton {matrix.get('triton')}, this is "
                f"{triton.__version__}: run `make compile-matrix`"]  # fmt: skip
    committed: dict = {}  # an entry and a candidate may share a configuration
    for e in matrix["entries"] + matrix.get("candidates", []):
        committed.setdefault((e["card"], e["kernel"], e["config"]), []).extend(e["launches"])
    today = launched_configs(tuple(matrix["cards"]))
    problems = [f"{c} {k} {key}: launched by {labels[0]!r} and {len(labels) - 1} more, "
                "not in the matrix" for (c, k, key), labels in today.items()
                if (c, k, key) not in committed]  # fmt: skip
    problems += [f"{c} {k} {key}: in the matrix, launched by nothing today"
                 for (c, k, key) in committed if (c, k, key) not in today]  # fmt: skip
    problems += [f"{c} {k} {key}: launches {sorted(set(today[c, k, key]) ^ set(labels))[:2]}"
                 " differ" for (c, k, key), labels in committed.items()
                 if (c, k, key) in today and set(today[c, k, key]) != set(labels)]  # fmt: skip
    if problems:
        return problems[:20] + ["(run `make compile-matrix` and commit its kernels.json)"]
    by_key = {(e["card"], e["config"]): e for e in matrix["entries"]}
    for e in sample_matrix(log)["entries"]:
        was = by_key[(e["card"], e["config"])]
        for field in COMPARED:
            if e[field] != was[field]:
                problems.append(f"{e['card']} {e['kernel']} {e['config']}: {field} "
                                f"{e[field]!r} now, {was[field]!r} committed")  # fmt: skip
    return problems


def dump(matrix: dict) -> str:
    """The matrix as JSON, one entry a line (a change shows as the lines of the
    entries it changed)."""
    lists = ("entries", "candidates")
    head = json.dumps({k: v for k, v in matrix.items() if k not in lists}, indent=1)
    parts = [head[:-2]]
    for name in lists:
        if name in matrix:
            rows = ",\n".join("  " + json.dumps(e) for e in matrix[name])
            parts.append(f',\n "{name}": [\n{rows}\n ]')
    return "".join(parts) + "\n}\n"


def add_parser(sub) -> None:
    cp = sub.add_parser("compile", help="every Triton kernel compiled for each card "
                        "(no GPU needed): registers, spills, shared memory, occupancy")
    cp.add_argument("--json", default=None, help="write the matrix here")
    cp.add_argument("--cards", nargs="+", choices=list(CARDS), default=list(CARDS))
    cp.add_argument("--sample", action="store_true",
                    help="only the fixed sample that CI compiles again")
    cp.add_argument("--check", default=None, metavar="PATH", help="check a committed "
                    "matrix: every launch's configuration in it, and the sample "
                    "compiling as it says (exit 1 if not)")
    cp.add_argument("--cache", default=None, help="a file of compiled results, one a "
                    "line: read first, appended to as each configuration compiles")
    cp.add_argument("--reuse", default=None, help="a matrix written before (by the "
                    "same Triton): its configurations are not compiled again")  # fmt: skip


def compile_main(args) -> None:
    """Build the matrix (restarting with ``TRITON_INTERPRET=0`` where the kernels
    were defined for the interpreter), print its headline, write ``--json``."""
    if os.environ.get("TRITON_INTERPRET") != "0":
        argv = ["compile", *sys.argv[sys.argv.index("compile") + 1:]]
        env = {**os.environ, "TRITON_INTERPRET": "0"}
        sys.exit(subprocess.call([sys.executable, "-m", "pagedkv_lab.bench", *argv],
                                 env=env))  # fmt: skip
    start = time.perf_counter()
    if args.check:
        problems = check_matrix(load_matrix(args.check), log=lambda *a: None)
        print("\n".join(problems) or f"{args.check}: every launch's configuration "
              f"is in it, and the sample compiles as it says "
              f"({time.perf_counter() - start:.0f} s)")
        sys.exit(1 if problems else 0)
    if args.sample:
        matrix = sample_matrix()
    else:
        reuse = load_matrix(args.reuse) if args.reuse else None
        cache = Path(args.cache) if args.cache else None
        matrix = build_matrix(tuple(args.cards), reuse=reuse, cache=cache)
        print("\n".join(headline(matrix)))
    print(f"{len(matrix['entries'])} entries in {time.perf_counter() - start:.0f} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(dump(matrix))
        print(f"wrote {args.json}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pagedkv_lab.bench.compile")
    add_parser(parser.add_subparsers(dest="command", required=True))
    compile_main(parser.parse_args(argv))


if __name__ == "__main__":
    main()

__all__ = ["CARDS", "Card", "build_matrix", "entry_for", "headline", "load_matrix",
           "programs_per_sm", "record_launches", "rung_label", "rung_resources"]  # fmt: skip
