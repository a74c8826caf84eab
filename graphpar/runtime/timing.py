"""Wall-clock timing of a repeated call: the median after a warm-up, as every measurement uses."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

__all__ = ["call_seconds", "median_seconds", "trimmed_mean"]


def call_seconds(fn: Callable[[], object], repeats: int, *, warmup: int = 1,
                 sync: Callable[[], object] | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """The seconds of `clock` (wall clock by default) of each of `repeats` timed calls of `fn()`
    after `warmup` untimed ones (measured). `sync` (e.g. `torch.cuda.synchronize`) runs before
    each clock read, so that work an accelerator queued is counted. `time.thread_time` as the
    clock counts only the CPU time this thread got: single-threaded work on a shared machine,
    timed as if the core were its own."""
    sync = sync or (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(1, repeats)):
        sync()
        start = clock()
        fn()
        sync()
        times.append(clock() - start)
    return times


def median_seconds(fn: Callable[[], object], repeats: int, *, warmup: int = 1,
                   sync: Callable[[], object] | None = None,
                   clock: Callable[[], float] = time.perf_counter) -> float:
    """The median of `call_seconds`: a stray slow call (another process took the core) does not
    move it."""
    return float(np.median(call_seconds(fn, repeats, warmup=warmup, sync=sync, clock=clock)))


def trimmed_mean(seconds: list[float]) -> float:
    """The mean without the slowest value (of three or more): a rare stall (the scheduler, a
    page fault) does not move it much, and, unlike a median, the means of a step's parts add
    up to the step's."""
    kept = sorted(seconds)[:-1] if len(seconds) >= 3 else list(seconds)
    return sum(kept) / len(kept)
