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
from pagedkv_lab.attention import TILE_SIZES, TILE_SIZES_PRE_AMPERE, tiled_launch
from pagedkv_lab.bench.common import _kv_spec
from pagedkv_lab.bench.kernel import max_row_kv_bytes, row_peak_bytes
from pagedkv_lab.device import (
    KNOWN_GPUS,
    GPUSpec,
    default_dtype,
    gpu_spec,
    supports_bf16,
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
        # fp16 runs on the tensor cores of every card; fp32 never does here
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
