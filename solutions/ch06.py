"""Solutions to chapter 06's exercises."""

import heapq


def static_steps(output_lens: list[int], batch_size: int) -> int:
    """Each batch runs as long as its longest request."""
    return sum(
        max(output_lens[i : i + batch_size])
        for i in range(0, len(output_lens), batch_size)
    )


def continuous_steps(output_lens: list[int], batch_size: int) -> int:
    """Each request takes the slot that frees first; the last to end sets the total."""
    free_at = [0] * batch_size
    for n in output_lens:
        heapq.heappush(free_at, heapq.heappop(free_at) + n)
    return max(free_at)


def demo_preemptions(watermark: float) -> int:
    """The chapter's demo, served as `serve_by_hand` serves it, with the
    watermark as a parameter: a fresh pool, runner and scheduler each call."""
    from pagedkv_lab.engine.block_manager import BlockManager
    from pagedkv_lab.engine.model_runner import ModelRunner
    from pagedkv_lab.engine.scheduler import Scheduler
    from pagedkv_lab.engine.sequence import Sequence, SequenceGroup
    from pagedkv_lab.models import load_model
    from pagedkv_lab.sampling_params import SamplingParams

    model, _ = load_model("tiny-llama")
    runner = ModelRunner(model, num_blocks=10, block_size=4)
    scheduler = Scheduler(
        BlockManager(num_blocks=10, block_size=4),
        max_model_len=2048,
        max_num_seqs=4,
        watermark=watermark,
    )
    for i, (p, o) in enumerate([(5, 9), (3, 4), (9, 10), (2, 3), (6, 8), (4, 2)]):
        params = SamplingParams(temperature=0, max_tokens=o, ignore_eos=True)
        scheduler.add(SequenceGroup(i, Sequence(list(range(1, p + 1)), params)))
    while scheduler.has_unfinished:
        plan = scheduler.schedule()
        sampled = runner.execute(plan)
        scheduler.postprocess(plan, sampled and sampled.read())
    return scheduler.num_preemptions


# Why: the watermark keeps int(watermark * 10) blocks free when admitting, so
# fewer requests start early; those that run have room to grow, so fewer are
# preempted (and later recomputed), at the cost of admitting newcomers later.
