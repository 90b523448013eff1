"""The process set-up of long-running services (sessionlog.process)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from sessionlog.process import GC_THRESHOLDS, tune_gc


@pytest.fixture
def collector_restored() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)
    gc.unfreeze()


def test_a_service_process_collects_young_objects_less_often_and_freezes_what_it_started(
    collector_restored: None,
) -> None:
    started = [object() for _ in range(10)]  # a service's objects, made before it is tuned
    assert gc.get_threshold() != GC_THRESHOLDS
    tune_gc()
    assert gc.get_threshold() == GC_THRESHOLDS
    assert gc.get_freeze_count() >= len(started)
    assert GC_THRESHOLDS[0] > 700  # CPython's default first generation: the cost the tuning removes
