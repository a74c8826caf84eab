"""Errors a user can cause. The CLI prints their message and exits non-zero, no traceback."""

from __future__ import annotations


class GraphparError(Exception):
    """Base of every error the user can fix; the message says what went wrong and what to do."""

    exit_code = 1


class UsageError(GraphparError):
    """Bad command-line input: a missing file, a file with no model, a bad pipeline string."""

    exit_code = 2


class OutOfMemoryError(GraphparError):
    """Real tensors that do not fit this machine's memory; says what needed how many bytes and
    how to avoid making them."""


class OutputError(GraphparError):
    """An output path that cannot be written: a file in the way, no permission, a full disk."""


class CaptureError(GraphparError):
    """torch.export / make_fx could not trace the model; carries the user's source line."""


class UnsupportedOpError(CaptureError):
    """An ATen op has no graphpar IR mapping, or an IR op is not in the registry."""


class IRParseError(GraphparError):
    """IR text that does not parse; the message names the file, line and column."""


class VerificationError(GraphparError):
    """An IR graph that breaks an invariant (types, SSA, order); the message names the node.

    `subject` is the node, value or graph at fault, so a caller that knows where it was
    written (the IR parser) can name that line."""

    def __init__(self, message: str, subject: object = None):
        super().__init__(message)
        self.subject = subject


class PassError(GraphparError):
    """A pass could not run on the graph it was given."""


class ScheduleError(GraphparError):
    """A pipeline schedule that cannot run: a missing or repeated action, a send with no
    matching receive, a wait cycle, or too few microbatches for the schedule asked for; the
    message names the stage and the action."""


class ShardingError(GraphparError):
    """A mesh or layout that does not fit the graph (e.g. a mesh that divides no dimension)."""


class MemoryLimitError(ShardingError):
    """No plan fits the per-device memory limit; says what the best plan needs."""


class TimeLimitError(ShardingError):
    """The sharding ILP's time limit ran out before it had any plan; says which limit to
    raise."""


class ClusterSpecError(UsageError):
    """A malformed cluster description file or an unknown cluster preset."""


class KVCacheError(GraphparError):
    """A request the KV block manager can never hold (e.g. longer than all KV memory)."""


class GenerationError(GraphparError):
    """A request the engine cannot serve (prompt longer than the context, unsupported head size)."""


class BackendError(GraphparError):
    """A device backend that is unavailable or cannot run a program (no GPU, no nvcc)."""


class PlacementSpecError(UsageError):
    """A serving-placement SPEC, workload or trace that is malformed: names the field or line."""


class PlacementError(GraphparError):
    """A placement that cannot exist: a model that fits no device group, an SLO that no
    parallel configuration can meet."""


class CheckpointError(GraphparError):
    """A checkpoint that cannot be resumed from: unreadable or half-written, or written for
    another model or optimizer; the message names the folder and what differs."""
