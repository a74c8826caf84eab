"""Independent solves run in worker processes, their results returned in the order asked.

`slice-stages` prices each kind of layer on each logical mesh with one ILP solve; the solves do
not depend on each other, so they can run side by side, as Alpa compiles its stage-mesh pairs
in parallel. The workers are forked: they start with the parent's graph, layers and caches as
they are, so only an index goes out and a small result comes back. Each solve's answer depends
only on its own problem, and the results are taken in the order asked, so the outcome is the
same for any number of workers.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Callable

_task: Callable[[int], object] | None = None  # what the forked workers run (set before forking)


def _run(i: int) -> object:
    return _task(i)


def _worker_signals() -> None:
    """A forked worker ends quietly when the pool terminates it (SIGTERM), instead of running
    the handler it inherited (the CLI's, which raises to clean up and would print a
    traceback); Ctrl-C is the parent's to handle."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def available_workers() -> int:
    """The CPUs this process may run on (its affinity, as a container or `taskset` sets it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def map_in_order(task: Callable[[int], object], count: int, workers: int) -> list:
    """[task(0), ..., task(count - 1)], on up to `workers` forked processes (in this process
    when one would do, or where forking is not possible: no `fork` start method, or this
    process is itself a daemonic worker)."""
    workers = min(workers, count)
    if (workers <= 1 or "fork" not in multiprocessing.get_all_start_methods()
            or multiprocessing.current_process().daemon):
        return [task(i) for i in range(count)]
    global _task
    _task = task
    try:
        with multiprocessing.get_context("fork").Pool(workers, _worker_signals) as pool:
            return pool.map(_run, range(count), chunksize=1)
    finally:
        _task = None
