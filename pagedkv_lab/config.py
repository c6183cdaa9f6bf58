"""`EngineArgs`: every setting of `LLM` except the model, checked when given,
and what the engine is built from (vLLM's ``vllm/engine/arg_utils.py`` holds
its ``EngineArgs`` the same way, apart from the engine's loop).

`LLM("tiny-llama", block_size=8, kv_cache_memory=2**20)` passes its keyword
arguments here: a bad value fails at once with a ValueError naming it, before
anything is loaded; a setting of vLLM's that this library does not have is a
TypeError that says so and lists the supported ones.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass

import torch

from pagedkv_lab.device import gpu_spec
from pagedkv_lab.engine.block_manager import BlockManager
from pagedkv_lab.engine.core import EngineCore, EngineStats
from pagedkv_lab.engine.kv_cache import PagedKVCache
from pagedkv_lab.engine.model_runner import ModelRunner
from pagedkv_lab.engine.scheduler import Scheduler
from pagedkv_lab.engine.swap import SwapSpace
from pagedkv_lab.input_processor import Limits
from pagedkv_lab.sampling_params import check_bool, check_int, refuse_unsupported

#: vLLM's engine settings this library does not have, and why (or what to use).
UNSUPPORTED_ARGS: dict[str, str] = {
    "tensor_parallel_size": "one device only; vLLM shards a model over GPUs",
    "pipeline_parallel_size": "one device only; vLLM splits layers over GPUs",
    "data_parallel_size": "one engine per process",
    "quantization": "weights are served in the model's dtype",
    "kv_cache_dtype": "the KV cache has the model's dtype",
    "enable_lora": "LoRA adapters are out of scope",
    "trust_remote_code": "Llama, Mistral, Qwen2 and Qwen3 are built in; no remote code runs",
    "kv_cache_memory_bytes": "use kv_cache_memory=<bytes>",
    "num_gpu_blocks_override": "use kv_cache_memory=<bytes> (blocks x bytes per block)",
    "enable_chunked_prefill": "always on: a prompt longer than what is left of "
    "max_num_batched_tokens is prefilled in chunks",
    "cpu_offload_gb": "not implemented (chapter 09 swaps K/V, not weights)",
    "speculative_config": "speculative decoding is out of scope",
    "limit_mm_per_prompt": "text models only",
    "compilation_config": "nothing is compiled; enforce_eager turns CUDA graphs off",
}

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def parse_dtype(dtype) -> torch.dtype | None:
    """``dtype`` as `LLM` takes it: a torch dtype, its name (vLLM's strings:
    ``"float16"``, ``"bfloat16"``, ``"float32"``...) or ``"auto"``/None (None:
    the library's rule, `default_dtype`, for a model loaded by name)."""
    if dtype is None or dtype == "auto":
        return None
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point type, got {dtype}")
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise ValueError(
        f"dtype must be 'auto', a torch dtype or one of {sorted(_DTYPES)}, "
        f"got {dtype!r}"
    )


def as_seed(name: str, value, none_ok: bool = False) -> int | None:
    """A seed as a Python int (NumPy integers too), or a ValueError naming it."""
    return check_int(name, value, 0, none_ok=none_ok)


@dataclass
class EngineArgs:
    """The settings of `LLM`, with vLLM's names where the meaning is the same.

    * ``block_size``: tokens per KV block (16).
    * ``kv_cache_memory``: the KV budget in bytes (int), or on a GPU the
      fraction of the GPU's total memory the engine may use (float), as
      ``gpu_memory_utilization``. By default 0.9 on a GPU, 256 MiB on a CPU.
    * ``gpu_memory_utilization``: vLLM's name for the fraction (its default is
      0.92 in vLLM 0.32, ours 0.9): the share of the GPU's *total* memory this
      engine may use, weights and activations included; the KV cache gets what
      is left after the weights and the peak memory of one forward pass over
      ``max_num_batched_tokens`` tokens (a profiling run). A CUDA device only:
      on a CPU give ``kv_cache_memory`` in bytes. Give one of the two.
    * ``max_num_seqs``: sequences per step (256); ``max_num_batched_tokens``:
      the step's token budget (by default ``max(4096, max_model_len)``);
      ``max_model_len``: by default the model's positions, or what the pool
      holds if that is less.
    * ``device``, ``dtype`` (a torch dtype, its name or ``"auto"``: a model
      loaded by name gets `default_dtype`, a loaded one stays as it is),
      ``seed`` (sampling: unseeded requests draw their seeds from it),
      ``weights_seed`` (an offline model's random weights).
    * ``reserve_max_len``: reserve ``max_model_len`` tokens per request at
      admission (chapter 02's scheme, for comparison).
    * ``enable_prefix_caching`` (chapter 08); ``watermark``, the share of
      blocks kept free when admitting; ``preemption_mode`` (``"recompute"`` or
      ``"swap"``), ``swap_space`` (bytes of CPU memory for swapped blocks) and
      ``victim`` (``"newest"``, ``"longest-output"``, ``"shortest-output"``)
      (chapter 09); ``block_manager``, a replacement block manager of the
      pool's size.
    * ``fused_forward``: the engine's fused runner (True), the model's own
      layers with the paged attention plugged in (False), or the first where
      the model's layout allows it (None); ``enforce_eager``: no CUDA graphs.
    * ``async_scheduling``: keep one step in flight (the next step planned and
      launched before this one's tokens are read); None, the default, turns it
      on with a CUDA device and off on a CPU (`use_async_scheduling`).
    """

    block_size: int = 16
    kv_cache_memory: int | float | None = None
    gpu_memory_utilization: float | None = None
    max_num_seqs: int = 256
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    device: str | torch.device | None = None
    dtype: str | torch.dtype | None = "auto"
    seed: int | None = None
    weights_seed: int = 0
    reserve_max_len: bool = False
    enable_prefix_caching: bool = False
    watermark: float = 0.01
    preemption_mode: str = "recompute"
    swap_space: int = 0
    victim: str = "newest"
    block_manager: object | None = None
    fused_forward: bool | None = None
    enforce_eager: bool = False
    async_scheduling: bool | None = None

    def __new__(cls, *args, **kwargs):
        names = [f.name for f in dataclasses.fields(cls)]
        refuse_unsupported("LLM", kwargs, names, UNSUPPORTED_ARGS)
        return super().__new__(cls)

    def __post_init__(self):
        self.block_size = check_int("block_size", self.block_size, 1)
        self.max_num_seqs = check_int("max_num_seqs", self.max_num_seqs, 1)
        self.max_model_len = check_int("max_model_len", self.max_model_len, 1, none_ok=True)
        self.max_num_batched_tokens = check_int(
            "max_num_batched_tokens", self.max_num_batched_tokens, 1, none_ok=True
        )
        check_bool("fused_forward", self.fused_forward, none_ok=True)
        check_bool("enforce_eager", self.enforce_eager)
        check_bool("async_scheduling", self.async_scheduling, none_ok=True)
        self.seed = as_seed("seed", self.seed, none_ok=True)
        self.weights_seed = as_seed("weights_seed", self.weights_seed)
        self.dtype = parse_dtype(self.dtype)
        if not isinstance(self.watermark, (int, float)) or not 0 <= self.watermark < 1:
            raise ValueError(
                f"watermark must be a fraction in [0, 1), got {self.watermark!r}"
            )
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(
                "preemption_mode must be 'recompute' or 'swap', "
                f"got {self.preemption_mode!r}"
            )
        fraction = self.gpu_memory_utilization
        if fraction is not None:
            if self.kv_cache_memory is not None:
                raise ValueError(
                    "give kv_cache_memory (bytes, or a fraction on a GPU) or "
                    "gpu_memory_utilization (a fraction), not both"
                )
            if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real):
                raise ValueError(
                    f"gpu_memory_utilization must be a fraction, got {fraction!r}"
                )
            if not 0 < fraction <= 1:
                raise ValueError(
                    f"gpu_memory_utilization must be in (0, 1], got {fraction}"
                )

    # -- loading the model -----------------------------------------------------

    def load(self, model, tokenizer, default_dtype) -> tuple:
        """``(model, tokenizer)``: an offline or Hugging Face name loaded on
        ``device`` in ``dtype`` (``default_dtype(device)`` for ``"auto"``); a
        loaded model (or a ``(model, tokenizer)`` pair) checked against them
        and served where it is; ``tokenizer`` supplies or replaces the
        tokenizer."""
        from transformers import PreTrainedModel

        from pagedkv_lab.device import pick_device
        from pagedkv_lab.models import load_model

        if tokenizer is not None and (
            isinstance(tokenizer, str) or not callable(getattr(tokenizer, "decode", None))
        ):
            raise ValueError(f"tokenizer must be a tokenizer object, got {tokenizer!r}")
        own = None
        if isinstance(model, tuple):
            model, own = model
        elif not isinstance(model, PreTrainedModel):
            device = pick_device(str(self.device) if self.device is not None else None)
            self._check_fraction_device(device)
            dtype = self.dtype or default_dtype(device)
            try:
                model, own = load_model(
                    model, seed=self.weights_seed, dtype=dtype, device=device
                )
            except torch.OutOfMemoryError as err:
                raise ValueError(
                    f"{model!r} in {dtype} does not fit on {device}: {err}"
                ) from err
            return model, tokenizer if tokenizer is not None else own
        if not isinstance(model, PreTrainedModel):
            raise ValueError(f"expected a transformers PreTrainedModel, got {model!r}")
        here = next(model.parameters()).device
        self._check_fraction_device(here)
        if self.device is not None and torch.device(self.device) != here:
            raise ValueError(
                f"the model is on {here}; a loaded model is served where "
                f"it is, so leave device=None or move the model first"
            )
        if self.dtype is not None and self.dtype != model.dtype:
            raise ValueError(f"the model is {model.dtype}, not {self.dtype}")
        return model, tokenizer if tokenizer is not None else own

    def _check_fraction_device(self, device: torch.device) -> None:
        if self.gpu_memory_utilization is not None and device.type != "cuda":
            raise ValueError(
                f"gpu_memory_utilization is a fraction of a GPU's memory; the "
                f"model is on {device.type}: give the KV cache's size in bytes "
                "instead, kv_cache_memory=<bytes> (256 MiB by default)"
            )

    # -- sizing the pool -------------------------------------------------------

    def num_kv_blocks(self, model, profile_tokens: int) -> int:
        """Blocks of the KV pool for ``model``: from ``kv_cache_memory`` bytes, or
        from a fraction of the GPU (``kv_cache_memory`` as a float, or
        ``gpu_memory_utilization``) through a profiling run."""
        device = next(model.parameters()).device
        budget = self.kv_cache_memory
        if self.gpu_memory_utilization is not None:
            self._check_fraction_device(device)
            budget = float(self.gpu_memory_utilization)
        if budget is None:
            budget = 0.9 if device.type == "cuda" else 256 * 2**20
        if isinstance(budget, bool) or not isinstance(budget, numbers.Real):
            raise ValueError(
                f"kv_cache_memory must be bytes (int) or a fraction, got {budget!r}"
            )
        if isinstance(budget, float):
            if device.type != "cuda" or not 0 < budget <= 1:
                raise ValueError(
                    "a fractional kv_cache_memory needs a CUDA device "
                    "and a value in (0, 1]"
                )
            budget = profile_kv_budget(model, budget, profile_tokens, device)
        num_blocks = PagedKVCache.blocks_for_budget(
            model.config, budget, self.block_size, model.dtype
        )
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory={budget} bytes holds not even one block "
                f"of {self.block_size} tokens"
            )
        return num_blocks

    def pool(self, model) -> tuple[int, int]:
        """``(num_blocks, max_model_len)`` for ``model``: the pool's blocks, and
        the longest sequence, which must fit in the pool."""
        positions = getattr(model.config, "max_position_embeddings", None) or 2**31
        profile = min(
            self.max_num_batched_tokens or max(4096, self.max_model_len or 0),
            positions,
        )
        num_blocks = self.num_kv_blocks(model, profile)
        tokens = num_blocks * self.block_size
        if self.max_model_len is None:
            return num_blocks, min(positions, tokens)
        if self.max_model_len > tokens:
            raise ValueError(
                f"max_model_len={self.max_model_len} tokens do not fit the KV pool "
                f"({num_blocks} blocks of {self.block_size} = {tokens} tokens): "
                "raise kv_cache_memory or lower max_model_len"
            )
        return num_blocks, self.max_model_len

    # -- building the engine ------------------------------------------------------

    def build_block_manager(self, num_blocks: int) -> BlockManager:
        """The given block manager (checked against the pool), or the library's,
        with prefix caching if asked (chapter 08)."""
        bm = self.block_manager
        if bm is None:
            return BlockManager(num_blocks, self.block_size,
                                enable_caching=self.enable_prefix_caching)  # fmt: skip
        if (bm.num_blocks, bm.block_size) != (num_blocks, self.block_size):
            raise ValueError(
                f"block_manager has {bm.num_blocks} blocks of {bm.block_size}; "
                f"the pool has {num_blocks} of {self.block_size}"
            )
        return bm

    def swap_blocks(self, model, num_blocks: int) -> int:
        """Host blocks of the swap space (``preemption_mode="swap"``: chapter 09)."""
        if self.preemption_mode != "swap":
            if self.swap_space:
                raise ValueError("swap_space is only used with preemption_mode='swap'")
            return 0
        space = check_int("swap_space", self.swap_space, 1)
        dtype = next(model.parameters()).dtype
        blocks = PagedKVCache.blocks_for_budget(model.config, space, self.block_size, dtype)
        if blocks < 1:
            raise ValueError(f"swap space needs at least one block, got {blocks}")
        return blocks

    def build_engine(self, model, num_blocks: int, max_model_len: int,
                     eos_token_ids) -> EngineCore:  # fmt: skip
        """The engine core: a scheduler over a block manager, a model runner
        that owns the KV cache, both sized for ``num_blocks`` blocks."""
        swap_blocks = self.swap_blocks(model, num_blocks)
        if self.fused_forward:
            from pagedkv_lab.engine.fused import fused_unsupported_reason

            reason = fused_unsupported_reason(model)
            if reason:
                raise ValueError(f"fused_forward=True, but {reason}")
        runner = ModelRunner(model, num_blocks, self.block_size, max_model_len,
                             fused=self.fused_forward, enforce_eager=self.enforce_eager,
                             max_num_seqs=self.max_num_seqs, swap_blocks=swap_blocks,
                             eos_token_ids=eos_token_ids)  # fmt: skip
        block_manager = self.build_block_manager(num_blocks)
        scheduler = Scheduler(
            block_manager, max_model_len=max_model_len, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens or max(4096, max_model_len),
            watermark=self.watermark, eos_token_ids=eos_token_ids, victim=self.victim,
            reserve_tokens=max_model_len if self.reserve_max_len else 0,
            swap_space=SwapSpace(swap_blocks, self.block_size) if swap_blocks else None,
        )  # fmt: skip
        stats = EngineStats(num_blocks, self.block_size)
        return EngineCore(scheduler, runner, stats,
                          self.use_async_scheduling(runner, block_manager))  # fmt: skip

    def limits(self, model, engine: EngineCore) -> Limits:
        """What `InputProcessor` checks every request against."""
        sched, bm = engine.scheduler, engine.scheduler.block_manager
        return Limits(model.config.vocab_size, sched.max_model_len, sched.max_num_seqs,
                      sched.max_num_batched_tokens, bm.block_size, bm.num_blocks,
                      sched.reserve_tokens)  # fmt: skip

    def use_async_scheduling(self, runner, block_manager) -> bool:
        """Whether the engine schedules a step ahead (``async_scheduling``).

        By default (None) on with a CUDA device, off on a CPU, as vLLM's
        default since 0.14 (its CPU backend excluded): on a GPU the host plans
        step N+1 while the device runs step N; on a CPU the host runs the
        forward pass itself, so there is nothing to overlap. Refused with a
        block manager that registers blocks for the prefix cache when they are
        scheduled (it would key a block by tokens the host does not have yet):
        an error if asked for, off if by default."""
        wanted = self.async_scheduling
        if wanted is None:
            wanted = runner.device.type == "cuda"
        if wanted and getattr(block_manager, "register", None) == "scheduled":
            if self.async_scheduling:
                raise ValueError(
                    "async_scheduling needs a block manager that registers blocks "
                    "once computed (register='computed'), not when scheduled"
                )
            return False
        return wanted


def profile_kv_budget(model, fraction: float, num_tokens: int, device) -> int:
    """vLLM's profile run: bytes left for K/V within ``fraction`` of the GPU
    after the weights and the peak activations of one forward pass over
    ``num_tokens`` tokens (with the model's own attention, which needs at
    least the memory of the paged one)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    weights = torch.cuda.memory_allocated(device)
    ids = torch.zeros((1, num_tokens), dtype=torch.long, device=device)
    with torch.inference_mode():
        model(input_ids=ids, use_cache=False)
    activations = torch.cuda.max_memory_allocated(device) - weights
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    card = gpu_spec(device).total_memory  # a smaller card's, when one is emulated
    if card < total:
        free, total = min(free, card - torch.cuda.memory_reserved(device)), card
    budget = min(int(fraction * total) - weights - activations, free)
    if budget <= 0:
        gib = 2**30
        raise ValueError(
            f"no memory left for the KV cache: {fraction:.0%} of "
            f"{total / gib:.1f} GiB holds the weights ({weights / gib:.2f} GiB) "
            f"and a forward pass over {num_tokens} tokens "
            f"({activations / gib:.2f} GiB), with {free / gib:.1f} GiB free; "
            "lower max_num_batched_tokens or raise kv_cache_memory"
        )
    return budget
