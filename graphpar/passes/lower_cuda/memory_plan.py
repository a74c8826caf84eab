"""The memory plan of a listing: every intermediate's offset in one arena per device.

Liveness comes from the calls themselves (a buffer lives from the call that first writes it
to the last call that reads it). Offsets are assigned as XLA's heap simulator does in its
global-decreasing-size best-fit mode: buffers from the largest down, each at the smallest gap
between already-placed buffers whose lifetimes intersect its own that fits it, else above
them all. The lower bound is the most bytes live at any one call: no plan can do better.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from graphpar.errors import OutOfMemoryError
from graphpar.ir.cuda_listing import ALIGNMENT

__all__ = ["Interval", "aligned", "check_no_overlap", "live_bytes_bound", "place"]


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to the buffer alignment (an empty tensor still gets a slot)."""
    return max(ALIGNMENT, -(-nbytes // ALIGNMENT) * ALIGNMENT)


@dataclass
class Interval:
    """One buffer to place: its size and its live calls [first, last], inclusive."""

    name: str
    nbytes: int
    first: int
    last: int
    offset: int = -1

    def overlaps_in_time(self, other: Interval) -> bool:
        return self.first <= other.last and other.first <= self.last


def place(buffers: Sequence[Interval]) -> int:
    """Give every buffer an offset (in place); returns the arena's size in bytes."""
    placed: list[Interval] = []
    top = 0
    for buf in sorted(buffers, key=lambda b: (-aligned(b.nbytes), b.first, b.name)):
        size = aligned(buf.nbytes)
        busy = sorted((b.offset, b.offset + aligned(b.nbytes)) for b in placed
                      if b.overlaps_in_time(buf))
        best, best_gap, cursor = None, None, 0
        for start, end in busy:
            gap = start - cursor
            if gap >= size and (best_gap is None or gap < best_gap):
                best, best_gap = cursor, gap
            cursor = max(cursor, end)
        buf.offset = cursor if best is None else best
        placed.append(buf)
        top = max(top, buf.offset + size)
    return top


def live_bytes_bound(buffers: Sequence[Interval], calls: int) -> int:
    """The most (aligned) bytes live during any one call: a lower bound on any plan."""
    delta = [0] * (calls + 3)
    for b in buffers:
        delta[b.first + 1] += aligned(b.nbytes)
        delta[b.last + 2] -= aligned(b.nbytes)
    best = running = 0
    for d in delta:
        running += d
        best = max(best, running)
    return best


def check_no_overlap(buffers: Sequence[Interval]) -> None:
    """Raise if two buffers live at the same time share bytes (the planner's own check)."""
    ordered = sorted(buffers, key=lambda b: b.offset)
    for i, a in enumerate(ordered):
        for b in ordered[i + 1:]:
            if b.offset >= a.offset + aligned(a.nbytes):
                break
            if a.overlaps_in_time(b):
                raise AssertionError(f"memory plan: {a.name} [{a.offset}, +{a.nbytes}) and "
                                     f"{b.name} [{b.offset}, +{b.nbytes}) overlap while both "
                                     "are live")


def check_fits(buffers: Sequence[Interval], arena: int, limit: int, what: str) -> None:
    """OutOfMemoryError when the arena exceeds `limit` bytes: by how much, and which tensors
    are live at the call where the most bytes are."""
    if limit <= 0 or arena <= limit:
        return
    calls = max((b.last for b in buffers), default=0) + 1
    live = [sum(aligned(b.nbytes) for b in buffers if b.first <= t <= b.last)
            for t in range(-1, calls)]
    peak_call = max(range(len(live)), key=live.__getitem__) - 1
    at_peak = sorted((b for b in buffers if b.first <= peak_call <= b.last),
                     key=lambda b: -b.nbytes)
    names = ", ".join(f"{b.name} ({b.nbytes} B)" for b in at_peak[:8])
    more = f" and {len(at_peak) - 8} more" if len(at_peak) > 8 else ""
    raise OutOfMemoryError(
        f"{what}: the memory plan needs {arena} bytes of arena, {arena - limit} bytes more than "
        f"the device's {limit}; at call {peak_call} these are live: {names}{more}. Shard the "
        "model over more devices (--mesh) or use a smaller batch")
