"""The serving engine, one module per mechanism (chapters 03 and 05a-09):

    sequence         Sequence, SequenceGroup, SchedulerOutput: plain data (05a, 06)
    block_manager    blocks on a free list with reference counts (03), and every
                     block table: allocate, append, fork, copy on write (06-08)
    prefix_cache     chained keys of full blocks, verified hits (08)
    swap             host blocks of swapped requests (09)
    scheduler        who computes how many tokens each step; after it, stops (06, 09)
    groups           parallel sampling and beam search on shared blocks (07)
    kv_cache         the paged K/V tensor, block copies (05a) and swaps (09)
    inputs           a step packed into one row, its attention metadata (05a)
    model_runner     the device side of a step: inputs, forward, sampling (05a)
    fused, layer_ops the fused step: 4 GEMMs a layer (05b)
    graphs           decode steps replayed from CUDA graphs (05b)
    sampler          a whole batch sampled in a fixed number of operations (05a)
    core             schedule -> execute -> postprocess, and its counters (06)

Importing this package imports nothing else: the block manager, the scheduler
and the sequence module load neither torch's model stack nor Triton.
"""

# Names that lived in the old flat module `pagedkv_lab.engine`, and where they are now.
_MOVED = {
    "Sequence": "engine.sequence", "SamplingParams": "sampling_params",
    "PagedKVCache": "engine.kv_cache", "StepInputs": "engine.inputs",
    "ModelRunner": "engine.model_runner", "upload": "engine.kv_cache",
    "pack_arrays": "engine.inputs", "sample_batched": "engine.sampler",
    "sample": "the tests' reference (tests/reference.py)",
}  # fmt: skip


def __getattr__(name: str):
    if name in _MOVED:
        raise AttributeError(
            f"pagedkv_lab.engine.{name} moved: see pagedkv_lab.{_MOVED[name]}"
        )
    raise AttributeError(f"module 'pagedkv_lab.engine' has no attribute {name!r}")
