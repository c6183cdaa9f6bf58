"""The transformers versions pyproject.toml declares are the ones the code works with.

CI runs the whole unit suite twice: on the newest transformers the range allows,
and on its lower bound (`make test-floor`, which installs exactly that version).
These tests say which version a run used and check the APIs the library calls.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import transformers
from packaging.requirements import Requirement
from packaging.version import Version

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def declared(name: str) -> Requirement:
    """The requirement on ``name`` in pyproject.toml's dependencies."""
    for line in PYPROJECT.read_text().splitlines():
        match = re.match(r'\s*"((\w[\w-]*)[^"]*)",?\s*$', line)
        if match and match.group(2) == name:
            return Requirement(match.group(1))
    raise AssertionError(f"pyproject.toml declares no {name}")


def test_installed_transformers_is_in_the_declared_range():
    requirement = declared("transformers")
    assert Version(transformers.__version__) in requirement.specifier, (
        f"transformers {transformers.__version__} is outside {requirement}"
    )


def test_the_declared_floor_is_the_version_make_test_floor_installs():
    makefile = (PYPROJECT.parent / "Makefile").read_text()
    floor = re.search(r"^TRANSFORMERS_FLOOR\s*:?=\s*(\S+)", makefile, re.M)
    lower = [s.version for s in declared("transformers").specifier if s.operator == ">="]
    assert floor and [Version(v) for v in lower] == [Version(floor.group(1))]


def test_the_transformers_apis_the_library_calls_exist():
    from transformers import AttentionInterface, GenerationConfig, GenerationMixin
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    assert callable(AttentionInterface.register)
    assert callable(GenerationMixin.init_continuous_batching)
    assert callable(GenerationMixin.generate_batch)
    # bench's peer sets the page size under either name (page_size from 5.18 on)
    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    assert {"page_size", "block_size"} & fields
    assert {"num_blocks", "max_batch_tokens", "max_requests_per_batch"} <= fields
    assert "allow_block_sharing" in fields
    GenerationConfig(max_new_tokens=1, do_sample=False, eos_token_id=-1, pad_token_id=0)
