"""The simulator against a real run: two small bundled models (MLPs) served on two CPU
processes started by the worker group, under one Poisson trace, placed either one model per
process ("simple") or as a 2-stage pipeline over both processes holding half of each model
("pipeline", activations sent over gloo).

What the simulator is given, measured on the same processes:

- each model's and each stage's service time, from probes: a short trace of its own (the same
  rate, another seed) that each placement serves before the checked trace, between its parts
  and after it, the run's processes used as the run uses them (paced arrivals and sleeps
  between requests, the other process at the same load, the pipeline's sends). The
  simulator's service times for a part are the means over the two probes around it, so they
  follow the machine's drift during the check. (A calibration of each process alone, one at
  a time, is reported beside it: on the idle machine the stages ran 9-18 % slower in the run
  than alone, as ops do inside a training step: `docs/calibration.md`.)
- the fixed costs a request pays that are not compute: the one-way send of a stage's
  activation (a gloo ping-pong, added to the first stage), the lateness of a process woken
  from sleep at a request's arrival (added to the first stage), and the receive of an
  activation sent while the second stage was busy (the simulator's held receive on the
  second stage: gloo moves such a send only once its receive is posted); the probes' own
  hand-overs replace the calibrated pair where they saw both.

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

from graphpar.placement.simulator import SimGroup, simulate
from graphpar.placement.workload import Workload, gamma_workload, load_trace, save_trace
from graphpar.runtime.timing import call_seconds

MODELS = ("a", "b")
MODES = ("simple", "pipeline")
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
    serve).

    The trace is served in `segments` parts, each placement in turn, and before the first
    part, between parts and after the last, each placement serves a probe: another trace
    (`probe` seconds, the same rate, another seed). The simulator's service times for a part
    are those its placement saw in the two probes around it: measured the way the run uses
    the processes (paced arrivals, sleeps between requests, the other process at the same
    load, the sends), and close enough in time to follow the machine's drift. `keep`: an
    .npz file to write every replay's per-request timestamps to."""
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
            parts = [_part(w, k * step, (k + 1) * step) for k in range(segments)]
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
    slo = {m: slo_scale * cal["whole"][m] for m in MODELS}
    counted = w.arrivals >= warmup
    for mode in MODES:
        out[mode] = _compare(mode, cal, parts, served[mode], probe_w, probed[mode], w, slo,
                             counted)
    out["service_s"] = cal
    return out


def _part(w: Workload, start: float, end: float) -> Workload:
    """The requests of `w` arriving in [start, end), as a trace of its own starting at 0."""
    win = w.window(start, end)
    return Workload(w.models, win.arrivals - start, win.model_ids, end - start)


def _joined(parts: list[Workload]) -> Workload:
    """Parts' requests one after the other (times as they are: each part's own), to pool
    their per-request statistics."""
    return Workload(parts[0].models, np.concatenate([p.arrivals for p in parts]),
                    np.concatenate([p.model_ids for p in parts]),
                    sum(p.duration for p in parts))


def _stacked(marks: list[list[np.ndarray]]) -> list[np.ndarray]:
    """Per rank, the timestamps of several replays one after the other."""
    return [np.vstack([m[r] for m in marks]) for r in (0, 1)]


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


def _compare(mode: str, cal: dict, parts: list[Workload], served: list, probe: Workload,
             probed: list, w: Workload, slo: dict, counted: np.ndarray) -> dict:
    """One placement's measured latencies against the simulator's, part by part (each part
    starts with empty queues in the run and in the simulator): given the probes' service
    times (the check), the one-process-at-a-time calibration's, the part's own means (the
    queueing model alone) and each request's own computes (its spread too)."""
    measured, sim = [], {k: [] for k in ("probed", "alone", "in_run", "per_request")}
    seen_parts, probe_parts = [], []
    twice = _joined([probe, probe])
    for k, (part, marks) in enumerate(zip(parts, served)):
        measured.append(_finish(mode, marks) - part.arrivals)
        around = _stacked(probed[k:k + 2])
        probe_service = _in_run(mode, _busy(mode, around), twice)
        seen = _in_run(mode, _busy(mode, marks), part)
        handover = _handover(mode, marks, part)
        sim["probed"].append(simulate(_groups(mode, cal, probe_service,
                                              _handover(mode, around, twice)), part).latency)
        sim["alone"].append(simulate(_groups(mode, cal), part).latency)
        sim["in_run"].append(simulate(_groups(mode, cal, seen, handover), part).latency)
        sim["per_request"].append(_per_request(mode, marks, part, cal, handover, 0.0).latency)
        seen_parts.append(seen)
        probe_parts.append(probe_service)
    lat = np.concatenate(measured)
    out = {"measured_mean_s": float(lat[counted].mean()),
           "measured_attainment": _attainment(lat, w, slo, counted)}
    for key, name in (("probed", "simulated"), ("alone", "simulated_alone"),
                      ("in_run", "simulated_in_run"), ("per_request", "simulated_per_request")):
        x = np.concatenate(sim[key])
        out[f"{name}_mean_s"] = float(x[counted].mean())
        out[f"{name}_attainment"] = _attainment(x, w, slo, counted)
    out["service_in_run_s"] = _in_run(mode, _busy(mode, _stacked(served)), _joined(parts))
    out["service_probed_s"] = _in_run(mode, _busy(mode, _stacked(probed)),
                                      _joined([probe] * len(probed)))
    out["service_in_run_by_part_s"] = seen_parts
    out["service_probed_by_part_s"] = probe_parts
    if mode == "pipeline":
        out["breakdown_s"] = _breakdown(_stacked(served), _joined(parts), counted)
    return out


def _replay(group, job: Path, w: Workload, name: str, mode: str, lead: float = 0.5
            ) -> list[np.ndarray]:
    """Serve trace `w` (written to `<name>.csv`) in one placement, starting `lead` seconds
    after it is sent: each rank's timestamps (`ServingRank.serve`)."""
    trace = str(job / f"{name}.csv")
    save_trace(w, trace)
    group.wait(group.send("serve", mode, trace, time.time() + lead))
    return [np.load(job / f"marks_{mode}{r}.npy") for r in (0, 1)]


def _handover(mode: str, marks: list[np.ndarray], w: Workload
              ) -> tuple[float, float] | None:
    """The pipeline's (send to a waiting second stage, receive of a held one) as the
    timestamps show them; None where the replay saw only one of the two."""
    if mode != "pipeline":
        return None
    b = _breakdown(marks, w, np.ones(len(w), bool))
    if 0 < b["second_busy_share"] < 1:
        return b["handover_second_idle"], b["handover_second_busy"]
    return None


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
