"""The peers this engine is served against: `transformers`' `generate` in
static batches, its continuous batching, and vLLM in a python of its own."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from pagedkv_lab.bench.common import ServeSetup, _run_result, static_batches

# the script the vLLM python runs: it needs nothing of this package
VLLM_PEER_SCRIPT = Path(__file__).resolve().parent / "_vllm_peer.py"

#: transformers' step budget when none is given (its ``PagedAttentionMemoryHandler``'s
#: default), passed explicitly: with ``num_blocks`` fixed and no ``max_batch_tokens``,
#: transformers 5.17 (the floor pyproject.toml allows) solves for the budget whose
#: footprint, mostly attention masks of ``[budget, cache tokens + budget]``, takes
#: 80-90% of the machine's memory less this process's own (on a CPU it does not
#: subtract other processes'): 73,466 tokens and 20 GB resident for tiny-llama's 2,048-token
#: cache on a 24 GiB machine (issue 47). transformers 5.24 takes 8192 either way.
HF_DEFAULT_MAX_BATCH_TOKENS = 8192


class _HFStaticRunner:
    """``model.generate`` in static batches sized by the KV budget (see `static_batches`)."""

    name = "hf-generate"
    block_size = None

    def __init__(self, setup: ServeSetup):
        from pagedkv_lab.models import load_model

        self.setup = setup
        self.model, _ = load_model(setup.model_name, device=setup.device, dtype=setup.dtype)

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], max_tokens: list[int]) -> dict:
        from pagedkv_lab.kvmath import cache_nbytes

        s, device = self.setup, self.setup.device
        batches = static_batches(
            [len(p) for p in prompts],
            max_tokens,
            s.budget_tokens,
            s.max_num_seqs,
            s.static_policy,
            s.max_model_len,
        )
        tokens: list[list[int]] = [[] for _ in prompts]
        peak = 0
        t0 = time.perf_counter()
        for batch in batches:
            rows = [prompts[i] for i in batch]
            width = max(map(len, rows))
            ids = torch.tensor(
                [[0] * (width - len(p)) + p for p in rows], device=device
            )
            mask = torch.tensor(
                [[0] * (width - len(p)) + [1] * len(p) for p in rows], device=device
            )
            # a static batch runs until its longest request is done
            new = max(max_tokens[i] for i in batch)
            out = self.model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                return_dict_in_generate=True,
            )
            # the DynamicCache's tensors at the end of the batch: its largest size
            peak = max(peak, cache_nbytes(out.past_key_values))
            for j, i in enumerate(batch):
                tokens[i] = out.sequences[j, width : width + max_tokens[i]].tolist()
            del out
        wall = time.perf_counter() - t0
        return _run_result(
            wall, tokens, None, None, peak, batch_sizes=[len(b) for b in batches]
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def close(self) -> None:
        del self.model


def _hf_paged_cache_layout(cache) -> tuple[int, list[tuple[dict, int]]]:
    """transformers' paged cache: (bytes its blocks can hold, [(block table, bytes per block)]).

    A block table maps a request to its block ids. Two layouts are supported:
    transformers >= 5.18 sizes the cache in sectors and keeps one allocator per
    cache kind (``cache_allocators``); 5.5-5.17 keep one K and one V tensor per
    layer position of a layer group, two padding blocks in each, and one
    allocator per group (``group_cache_managers``), all drawing block ids from one
    pool of ``num_blocks``: a block id holds one group's layers.
    """
    if hasattr(cache, "cache_allocators"):
        tables = [(a.block_table, a.bytes_per_block) for a in cache.cache_allocators.values()]
        return cache.num_sectors * cache.bytes_per_sector, tables
    slot_bytes = sum(  # one token of every layer position, K and V
        t[0].numel() * t.element_size() for t in (*cache.key_cache, *cache.value_cache)
    )
    bytes_per_block = cache.block_size * slot_bytes
    tables = [(m.block_table, bytes_per_block) for m in cache.group_cache_managers]
    return cache.num_blocks * bytes_per_block, tables


class _HFContinuousRunner:
    """transformers' continuous batching (the engine behind ``generate_batch``), one paged cache of the budget.

    Its manager runs the model in a background thread, and that thread's torch operations give it
    an OpenMP thread team of its own. While that thread lives, libgomp counts more OpenMP threads
    than CPUs and cuts the time a waiting worker spins from 300,000 to 100 iterations (its
    ``GOMP_SPINCOUNT`` documentation), so every other system in this process pays a sleep and a
    wake-up per parallel region: on the course's 2-core CPU this engine served W1 at 0.3-0.8 of
    its speed alone beside such a thread (``scripts/openmp_neighbour.py``). So the thread lives only inside `run`: the manager is stopped
    after each run, kept for the next (transformers' persistent manager), and started again.
    """

    name = "hf-continuous"

    def __init__(self, setup: ServeSetup):
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        from pagedkv_lab.models import load_model

        self.block_size = setup.block_size
        self.model, _ = load_model(setup.model_name, device=setup.device, dtype=setup.dtype)
        self._generation = GenerationConfig(
            max_new_tokens=setup.max_model_len,
            do_sample=False,
            eos_token_id=-1,
            pad_token_id=0,
        )
        # transformers 5.18 renamed the config's block_size to page_size
        fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
        size_field = "page_size" if "page_size" in fields else "block_size"
        step_budget = setup.max_num_batched_tokens or HF_DEFAULT_MAX_BATCH_TOKENS
        self._batching = ContinuousBatchingConfig(
            **{size_field: setup.block_size},
            num_blocks=setup.budget_tokens // setup.block_size,
            max_batch_tokens=step_budget,
            max_requests_per_batch=setup.max_num_seqs,
            allow_block_sharing=setup.prefix_caching,
        )
        self.manager = None
        self._start()
        try:
            processor = self.manager.batch_processor
            self.capacity_bytes, block_tables = _hf_paged_cache_layout(processor.cache)
            if self.capacity_bytes > setup.budget_bytes:
                raise RuntimeError(
                    f"transformers' paged cache holds {self.capacity_bytes} bytes, "
                    f"more than the {setup.budget_bytes}-byte budget"
                )
        except BaseException:
            self.close()
            raise
        self.peak = 0
        update = processor.update_batch

        def update_and_measure():
            # after each step, as for the other engines: blocks held by unfinished requests
            update()
            # a block shared by several requests (prefix sharing) counts once
            held = sum(
                len({b for blocks in table.values() for b in blocks}) * bytes_per_block
                for table, bytes_per_block in block_tables
            )
            self.peak = max(self.peak, held)

        # the processor, and so this hook, is kept across stop and start
        processor.update_batch = update_and_measure
        self._pause()
        self._ids = 0

    def _start(self) -> None:
        """Start the manager's thread (the kept manager after the first call) and wait for its batch processor."""
        # after the first call this returns the manager kept by `_pause`
        self.manager = self.model.init_continuous_batching(
            self._generation, self._batching
        )
        self.manager.start()
        deadline = time.monotonic() + 120
        while getattr(self.manager, "batch_processor", None) is None:
            if time.monotonic() > deadline or not self.manager.is_running():
                self.close()
                raise RuntimeError("transformers' continuous batching did not start")
            time.sleep(0.01)

    def _pause(self) -> None:
        """Stop the thread (its OpenMP team goes with it), keeping the manager, its cache and the hook."""
        self.manager.stop(block=True, keep_for_next_session=True)

    def run(self, prompts: list[list[int]], max_tokens: list[int]) -> dict:
        self._start()
        try:
            return self._serve(prompts, max_tokens)
        finally:
            self._pause()

    def _serve(self, prompts: list[list[int]], max_tokens: list[int]) -> dict:
        self.peak = 0
        t0 = time.perf_counter()
        ids = {}
        for i, (p, n) in enumerate(zip(prompts, max_tokens)):
            rid = f"bench-{self._ids}"
            self._ids += 1
            self.manager.add_request(
                p, request_id=rid, max_new_tokens=n, record_timestamps=True
            )
            ids[rid] = i
        results = {}
        while len(results) < len(ids):
            res = self.manager.get_result(timeout=120)
            if res is None:
                raise RuntimeError(
                    "transformers' continuous batching stopped before finishing every request"
                )
            if res.is_finished() and res.request_id in ids:
                results[ids[res.request_id]] = res
        wall = time.perf_counter() - t0
        ttft, tpot = [], []
        for i in range(len(prompts)):
            stamps = results[i].timestamps or []
            if stamps:
                ttft.append(stamps[0] - results[i].created_time)
                tpot.append((stamps[-1] - stamps[0]) / max(1, len(stamps) - 1))
        return _run_result(
            wall,
            [list(results[i].generated_tokens) for i in range(len(prompts))],
            ttft or None,
            tpot or None,
            self.peak,
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def close(self) -> None:
        """Stop the thread if it runs and drop the kept manager."""
        if self.manager is not None and self.manager.is_running():
            self.manager.stop(block=True)
        self.model.destroy_cached_continuous_batching_manager()


def find_vllm_python(explicit: str | None = None) -> str | None:
    """The python that runs the vLLM peer: ``explicit``, else ``$PAGEDKV_VLLM_PYTHON``, else this
    python if it can import vllm (looked up without importing it), else None."""
    import importlib.util
    import os
    import sys

    found = explicit or os.environ.get("PAGEDKV_VLLM_PYTHON")
    if found:
        return found
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


def vllm_block_sizes(
    candidates: tuple[int, ...], max_model_len: int, budget_tokens: int
) -> list[int]:
    """The block sizes vLLM's CPU attention accepts (multiples of 32) that fit: at most
    ``max_model_len``, and a budget that holds at least one ``max_model_len`` request."""
    return [
        b
        for b in candidates
        if b % 32 == 0
        and b <= max_model_len
        and budget_tokens // b >= -(-max_model_len // b)
    ]


class _VLLMRunner:
    """vLLM in a subprocess of the vLLM python (`_vllm_peer.py`), kept alive across repetitions."""

    def __init__(
        self,
        setup: ServeSetup,
        python: str,
        block_size: int,
        model_dir: str,
        log_dir: str,
        eager: bool = False,
    ):
        import json
        import os
        import subprocess

        from pagedkv_lab.models import OFFLINE_MODELS

        # eager: vLLM's own kernels, no torch.compile ("-tc": with its default compile)
        self.name = f"vllm-b{block_size}" + ("" if eager else "-tc")
        self.block_size = block_size
        self._json = json
        env = {
            **os.environ,
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in the peer's process
            "OMP_NUM_THREADS": str(setup.threads),  # the thread count our side uses
            "TOKENIZERS_PARALLELISM": "false",
        }
        self.log_path = Path(log_dir) / f"{self.name}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [python, str(VLLM_PEER_SCRIPT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )
        self.info = self._ask(
            {
                "cmd": "init",
                "model": model_dir,
                "block_size": block_size,
                "kv_cache_bytes": setup.budget_bytes,
                "max_model_len": setup.max_model_len,
                "max_num_seqs": setup.max_num_seqs,
                "max_num_batched_tokens": setup.max_num_batched_tokens,
                "enforce_eager": eager,
                "enable_prefix_caching": setup.prefix_caching,
                # the offline models are fp32 checkpoints served in fp32 by us;
                # vLLM's "auto" would serve them in 16 bits
                "dtype": str(setup.dtype).removeprefix("torch.") if setup.dtype else
                "float32" if setup.model_name in OFFLINE_MODELS else "auto",
            }
        )
        # bytes per block of vLLM's own cache tensors
        self.block_bytes = self.info["kv_cache_bytes"] // self.info["num_blocks"]
        if self.info["kv_cache_bytes"] > setup.budget_bytes:
            raise RuntimeError(
                f"vLLM allocated {self.info['kv_cache_bytes']} KV bytes, "
                f"more than the {setup.budget_bytes}-byte budget"
            )

    def _ask(self, msg: dict) -> dict:
        try:
            self.proc.stdin.write(self._json.dumps(msg) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        reply = self._json.loads(line) if line else {"error": "the vLLM peer exited"}
        if "error" in reply:
            self._log.flush()
            tail = self.log_path.read_text()[-3000:]
            raise RuntimeError(
                f"vLLM peer: {reply['error']}\n--- {self.log_path}:\n{tail}"
            )
        return reply

    def run(self, prompts: list[list[int]], max_tokens: list[int]) -> dict:
        r = self._ask(
            {"cmd": "run", "prompts": prompts, "max_tokens": list(max_tokens)}
        )
        return _run_result(
            r["seconds"],
            r["tokens"],
            r["ttft"],
            r["tpot"],
            r["peak_blocks"] * self.block_bytes,
        )

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"cmd": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except Exception:  # a peer that does not answer is killed
                self.proc.kill()
        self._log.close()


def _save_for_vllm(model_name: str, directory: str) -> str:
    """The offline model's weights and byte tokenizer, saved where vLLM can load them; other names pass through."""
    from pagedkv_lab.models import OFFLINE_MODELS, load_model

    if model_name not in OFFLINE_MODELS:
        return model_name
    from transformers.utils import logging as hf_logging

    model, tokenizer = load_model(model_name)
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(directory)
    finally:
        hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(directory)
    return directory
