"""The simulator against the timestamps of a real run (`real_check`): per request, when each
process began and ended its compute (and the pipeline's second process when it posted its
receive and got the data), per part of the trace. `compare` simulates each part with the
service times as the processes delivered them (each model's mean over the part, the
process's speed around each request, the part's spread: `speed_around`, `spread_draws`) and,
beside it, with the part's means held fixed, the probes' means, the one-process-at-a-time
calibration and each request's own computes; `breakdown` splits a pipelined request's latency
into where it went; `errors` sums up the simulator's error per profile, the predictive ones
(probes, each process alone) apart from the consistency checks. Pure functions of the recorded
arrays: the tests feed them hand-made timestamps."""

from __future__ import annotations

import numpy as np

from graphpar.placement.simulator import SimGroup, simulate
from graphpar.placement.workload import Workload

MODELS = ("a", "b")
MODES = ("simple", "pipeline")
DRAWS = 16  # simulations per part with service times drawn from the part's, averaged
SPEED_WINDOW = 0.5  # s either side: the machine's speed changes within seconds
SLO_SCALES = (1.5, 2.0, 3.0, 5.0)  # attainment is also reported at these (x alone service)

# What the simulator was given, by name, and the prefix of `compare`'s keys for it. The first
# two are predictions (a profile taken apart from the requests checked), the rest consistency
# checks of the simulator's queueing given what the run's processes delivered.
PROFILES = {
    "probes": "simulated_probed",
    "alone": "simulated_alone",
    "replay": "simulated",
    "fixed": "simulated_fixed",
    "per_request": "simulated_per_request",
}
PROFILE_NOTES = {
    "probes": "predictive: the mean service times of probes (traces of their own at the same "
              "rate) served in the seconds before and after each part, not the requests checked",
    "alone": "predictive: each process's service times calibrated alone, one at a time, "
             "before the run (what profiling each model before a deployment gives)",
    "replay": "consistency check, not a prediction: the service times the run's processes "
              "delivered, each request's from its neighbours within SPEED_WINDOW s, with the "
              "part's spread (the check of the simulator's queueing)",
    "fixed": "consistency check: each part's own mean service times, held fixed",
    "per_request": "consistency check: each request's own compute times",
}


def part_of(w: Workload, start: float, end: float) -> Workload:
    """The requests of `w` arriving in [start, end), as a trace of its own starting at 0."""
    win = w.window(start, end)
    return Workload(w.models, win.arrivals - start, win.model_ids, end - start)


def joined(parts: list[Workload]) -> Workload:
    """Parts' requests one after the other (times as they are: each part's own), to pool
    their per-request statistics."""
    return Workload(parts[0].models, np.concatenate([p.arrivals for p in parts]),
                    np.concatenate([p.model_ids for p in parts]),
                    sum(p.duration for p in parts))


def stacked(marks: list[list[np.ndarray]]) -> list[np.ndarray]:
    """Per rank, the timestamps of several replays one after the other."""
    return [np.vstack([m[r] for m in marks]) for r in (0, 1)]


def compare(mode: str, cal: dict, parts: list[Workload], served: list, probe: Workload,
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
    twice = joined([probe, probe])
    for k, (part, marks) in enumerate(zip(parts, served)):
        measured.append(finish_times(mode, marks) - part.arrivals)
        around = stacked(probed[k:k + 2])
        probe_service = mean_computes(mode, computes(mode, around), twice)
        seen = mean_computes(mode, computes(mode, marks), part)
        handover = seen_handover(mode, marks, part)
        groups = sim_groups(mode, cal, seen, handover)
        # each a row per simulation (the drawn ones DRAWS rows)
        sim["window"].append(np.array([
            simulate(groups, part, service_scale=scale).latency
            for scale in spread_draws(mode, marks, part, groups, seen, rng, DRAWS)]))
        sim["fixed"].append(simulate(groups, part).latency[None])
        probe_groups = sim_groups(mode, cal, probe_service, seen_handover(mode, around, twice))
        sim["probed"].append(simulate(probe_groups, part).latency[None])
        sim["alone"].append(simulate(sim_groups(mode, cal), part).latency[None])
        sim["per_request"].append(
            per_request(mode, marks, part, cal, handover, 0.0).latency[None])
        seen_parts.append(seen)
        probe_parts.append(probe_service)
    lat = np.concatenate(measured)
    headline = next(iter(slos.values()))
    out: dict = {"measured_mean_s": float(lat[counted].mean()),
                 "measured_attainment": attainment(lat, w, headline, counted)}
    by_scale = {str(scale): {"measured": attainment(lat, w, slo, counted)}
                for scale, slo in slos.items()}
    for key, name in (("window", "simulated"), ("fixed", "simulated_fixed"),
                      ("probed", "simulated_probed"), ("alone", "simulated_alone"),
                      ("per_request", "simulated_per_request")):
        x = np.concatenate(sim[key], axis=1)
        out[f"{name}_mean_s"] = float(x[:, counted].mean())
        out[f"{name}_attainment"] = attainment(x, w, headline, counted)
        for scale, slo in slos.items():
            by_scale[str(scale)][name] = attainment(x, w, slo, counted)
    out["attainment_by_slo_scale"] = by_scale
    out["service_in_run_s"] = mean_computes(mode, computes(mode, stacked(served)), joined(parts))
    out["service_probed_s"] = mean_computes(mode, computes(mode, stacked(probed)),
                                            joined([probe] * len(probed)))
    out["service_in_run_by_part_s"] = seen_parts
    out["service_probed_by_part_s"] = probe_parts
    # the spread the check's simulator draws from, per rank (each part's own, pooled)
    rel = [np.concatenate([relative(mode, marks, part, r)
                           for part, marks in zip(parts, served)]) for r in (0, 1)]
    out["service_cv_in_run"] = [cv(x[~np.isnan(x)]) for x in rel]
    if mode == "pipeline":
        out["breakdown_s"] = breakdown(stacked(served), joined(parts), counted)
    return out


def relative(mode: str, marks: list[np.ndarray], w: Workload, rank: int) -> np.ndarray:
    """Per request, rank `rank`'s compute over its model's mean compute there (NaN where the
    rank did not serve it)."""
    busy = computes(mode, marks)[rank]
    rel = np.full(len(w), np.nan)
    for m in range(len(MODELS)):
        mine = (w.model_ids == m) & ~np.isnan(busy)
        if mine.any():
            rel[mine] = busy[mine] / busy[mine].mean()
    return rel


def speed_around(mode: str, marks: list[np.ndarray], rel: np.ndarray, rank: int,
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


def spread_draws(mode: str, marks: list[np.ndarray], w: Workload, groups: list[SimGroup],
                 seen: dict, rng: np.random.Generator, count: int = 1) -> np.ndarray:
    """`count` draws of service-time multiples for the simulator (`service_scale`), as
    [count, requests, 2]. Request i's compute on a rank is its model's mean there (`seen`)
    times the rank's speed around it (`speed_around`) times a draw from the part's computes
    relative to their speeds: the machine's slow stretches and the spread within them, not the
    request's own time. The fixed costs in a stage's latency (`groups`) are left as they are.
    The speeds and the fixed costs are the part's, found once; only the draws differ."""
    # per rank (the simple placement's model r, the pipeline's stage r): its speed around
    # each request, what it draws from, and per model its requests, column, mean compute and
    # stage latency
    ranks = []
    for r in (0, 1):
        rel = relative(mode, marks, w, r)
        speed = speed_around(mode, marks, rel, r)
        shares = []
        for m, name in enumerate(MODELS):
            if mode == "simple" and m != r:
                continue
            latency = (groups[r].stage_latency[name][0] if mode == "simple"
                       else groups[0].stage_latency[name][r])
            compute = seen[name] if mode == "simple" else seen[name][r]
            shares.append(((w.model_ids == m) & ~np.isnan(speed),
                           0 if mode == "simple" else r, compute, latency))
        ranks.append((speed, (rel / speed)[~np.isnan(rel)], shares))
    draws = np.ones((count, len(w), 2))
    for out in draws:
        for speed, within, shares in ranks:
            drawn = speed * rng.choice(within, size=len(w)) if within.size else speed
            for mine, column, compute, latency in shares:
                out[mine, column] = 1.0 + compute * (drawn[mine] - 1.0) / latency
    return draws


def seen_handover(mode: str, marks: list[np.ndarray], w: Workload
                  ) -> tuple[float, float] | None:
    """The pipeline's (send to a waiting second stage, receive of a held one) as the
    timestamps show them; None where the replay saw only one of the two."""
    if mode != "pipeline":
        return None
    b = breakdown(marks, w, np.ones(len(w), bool))
    if 0 < b["second_busy_share"] < 1:
        return b["handover_second_idle"], b["handover_second_busy"]
    return None


def sim_groups(mode: str, cal: dict, seen: dict | None = None,
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


def per_request(mode: str, marks: list[np.ndarray], w: Workload, cal: dict,
                handover: tuple[float, float] | None, warmup: float):
    """The simulator on the run's trace with every request its own model, whose stage
    latencies are the computes that request took in the run (plus the fixed costs, as
    `sim_groups` prices them)."""
    names = tuple(str(i) for i in range(len(w)))
    each = Workload(names, w.arrivals, np.arange(len(w)), w.duration)
    busy = computes(mode, marks)
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


def finish_times(mode: str, marks: list[np.ndarray]) -> np.ndarray:
    """When each request finished (s after the start): on its rank, or on the last stage."""
    if mode == "simple":
        return np.fmax(marks[0][:, 1], marks[1][:, 1])
    return marks[1][:, 2]


def computes(mode: str, marks: list[np.ndarray]) -> list[np.ndarray]:
    """Each rank's compute per request (s; NaN where the rank did not serve it)."""
    if mode == "simple":
        return [m[:, 1] - m[:, 0] for m in marks]
    return [marks[0][:, 1] - marks[0][:, 0], marks[1][:, 2] - marks[1][:, 1]]


def mean_computes(mode: str, busy: list[np.ndarray], w: Workload) -> dict:
    """Mean compute per request that each rank measured during the run, per model (and
    stage): what the calibration should have predicted."""
    if mode == "simple":
        return {m: float(np.nanmean(busy[r][w.model_ids == r])) for r, m in enumerate(MODELS)}
    return {m: [float(np.nanmean(busy[r][w.model_ids == k])) for r in (0, 1)]
            for k, m in enumerate(MODELS)}


def breakdown(marks: list[np.ndarray], w: Workload, counted: np.ndarray) -> dict:
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
            "first_compute_cv": cv((end0 - begin0)[c]),
            "second_compute_cv": cv((end1 - got)[c])}


def cv(x: np.ndarray) -> float:
    return float(np.std(x) / np.mean(x)) if x.size else float("nan")


def attainment(latency: np.ndarray, w: Workload, slo: dict, counted: np.ndarray) -> float:
    """The share of counted requests within their SLO (over every row of a 2-D `latency`:
    its mean over several simulations)."""
    limit = np.array([slo[m] for m in w.models])[w.model_ids]
    return float((latency[..., counted] <= limit[counted]).mean())


def errors(run: dict, profiles: dict[str, str] | None = None) -> dict:
    """Per profile (`PROFILES`, or `profiles`: name -> key prefix, for JSON kept by earlier
    versions of the check) and placement, the simulator's error against the measurement:
    mean latency in percent (simulated / measured - 1) and the largest gap in SLO attainment
    in points over the SLO scales the run kept for it (its headline scale alone where it kept
    no others; None where it kept no attainment). A profile the run did not keep is left
    out."""
    out: dict = {}
    for name, key in (profiles or PROFILES).items():
        for mode in MODES:
            m = run.get(mode, {})
            if f"{key}_mean_s" not in m:
                continue
            scales = {s: a for s, a in m.get("attainment_by_slo_scale", {}).items() if key in a}
            gaps = ([a[key] - a["measured"] for a in scales.values()] if scales
                    else [m[f"{key}_attainment"] - m["measured_attainment"]]
                    if f"{key}_attainment" in m else [])
            out.setdefault(name, {})[mode] = {
                "mean_latency_error_pct": round((m[f"{key}_mean_s"] / m["measured_mean_s"] - 1)
                                                * 100, 2),
                "slo_points": round(max(abs(g) for g in gaps) * 100, 2) if gaps else None,
                "slo_scales": [float(s) for s in scales] or ("headline" if gaps else []),
            }
    return out
