"""One device-capability rule, checked on cards this machine does not have.

The tests mock what torch reports for a T4 (sm_75, 15 GiB, 40 SMs), an L4, an
A100-40GB and an H100-80GB, and check every decision the library derives from
it: the dtype, the tiled kernel's tiles and whether it may hand bf16 to
``tl.dot``, the kernel benchmark's row sizes, and the real shape the GPU scripts
pick. ``torch.cuda.is_bf16_supported`` is mocked to say True everywhere, as it
does on a T4 (it counts emulation), so a caller that asks it fails here.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pagedkv_lab import device as device_mod
from pagedkv_lab.bench.common import _kv_spec
from pagedkv_lab.bench.kernel import max_row_kv_bytes, row_peak_bytes
from pagedkv_lab.device import (
    KNOWN_GPUS,
    GPUSpec,
    default_dtype,
    gpu_spec,
    supports_bf16,
)
from pagedkv_lab.kernels.triton_tiled import (
    TILE_SIZES,
    TILE_SIZES_PRE_AMPERE,
    tiled_launch,
)
from pagedkv_lab.kvmath import KVSpec, count_parameters_from_config
from pagedkv_lab.models import largest_real_shape, real_model_shapes

CUDA = torch.device("cuda")
EXPECTED = {  # card -> (dtype, pre-Ampere tiles, the scripts' shape)
    "T4": (torch.float16, True, "Llama-3.2-1B"),
    "L4": (torch.bfloat16, False, "Llama-3.2-1B"),
    "A100-40GB": (torch.bfloat16, False, "Llama-3-8B"),
    "H100-80GB": (torch.bfloat16, False, "Llama-3-8B"),
}


@pytest.fixture(params=sorted(KNOWN_GPUS))
def card(request, monkeypatch):
    """Make torch report ``KNOWN_GPUS[name]`` as CUDA device 0."""
    spec = KNOWN_GPUS[request.param]
    props = SimpleNamespace(
        name=spec.name,
        major=spec.capability[0],
        minor=spec.capability[1],
        total_memory=spec.total_memory,
        multi_processor_count=spec.multiprocessors,
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a, **k: props)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: spec.capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    return request.param


def test_mocked_card_is_read_back(card):
    spec = gpu_spec(CUDA)
    assert spec == KNOWN_GPUS[card]
    assert gpu_spec(torch.device("cpu")) is None


def test_dtype_rule(card):
    dtype, _, _ = EXPECTED[card]
    assert default_dtype(CUDA) == dtype
    assert supports_bf16(CUDA) == (dtype == torch.bfloat16)
    assert default_dtype(torch.device("cpu")) == torch.float32


def test_no_bf16_dot_below_sm80(card):
    _, pre_ampere, _ = EXPECTED[card]
    capability = KNOWN_GPUS[card].capability
    for decode in (True, False):
        tiles, upcast = tiled_launch(torch.bfloat16, capability, decode)
        # bf16 reaches tl.dot only where the tensor cores take it
        assert upcast == pre_ampere
        table = TILE_SIZES_PRE_AMPERE if pre_ampere else TILE_SIZES
        assert tiles == table["decode" if decode else "prefill"]
        # fp16 goes to tl.dot as it is on every card (on the tensor cores from sm_80;
        # before, Triton multiplies on the CUDA cores: the compile matrix); fp32 upcasts
        assert tiled_launch(torch.float16, capability, decode)[1] is False
        assert tiled_launch(torch.float32, capability, decode)[1] is True
    # the interpreter (no capability) always upcasts: its bf16 arithmetic is wrong
    assert tiled_launch(torch.bfloat16, None, True)[1] is True


def test_pre_ampere_tiles_fit_64k_of_shared_memory():
    """K and V tiles of head_dim 128 in fp16 stay under a T4's 64 KiB."""
    for rows, keys in TILE_SIZES_PRE_AMPERE.values():
        tile_bytes = 2 * keys * 128 * 2 + rows * 128 * 2  # K + V tiles, the query rows
        assert tile_bytes <= 64 * 1024


def test_benchmark_kv_spec_uses_the_rule(card, monkeypatch):
    dtype, _, _ = EXPECTED[card]
    seen = []
    original = KVSpec.from_config.__func__
    monkeypatch.setattr(
        KVSpec, "from_config", classmethod(lambda cls, c, d: seen.append(d) or original(cls, c, d))
    )
    _kv_spec("Qwen2.5-0.5B", CUDA)
    assert seen == [dtype]


def test_every_caller_asks_the_rule_not_torch():
    """`LLM` and the model loader use `device.default_dtype`; nothing in the
    package or the scripts asks ``torch.cuda.is_bf16_supported``."""
    from pagedkv_lab import llm

    assert llm.default_dtype is default_dtype
    root = Path(__file__).resolve().parent.parent
    files = [*root.joinpath("pagedkv_lab").rglob("*.py"), *root.joinpath("scripts").glob("*.py")]
    callers = [f.name for f in files if "is_bf16_supported(" in f.read_text()]
    assert callers == []


def test_kernel_rows_peak_under_half_the_card(card):
    total = KNOWN_GPUS[card].total_memory
    for in_order in (False, True):
        cap = max_row_kv_bytes(CUDA, in_order)
        assert row_peak_bytes(cap, in_order) <= total // 2
        assert cap <= 4 << 30
    # the H100's rows are the committed report's: 4 GiB of K/V at most
    if card == "H100-80GB":
        assert max_row_kv_bytes(CUDA) == 4 << 30
    assert max_row_kv_bytes(torch.device("cpu")) is None


def test_scripts_pick_the_largest_shape_that_fits(card):
    _, _, shape = EXPECTED[card]
    assert largest_real_shape(CUDA) == shape
    config = real_model_shapes()[shape]
    weight_bytes = count_parameters_from_config(config) * default_dtype(CUDA).itemsize
    assert weight_bytes <= KNOWN_GPUS[card].total_memory // 2
    assert largest_real_shape(torch.device("cpu")) == "Qwen2.5-0.5B"


def test_specs_pass_through_without_torch():
    t4 = KNOWN_GPUS["T4"]
    assert gpu_spec(t4) is t4 and default_dtype(t4) == torch.float16
    assert device_mod.memory_budget(t4, 0.5) == t4.total_memory // 2
    tiny = GPUSpec("a 4 GiB card", (8, 6), 4 << 30, 16)
    assert largest_real_shape(tiny) == "Qwen2.5-0.5B"  # the smallest, as a last resort


# ---- PAGEDKV_EMULATE: a smaller card's rules on a bigger one ------------------


@pytest.fixture
def emulate(monkeypatch):
    """A mocked H100 as CUDA device 0, told by ``$PAGEDKV_EMULATE`` to be the
    card the test names (`emulate("t4")`); returns the calls made to
    ``torch.cuda.set_per_process_memory_fraction``."""
    from pagedkv_lab.kernels import triton_decode, triton_tiled

    h100 = KNOWN_GPUS["H100-80GB"]
    props = SimpleNamespace(name=h100.name, major=9, minor=0, total_memory=h100.total_memory,
                            multi_processor_count=h100.multiprocessors)  # fmt: skip
    caps = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a, **k: props)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, index=None: caps.append((fraction, index)))  # fmt: skip
    monkeypatch.setattr(device_mod, "_capped", set())
    for cached in (triton_tiled._card, triton_decode._multiprocessors):
        cached.cache_clear()

    def start(name: str):
        monkeypatch.setenv(device_mod.EMULATE_ENV, name)
        return caps

    yield start
    for cached in (triton_tiled._card, triton_decode._multiprocessors):
        cached.cache_clear()


def test_an_h100_emulating_a_t4_takes_every_t4_rule(emulate):
    from pagedkv_lab.kernels import triton_decode, triton_tiled

    caps = emulate("t4")
    t4, h100 = KNOWN_GPUS["T4"], KNOWN_GPUS["H100-80GB"]
    assert gpu_spec(CUDA) == t4
    assert default_dtype(CUDA) == torch.float16 and not supports_bf16(CUDA)
    # the kernels' launch reads the card through the rule: pre-Ampere tiles, 40 SMs
    capability, name = triton_tiled._card(0)
    assert (capability, name) == ((7, 5), "Tesla T4")
    assert tiled_launch(torch.float16, capability, True)[0] == TILE_SIZES_PRE_AMPERE["decode"]
    assert triton_decode._multiprocessors(0) == 40
    # sizes for 15 GiB: the scripts' shape and the benchmark rows
    assert largest_real_shape(CUDA) == "Llama-3.2-1B"
    assert device_mod.memory_budget(CUDA, 0.5) == t4.total_memory // 2
    assert row_peak_bytes(max_row_kv_bytes(CUDA), False) <= t4.total_memory // 2
    # the memory cap, set once for the device however often the rule is asked
    gpu_spec(CUDA)
    assert caps == [(t4.total_memory / h100.total_memory, 0)]


def test_the_emulated_cap_bounds_the_kv_budget(emulate, monkeypatch):
    """`profile_kv_budget` sizes the pool from the emulated card's memory,
    not the real card's (whose free memory torch still reports)."""
    from pagedkv_lab import config

    emulate("T4")
    gib = 2**30
    allocated = iter([1 * gib])  # the weights
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: next(allocated))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 3 * gib)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 3 * gib)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (75 * gib, 79 * gib))
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: None)
    budget = config.profile_kv_budget(lambda **kw: None, 0.9, 16, CUDA)
    t4 = KNOWN_GPUS["T4"].total_memory
    assert budget == min(int(0.9 * t4) - 1 * gib - 2 * gib, t4 - 3 * gib)


def test_emulation_refuses_unknown_and_larger_cards(emulate, monkeypatch):
    emulate("v100")
    with pytest.raises(ValueError, match="names no known card.*t4"):
        gpu_spec(CUDA)
    emulate("h100-80gb")  # as large as the real card: allowed, the card itself
    assert gpu_spec(CUDA) == KNOWN_GPUS["H100-80GB"]
    t4 = KNOWN_GPUS["T4"]
    props = SimpleNamespace(name=t4.name, major=7, minor=5, total_memory=t4.total_memory,
                            multi_processor_count=40)  # fmt: skip
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a, **k: props)
    emulate("l4")
    with pytest.raises(ValueError, match="cannot emulate"):
        gpu_spec(CUDA)
