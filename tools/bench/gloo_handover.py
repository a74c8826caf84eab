"""What handing tensors from one gloo rank to another costs, in the patterns a pipeline makes.

Two worker processes (`runtime.workers.WorkerGroup`, one intra-op thread each, as the pipeline
runtime's ranks) play two pipeline stages: rank 0 sends (`isend`, as `GlooCommunicator` does,
tag = the tensor's place in the boundary), rank 1 receives (`recv`). A boundary is

- `1 tensor`: one f32 [2,32,128] activation (32 KiB);
- `3 tensors`: GPT tiny's backward boundary (4 layers, width 128, microbatch 2): [2,32,128],
  [64,384] and [384,64] f32, 224 KiB in all, each its own message;
- `3 packed`: the same bytes as one message (one flat uint8 buffer);
- `3 early`, `packed early`: the three messages, or the one, their receives posted ahead
  (`irecv`): before the receiver's compute, and in `queued` the next microbatch's as soon as
  the last one has arrived.

Patterns (`--repeats` trials each, all ranks starting a trial after a barrier):

- `waiting`: the receiver has posted its receives; the sender sends 5 ms later. Measured: from
  the first `isend` to the last receive done (wall clock, both processes on one machine).
- `late/idle`, `late/busy`: the sender sends, then sleeps (idle) or computes (busy) 20 ms;
  the receiver computes 10 ms, then receives. Measured: the receiver's wait.
- `queued/idle`, `queued/busy`: the sender sends 8 microbatches' boundaries at once (each
  microbatch the same tags, as the runtime), then sleeps or computes; the receiver computes
  5 ms before each microbatch's receives. Measured: the wait of each microbatch's receives.
- `both ways`: each rank sends a boundary to the other, computes 5 ms, then receives the
  other's (1F1B's steady state: activations forward while gradients go back). Measured: each
  rank's wait.

    python tools/bench/gloo_handover.py            # table; writes gloo_handover.json here
    python tools/bench/gloo_handover.py --quick --out /tmp/handover.json

Times are measured wall clock (milliseconds) and CPU seconds of the whole run; run it on an
idle machine for numbers to quote.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

BOUNDARIES = {"1 tensor": [(2, 32, 128)],
              "3 tensors": [(2, 32, 128), (64, 384), (384, 64)]}
LAYOUTS = ("1 tensor", "3 tensors", "3 packed", "3 early", "packed early")
PATTERNS = ("waiting", "late/idle", "late/busy", "queued/idle", "queued/busy", "both ways")
MICROBATCHES = 8


def _tensors(layout: str) -> list[torch.Tensor]:
    shapes = BOUNDARIES["1 tensor" if layout == "1 tensor" else "3 tensors"]
    tensors = [torch.randn(shape) for shape in shapes]
    if layout in ("3 packed", "packed early"):
        return [torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])]
    return tensors


class HandoverRank:
    """One of the two ranks: runs each pattern, writes its measurements (seconds)."""

    def __init__(self, jobdir, rank: int, world: int) -> None:
        self.jobdir, self.rank = Path(jobdir), rank
        self.a = torch.randn(128, 128)

    def compute(self, seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            self.a @ self.a

    def send(self, tensors: list[torch.Tensor], peer: int) -> list:
        return [dist.isend(t, peer, tag=tag) for tag, t in enumerate(tensors)]

    def post(self, tensors: list[torch.Tensor], peer: int) -> list:
        """Post the receives of one boundary ahead (`irecv`)."""
        return [dist.irecv(torch.empty_like(t), peer, tag=tag) for tag, t in enumerate(tensors)]

    def recv(self, tensors: list[torch.Tensor], peer: int, posted: list | None = None
             ) -> float:
        """Receive one boundary (wait for its posted receives, if any); returns the seconds
        waited."""
        start = time.perf_counter()
        if posted is not None:
            for w in posted:
                w.wait()
        else:
            for tag, t in enumerate(tensors):
                dist.recv(torch.empty_like(t), peer, tag=tag)
        return time.perf_counter() - start

    def run(self, pattern: str, layout: str, repeats: int) -> None:
        tensors = _tensors(layout)
        early = layout.endswith("early")
        out: list[float] = []  # receive waits, or (waiting) send and done times
        for _ in range(repeats + 1):  # the first trial is untimed
            trial: list[float] = []
            dist.barrier()
            other = 1 - self.rank
            if pattern == "waiting":
                if self.rank == 0:
                    time.sleep(0.005)
                    trial.append(time.time())
                    works = self.send(tensors, other)
                    for w in works:
                        w.wait()
                else:
                    self.recv(tensors, other, self.post(tensors, other) if early else None)
                    trial.append(time.time())
            elif pattern.startswith(("late", "queued")):
                queued = pattern.startswith("queued")
                n = MICROBATCHES if queued else 1
                if self.rank == 0:
                    works = [w for _ in range(n) for w in self.send(tensors, other)]
                    busy = 0.005 * n if queued else 0.02
                    (self.compute if pattern.endswith("busy") else time.sleep)(busy)
                    for w in works:
                        w.wait()
                else:
                    posted = self.post(tensors, other) if early else None
                    for i in range(n):
                        self.compute(0.005 if queued else 0.01)
                        trial.append(self.recv(tensors, other, posted))
                        if early and i + 1 < n:
                            posted = self.post(tensors, other)
            else:  # both ways
                posted = self.post(tensors, other) if early else None
                works = self.send(tensors, other)
                self.compute(0.005)
                trial.append(self.recv(tensors, other, posted))
                for w in works:
                    w.wait()
            out.append(trial)
        (self.jobdir / f"rank{self.rank}.json").write_text(json.dumps(out[1:]))


def factory(jobdir: str, rank: int, world: int) -> HandoverRank:
    return HandoverRank(jobdir, rank, world)


def measure(repeats: int) -> list[dict]:
    from graphpar.runtime.workers import WorkerGroup

    here = str(Path(__file__).resolve().parent)  # the workers import this module
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH"))
                                               if p)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        group = WorkerGroup(2, "gloo_handover:factory", Path(tmp), name="handover")
        group.start()
        try:
            for pattern in PATTERNS:
                for layout in LAYOUTS:
                    group.wait(group.send("run", pattern, layout, repeats))
                    r0, r1 = (json.loads((Path(tmp) / f"rank{r}.json").read_text())
                              for r in (0, 1))
                    if pattern == "waiting":
                        waits = [b[0] - a[0] for a, b in zip(r0, r1)]
                    else:
                        waits = [w for trial in r0 + r1 for w in trial]
                    rows.append({"pattern": pattern, "layout": layout,
                                 "wait_ms_median": 1e3 * statistics.median(waits),
                                 "wait_ms_p90": 1e3 * sorted(waits)[int(0.9 * (len(waits) - 1))],
                                 "wait_ms_max": 1e3 * max(waits), "samples": len(waits)})
        finally:
            group.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="5 repeats")
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    args = parser.parse_args(argv)
    start = time.perf_counter()
    rows = measure(5 if args.quick else args.repeats)
    wall = time.perf_counter() - start
    use = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    cpu = sum(u.ru_utime + u.ru_stime for u in use)
    print("hand-over between 2 gloo ranks, receive wait (ms, measured wall clock; `waiting`: "
          "first isend to last receive done)")
    print(f"{'pattern':12} {'boundary':10} {'median':>7} {'p90':>7} {'max':>7} {'n':>4}")
    for r in rows:
        print(f"{r['pattern']:12} {r['layout']:10} {r['wait_ms_median']:7.2f} "
              f"{r['wait_ms_p90']:7.2f} {r['wait_ms_max']:7.2f} {r['samples']:4d}")
    print(f"whole run: {wall:.1f} s wall, {cpu:.1f} s CPU (this process and the ranks)")
    Path(args.out).write_text(json.dumps({"rows": rows, "wall_seconds": wall,
                                          "cpu_seconds": cpu, "python": sys.version.split()[0],
                                          "torch": torch.__version__}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
