"""Solutions to chapter 05b's exercises."""


def fused_rows(heads: int, kv_heads: int, head_dim: int) -> int:
    """q contributes heads x head_dim rows; k and v kv_heads x head_dim each."""
    return (heads + 2 * kv_heads) * head_dim


def graph_bucket(batch: int, max_num_seqs: int) -> int | None:
    """The smallest graph size that holds the batch: 1, 2, 4, 8, the multiples
    of 16 and max_num_seqs itself, none above max_num_seqs."""
    sizes = {s for s in (1, 2, 4, 8) if s < max_num_seqs}
    sizes |= set(range(16, max_num_seqs, 16)) | {max_num_seqs}
    fits = [s for s in sorted(sizes) if s >= batch]
    return fits[0] if fits else None
