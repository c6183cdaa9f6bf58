import os
import sys

# Kernels run in Triton's interpreter without a GPU; set before anything imports triton.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass

from hypothesis import settings

settings.register_profile("ci", max_examples=60, deadline=None)
settings.load_profile("ci")

# Where this process's memory went: its peak resident set and the tests that raised it
# most, one line at the end of the run. CI's machine has 24 GiB for every process of
# `.ci/run`; a test that raises the peak by gigabytes shows up here by name (issue 47).
try:
    import resource
except ImportError:  # pragma: no cover (Windows)
    resource = None
# ru_maxrss counts bytes on macOS, KiB elsewhere
_RSS_UNIT = 1 if sys.platform == "darwin" else 1024
_peak = [0]
_rises: list[tuple[int, str]] = []


def _max_rss(who: int) -> int:
    return resource.getrusage(who).ru_maxrss * _RSS_UNIT


def pytest_runtest_logfinish(nodeid, location):
    if resource is None:
        return
    peak = _max_rss(resource.RUSAGE_SELF)
    if peak > _peak[0]:
        if _peak[0]:  # the first test's rise is mostly imports
            _rises.append((peak - _peak[0], nodeid))
        _peak[0] = peak


def pytest_terminal_summary(terminalreporter):
    if not _peak[0]:
        return
    top = sorted(_rises, reverse=True)[:3]
    rises = "; ".join(f"+{rise / 1e9:.2f} GB {nodeid}" for rise, nodeid in top)
    terminalreporter.write_line(
        f"peak resident memory {_peak[0] / 1e9:.2f} GB (subprocesses: "
        f"{_max_rss(resource.RUSAGE_CHILDREN) / 1e9:.2f} GB); largest rises: {rises}"
    )
