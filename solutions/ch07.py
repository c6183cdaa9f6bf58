"""Solutions to chapter 07's exercises."""


def blocks_after_fork(prompt_len: int, n: int, k: int, block_size: int) -> int:
    """Full prompt blocks are shared; each sequence owns the rest."""
    shared, partial = divmod(prompt_len, block_size)
    return shared + n * -(-(partial + k) // block_size)


def copies_after_fork(prompt_len: int, n: int, block_size: int) -> int:
    """Every holder of the partial block but the last copies it."""
    return n - 1 if prompt_len % block_size else 0


def unshared_blocks(prompt_len: int, n: int, k: int, block_size: int) -> int:
    """Each sequence on its own."""
    return n * -(-(prompt_len + k) // block_size)


# With a 500-token prompt, n = 4, k = 100 at block 16: 59 blocks shared against
# 152 unshared, a 61% saving, far above the paper's 6.1-30.5% for parallel
# sampling: there the prompts were short against the outputs (Alpaca, ShareGPT),
# here the prompt is five times the output, so most of each sequence is shared.
