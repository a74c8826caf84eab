"""Wall-clock timing of a repeated call: the median after a warm-up, as every measurement uses."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

__all__ = ["median_seconds"]


def median_seconds(fn: Callable[[], object], repeats: int, *, warmup: int = 1,
                   sync: Callable[[], object] | None = None,
                   clock: Callable[[], float] = time.perf_counter) -> float:
    """The median of `repeats` timed calls of `fn()` after `warmup` untimed ones (measured,
    seconds of `clock`: wall clock by default). `sync` (e.g. `torch.cuda.synchronize`) runs
    before each clock read, so that work an accelerator queued is counted; the median keeps a
    stray slow call (another process took the core) from moving the result. `time.thread_time`
    as the clock counts only the CPU time this thread got: single-threaded work on a shared
    machine, timed as if the core were its own."""
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
    return float(np.median(times))
