"""Models the course runs: seeded random-weight offline models, or real checkpoints by name.

No model hub is reachable in CI, so the default models are built from configs
shipped in ``pagedkv_lab/configs`` with seeded random weights, and come with a
byte-level tokenizer that needs no download. Their text is meaningless; their
shapes, memory and speed are those of real Llama and Qwen models, which is all
the course measures. With a network, ``load_model("Qwen/Qwen2.5-0.5B")`` loads a
real checkpoint through the same function.
"""

from __future__ import annotations

import difflib
import json
import os
from functools import lru_cache
from importlib import resources

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from pagedkv_lab.device import GPUSpec, default_dtype, memory_budget

#: The offline models: name -> what it is for.
OFFLINE_MODELS: dict[str, str] = {
    "tiny-llama": "2-layer Llama, GQA 4:2, head_dim 16: tests and quick demos",
    "small-llama": "~30M-parameter Llama, GQA 8:4, head_dim 64: benchmarks",
    "tiny-qwen2": "2-layer Qwen2, q/k/v bias, tied embeddings, GQA 6:1: tests",
    "tiny-mistral": "2-layer Mistral, GQA 8:2, head_dim 8: tests",
    "small-qwen2": "~30M-parameter Qwen2, GQA 8:2, head_dim 64: benchmarks",
    "tiny-qwen3": "2-layer Qwen3, q/k RMSNorm, head_dim 32 (not hidden/heads), GQA 4:2: tests",
}

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
_NUM_SPECIAL = 3  # ids 0, 1, 2; byte b gets id b + 3

#: The offline tokenizer's chat template: each message as ``<|role|>``, a
#: newline, its content and ``</s>``; the generation prompt opens the
#: assistant's turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _read_config_json(name: str) -> dict:
    text = resources.files("pagedkv_lab.configs").joinpath(f"{name}.json").read_text()
    return {k: v for k, v in json.loads(text).items() if not k.startswith("_")}


def offline_config(name: str) -> PretrainedConfig:
    """The transformers config of an offline model (see `OFFLINE_MODELS`)."""
    if name not in OFFLINE_MODELS:
        raise ValueError(
            f"unknown offline model {name!r}; choose one of {sorted(OFFLINE_MODELS)}"
        )
    fields = _read_config_json(name)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def _bytes_to_unicode() -> list[str]:
    """GPT-2's reversible map from the 256 byte values to printable characters, in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(
        range(ord("¡"), ord("¬") + 1)
    )
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


#: `build_tokenizer` reserves special tokens up to this many past the bytes.
MAX_RESERVED_TOKENS = 4096


@lru_cache(maxsize=4)
def build_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer that needs no download: one token per UTF-8 byte.

    Ids: 0 ``<pad>``, 1 ``<s>`` (prepended to every encoded text), 2 ``</s>``,
    3..258 the bytes 0..255, then reserved special tokens up to ``vocab_size`` so
    that the tokenizer covers every id the model can produce (they decode to
    nothing with ``skip_special_tokens``). A vocabulary over
    `MAX_RESERVED_TOKENS` (a real model's shape: 32,000-152,000) gets none,
    because transformers takes minutes to register that many special tokens;
    ids past the bytes then decode to nothing at all.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    if vocab_size < 256 + _NUM_SPECIAL:
        raise ValueError(
            f"vocab_size must be at least {256 + _NUM_SPECIAL} for a byte tokenizer, got {vocab_size}"
        )
    vocab = {PAD: 0, BOS: 1, EOS: 2}
    vocab.update({ch: b + _NUM_SPECIAL for b, ch in enumerate(_bytes_to_unicode())})
    extra = vocab_size - len(vocab)
    reserved = [f"<reserved_{i}>" for i in range(extra * (extra <= MAX_RESERVED_TOKENS))]
    vocab.update({tok: len(vocab) + i for i, tok in enumerate(reserved)})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(
        add_prefix_space=False, use_regex=False
    )
    core.decoder = decoders.ByteLevel()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, 1)]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=reserved,
    )
    tok.padding_side = "left"  # decoder-only generation pads on the left
    tok.chat_template = CHAT_TEMPLATE
    return tok


def check_offline_name(name: str) -> None:
    """Fail fast on a mistyped offline name: a name close to one of
    `OFFLINE_MODELS` that is neither a Hub name (``org/model``) nor a local
    path raises ValueError with a suggestion, before any network call."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"model must be a name or a path, got {name!r}")
    known = [*OFFLINE_MODELS, *real_model_shapes()]
    if name in known or "/" in name or os.path.exists(name):
        return
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
    if close:
        raise ValueError(
            f"unknown model {name!r}: did you mean {close[0]!r}? Offline models: "
            f"{sorted(OFFLINE_MODELS)}; real shapes with random weights: "
            f"{sorted(real_model_shapes())}; Hub models are named 'org/model'"
        )


def load_model(
    name: str = "tiny-llama",
    *,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    local_files_only: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Return ``(model, tokenizer)`` in eval mode.

    ``name`` is an offline model (``"tiny-llama"``, ``"small-llama"``,
    ``"tiny-qwen2"``, ``"small-qwen2"``, ``"tiny-qwen3"``, ``"tiny-mistral"``: seeded random weights, so the same seed
    always gives the same model), a real model's shape from
    ``configs/real_models.json`` (``"Llama-3-8B"``, ``"Qwen3-0.6B"``, ...: the
    checkpoint's architecture with seeded random weights, built on ``device``,
    in `default_dtype` for the device (bf16 on sm_80+, fp16 on older GPUs); vLLM's ``load_format="dummy"``), a Hugging Face
    checkpoint name, which needs a network the first time
    (``local_files_only=True``: only the local Hub cache), or the path of a
    checkpoint saved with ``save_pretrained``.
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    check_offline_name(name)
    if name in real_model_shapes():
        model = _random_model(real_model_shapes()[name], seed, dtype, device)
        tokenizer = build_tokenizer(model.config.vocab_size)
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        return model.eval(), tokenizer
    if name in OFFLINE_MODELS:
        config = offline_config(name)
        gen = torch.random.fork_rng(
            devices=[]
        )  # don't disturb the caller's random stream
        with gen:
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tokenizer = build_tokenizer(config.vocab_size)
    else:
        try:
            from transformers import AutoTokenizer

            model = AutoModelForCausalLM.from_pretrained(
                name, dtype=dtype or "auto", local_files_only=local_files_only
            )
            tokenizer = AutoTokenizer.from_pretrained(
                name, local_files_only=local_files_only
            )
        except OSError as err:
            raise RuntimeError(
                f"could not load {name!r} from the Hugging Face Hub (no network, not cached, or no such model). "
                f"Offline models that need no download: {sorted(OFFLINE_MODELS)}"
            ) from err
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side = "left"
    if dtype is not None:
        model = model.to(dtype)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.to(device).eval(), tokenizer


def real_model_shapes() -> dict[str, PretrainedConfig]:
    """Real checkpoints' architectures (`kvmath.real_model_configs`) that
    `load_model` builds with random weights, by name."""
    from pagedkv_lab.kvmath import real_model_configs

    return real_model_configs()


#: Real shapes the GPU scripts and benchmarks run, largest first.
GPU_SHAPES = ("Llama-3-8B", "Llama-3.2-1B", "Qwen2.5-0.5B")


def largest_real_shape(
    device: torch.device | GPUSpec | None = None,
    fraction: float = 0.5,
    candidates: tuple[str, ...] = GPU_SHAPES,
) -> str:
    """The first of ``candidates`` (largest first) whose weights, in the
    library's dtype for ``device``, take at most ``fraction`` of the card's
    memory, leaving the rest for the KV cache and activations: Llama-3-8B (16 GB
    in bf16) on a 40 GB card and up, Llama-3.2-1B on a T4 or an L4. The last
    candidate where none fits, and on a CPU."""
    from pagedkv_lab.kvmath import count_parameters_from_config

    budget = memory_budget(device, fraction)
    if budget is None:
        return candidates[-1]
    itemsize = default_dtype(device).itemsize
    shapes = real_model_shapes()
    for name in candidates:
        if count_parameters_from_config(shapes[name]) * itemsize <= budget:
            return name
    return candidates[-1]


def _random_model(
    config: PretrainedConfig,
    seed: int,
    dtype: torch.dtype | None,
    device: torch.device,
) -> PreTrainedModel:
    """A model of ``config``'s shape with seeded random weights, allocated and
    initialised on ``device``: on a GPU an 8B model takes seconds; on a CPU
    initialisation runs at tens of millions of weights a second (a 0.5B model
    takes about a minute on 2 cores); on ``"meta"`` nothing is allocated."""
    if dtype is None:  # 16-bit on a GPU by the library's rule; float32 on a CPU
        dtype = default_dtype(device)
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        if device.type == "cpu":  # the default device: no context (it slows init)
            return AutoModelForCausalLM.from_config(config, dtype=dtype)
        with torch.device(device):
            return AutoModelForCausalLM.from_config(config, dtype=dtype)


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
