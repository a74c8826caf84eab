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

from graphpar.placement.simulator import SimGroup, simulate
from graphpar.placement.workload import Workload, gamma_workload, load_trace, save_trace
from graphpar.runtime.timing import call_seconds

MODELS = ("a", "b")
MODES = ("simple", "pipeline")
_PROBE_SEED = 7919  # the probes' trace is not the checked one
DRAWS = 16  # simulations per part with service times drawn from the part's, averaged
SPEED_WINDOW = 0.5  # s either side: the machine's speed changes within seconds
SLO_SCALES = (1.5, 2.0, 3.0, 5.0)  # attainment is also reported at these (x alone service)
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
    slos = {scale: {m: scale * cal["whole"][m] for m in MODELS}
            for scale in dict.fromkeys((slo_scale, *SLO_SCALES))}
    counted = w.arrivals >= warmup
    for mode in MODES:
        out[mode] = _compare(mode, cal, parts, served[mode], probe_w, probed[mode], w, slos,
                             counted, seed)
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
             probed: list, w: Workload, slos: dict[float, dict], counted: np.ndarray,
             seed: int) -> dict:
    """One placement's measured latencies against the simulator's, part by part (each part
    starts with empty queues in the run and in the simulator). The check: each part simulated
    with the service times profiled over that part, their means and their spread (`DRAWS`
    simulations, each request's times drawn from the part's). Beside it the same means held
    fixed, the probes' means (taken before and after the part), the one-process-at-a-time
    calibration's, and each request's own computes. `slos`: SLO scale -> SLO per model (s);
    the first is the headline."""
    rng = np.random.default_rng(seed)
    measured = []
    sim: dict[str, list] = {k: [] for k in ("window", "fixed", "probed", "alone",
                                            "per_request")}
    seen_parts, probe_parts = [], []
    twice = _joined([probe, probe])
    for k, (part, marks) in enumerate(zip(parts, served)):
        measured.append(_finish(mode, marks) - part.arrivals)
        around = _stacked(probed[k:k + 2])
        probe_service = _in_run(mode, _busy(mode, around), twice)
        seen = _in_run(mode, _busy(mode, marks), part)
        handover = _handover(mode, marks, part)
        groups = _groups(mode, cal, seen, handover)
        # each a row per simulation (the drawn ones DRAWS rows)
        sim["window"].append(np.array([simulate(groups, part, service_scale=_spread(
            mode, marks, part, groups, seen, rng)).latency for _ in range(DRAWS)]))
        sim["fixed"].append(simulate(groups, part).latency[None])
        sim["probed"].append(simulate(_groups(mode, cal, probe_service,
                                              _handover(mode, around, twice)), part
                                      ).latency[None])
        sim["alone"].append(simulate(_groups(mode, cal), part).latency[None])
        sim["per_request"].append(
            _per_request(mode, marks, part, cal, handover, 0.0).latency[None])
        seen_parts.append(seen)
        probe_parts.append(probe_service)
    lat = np.concatenate(measured)
    headline = next(iter(slos.values()))
    out: dict = {"measured_mean_s": float(lat[counted].mean()),
                 "measured_attainment": _attainment(lat, w, headline, counted)}
    by_scale = {str(scale): {"measured": _attainment(lat, w, slo, counted)}
                for scale, slo in slos.items()}
    for key, name in (("window", "simulated"), ("fixed", "simulated_fixed"),
                      ("probed", "simulated_probed"), ("alone", "simulated_alone"),
                      ("per_request", "simulated_per_request")):
        x = np.concatenate(sim[key], axis=1)
        out[f"{name}_mean_s"] = float(x[:, counted].mean())
        out[f"{name}_attainment"] = _attainment(x, w, headline, counted)
        for scale, slo in slos.items():
            by_scale[str(scale)][name] = _attainment(x, w, slo, counted)
    out["attainment_by_slo_scale"] = by_scale
    out["service_in_run_s"] = _in_run(mode, _busy(mode, _stacked(served)), _joined(parts))
    out["service_probed_s"] = _in_run(mode, _busy(mode, _stacked(probed)),
                                      _joined([probe] * len(probed)))
    out["service_in_run_by_part_s"] = seen_parts
    out["service_probed_by_part_s"] = probe_parts
    # the spread the check's simulator draws from, per rank (each part's own, pooled)
    rel = [np.concatenate([_relative(mode, marks, part, r)
                           for part, marks in zip(parts, served)]) for r in (0, 1)]
    out["service_cv_in_run"] = [_cv(x[~np.isnan(x)]) for x in rel]
    if mode == "pipeline":
        out["breakdown_s"] = _breakdown(_stacked(served), _joined(parts), counted)
    return out


def _relative(mode: str, marks: list[np.ndarray], w: Workload, rank: int) -> np.ndarray:
    """Per request, rank `rank`'s compute over its model's mean compute there (NaN where the
    rank did not serve it)."""
    busy = _busy(mode, marks)[rank]
    rel = np.full(len(w), np.nan)
    for m in range(len(MODELS)):
        mine = (w.model_ids == m) & ~np.isnan(busy)
        if mine.any():
            rel[mine] = busy[mine] / busy[mine].mean()
    return rel


def _speed(mode: str, marks: list[np.ndarray], rel: np.ndarray, rank: int,
           width: float = SPEED_WINDOW) -> np.ndarray:
    """Per request, how slow rank `rank` was around the time it computed it: the mean
    relative compute (`rel`) of the rank's other requests that began within `width` seconds
    (1 with none). A request's own time is left out: it is what the simulator predicts."""
    begin = marks[rank][:, 0] if mode == "simple" or rank == 0 else marks[1][:, 1]
    served = np.flatnonzero(~np.isnan(rel))
    order = served[np.argsort(begin[served])]
    t, x = begin[order], rel[order]
    total = np.concatenate([[0.0], np.cumsum(x)])
    lo = np.searchsorted(t, t - width, side="left")
    hi = np.searchsorted(t, t + width, side="right")
    others = hi - lo - 1
    speed = np.full(len(rel), np.nan)
    speed[order] = np.where(others > 0, (total[hi] - total[lo] - x) / np.maximum(others, 1),
                            1.0)
    return speed


def _spread(mode: str, marks: list[np.ndarray], w: Workload, groups: list[SimGroup],
            seen: dict, rng: np.random.Generator) -> np.ndarray:
    """One draw of service-time multiples for the simulator (`service_scale`). Request i's
    compute on a rank is its model's mean there (`seen`) times the rank's speed around it
    (`_speed`) times a draw from the part's computes relative to their speeds: the machine's
    slow stretches and the spread within them, not the request's own time. The fixed costs
    in a stage's latency (`groups`) are left as they are."""
    draws = np.ones((len(w), 2))
    for r in (0, 1):  # rank r: the simple placement's model r, the pipeline's stage r
        rel = _relative(mode, marks, w, r)
        speed = _speed(mode, marks, rel, r)
        within = (rel / speed)[~np.isnan(rel)]
        drawn = speed * rng.choice(within, size=len(w)) if within.size else speed
        for m, name in enumerate(MODELS):
            if mode == "simple" and m != r:
                continue
            latency = (groups[r].stage_latency[name][0] if mode == "simple"
                       else groups[0].stage_latency[name][r])
            compute = seen[name] if mode == "simple" else seen[name][r]
            mine = (w.model_ids == m) & ~np.isnan(drawn)
            draws[mine, 0 if mode == "simple" else r] = (
                1.0 + compute * (drawn[mine] - 1.0) / latency)
    return draws


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
    """The share of counted requests within their SLO (over every row of a 2-D `latency`:
    its mean over several simulations)."""
    limit = np.array([slo[m] for m in w.models])[w.model_ids]
    return float((latency[..., counted] <= limit[counted]).mean())
