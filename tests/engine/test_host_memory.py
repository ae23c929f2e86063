"""The C heap's trims (engine/host_memory.py): always when nothing waits, while busy at most ~1 % of the time."""

from __future__ import annotations

import sys

import pytest

from nanovllm.engine import host_memory
from nanovllm.engine.host_memory import HeapTrimmer


class SlowTrim:
    """A malloc_trim that takes ``seconds`` of a fake clock."""

    def __init__(self, clock, seconds: float):
        self.clock, self.seconds, self.calls = clock, seconds, 0

    def __call__(self, pad: int) -> int:
        assert pad == 0
        self.calls += 1
        self.clock.now += self.seconds
        return 1


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def test_busy_trims_keep_to_their_share_of_the_time_and_idle_ones_always_run(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(host_memory.time, "perf_counter", clock)
    trim = SlowTrim(clock, 0.005)
    heap = HeapTrimmer(trim)
    assert heap.trim(busy=True)  # the first
    clock.now += 0.2  # a step later: 5 ms of trimming would be 2.5 % of the time
    assert not heap.trim(busy=True) and trim.calls == 1
    assert heap.trim(busy=False) and trim.calls == 2  # idle: nobody waits
    clock.now += 0.5 - 1e-6
    assert not heap.trim(busy=True)
    clock.now += 2e-6  # 100 trims' time since the last one ended: its cost is 1 %
    assert heap.trim(busy=True) and trim.calls == 3 == heap.num_trims


def test_without_malloc_trim_nothing_happens(monkeypatch):
    monkeypatch.setattr(host_memory, "_load_malloc_trim", lambda: None)
    heap = HeapTrimmer()
    assert not heap.available and not heap.trim(busy=False)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim: Linux")
def test_glibcs_malloc_trim_is_found_and_runs():
    heap = HeapTrimmer()
    assert heap.available and heap.trim(busy=False) and heap.num_trims == 1
