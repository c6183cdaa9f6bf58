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
    """Serve the demo's six requests without a model: with EOS ignored, which
    token is sampled does not change the schedule."""
    from pagedkv_lab.engine.block_manager import BlockManager
    from pagedkv_lab.engine.scheduler import Scheduler
    from pagedkv_lab.engine.sequence import Sequence, SequenceGroup
    from pagedkv_lab.sampling_params import SamplingParams

    sched = Scheduler(
        BlockManager(10, 4), max_model_len=2048, max_num_seqs=4, watermark=watermark
    )
    for i, (p, o) in enumerate([(5, 9), (3, 4), (9, 10), (2, 3), (6, 8), (4, 2)]):
        params = SamplingParams(temperature=0, max_tokens=o, ignore_eos=True)
        sched.add(SequenceGroup(i, Sequence(list(range(1, p + 1)), params)))
    while sched.has_unfinished:
        plan = sched.schedule()
        for seq, n in zip(plan.seqs, plan.num_new_tokens):
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:
                seq.append_token(5, None, 2048)
        sched.free_finished()
    return sched.num_preemptions


# Why: the watermark keeps int(watermark * 10) blocks free when admitting, so
# fewer requests start early; those that run have room to grow, so fewer are
# preempted (and later recomputed), at the cost of admitting newcomers later.
