"""The limits a sharding plan is found under (`PlanLimits`): the memory each device may hold and
the seconds the search may take, read once from the user's text by `PlanLimits.parse`.

    PlanLimits.parse("40GB", 30, "dgx-a100")     # 40e9 bytes per device, 30 s
    PlanLimits.parse("device", 10, cluster)      # the cluster's memory per device
    PlanLimits.parse("none")                     # no memory limit (memory_bytes None), 30 s
    PlanLimits(memory_bytes=None, time_seconds=5.0)

Every pass and stage re-solve takes the object, never the text: `None` memory means no limit
everywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from graphpar.cost.cluster import get_cluster
from graphpar.errors import UsageError
from graphpar.ir.cluster import Cluster
from graphpar.units import parse_bytes

__all__ = ["DEFAULT_MEMORY", "DEFAULT_TIME_SECONDS", "NO_MEMORY_LIMIT", "PlanLimits"]

DEFAULT_MEMORY = "device"  # the memory limit when the user gives none: the device's memory
DEFAULT_TIME_SECONDS = 30.0  # the time limit when the user gives none


def _check_memory(value: float | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected a number of bytes, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError("a memory limit must be positive")
    return float(value)


def _check_seconds(value: float) -> float:
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not (math.isfinite(value) and value > 0)):
        raise ValueError("give a positive number of seconds")
    return float(value)


@dataclass(frozen=True)
class PlanLimits:
    """What a plan must meet: `memory_bytes` per device (None: no limit) and `time_seconds`,
    the time one ILP may take (auto-shard: building and solving it; slice-stages: each layer's
    solve)."""

    memory_bytes: float | None = None
    time_seconds: float = DEFAULT_TIME_SECONDS

    def __post_init__(self) -> None:
        try:
            memory = _check_memory(self.memory_bytes)
        except ValueError as exc:
            raise UsageError(f"memory_bytes={self.memory_bytes!r}: {exc}") from None
        try:
            seconds = _check_seconds(self.time_seconds)
        except ValueError as exc:
            raise UsageError(f"time_seconds={self.time_seconds!r}: {exc}") from None
        object.__setattr__(self, "memory_bytes", memory)
        object.__setattr__(self, "time_seconds", seconds)

    @classmethod
    def parse(cls, memory: str | float | None = DEFAULT_MEMORY,
              time_seconds: float = DEFAULT_TIME_SECONDS,
              cluster: Cluster | str | Path = "dgx-a100", *,
              options: tuple[str, str] = ("memory_limit=", "time_limit=")) -> PlanLimits:
        """The limits as users write them: `memory` "device" (the memory per device of
        `cluster`, a preset, cluster file or `Cluster`; only then is it read), "none" (no
        limit), a size like "40GB", a number of bytes, or None (no limit: a value already
        read); `time_seconds` a positive number. A bad one is a `UsageError` naming it as
        `options` spell it ("--memory-limit " on the command line, "memory_limit=" in a
        pass)."""
        limit, seconds = cls._read(memory, time_seconds, options)
        if limit == DEFAULT_MEMORY:
            limit = float(get_cluster(cluster).device_memory)
        return cls(limit, seconds)

    @classmethod
    def check(cls, memory: str | float | None = DEFAULT_MEMORY,
              time_seconds: float = DEFAULT_TIME_SECONDS, *,
              options: tuple[str, str] = ("memory_limit=", "time_limit=")) -> None:
        """The `UsageError` `parse` would raise for this text, found without reading a
        cluster: for options checked before the cluster is."""
        cls._read(memory, time_seconds, options)

    @staticmethod
    def _read(memory: str | float | None, time_seconds: float,
              options: tuple[str, str]) -> tuple[float | str | None, float]:
        """(bytes, None or "device"; seconds) of the user's text, each checked."""
        memory_option, time_option = options
        try:
            seconds = _check_seconds(time_seconds)
        except ValueError as exc:
            raise UsageError(f"{time_option}{time_seconds}: {exc}") from None
        if isinstance(memory, str) and memory.strip() in ("none", DEFAULT_MEMORY):
            return (None if memory.strip() == "none" else DEFAULT_MEMORY), seconds
        try:
            return _check_memory(parse_bytes(memory) if isinstance(memory, str)
                                 else memory), seconds
        except ValueError as exc:
            raise UsageError(f"{memory_option}{memory}: {exc}") from None


NO_MEMORY_LIMIT = PlanLimits()  # no memory limit, the default time: the bare ILP's default
