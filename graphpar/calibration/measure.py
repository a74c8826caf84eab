"""Measuring a machine for the cost model: ops of each class timed in this process, and
collectives timed on ranks of a worker group (gloo processes on the CPU; NCCL on GPUs).

Compute: every case is one registry op on one shape, run through the op's reference (what the
interpreter runs) with the thread count the runtime's workers have, so that one process here is
one device there. Its class, FLOPs and bytes are the cost model's own (`cost.compute.op_class`,
`OpDef.flops`, `cost.compute.bytes_moved`): the numbers the fitted rates divide. A case whose
operands outgrow the cache (`CACHE_BYTES`: the skinny matmuls of a decode step, which stream
their weights) is timed over `ROTATIONS` copies of them in turn, so no call finds the last one's
data cached.

Per-call overhead (`measure_overheads`): a tiny call of each class (one element, or a few rows)
through the interpreter's per-node dispatch, what every node of a run pays whatever its size;
the roofline fit takes it as the class's overhead and fits the rates to the rest.

Collectives: a job (`graphpar.runtime.jobs`) of `ranks` worker processes; each rank joins one
group of every size n in `group_sizes` (consecutive ranks, all groups of a size running at
once, as the groups of a mesh axis do) and times each kind on each message size. `nbytes` is
the formula's M (`graphpar.cost.communication`): the buffer for all_reduce, the gathered output
for all_gather, the full input for reduce_scatter, the local buffer for all_to_all, the message
for send_recv (half a ping-pong between ranks 2i and 2i+1). Rank 0's medians are reported.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from graphpar.backends.interpreter import Interpreter
from graphpar.cost.compute import SKINNY_ROWS, bytes_moved, op_class
from graphpar.ir.graph import Graph
from graphpar.ir.registry import get_op
from graphpar.ir.types import TensorType
from graphpar.runtime.jobs import Job, JobWorker
from graphpar.runtime.timing import median_seconds
from graphpar.runtime.workers import worker_threads

__all__ = ["CACHE_BYTES", "MEASURED_COLLECTIVES", "ROTATIONS", "SKINNY_WEIGHT_BYTES",
           "CollectiveBench", "CollectiveSample", "ComputeCase", "ComputeSample",
           "collective_sizes", "compute_cases", "contention_note", "measure_collectives",
           "measure_compute", "measure_overheads", "overhead_cases", "rotations"]

Progress = Callable[[str], None]  # called once per finished measurement, with what it was

# the kinds timed (not broadcast: no IR op issues one; the link prices it)
MEASURED_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")

F32, I64 = torch.float32, torch.int64

CACHE_BYTES = 64 * 2**20
"""More than the last-level cache of the machines calibrated (32 MiB of L3 on the development
CPU, 50 MiB of L2 on an H100): operands this large are not timed from cache."""
ROTATIONS = 2
"""Copies of a case's operands timed in turn when they reach `CACHE_BYTES`."""
SKINNY_WEIGHT_BYTES = (CACHE_BYTES, 2 * CACHE_BYTES, 4 * CACHE_BYTES)
"""The weight matrices of the `gemm_skinny` cases (64, 128 and 256 MiB, each timed over
`ROTATIONS` copies): a decode step streams every layer's weights (hundreds of MiB) once per
token, so its matmuls are timed on weights no cache holds. Sizes differ, so that the bytes
term of the M = 1 cases is told apart from the per-call overhead."""


@dataclass(frozen=True)
class ComputeCase:
    """One registry op on one shape: its tensor operands' types and attributes."""

    op: str
    operands: tuple[TensorType, ...]
    attrs: tuple[tuple[str, Any], ...] = ()

    @property
    def op_class(self) -> str:
        """The class the cost model prices this call as (`graphpar.cost.compute.op_class`)."""
        return op_class(self.op, self.operands)

    @property
    def dtype(self) -> torch.dtype:
        return self.operands[0].dtype

    def __str__(self) -> str:
        return f"{self.op}({', '.join(map(str, self.operands))})"


@dataclass(frozen=True)
class ComputeSample:
    case: ComputeCase
    flops: int
    nbytes: int
    seconds: float  # measured, median (on the CPU: the thread's CPU seconds)


def compute_cases(dtype: torch.dtype = F32, quick: bool = False) -> list[ComputeCase]:
    """The cases of every class at `dtype`: shapes on both sides of a CPU's ridge point where
    the class has both regimes (`quick`: the three smallest of each class)."""
    gemm = [(32, 256, 256), (64, 512, 512), (128, 512, 1024), (256, 1024, 1024),
            (512, 1024, 1024), (48, 2048, 2048)]
    # (M, K, weight bytes): N makes the weight that size; M = 1 first, the half precisions'
    # three (a CPU without half matmuls runs them at 0.2 GFLOP/s: 0.3-1.3 s a call)
    small, medium, large = SKINNY_WEIGHT_BYTES
    skinny = [(m, k, size // dtype.itemsize // k) for m, k, size in (
        (1, 4096, small), (1, 8192, medium), (1, 8192, large), (4, 8192, medium),
        (16, 4096, medium), (8, 8192, medium))]
    elements = [2**12, 2**15, 2**18, 2**21]
    rows = [(16, 256), (128, 1024), (1024, 1024), (2048, 2048)]
    # (batch, heads, query rows, key rows): causal prefill, and decode (one query row against
    # a long cache, memory-bound: it measures the class's memory roof, which the small prefill
    # shapes would otherwise invent to explain their lower FLOP rate)
    attention = [(1, 4, 64, 64), (1, 8, 1, 4096), (1, 8, 128, 128), (1, 8, 512, 512),
                 (2, 8, 512, 512), (1, 8, 1, 16384)]
    gather = [(1000, 256, 64), (32000, 512, 512), (50000, 1024, 1024), (32000, 768, 4096)]
    if quick:
        gemm, skinny, elements, rows, attention, gather = (
            shapes[:3] for shapes in (gemm, skinny, elements, rows, attention, gather))

    def t(*shape: int) -> TensorType:
        return TensorType(shape, dtype)
    cases = [ComputeCase("matmul", (t(m, k), t(k, n))) for m, k, n in gemm + skinny]
    for n in elements:
        # gelu counts TRANSCENDENTAL FLOPs per element (`OpDef.flops_per_element`): the
        # class's compute roof, beside the memory roof the others measure
        cases += [ComputeCase("add", (t(n), t(n))), ComputeCase("mul", (t(n), t(n))),
                  ComputeCase("relu", (t(n),)), ComputeCase("gelu", (t(n),))]
    for r, h in rows:  # reductions are priced as normalizations: both reduce over rows
        cases += [ComputeCase("layer_norm", (t(r, h), t(h), t(h)), (("shape", (h,)),)),
                  ComputeCase("softmax", (t(r, h),), (("dim", -1),)),
                  ComputeCase("sum", (t(r, h),), (("dims", (-1,)),))]
    cases += [ComputeCase("attention", (t(b, h, q, 64), t(b, h, k, 64), t(b, h, k, 64)),
                          (("causal", q == k),)) for b, h, q, k in attention]
    cases += [ComputeCase("embedding", (t(v, d), TensorType((n,), I64))) for v, d, n in gather]
    return cases


def _tensor(t: TensorType, device: torch.device, low: int) -> torch.Tensor:
    if t.dtype.is_floating_point:
        return torch.randn(t.shape, dtype=t.dtype, device=device)
    return torch.randint(0, low, t.shape, dtype=t.dtype, device=device)


def _sync(device: torch.device) -> Callable[[], object] | None:
    return torch.cuda.synchronize if device.type == "cuda" else None


def measure_compute(cases: Sequence[ComputeCase], device: str = "cpu", *,
                    budget_s: float = 0.2, progress: Progress | None = None
                    ) -> list[ComputeSample]:
    """Time each case on `device` (medians of calls filling about `budget_s` each) with the
    workers' thread count."""
    dev = torch.device(device)
    threads = torch.get_num_threads()
    torch.set_num_threads(worker_threads())
    samples = []
    try:
        with torch.no_grad():
            for case in cases:
                samples.append(_time_case(case, dev, budget_s))
                if progress:
                    progress(str(case))
    finally:
        torch.set_num_threads(threads)
    return samples


def rotations(case: ComputeCase) -> int:
    """How many copies of `case`'s operands its calls take in turn: `ROTATIONS` when they
    reach `CACHE_BYTES` (each call then reads memory, as a decode step's matmuls do), else
    one."""
    nbytes = sum(t.nbytes for t in case.operands)
    return ROTATIONS if nbytes >= CACHE_BYTES else 1


def _time_case(case: ComputeCase, dev: torch.device, budget_s: float) -> ComputeSample:
    op, attrs = get_op(case.op), dict(case.attrs)
    index_range = case.operands[0].shape[0]  # embedding: the table's rows
    copies = [[_tensor(t, dev, index_range) for t in case.operands]
              for _ in range(rotations(case))]
    results = op.infer(list(case.operands), attrs)
    turn = iter(range(1 << 62))

    def call() -> object:
        return op.reference(*copies[next(turn) % len(copies)], **attrs)
    # On the CPU, the thread's own CPU time: one thread's work takes that long on an idle core,
    # however many other processes shared the core meanwhile (a loaded machine stretches the
    # wall time of long calls most, as they span more of the others' time slices).
    clock = time.thread_time if dev.type == "cpu" else time.perf_counter
    first = median_seconds(call, 1, sync=_sync(dev), clock=clock)
    repeats = int(min(50, max(3, budget_s / max(first, 1e-9))))
    seconds = median_seconds(call, repeats, warmup=0, sync=_sync(dev), clock=clock)
    return ComputeSample(case, op.flops(list(case.operands), results, attrs),
                         bytes_moved(op, list(case.operands), results, attrs), seconds)


# --------------------------------------------------------------------- per-call overhead

def overhead_cases(dtype: torch.dtype = F32) -> list[ComputeCase]:
    """One tiny call per op class: its roofline terms are nanoseconds, what it takes is the
    per-call cost (the matmul for `gemm` has SKINNY_ROWS + 1 rows, one column)."""
    def t(*shape: int) -> TensorType:
        return TensorType(shape, dtype)
    m = SKINNY_ROWS + 1
    cases = [ComputeCase("matmul", (t(m, 1), t(1, 1))), ComputeCase("matmul", (t(1, 1), t(1, 1))),
             ComputeCase("add", (t(1), t(1))),
             ComputeCase("layer_norm", (t(1, 1), t(1), t(1)), (("shape", (1,)),)),
             ComputeCase("attention", (t(1, 1, 1, 1),) * 3, (("causal", True),)),
             ComputeCase("embedding", (t(1, 1), TensorType((1,), I64)))]
    return cases


def measure_overheads(dtype: torch.dtype = F32, device: str = "cpu", *, nodes: int = 32,
                      repeats: int = 30) -> dict[str, float]:
    """Seconds per node of a tiny call of each class through the interpreter (a graph of
    `nodes` such nodes, run `repeats` times; the median run over `nodes`), with the workers'
    thread count and the clock `measure_compute` uses: each class's per-call overhead."""
    dev = torch.device(device)
    clock = time.thread_time if dev.type == "cpu" else time.perf_counter
    threads = torch.get_num_threads()
    torch.set_num_threads(worker_threads())
    overheads = {}
    try:
        for case in overhead_cases(dtype):
            graph = Graph(f"overhead_{case.op}")
            inputs = [graph.add_input(f"x{i}", t) for i, t in enumerate(case.operands)]
            last = None
            for _ in range(nodes):  # independent nodes on the same inputs: dispatch only
                last = graph.create(case.op, inputs, dict(case.attrs))
            graph.add_output(last.outputs[0])  # type: ignore[union-attr]
            interpreter = Interpreter(graph)  # as the workers run plans (no_grad)
            args = [_tensor(t, dev, 1) for t in case.operands]
            seconds = median_seconds(functools.partial(interpreter.run, args), repeats, warmup=2,
                                     sync=_sync(dev), clock=clock)
            overheads[case.op_class] = seconds / nodes
    finally:
        torch.set_num_threads(threads)
    return overheads


# --------------------------------------------------------------------------- collectives

@dataclass(frozen=True)
class CollectiveSample:
    kind: str
    ranks: int  # n, the group's size
    nbytes: int  # the formula's M
    seconds: float  # measured, median on rank 0


def collective_sizes(quick: bool = False) -> list[int]:
    """Message sizes, bytes: 256 B to 16 MiB in steps of 4x (`quick`: to 1 MiB in 16x)."""
    return [2**k for k in range(8, 21, 4)] if quick else [2**k for k in range(8, 25, 2)]


def _repeats(nbytes: int, quick: bool) -> int:
    repeats = 30 if nbytes <= 2**16 else 15 if nbytes <= 2**20 else 5
    return max(3, repeats // 3) if quick else repeats


def measure_collectives(ranks: int, sizes: Sequence[int], *,
                        kinds: Sequence[str] = MEASURED_COLLECTIVES,
                        group_sizes: Sequence[int] | None = None, device: str = "cpu",
                        quick: bool = False, timeout: float = 120.0,
                        progress: Progress | None = None) -> list[CollectiveSample]:
    """Time `kinds` on every size over `ranks` worker processes (gloo; NCCL when `device` is
    "cuda"). `group_sizes`: every divisor of `ranks` from 2 up by default."""
    if group_sizes is None:
        group_sizes = [n for n in range(2, ranks + 1) if ranks % n == 0]
    samples: list[CollectiveSample] = []
    with Job(ranks, "graphpar.calibration.measure:CollectiveBench", prefix="calibrate",
             timeout=timeout, name="calibration") as job:
        job.folder.describe({"group_sizes": list(group_sizes), "device": device,
                             "backend": "nccl" if device.startswith("cuda") else "gloo"})
        try:
            job.start(wait=True)
            for kind in kinds:
                for nbytes in sizes:
                    rows = job.call("measure", kind, nbytes, _repeats(nbytes, quick))[0]
                    samples += [CollectiveSample(kind, n, b, s) for n, b, s in rows]
                    if progress:
                        progress(f"{kind} {nbytes} B")
        except BaseException as exc:
            job.group.fail(exc)  # the rank that failed, and why, if one did; else exc
    return samples


class CollectiveBench(JobWorker):
    """A calibration worker: joins its groups, then times the collectives it is told to."""

    def __init__(self, jobdir: Path, rank: int, world: int) -> None:
        super().__init__(jobdir, rank, world)
        self.device = torch.device(self.job["device"])
        if self.device.type == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        self.groups: dict[int, tuple[list[int], Any]] = {}
        for n in self.job["group_sizes"]:
            for start in range(0, world, n):  # new_group is collective: every rank makes all
                members = list(range(start, start + n))
                pg = dist.new_group(members, backend=self.job["backend"])
                if rank in members:
                    self.groups[n] = (members, pg)

    def measure(self, kind: str, nbytes: int, repeats: int) -> list[tuple] | None:
        """Time `kind` on an `nbytes` message in every group: (n, bytes, median seconds) per
        group, on rank 0 (the one reported)."""
        rows = []
        for n, (members, pg) in sorted(self.groups.items()):
            if kind == "send_recv" and n != min(self.groups):
                continue  # one point-to-point pair per rank is enough: the formula has no n
            elements = max(n, nbytes // 4 // n * n)
            fn = self._collective(kind, elements, members, pg)
            dist.barrier()
            seconds = median_seconds(fn, repeats, warmup=2, sync=_sync(self.device))
            if kind == "send_recv":
                seconds /= 2  # a ping-pong is two messages
            rows.append((n, 4 * elements, seconds))
        return rows if self.rank == 0 else None

    def _collective(self, kind: str, elements: int, members: list[int], pg: Any
                    ) -> Callable[[], object]:
        n, dev = len(members), self.device
        x = torch.ones(elements, device=dev)
        if kind == "all_reduce":
            return lambda: dist.all_reduce(x, group=pg)
        if kind == "all_gather":
            part, out = torch.ones(elements // n, device=dev), torch.empty(elements, device=dev)
            return lambda: dist.all_gather_into_tensor(out, part, group=pg)
        if kind == "reduce_scatter":
            out = torch.empty(elements // n, device=dev)
            return lambda: dist.reduce_scatter_tensor(out, x, group=pg)
        if kind == "all_to_all":
            out = torch.empty(elements, device=dev)
            return lambda: dist.all_to_all_single(out, x, group=pg)
        if kind == "send_recv":
            position = members.index(self.rank)
            peer = members[position ^ 1] if (position ^ 1) < n else None
            first = position % 2 == 0

            def ping_pong() -> None:  # ranks 2i and 2i+1 of the group; an odd one out waits
                if peer is None:
                    return
                if first:
                    dist.send(x, peer)
                    dist.recv(x, peer)
                else:
                    dist.recv(x, peer)
                    dist.send(x, peer)
            return ping_pong
        raise ValueError(f"unknown collective kind {kind!r}; expected one of "
                         f"{', '.join(MEASURED_COLLECTIVES)}")


def contention_note(ranks: int) -> str | None:
    """A warning when `ranks` processes (one thread each) outnumber this machine's cores."""
    cores = os.cpu_count() or 1
    threads = ranks * worker_threads()
    if threads <= cores:
        return None
    return (f"{ranks} ranks x {worker_threads()} thread(s) on {cores} CPU cores: the ranks "
            "contend for cores, which will distort the fit (slower, noisier collectives)")

