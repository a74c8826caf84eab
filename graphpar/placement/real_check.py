"""The simulator against a real run: two small bundled models (MLPs) served on two CPU
processes started by the worker group, under one Poisson trace, placed either one model per
process ("simple") or as a 2-stage pipeline over both processes holding half of each model
("pipeline", activations sent over gloo).

What the simulator is given, measured before the run on the same processes:

- each model's and each stage's service time: the mean of repeated runs (the median hid the
  slow tail that the run's queues feel), once with one process working at a time and once
  with both always busy (each placement's serving loop on requests that all arrive at once),
  blended by how busy the other process is at the trace's rate (on the idle machine the
  stages ran 9-11 % slower in the run than alone, as ops do inside a training step:
  `docs/calibration.md`);
- the fixed costs a request pays that are not compute: the one-way send of a stage's
  activation (a gloo ping-pong, added to the first stage), the lateness of a process woken
  from sleep at a request's arrival (added to the first stage), and the receive of an
  activation sent while the second stage was busy (the simulator's held receive on the
  second stage: gloo moves such a send only once its receive is posted).

The run itself mirrors the simulator's queueing: each process serves FCFS, and the first
stage of the pipeline sends without waiting for the second to receive (`isend`). Per
request, each rank records when its compute began and ended (and the second rank when it
posted its receive and got the data), so the run reports how far the machine drifted from
the calibration (the noise of a shared machine), where a pipelined request's time went, and
the simulator again with the run's own service times.
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
            group.wait(group.send("handover", repeats))
            service = [json.loads((job / f"service{r}.json").read_text()) for r in (0, 1)]
            trip = json.loads((job / "pingpong.json").read_text())
            held = json.loads((job / "handover.json").read_text())
            cal = _calibration(service, trip)
            if rate is None:  # each model gets half the requests, one process each
                rate = 2 * utilisation / max(cal["whole"].values())
            _side_by_side(cal, _saturated(group, job, repeats), rate)
            # a held send finds the first stage computing a share of the time equal to its
            # utilisation (each model half of the requests)
            busy = min(1.0, rate * float(np.mean([s[0] for s in cal["stages"].values()])))
            cal["receive"] = (busy * float(np.mean(held["first_busy"]))
                              + (1 - busy) * float(np.mean(held["first_idle"])))
            cal["receive_first_busy"] = float(np.mean(held["first_busy"]))
            cal["receive_first_idle"] = float(np.mean(held["first_idle"]))
            w = gamma_workload(MODELS, rate, 1.0, duration, seed=seed)
            group.timeout = duration + 60.0
            runs = _replay(group, job, w, "trace", lead=2.0)
        finally:
            group.stop()
    out: dict = {"requests": len(w), "rate": rate, "duration_s": duration}
    slo = {m: slo_scale * cal["whole"][m] for m in MODELS}
    counted = w.arrivals >= warmup
    for mode, marks in runs.items():
        measured = _finish(mode, marks) - w.arrivals
        seen = _in_run(mode, _busy(mode, marks), w)
        handover = None
        if mode == "pipeline":
            b = _breakdown(marks, w, counted)
            if b["second_busy_share"] > 0 and b["second_busy_share"] < 1:
                handover = (b["handover_second_idle"], b["handover_second_busy"])
        sim = simulate(_groups(mode, cal), w, warmup=warmup)  # no rejection: as served
        again = simulate(_groups(mode, cal, seen, handover), w, warmup=warmup)
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
        # each request's own compute times (the run's spread, which a deterministic
        # simulator leaves out): what is left is the model of the fixed costs and the queues
        own = _per_request(mode, marks, w, cal, handover, warmup)
        out[mode]["simulated_per_request_mean_s"] = own.mean_latency
        if mode == "pipeline":
            out[mode]["breakdown_s"] = b
            # the model before the held receive was priced: the whole send on the first
            # stage, nothing on the second's clock
            before = simulate(_groups(mode, cal, handover=(cal["send"], 0.0)), w,
                              warmup=warmup)
            out[mode]["simulated_send_on_first_mean_s"] = before.mean_latency
            if handover:
                before = simulate(_groups(mode, cal, seen, (handover[0], 0.0)), w,
                                  warmup=warmup)
                out[mode]["simulated_in_run_send_on_first_mean_s"] = before.mean_latency
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


def _saturated(group, job: Path, repeats: int) -> dict:
    """Service times with both processes always computing: each placement's own serving
    loop (`ServingRank.serve`) replaying `2 * repeats` requests that all arrive at once,
    alternating models; the pipeline's stages then run beside each other and beside their
    sends, as they do in a busy run. Means per model (and stage), the first two requests of
    each model dropped (warm-up)."""
    n = 2 * repeats
    w = Workload(MODELS, np.zeros(n), np.arange(n) % len(MODELS), 0.0)
    both = {}
    for mode, marks in _replay(group, job, w, "saturated", lead=0.5).items():
        busy = _busy(mode, marks)
        for b in busy:
            b[:2 * len(MODELS)] = np.nan
        both[mode] = _in_run(mode, busy, w)
    return {"whole": both["simple"], "stages": {m: tuple(v) for m, v in
                                                 both["pipeline"].items()}}


def _replay(group, job: Path, w: Workload, name: str, lead: float
            ) -> dict[str, list[np.ndarray]]:
    """Serve trace `w` (written to `<name>.csv`) in both placements, each starting `lead`
    seconds after it is sent: per placement, each rank's timestamps (`ServingRank.serve`)."""
    trace = str(job / f"{name}.csv")
    save_trace(w, trace)
    runs = {}
    for mode in ("simple", "pipeline"):
        group.wait(group.send("serve", mode, trace, time.time() + lead))
        runs[mode] = [np.load(job / f"marks_{mode}{r}.npy") for r in (0, 1)]
    return runs


def _side_by_side(cal: dict, both: dict, rate: float) -> None:
    """Blend `cal`'s service times (each process alone) with `both`'s (both computing at once)
    by how busy the other process is at `rate` (its utilisation: the chance that it computes
    while this one does), keeping the alone times as `whole_alone` / `stages_alone`. In the
    simple placement each process serves one model at half the rate; in the pipeline each
    stage runs beside the other stage of every model."""
    half = rate / 2
    whole, stages = dict(cal["whole"]), dict(cal["stages"])
    cal["whole_alone"], cal["stages_alone"] = whole, stages
    cal["whole_together"], cal["stages_together"] = both["whole"], both["stages"]
    other = {m: min(1.0, half * whole[n]) for m, n in zip(MODELS, reversed(MODELS))}
    cal["whole"] = {m: whole[m] + other[m] * (both["whole"][m] - whole[m]) for m in MODELS}
    busy = [min(1.0, sum(half * stages[m][k] for m in MODELS)) for k in (0, 1)]
    cal["stages"] = {m: tuple(stages[m][k] + busy[1 - k] * (both["stages"][m][k]
                                                           - stages[m][k]) for k in (0, 1))
                     for m in MODELS}
    cal["other_busy"] = {"simple": other, "pipeline": busy}


def _groups(mode: str, cal: dict, seen: dict | None = None,
            handover: tuple[float, float] | None = None) -> list[SimGroup]:
    """The placement as the simulator sees it: service times (calibrated, or `seen` in the
    run) plus the fixed costs of a request. The wake-up lateness and the one-way `send` to an
    idle second stage ride on the first stage; a request that finds the second stage busy is
    received once that stage frees and posts its receive, which then takes `receive` on the
    second stage's clock (the simulator's held receive). `handover` = (send, receive) seen in
    the run replaces the calibrated pair."""
    wake = cal["wake"]
    if mode == "simple":
        whole = seen or cal["whole"]
        return [SimGroup({m: [wake[r] + whole[m]]}) for r, m in enumerate(MODELS)]
    stages = seen or cal["stages"]
    send, receive = handover or (cal["send"], cal["receive"])
    return [SimGroup({m: [wake[0] + stages[m][0] + send, stages[m][1]] for m in MODELS},
                     receive={m: [0.0, receive] for m in MODELS})]


def _per_request(mode: str, marks: list[np.ndarray], w: Workload, cal: dict,
                 handover: tuple[float, float] | None, warmup: float):
    """The simulator on the run's trace with every request its own model, whose stage
    latencies are the computes that request took in the run (plus the fixed costs, as
    `_groups` prices them)."""
    names = tuple(str(i) for i in range(len(w)))
    each = Workload(names, w.arrivals, np.arange(len(w)), w.duration)
    busy = _busy(mode, marks)
    wake = cal["wake"]
    if mode == "simple":
        groups = [SimGroup({names[i]: [wake[r] + busy[r][i]]
                            for i in np.flatnonzero(w.model_ids == r)}) for r in (0, 1)]
    else:
        send, receive = handover or (cal["send"], cal["receive"])
        groups = [SimGroup({n: [wake[0] + busy[0][i] + send, busy[1][i]]
                            for i, n in enumerate(names)},
                           receive={n: [0.0, receive] for n in names})]
    return simulate(groups, each, warmup=warmup)


def _finish(mode: str, marks: list[np.ndarray]) -> np.ndarray:
    """When each request finished (s after the start): on its rank, or on the last stage."""
    if mode == "simple":
        return np.fmax(marks[0][:, 1], marks[1][:, 1])
    return marks[1][:, 2]


def _busy(mode: str, marks: list[np.ndarray]) -> list[np.ndarray]:
    """Each rank's compute per request (s; NaN where the rank did not serve it)."""
    if mode == "simple":
        return [m[:, 1] - m[:, 0] for m in marks]
    return [marks[0][:, 1] - marks[0][:, 0], marks[1][:, 2] - marks[1][:, 1]]


def _in_run(mode: str, busy: list[np.ndarray], w: Workload) -> dict:
    """Mean compute per request that each rank measured during the run, per model (and
    stage): what the calibration should have predicted."""
    if mode == "simple":
        return {m: float(np.nanmean(busy[r][w.model_ids == r])) for r, m in enumerate(MODELS)}
    return {m: [float(np.nanmean(busy[r][w.model_ids == k])) for r in (0, 1)]
            for k, m in enumerate(MODELS)}


def _breakdown(marks: list[np.ndarray], w: Workload, counted: np.ndarray) -> dict:
    """Where a pipelined request's latency went (means, s; they sum to the measured mean):
    from arrival to the first stage's start (wake-up and queue), its compute, the wait for the
    second rank to post its receive (busy with earlier requests), the hand-over (from the
    later of the first stage's end and the posted receive to the data received), and the
    second stage's compute. The hand-over is split by whether the second rank was already
    waiting."""
    begin0, end0 = marks[0][:, 0], marks[0][:, 1]
    posted, got, end1 = marks[1][:, 0], marks[1][:, 1], marks[1][:, 2]
    handover = got - np.maximum(end0, posted)
    idle = posted <= end0
    c = counted
    mean = lambda x: float(np.mean(x)) if x.size else float("nan")  # noqa: E731
    return {"to_first_stage": mean(begin0[c] - w.arrivals[c]),
            "first_compute": mean(end0[c] - begin0[c]),
            "wait_for_receive": mean(np.maximum(0.0, posted - end0)[c]),
            "handover": mean(handover[c]),
            "second_compute": mean(end1[c] - got[c]),
            "handover_second_idle": mean(handover[c & idle]),
            "handover_second_busy": mean(handover[c & ~idle]),
            "second_busy_share": mean((~idle)[c].astype(float)),
            # the spread a deterministic-service simulator leaves out
            "first_compute_cv": _cv((end0 - begin0)[c]),
            "second_compute_cv": _cv((end1 - got)[c])}


def _cv(x: np.ndarray) -> float:
    return float(np.std(x) / np.mean(x)) if x.size else float("nan")


def _attainment(latency: np.ndarray, w: Workload, slo: dict, counted: np.ndarray) -> float:
    limit = np.array([slo[m] for m in w.models])[w.model_ids]
    return float((latency[counted] <= limit[counted]).mean())
