"""The simulator against a real run: two small bundled models (MLPs) served on two CPU
processes started by the worker group, under one Poisson trace, placed either one model per
process ("simple") or as a 2-stage pipeline over both processes holding half of each model
("pipeline", activations sent over gloo).

What the simulator is given, measured before the run on the same processes:

- each model's and each stage's service time: the mean of repeated runs with one process
  working at a time (calibrating both at once made each measure the other's contention, and
  the median hid the slow tail that the run's queues feel);
- the fixed costs a request pays that are not compute: the one-way send of a stage's
  activation (a gloo ping-pong, added to the first stage) and the lateness of a process
  woken from sleep at a request's arrival (added to the first stage).

The run itself mirrors the simulator's queueing: each process serves FCFS, and the first
stage of the pipeline sends without waiting for the second to receive (`isend`), so the
stages queue independently as the simulator's stage clocks do. Per request, each process
also records how long its compute took, so the run reports how far the machine drifted from
the calibration (the noise of a shared machine) beside the error.
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

from graphpar.placement.simulator import SimGroup, simulate
from graphpar.placement.workload import Workload, gamma_workload, load_trace, save_trace
from graphpar.runtime.timing import call_seconds

MODELS = ("a", "b")
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
    def serve(self, mode: str, trace: str, start_at: float) -> None:
        w = load_trace(trace, MODELS)
        finish = np.full(len(w), np.nan)
        busy = np.full(len(w), np.nan)  # this rank's compute per request (s)
        wait = lambda t: time.sleep(max(0.0, start_at + t - time.time()))  # noqa: E731
        if mode == "simple":
            for i in np.flatnonzero(w.model_ids == self.rank):
                wait(w.arrivals[i])
                begin = time.time()
                self.models[self.rank](self.x)
                finish[i] = time.time() - start_at
                busy[i] = finish[i] - (begin - start_at)
        elif self.rank == 0:
            pending = []
            for i in range(len(w)):
                wait(w.arrivals[i])
                begin = time.perf_counter()
                out = self.stages[w.model_ids[i]](self.x).contiguous()
                busy[i] = time.perf_counter() - begin
                # no wait for the next stage to receive: the stages queue independently
                pending.append((dist.isend(out, 1), out))
                pending = [p for p in pending if not p[0].is_completed()]
            for req, _ in pending:
                req.wait()
        else:
            buf = torch.empty(_ROWS, _HIDDEN)
            for i in range(len(w)):
                dist.recv(buf, 0)
                begin = time.perf_counter()
                self.stages[w.model_ids[i]](buf)
                end = time.time()
                busy[i] = time.perf_counter() - begin
                finish[i] = end - start_at
        np.save(self.jobdir / f"finish_{mode}{self.rank}.npy", finish)
        np.save(self.jobdir / f"busy_{mode}{self.rank}.npy", busy)


def factory(jobdir: str, rank: int, world: int) -> ServingRank:
    return ServingRank(jobdir, rank, world)


def real_check(rate: float | None = None, duration: float = 30.0, slo_scale: float = 5.0,
               seed: int = 0, warmup: float = 2.0, repeats: int = 30,
               utilisation: float = 0.4) -> dict:
    """Measured and simulated mean latency (s) and SLO attainment of both placements, with
    the calibration the simulator was given and the service times the run itself saw.
    Without `rate`, the trace's total rate keeps each process of the simple placement busy a
    `utilisation` share of the time at the calibrated service times (a load the machine can
    serve)."""
    from graphpar.runtime.workers import WorkerGroup

    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp)
        group = WorkerGroup(2, "graphpar.placement.real_check:factory", job, name="serving")
        group.start()
        try:
            group.wait_started()
            for r in (0, 1):
                group.wait(group.send("calibrate", r, repeats))
            group.wait(group.send("pingpong", repeats))
            service = [json.loads((job / f"service{r}.json").read_text()) for r in (0, 1)]
            trip = json.loads((job / "pingpong.json").read_text())
            cal = _calibration(service, trip)
            if rate is None:  # each model gets half the requests, one process each
                rate = 2 * utilisation / max(cal["whole"].values())
            w = gamma_workload(MODELS, rate, 1.0, duration, seed=seed)
            save_trace(w, job / "trace.csv")
            runs = {}
            for mode in ("simple", "pipeline"):
                group.timeout = duration + 60.0
                group.wait(group.send("serve", mode, str(job / "trace.csv"), time.time() + 2.0))
                parts = [np.load(job / f"finish_{mode}{r}.npy") for r in (0, 1)]
                busy = [np.load(job / f"busy_{mode}{r}.npy") for r in (0, 1)]
                runs[mode] = (np.fmax(parts[0], parts[1]) - w.arrivals, busy)
        finally:
            group.stop()
    out: dict = {"requests": len(w), "rate": rate, "duration_s": duration}
    slo = {m: slo_scale * cal["whole"][m] for m in MODELS}
    counted = w.arrivals >= warmup
    for mode, (measured, busy) in runs.items():
        seen = _in_run(mode, busy, w)
        sim = simulate(_groups(mode, cal), w, warmup=warmup)  # no rejection: as served
        again = simulate(_groups(mode, cal, seen), w, warmup=warmup)
        out[mode] = {
            "measured_mean_s": float(measured[counted].mean()),
            "simulated_mean_s": sim.mean_latency,
            "measured_attainment": _attainment(measured, w, slo, counted),
            "simulated_attainment": _attainment(sim.latency, w, slo, counted),
            "service_in_run_s": seen,
            # the simulator given the service times the run itself saw: its queueing model
            # alone, without the machine's drift since the calibration
            "simulated_in_run_mean_s": again.mean_latency,
            "simulated_in_run_attainment": _attainment(again.latency, w, slo, counted)}
    out["service_s"] = cal
    return out


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


def _groups(mode: str, cal: dict, seen: dict | None = None) -> list[SimGroup]:
    """The placement as the simulator sees it: service times (calibrated, or `seen` in the
    run) plus the fixed costs, wake-up lateness and the first stage's send, on the first
    stage."""
    wake, send = cal["wake"], cal["send"]
    if mode == "simple":
        whole = seen or cal["whole"]
        return [SimGroup({m: [wake[r] + whole[m]]}) for r, m in enumerate(MODELS)]
    stages = seen or cal["stages"]
    return [SimGroup({m: [wake[0] + stages[m][0] + send, stages[m][1]] for m in MODELS})]


def _in_run(mode: str, busy: list[np.ndarray], w: Workload) -> dict:
    """Mean compute per request that each rank measured during the run, per model (and
    stage): what the calibration should have predicted."""
    if mode == "simple":
        return {m: float(np.nanmean(busy[r][w.model_ids == r])) for r, m in enumerate(MODELS)}
    return {m: [float(np.nanmean(busy[r][w.model_ids == k])) for r in (0, 1)]
            for k, m in enumerate(MODELS)}


def _attainment(latency: np.ndarray, w: Workload, slo: dict, counted: np.ndarray) -> float:
    limit = np.array([slo[m] for m in w.models])[w.model_ids]
    return float((latency[counted] <= limit[counted]).mean())
