import os
import sys

# Kernels run in Triton's interpreter without a GPU; set before anything imports triton.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass

import pytest
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


def _report() -> tuple[int, int, list[tuple[int, str]]]:
    """This process's peak, its children's, and its three largest rises."""
    return _peak[0], _max_rss(resource.RUSAGE_CHILDREN), sorted(_rises, reverse=True)[:3]


# Under pytest-xdist (`make test` runs two workers) each worker measures itself and
# hands its figures to the controller, which prints the largest.
_workers: list[tuple[int, int, list]] = []


def pytest_sessionfinish(session):
    if resource is not None and hasattr(session.config, "workeroutput"):
        session.config.workeroutput["memory"] = _report()


@pytest.hookimpl(optionalhook=True)  # an xdist hook: absent where xdist is not installed
def pytest_testnodedown(node, error):
    memory = getattr(node, "workeroutput", {}).get("memory")
    if memory:
        _workers.append(memory)


def pytest_terminal_summary(terminalreporter):
    if resource is None:
        return
    if _workers:
        peak, children = max(w[0] for w in _workers), max(w[1] for w in _workers)
        top = sorted((tuple(r) for w in _workers for r in w[2]), reverse=True)[:3]
        who = f"the largest of {len(_workers)} workers"
    elif _peak[0]:
        peak, children, top = _report()
        who = "this process"
    else:
        return
    rises = "; ".join(f"+{rise / 1e9:.2f} GB {nodeid}" for rise, nodeid in top)
    terminalreporter.write_line(
        f"peak resident memory {peak / 1e9:.2f} GB ({who}; its subprocesses: "
        f"{children / 1e9:.2f} GB); largest rises: {rises}"
    )
