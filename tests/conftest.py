"""Shared test setup: Hypothesis profiles and the path to the dsh fixtures."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

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


def dsh_header_problem(header: dict[str, Any]) -> str | None:
    """Why dsh would refuse this session header line, or None: the rules of its loader (checked against dsh's
    packages/core/session source, 2026-12-03). It knows `origin` only as "subagent"; a fork writes none."""

    def non_negative_int(value: Any) -> bool:
        return type(value) is int and value >= 0

    if header.get("type") != "session":
        return "first line is not a session header"
    if header.get("version") != 0:
        return f"version must be 0, got {header.get('version')!r}"
    if not isinstance(header.get("id"), str):
        return "id must be a string"
    if not non_negative_int(header.get("createdAt")):
        return "createdAt must be a non-negative safe integer"
    if "cwd" in header and not (isinstance(header["cwd"], str) and header["cwd"].startswith("/")):
        return f"cwd must be an absolute path, got {header['cwd']!r}"
    if "parentSession" in header and not isinstance(header["parentSession"], str):
        return "parentSession must be a string"
    if "seedLength" in header and not non_negative_int(header["seedLength"]):
        return "seedLength must be a non-negative safe integer"
    if "origin" in header and header["origin"] != "subagent":
        return f'origin must be "subagent", got {header["origin"]!r}'
    if "delegationDepth" in header and not non_negative_int(header["delegationDepth"]):
        return "delegationDepth must be a non-negative safe integer"
    if "agentPreset" in header and not isinstance(header["agentPreset"], str):
        return "agentPreset must be a string"
    return None


def normalize_fixture(data: bytes) -> bytes:
    """The fixtures' one rule (tests/fixtures/README.md): a `request/header` whose `tools` is the recorder's
    placeholder string "{{tools}}" gets `[]` there; every other byte is kept."""
    lines = data.split(b"\n")
    for i, line in enumerate(lines):
        if b'"{{tools}}"' in line and msgspec.json.decode(line).get("type") == "request/header":
            lines[i] = line.replace(b'"tools":"{{tools}}"', b'"tools":[]')
    return b"\n".join(lines)
