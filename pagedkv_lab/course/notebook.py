"""The setup that opens every chapter notebook.

`setup()` must run before any Triton kernel is defined (our kernel modules
define theirs when imported): without a CUDA device it sets
``TRITON_INTERPRET=1`` so that kernels run (slowly) on the CPU.
"""

from __future__ import annotations

import logging
import os
import random
import warnings

import numpy as np
import torch

from pagedkv_lab.course.plotting import use_style
from pagedkv_lab.device import pick_device

#: The mime prefix myst-nb's `glue` gives a value stored for the book but not shown.
GLUE_PREFIX = "application/papermill.record/"
#: Output metadata marking a line meant for live notebooks only; the book drops
#: such outputs (`pagedkv_lab.course._sphinx`).
LIVE_ONLY = "pagedkv_lab_live_only"


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def glue(name: str, value: object, display: bool = False) -> None:
    """Store ``value`` under ``name`` for the book's ``{glue:text}`name``` roles.

    The record is the one myst-nb's own ``glue`` writes (so the site renders the
    number in the prose), made with IPython alone: the base install, which is
    all that Colab gets, needs no book tooling. A live notebook (JupyterLab,
    Colab) shows the roles raw, so the value is also shown under the cell as
    ``name = value``; the book drops that line. ``display=True`` shows the value
    itself as an ordinary output, as myst-nb's does.
    """
    from IPython.core.formatters import format_display_data
    from IPython.display import display as show

    bundle, metadata = format_display_data(value)
    prefix = "" if display else GLUE_PREFIX
    metadata["scrapbook"] = {"name": name, "mime_prefix": prefix}
    show({prefix + k: v for k, v in bundle.items()}, raw=True, metadata=metadata)
    if not display:
        text = f"{name} = {bundle.get('text/plain', '')}"
        show({"text/plain": text}, raw=True, metadata={LIVE_ONLY: True})


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
    """Prepare a chapter: quiet warnings, Triton mode, seeds, plot style; return the device to use.

    Triton's mode follows the device chosen (``$PAGEDKV_DEVICE`` included), not
    the hardware: a chapter run on the CPU of a GPU machine interprets its kernels.
    """
    device = pick_device()
    if device.type != "cuda":
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
    return device


def chapter_class(cls: type) -> type:
    """A copy of the library class ``cls`` for a chapter to add methods to.

    A chapter that changes a method an earlier chapter wrote (chapter 07's
    `BlockManager.__init__` takes ``eager_fork_copy``) adds its version to this
    copy with `add_to_class`: the chapter's objects get it, while the library's
    own code (an `LLM` built in the same notebook) keeps the class as shipped,
    whose methods are the last chapters' versions."""
    skip = ("__dict__", "__weakref__")
    return type(cls.__name__, cls.__bases__,
                {k: v for k, v in vars(cls).items() if k not in skip})  # fmt: skip


def add_to_class(cls: type):
    """Attach the decorated function to ``cls`` as a method (d2l's habit): a
    chapter introduces a long class method by method, with prose between.

    Only notebooks use it. The exporter (`pagedkv_lab._export`) writes each
    such function into the class body of the shipped module instead, so the
    library holds whole classes and patches nothing at run time. Put it
    outermost, above ``@property`` or ``@staticmethod``."""

    def attach(fn):
        target = fn.fget if isinstance(fn, property) else getattr(fn, "__func__", fn)
        setattr(cls, target.__name__, fn)
        return fn

    return attach
