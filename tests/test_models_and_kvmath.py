import pytest
import torch

from pagedkv_lab import models
from pagedkv_lab.device import (
    KNOWN_GPUS,
    by_device,
    device_report,
    pick_device,
    triton_mode,
)
from pagedkv_lab.kvmath import (
    KVSpec,
    cache_nbytes,
    count_parameters_from_config,
    format_bytes,
    gpu_memory_bytes,
    kv_budget,
    real_model_configs,
)
from pagedkv_lab.models import (
    OFFLINE_MODELS,
    build_tokenizer,
    count_parameters,
    load_model,
    offline_config,
)


@pytest.mark.parametrize("name", sorted(OFFLINE_MODELS))
def test_offline_models_are_seeded_and_counted_exactly(name):
    a, _ = load_model(name, seed=1)
    b, _ = load_model(name, seed=1)
    c, _ = load_model(name, seed=2)
    pa, pb, pc = (list(m.parameters()) for m in (a, b, c))
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))
    assert not all(torch.equal(x, y) for x, y in zip(pa, pc))
    assert count_parameters_from_config(a.config) == count_parameters(a)


def test_load_model_does_not_disturb_the_callers_random_stream():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    load_model("tiny-llama")
    assert torch.equal(torch.rand(3), expected)


def test_byte_tokenizer_round_trips_any_text():
    tok = build_tokenizer(320)
    text = "Paged KV — naïve 🚀 text\nwith lines"
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id == 1 and len(ids) == 1 + len(text.encode())
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert len(tok) == 320 and tok.eos_token_id == 2 and tok.pad_token_id == 0
    with pytest.raises(ValueError, match="at least 259"):
        build_tokenizer(100)


def test_unknown_models_fail_clearly():
    with pytest.raises(ValueError, match="unknown offline model"):
        offline_config("huge-llama")
    with pytest.raises(RuntimeError, match="Offline models that need no download"):
        load_model("Qwen/Qwen2.5-0.5B", local_files_only=True)


def test_kv_formula_matches_real_cache_tensors():
    for name in ["tiny-llama", "tiny-qwen2"]:
        model, _ = load_model(name)
        spec = KVSpec.from_config(model.config, dtype=torch.float32)
        ids = torch.randint(3, 259, (2, 21))
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=5,
            do_sample=False,
            return_dict_in_generate=True,
        )
        assert cache_nbytes(out.past_key_values) == 2 * spec.bytes_for(25)


def test_real_model_numbers():
    configs = real_model_configs()
    assert {
        "Llama-2-7B",
        "Llama-2-13B",
        "Llama-2-70B",
        "Llama-3-8B",
        "Mistral-7B-v0.1",
        "Qwen2.5-0.5B",
        "Qwen2.5-7B",
        "Qwen3-0.6B",
    } <= set(configs)
    assert KVSpec.from_config(configs["Llama-2-70B"]).bytes_per_token == 320 * 1024
    assert KVSpec.from_config(configs["Llama-2-7B"]).bytes_for(4096) == 2 * 1024**3
    # computed parameter counts land on the published sizes
    for name, billions in [
        ("Llama-2-7B", 6.74),
        ("Llama-2-70B", 68.98),
        ("Llama-3-8B", 8.03),
        ("Qwen2.5-0.5B", 0.49),
        ("Qwen2.5-7B", 7.62),
        ("Qwen3-0.6B", 0.6),  # "0.6B", 0.44B of them outside the embedding
    ]:
        assert round(count_parameters_from_config(configs[name]) / 1e9, 2) == billions
    assert all(c.source.startswith("https://huggingface.co/") for c in configs.values())


def test_budget_and_capacity():
    cfg = real_model_configs()["Llama-2-7B"]
    gpus = gpu_memory_bytes()
    # The memory the runtime reports: a "16 GB" T4 shows 15,360 MiB with ECC on.
    assert gpus == {n: s.total_memory for n, s in KNOWN_GPUS.items()}
    assert gpus["T4"] == 15_360 * 2**20 and gpus["L4"] == 23_034 * 2**20
    request = 2048 * KVSpec.from_config(cfg).bytes_per_token
    # Llama-2-7B's fp16 weights fit a T4, but not one full-length request beside them.
    assert 0 < kv_budget(cfg, gpus["T4"]) < request
    assert kv_budget(cfg, gpus["L4"]) // request == 7
    assert kv_budget(real_model_configs()["Llama-2-70B"], gpus["H100-80GB"]) < 0
    assert KVSpec(1, 1, 1, 2).tokens_in(-5) == 0
    assert format_bytes(512) == "512 B" and format_bytes(320 * 1024) == "320.0 KiB"
    assert format_bytes(2 * 1024**3) == "2.0 GiB"


def test_device_helpers():
    assert pick_device().type in ("cpu", "cuda")
    assert (
        by_device(1, 2, torch.device("cpu")) == 1
        and by_device(1, 2, torch.device("cuda")) == 2
    )
    report = device_report(torch.device("cpu"))
    assert report["device"] == "cpu" and report["torch"] == torch.__version__
    expected = "gpu" if torch.cuda.is_available() else "interpreter"
    assert (
        triton_mode() == expected
    )  # tests/conftest.py sets TRITON_INTERPRET without CUDA
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA device"):
            pick_device("cuda")


@pytest.mark.parametrize("name", sorted(models.real_model_shapes()))
def test_real_model_shapes_build_at_their_parameter_count(name):
    """On the meta device nothing is allocated: an 8B or 70B shape builds here too."""
    model, tokenizer = models.load_model(name, device="meta")
    config = models.real_model_shapes()[name]
    assert models.count_parameters(model) == count_parameters_from_config(config)
    assert next(model.parameters()).device.type == "meta"
    assert tokenizer.pad_token_id is not None


def test_random_weights_at_a_real_shape_are_seeded_and_take_the_dtype():
    config = models.real_model_shapes()["Qwen2.5-0.5B"]
    config.num_hidden_layers, config.vocab_size = 1, 1024  # small enough for a test
    cpu = torch.device("cpu")
    a = models._random_model(config, 3, None, cpu)
    b = models._random_model(config, 3, None, cpu)
    c = models._random_model(config, 4, torch.bfloat16, cpu)
    assert a.dtype == torch.float32 and c.dtype == torch.bfloat16
    pairs = list(zip(a.parameters(), b.parameters()))
    assert all(torch.equal(x, y) for x, y in pairs)
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight.float())
    logits = a(input_ids=torch.tensor([[1, 5, 9]])).logits
    assert logits.shape == (1, 3, 1024) and logits.isfinite().all()


def test_qwen3_shape_has_an_explicit_head_dim_and_head_norms():
    """Qwen3-0.6B: 16 heads of 128 on a 1,024-wide model (head_dim is not
    hidden / heads), 8 KV heads, an RMSNorm over each q and k head."""
    cfg = real_model_configs()["Qwen3-0.6B"]
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim) == (1024, 16, 128)
    assert KVSpec.from_config(cfg).bytes_per_token == 2 * 28 * 8 * 128 * 2
    embedding = cfg.vocab_size * cfg.hidden_size
    assert round((count_parameters_from_config(cfg) - embedding) / 1e9, 2) == 0.44
    model, _ = load_model("tiny-qwen3")
    assert model.config.head_dim != model.config.hidden_size // 4
    norms = sum(p.numel() for n, p in model.named_parameters() if "q_norm" in n or "k_norm" in n)
    assert norms == 2 * model.config.num_hidden_layers * model.config.head_dim
    assert count_parameters_from_config(model.config) == count_parameters(model)
