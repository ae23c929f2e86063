"""Giving the C heap's free pages back to the system (glibc's ``malloc_trim``), at moments a step does not wait for.

torch's CPU tensors come from malloc. After a large step (a prefill of thousands of tokens) frees its working
memory, glibc keeps most of it: the pages of freed chunks inside the heap and the threads' arenas stay resident
(its mmap threshold rises with each large free, so later large buffers come from the heap too). ``malloc_trim``
returns them (figures in docs/benchmarks.md). Elsewhere than glibc (musl, macOS) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time

# the trims' share of the wall-clock time, at most, while steps run (the cost of one is measured as it runs)
MAX_TRIM_TIME_FRACTION = 0.01


def _load_malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


class HeapTrimmer:
    """Trims the C heap when asked, but while steps run no more often than keeps its cost under
    MAX_TRIM_TIME_FRACTION of the time (one trim walks every arena: ~2-7 ms for a 135M model's core)."""

    def __init__(self, malloc_trim=None):
        self._malloc_trim = malloc_trim if malloc_trim is not None else _load_malloc_trim()
        self._next_allowed = 0.0  # perf_counter time before which a trim while busy is skipped
        self.num_trims = 0

    @property
    def available(self) -> bool:
        return self._malloc_trim is not None

    def trim(self, busy: bool) -> bool:
        """Trim now (busy False: nothing waits on it, e.g. the engine has gone idle), or if busy only when the
        last trim's cost is paid for; whether it trimmed."""
        if self._malloc_trim is None:
            return False
        start = time.perf_counter()
        if busy and start < self._next_allowed:
            return False
        self._malloc_trim(0)
        end = time.perf_counter()
        self._next_allowed = end + (end - start) / MAX_TRIM_TIME_FRACTION
        self.num_trims += 1
        return True
