"""A vLLM user's first lines: ``gpu_memory_utilization``, ``get_tokenizer``,
``dir(pagedkv_lab)``, and vLLM fields this library does not have, refused with
a message that lists what it has and where to read more."""

import types
from unittest import mock

import pytest
import torch

import pagedkv_lab
from pagedkv_lab import LLM, RequestOutputKind, SamplingParams
from pagedkv_lab.config import UNSUPPORTED_ARGS, EngineArgs
from pagedkv_lab.models import load_model
from pagedkv_lab.sampling_params import UNSUPPORTED_FIELDS


def test_the_package_lists_its_lazy_names():
    names = dir(pagedkv_lab)
    for name in pagedkv_lab.__all__:
        assert name in names
    assert {"LLM", "SamplingParams", "RequestOutput", "CompletionOutput"} <= set(names)
    assert {"RequestOutputKind", "EngineArgs"} <= set(names)
    # every listed name resolves
    assert all(getattr(pagedkv_lab, n) is not None for n in pagedkv_lab.__all__)
    assert pagedkv_lab.RequestOutputKind is RequestOutputKind


def test_get_tokenizer_is_the_engines_tokenizer():
    pair = load_model("tiny-llama")
    llm = LLM(pair, kv_cache_memory=2**20)
    tok = llm.get_tokenizer()
    assert tok is pair[1]
    ids = tok("Hello").input_ids
    out = llm.generate(ids, SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids
    assert LLM(pair[0], kv_cache_memory=2**20).get_tokenizer() is None


@pytest.mark.parametrize("name", sorted(UNSUPPORTED_FIELDS))
def test_unsupported_sampling_fields_say_why_and_list_the_supported(name):
    with pytest.raises(TypeError) as err:
        SamplingParams(**{name: 1})
    text = str(err.value)
    assert name in text and UNSUPPORTED_FIELDS[name] in text
    assert "book/vllm.md" in text
    for supported in ("temperature", "top_p", "max_tokens", "logprobs", "stop"):
        assert supported in text


def test_a_mistyped_sampling_field_gets_the_closest_name():
    with pytest.raises(TypeError, match="did you mean 'temperature'"):
        SamplingParams(temprature=0.5)
    # copies (the engine's clone) are unaffected by the check
    assert SamplingParams(temperature=0.5).clone(max_tokens=3).max_tokens == 3


@pytest.mark.parametrize("name", sorted(UNSUPPORTED_ARGS))
def test_unsupported_llm_arguments_fail_before_loading(name):
    with mock.patch("pagedkv_lab.models.load_model") as load:
        with pytest.raises(TypeError) as err:
            LLM("tiny-llama", **{name: 2})
    load.assert_not_called()
    text = str(err.value)
    assert name in text and "kv_cache_memory" in text and "book/vllm.md" in text


def test_gpu_memory_utilization_on_a_cpu_names_kv_cache_memory():
    with mock.patch("pagedkv_lab.models.load_model") as load:
        with pytest.raises(ValueError, match=r"kv_cache_memory=<bytes>"):
            LLM("tiny-llama", gpu_memory_utilization=0.5, device="cpu")
    load.assert_not_called()  # refused before anything is loaded
    model, _ = load_model("tiny-llama")
    with pytest.raises(ValueError, match="kv_cache_memory"):
        LLM(model, gpu_memory_utilization=0.5)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(gpu_memory_utilization=0.0), r"in \(0, 1\]"),
        (dict(gpu_memory_utilization=1.5), r"in \(0, 1\]"),
        (dict(gpu_memory_utilization="half"), "a fraction"),
        (dict(gpu_memory_utilization=True), "a fraction"),
        (dict(gpu_memory_utilization=0.5, kv_cache_memory=2**20), "not both"),
    ],
)
def test_gpu_memory_utilization_values_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)


def test_gpu_memory_utilization_is_the_fractional_kv_cache_memory(monkeypatch):
    """On a GPU, gpu_memory_utilization=f sizes the pool exactly as
    kv_cache_memory=f: the profiled budget of f of the GPU's total memory."""
    from pagedkv_lab import config

    seen = []

    def profile(model, fraction, num_tokens, device):
        seen.append(fraction)
        return 2**20

    monkeypatch.setattr(config, "profile_kv_budget", profile)
    model, _ = load_model("tiny-llama")
    on_gpu = types.SimpleNamespace(  # the model as it would look on a GPU
        config=model.config,
        dtype=model.dtype,
        parameters=lambda: iter([types.SimpleNamespace(device=torch.device("cuda", 0))]),
    )
    by_name = EngineArgs(gpu_memory_utilization=0.5).num_kv_blocks(on_gpu, 64)
    by_fraction = EngineArgs(kv_cache_memory=0.5).num_kv_blocks(on_gpu, 64)
    assert seen == [0.5, 0.5] and by_name == by_fraction > 0
