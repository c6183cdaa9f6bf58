"""`EngineStats`: counters over an engine's life (vLLM keeps its scheduler and
iteration statistics in ``vllm/v1/metrics/stats.py``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    """Counters over the engine's life."""

    num_blocks: int
    block_size: int
    steps: int = 0
    preemptions: int = 0
    peak_running: int = 0
    peak_blocks_used: int = 0
    # Sum over steps of (tokens with K/V) / (slots in blocks held).
    utilization_sum: float = 0.0
    # Sums over steps of the blocks the forward pass holds, and of what its
    # running sequences would hold if none shared a block (chapter 07's memory
    # saving), both taken once the step's copies-on-write are made.
    blocks_held_sum: int = 0
    blocks_unshared_sum: int = 0
    # Tokens whose K/V the forward passes computed (prefill and decode).
    tokens_computed: int = 0
    block_copies: int = 0
    errors: int = 0
    aborts: int = 0

    @property
    def mean_utilization(self) -> float:
        """Mean share of allocated block slots that hold a token's K/V."""
        return self.utilization_sum / self.steps if self.steps else 0.0

    @property
    def sharing_saving(self) -> float:
        """Blocks saved by sharing over blocks without sharing, over the run
        (the vLLM paper's Figure 15 measure)."""
        unshared = self.blocks_unshared_sum
        return 1 - self.blocks_held_sum / unshared if unshared else 0.0

    def record_held_blocks(self, scheduler, block_manager) -> None:
        """Add the blocks this step's forward pass holds, and what its running
        sequences would hold if none shared a block, to chapter 07's sums.

        Called once the step is planned: its copies-on-write are made, so a
        partial block that forked sequences shared until this step, and that
        all but one now copy, counts as copied, not as shared.
        """
        bm = block_manager
        self.blocks_held_sum += bm.num_blocks - bm.num_free_blocks
        self.blocks_unshared_sum += sum(
            len(q.block_table.blocks) for q in running_seqs(scheduler)
            if q.block_table is not None
        )  # fmt: skip

    def record_step(self, scheduler, block_manager) -> None:
        """Count a finished step: preemptions, copies, peaks and utilization."""
        bm = block_manager
        seqs = running_seqs(scheduler)
        held = bm.num_blocks - bm.num_free_blocks
        self.steps += 1
        self.preemptions = scheduler.num_preemptions
        self.block_copies = bm.num_copies
        self.peak_running = max(self.peak_running, len(seqs))
        self.peak_blocks_used = max(self.peak_blocks_used, held)
        if held:
            # Only a table's trailing blocks have empty slots; a shared block
            # is counted once (its holders see the same tokens in it).
            tables = [(q.block_table.blocks, q.num_computed_tokens) for q in seqs
                      if q.block_table is not None and q.block_table.blocks]  # fmt: skip
            bs = self.block_size
            empty = {blocks[-1]: len(blocks) * bs - n for blocks, n in tables}
            self.utilization_sum += 1 - sum(empty.values()) / (held * self.block_size)


def running_seqs(scheduler) -> list:
    """The unfinished sequences of the scheduler's running requests."""
    return [q for g in scheduler.running for q in g.seqs if q.finish_reason is None]
