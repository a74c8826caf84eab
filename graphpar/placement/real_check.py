"""The simulator against a real run: two small bundled models (MLPs) served on two CPU
processes started by the worker group, under one Poisson trace, placed either one model per
process ("simple") or as a 2-stage pipeline over both processes holding half of each model
("pipeline", activations sent over gloo).

What the simulator is given, measured on the same processes:

- each stage's service times as the run's processes delivered them: each rank records its
  compute per request, and for request i the simulator's time is its model's mean over the
  part times the rank's speed around i (its other requests within `SPEED_WINDOW` seconds;
  i's own time left out) times a draw from the part's spread (`service_scale`, `DRAWS`
  simulations averaged). A shared CPU's speed moves by a third within a second, which no
  profile taken at another time can follow (the paper checks its simulator with latencies
  profiled on GPUs, whose speed holds still).
- the fixed costs a request pays that are not compute: the one-way send of a stage's
  activation (a gloo ping-pong, added to the first stage), the lateness of a process woken
  from sleep at a request's arrival (added to the first stage), and the receive of an
  activation sent while the second stage was busy (the simulator's held receive on the
  second stage: gloo moves such a send only once its receive is posted); the part's own
  hand-overs replace the calibrated pair where it saw both.

Beside it, the simulator is also given profiles taken at other times, to show what the
machine's drift does: probes (a short trace of its own, the same rate, another seed, served
by each placement before the checked trace, between its parts and after it), and each
process calibrated alone, one at a time; and each request's own compute times, which leave
only the queueing model.

The run itself mirrors the simulator's queueing: each process serves FCFS, and the first
stage of the pipeline sends without waiting for the second to receive (`isend`). Each part of
the trace starts with empty queues, in the run and in the simulator. Per request, each rank
records when its compute began and ended (and the second rank when it posted its receive and
got the data), so the run reports where a pipelined request's time went and the simulator
again with the run's own service times (its queueing model alone).
Latencies are wall-clock on this machine."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from graphpar.placement.real_compare import MODELS, MODES, SLO_SCALES, compare, part_of
from graphpar.placement.workload import Workload, gamma_workload, load_trace, save_trace
from graphpar.runtime.timing import call_seconds

_PROBE_SEED = 7919  # the probes' trace is not the checked one
_HIDDEN, _LAYERS, _ROWS = 1536, 8, 32  # tens of ms per request on one CPU thread


def _model(seed: int) -> nn.Sequential:
    from graphpar.models import get_model

    return get_model("mlp", "tiny", seed=seed, in_dim=_HIDDEN, hidden_dim=_HIDDEN,
                     out_dim=_HIDDEN, n_layers=_LAYERS).module.layers


class ServingRank:
    """A worker: holds its part of the models, calibrates, and replays the trace in real
    time."""

    def __init__(self, jobdir: str, rank: int, world: int) -> None:
        torch.set_num_threads(1)
        self.jobdir, self.rank = Path(jobdir), rank
        self.models = [_model(seed) for seed in range(len(MODELS))]
        half = len(self.models[0]) // 2
        # the pipeline's stage of this rank, of each model
        self.stages = [m[:half] if rank == 0 else m[half:] for m in self.models]
        self.x = torch.randn(_ROWS, _HIDDEN)

    @torch.no_grad()
    def calibrate(self, which: int, repeats: int) -> None:
        """Service times of rank `which` alone (the other rank waits idle)."""
        if self.rank != which:
            return
        def timings(fn):  # three warm-up calls: caches and the allocator
            return call_seconds(fn, repeats, warmup=3)

        times = {"whole": [timings(lambda m=m: m(self.x)) for m in self.models],
                 "stage": [timings(lambda s=s: s(self.x)) for s in self.stages],
                 "wake": self._lateness(repeats)}
        (self.jobdir / f"service{self.rank}.json").write_text(json.dumps(times))

    @staticmethod
    def _lateness(repeats: int) -> list[float]:
        """How late a sleeping process wakes for a deadline 5 ms ahead (seconds)."""
        late = []
        for _ in range(repeats):
            target = time.time() + 0.005
            time.sleep(max(0.0, target - time.time()))
            late.append(time.time() - target)
        return late

    @torch.no_grad()
    def pingpong(self, repeats: int) -> None:
        """Round trips of one activation between the ranks; rank 0 writes the times."""
        buf = torch.empty(_ROWS, _HIDDEN)
        times = []
        for _ in range(repeats + 3):
            start = time.perf_counter()
            if self.rank == 0:
                dist.send(self.x, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            times.append(time.perf_counter() - start)
        if self.rank == 0:
            (self.jobdir / "pingpong.json").write_text(json.dumps(times[3:]))

    @torch.no_grad()
    def handover(self, repeats: int) -> None:
        """Receives of an activation that rank 0 sent while rank 1 was still computing, as in
        a run whenever a request finds the second stage busy: gloo holds such a send until
        the receive is posted (a send-ready and a receive-ready notice, then the data), so the
        hand-over happens on the receiving stage's time. Rank 1 times each receive; rank 0
        computes through the odd ones and sleeps through the even ones (the run sees both)."""
        buf = torch.empty(_ROWS, _HIDDEN)
        times = []
        for i in range(2 * repeats + 2):
            dist.barrier()
            if self.rank == 0:
                req = dist.isend(self.x, 1)
                if i % 2:
                    for _ in range(3):  # busy until well after rank 1's receive
                        self.stages[0](self.x)
                else:
                    time.sleep(0.03)
                req.wait()
            else:
                self.stages[0](self.x)  # rank 1 busy while the send is posted
                start = time.perf_counter()
                dist.recv(buf, 0)
                times.append(time.perf_counter() - start)
        if self.rank == 1:
            (self.jobdir / "handover.json").write_text(json.dumps(
                {"first_busy": times[3::2], "first_idle": times[2::2]}))

    @torch.no_grad()
    def serve(self, mode: str, trace: str, start_at: float) -> None:
        """Replay the trace; per request, write this rank's timestamps (seconds after
        `start_at`, wall clock, comparable across the ranks): [begin, end] of its compute, and
        on the pipeline's second rank [recv posted, recv done, end]."""
        w = load_trace(trace, MODELS)
        marks = np.full((len(w), 3), np.nan)
        now = lambda: time.time() - start_at  # noqa: E731
        wait = lambda t: time.sleep(max(0.0, t - now()))  # noqa: E731
        if mode == "simple":
            for i in np.flatnonzero(w.model_ids == self.rank):
                wait(w.arrivals[i])
                marks[i, 0] = now()
                self.models[self.rank](self.x)
                marks[i, 1] = now()
        elif self.rank == 0:
            pending = []
            for i in range(len(w)):
                wait(w.arrivals[i])
                marks[i, 0] = now()
                out = self.stages[w.model_ids[i]](self.x).contiguous()
                marks[i, 1] = now()
                # no wait for the next stage to receive: the stages queue independently
                pending.append((dist.isend(out, 1), out))
                pending = [p for p in pending if not p[0].is_completed()]
            for req, _ in pending:
                req.wait()
        else:
            buf = torch.empty(_ROWS, _HIDDEN)
            for i in range(len(w)):
                marks[i, 0] = now()
                dist.recv(buf, 0)
                marks[i, 1] = now()
                self.stages[w.model_ids[i]](buf)
                marks[i, 2] = now()
        np.save(self.jobdir / f"marks_{mode}{self.rank}.npy", marks)


def factory(jobdir: str, rank: int, world: int) -> ServingRank:
    return ServingRank(jobdir, rank, world)


def real_check(rate: float | None = None, duration: float = 30.0, slo_scale: float = 5.0,
               seed: int = 0, warmup: float = 2.0, repeats: int = 30,
               utilisation: float = 0.4, segments: int = 4, probe: float = 4.0,
               keep: str | Path | None = None) -> dict:
    """Measured and simulated mean latency (s) and SLO attainment of both placements, with
    the calibration the simulator was given and the service times the run itself saw.
    Without `rate`, the trace's total rate keeps each process of the simple placement busy a
    `utilisation` share of the time at the calibrated service times (a load the machine can
    serve). Attainment is for SLOs of `slo_scale` (and `SLO_SCALES`) times each model's
    service alone.

    The trace is served in `segments` parts, each placement in turn, each part starting with
    empty queues; the simulator is given each part's service times as its processes
    delivered them (module docstring). Before the first part, between parts and after the
    last, each placement also serves a probe: another trace (`probe` seconds, the same rate,
    another seed), whose service times make the profile taken beside the run that is
    reported next to the check. `keep`: an .npz file to write every replay's per-request
    timestamps to."""
    from graphpar.errors import UsageError
    from graphpar.runtime.workers import WorkerGroup

    if segments < 1 or not probe > 0 or not duration > 0:
        raise UsageError(f"real check: segments={segments}, probe={probe} s, "
                         f"duration={duration} s: give at least one part and a probe and a "
                         "trace of more than 0 s")
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp)
        group = WorkerGroup(2, "graphpar.placement.real_check:factory", job, name="serving")
        group.start()
        try:
            group.wait_started()
            for r in (0, 1):
                group.wait(group.send("calibrate", r, repeats))
            group.wait(group.send("pingpong", repeats))
            group.wait(group.send("handover", repeats))
            service = [json.loads((job / f"service{r}.json").read_text()) for r in (0, 1)]
            trip = json.loads((job / "pingpong.json").read_text())
            held = json.loads((job / "handover.json").read_text())
            cal = _calibration(service, trip)
            if rate is None:  # each model gets half the requests, one process each
                rate = 2 * utilisation / max(cal["whole"].values())
            # a held send finds the first stage computing a share of the time equal to its
            # utilisation (each model half of the requests)
            busy = min(1.0, rate * float(np.mean([s[0] for s in cal["stages"].values()])))
            cal["receive"] = (busy * float(np.mean(held["first_busy"]))
                              + (1 - busy) * float(np.mean(held["first_idle"])))
            cal["receive_first_busy"] = float(np.mean(held["first_busy"]))
            cal["receive_first_idle"] = float(np.mean(held["first_idle"]))
            w = gamma_workload(MODELS, rate, 1.0, duration, seed=seed)
            probe_w = gamma_workload(MODELS, rate, 1.0, probe, seed=seed + _PROBE_SEED)
            step = duration / segments
            parts = [part_of(w, k * step, (k + 1) * step) for k in range(segments)]
            group.timeout = step + probe + 60.0
            served, probed = _interleaved(group, job, parts, probe_w)
        finally:
            group.stop()
    if keep is not None:
        np.savez(keep, probe_arrivals=probe_w.arrivals, probe_models=probe_w.model_ids,
                 **{f"part{k}_{name}": getattr(part, attr) for k, part in enumerate(parts)
                    for name, attr in (("arrivals", "arrivals"), ("models", "model_ids"))},
                 **{f"{kind}_{mode}{k}_rank{r}": marks[r]
                    for kind, runs in (("served", served), ("probed", probed))
                    for mode in MODES for k, marks in enumerate(runs[mode]) for r in (0, 1)})
    out: dict = {"requests": len(w), "rate": rate, "duration_s": duration,
                 "segments": segments, "probe_s": probe}
    slos = {scale: {m: scale * cal["whole"][m] for m in MODELS}
            for scale in dict.fromkeys((slo_scale, *SLO_SCALES))}
    counted = w.arrivals >= warmup
    for mode in MODES:
        out[mode] = compare(mode, cal, parts, served[mode], probe_w, probed[mode], w, slos,
                             counted, seed)
    out["service_s"] = cal
    return out


def _interleaved(group, job: Path, parts: list[Workload], probe: Workload):
    """Serve the probe, then each part followed by the probe again, alternating the
    placements: per placement, each part's timestamps and each probe's (one more probe than
    parts)."""
    served: dict[str, list] = {m: [] for m in MODES}
    probed: dict[str, list] = {m: [] for m in MODES}
    for k in range(len(parts) + 1):
        for mode in MODES:
            probed[mode].append(_replay(group, job, probe, "probe", mode))
            if k < len(parts):
                served[mode].append(_replay(group, job, parts[k], f"part{k}", mode))
    return served, probed


def _replay(group, job: Path, w: Workload, name: str, mode: str, lead: float = 0.5
            ) -> list[np.ndarray]:
    """Serve trace `w` (written to `<name>.csv`) in one placement, starting `lead` seconds
    after it is sent: each rank's timestamps (`ServingRank.serve`)."""
    trace = str(job / f"{name}.csv")
    save_trace(w, trace)
    group.wait(group.send("serve", mode, trace, time.time() + lead))
    return [np.load(job / f"marks_{mode}{r}.npy") for r in (0, 1)]


def _calibration(service: list[dict], trip: list[float]) -> dict:
    """Means (seconds) of the calibration: whole models, stages, one-way send, wake-up
    lateness per rank, and each model's CV of service time."""
    mean = lambda xs: float(np.mean(xs))  # noqa: E731
    return {"whole": {m: mean(service[r]["whole"][r]) for r, m in enumerate(MODELS)},
            "stages": {m: (mean(service[0]["stage"][k]), mean(service[1]["stage"][k]))
                       for k, m in enumerate(MODELS)},
            "send": mean(trip) / 2,
            "wake": [mean(service[r]["wake"]) for r in (0, 1)],
            "cv": {m: float(np.std(service[r]["whole"][r]) / np.mean(service[r]["whole"][r]))
                   for r, m in enumerate(MODELS)}}


