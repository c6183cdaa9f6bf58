"""The setup that opens every chapter notebook.

`setup()` must run before anything imports Triton: without a CUDA device it
sets ``TRITON_INTERPRET=1`` so that kernels run (slowly) on the CPU.
"""

from __future__ import annotations

import logging
import os
import random
import warnings

import numpy as np
import torch

from .device import pick_device
from .plotting import use_style


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def within(error: float, bound: float) -> str:
    """State a rounding error the way a compared notebook output may: by the bound it meets.

    An error's digits depend on the CPU's vector code (AVX-512, AVX2, scalar) and
    the thread count, so a printed ``2.6e-16`` on one machine is ``1.2e-16`` on
    the next; the bound is the same on every IEEE machine. Over the bound, the
    digits are shown (and the chapter's assertion fails next to them).
    """
    if error < bound:
        return f"< {bound:.0e}"
    return f"{error:.1e} (over the bound {bound:.0e})"


def setup(seed: int = 0) -> torch.device:
    """Prepare a chapter: quiet warnings, Triton mode, seeds, plot style; return the device to use."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass
    seed_everything(seed)
    use_style()
    return pick_device()
