"""Shared test setup: Hypothesis profiles and the path to the dsh fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, settings

# The shared helpers assert (assert_contiguous, ...): rewrite them as pytest rewrites a test module's asserts.
pytest.register_assert_rewrite("scaffold", "sessiongen")

# CI runs on 2 cores with a 90-minute limit for everything: keep property tests bounded there.
settings.register_profile(
    "ci", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile("dev", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

REPO_ROOT = Path(__file__).resolve().parents[1]
# The 81 dsh logs are vendored (tests/fixtures/README.md): a clone needs nothing beside it.
FIXTURES_DIR = REPO_ROOT / "tests" / "fixtures" / "dsh-sessions"

pytest_plugins = ["natsfixtures"]


def normalize_fixture(data: bytes) -> bytes:
    """The fixtures' one rule (tests/fixtures/README.md): a `request/header` whose `tools` is the recorder's
    placeholder string "{{tools}}" gets `[]` there; every other byte is kept."""
    lines = data.split(b"\n")
    for i, line in enumerate(lines):
        if b'"{{tools}}"' in line and msgspec.json.decode(line).get("type") == "request/header":
            lines[i] = line.replace(b'"tools":"{{tools}}"', b'"tools":[]')
    return b"\n".join(lines)
