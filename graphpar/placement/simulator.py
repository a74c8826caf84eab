"""The placement simulator: continuous-time, discrete-event serving of a workload on device
groups, numba-compiled.

Semantics (AlpaServe §4.3 and its public simulator):
- A group runs one parallel configuration: S pipeline stages, each with a clock (the time it
  becomes free). A request of model m entering at time t leaves stage s at
  `t_s = max(clock[s], t_{s-1}) + latency[m][s]` — FCFS per stage, so a pipeline's occupancy
  per request is its slowest stage while a request's latency is the sum of its stages.
- Optionally a stage receives its input on its own clock when it was busy as the input came
  (`receive[m][s]`): `t_s = max(clock[s] + receive[m][s], t_{s-1}) + latency[m][s]`. A
  rendezvous transport (gloo, NCCL) moves a message only once its receive is posted, so a send
  to a busy stage costs that stage the hand-over after it frees; the one-way send to an idle
  stage stays in the previous stage's latency.
- A controller sends each request to the group, among those hosting its model, that would
  finish it soonest.
- A request that cannot finish within its SLO even so is rejected on arrival (it counts as
  missed and occupies nothing): execution time is known, so the runtime never starts work it
  will throw away.
- Optional batching (`max_batch` > 1): a request may join the batch its group has queued last
  when that batch is of the same model and has not started; a batch of b runs each stage in
  `latency * batch_scale[b]` and every member must still meet its SLO.
- Requests arriving before `warmup` seconds are served but left out of the statistics.
- Optionally service times vary (`service_scale[i, s]`: request i's stage s takes that many
  times its latency; a batch takes its first member's). The controller and the rejection
  still go by the latencies, as a runtime that knows only its profile does; the clocks move
  by what the stages took. On a device whose speed varies (a shared CPU) queues grow with
  the spread of service times (Pollaczek-Khinchine), which a fixed latency leaves out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from numba import njit

from graphpar.errors import PlacementError
from graphpar.placement.workload import Workload

# slack against floating-point rounding when comparing a finish time with a deadline
_EPS = 1e-9


@dataclass(frozen=True)
class SimGroup:
    """One device group as the simulator sees it: per hosted model, its stage latencies in
    seconds (all models of a group have the same number of stages), and optionally per stage
    the seconds it takes to receive an input sent while it was busy (none by default)."""

    stage_latency: Mapping[str, Sequence[float]]
    receive: Mapping[str, Sequence[float]] | None = None

    @property
    def stages(self) -> int:
        counts = {len(v) for v in self.stage_latency.values()}
        return counts.pop() if len(counts) == 1 else 0


@dataclass(frozen=True)
class SimResult:
    """Per request: its finish time (NaN when rejected); and the statistics over the requests
    that arrived after the warm-up window."""

    models: tuple[str, ...]
    finish: np.ndarray
    latency: np.ndarray  # finish - arrival, NaN when rejected
    good: np.ndarray  # bool: served within its SLO
    counted: np.ndarray  # bool: after the warm-up window
    model_ids: np.ndarray

    @property
    def attainment(self) -> float:
        """Fraction of counted requests served within their SLO (1.0 with no requests)."""
        n = int(self.counted.sum())
        return float(self.good[self.counted].sum()) / n if n else 1.0

    def attainment_per_model(self) -> dict[str, float]:
        out = {}
        for m, name in enumerate(self.models):
            mask = self.counted & (self.model_ids == m)
            n = int(mask.sum())
            out[name] = float(self.good[mask].sum()) / n if n else 1.0
        return out

    @property
    def mean_latency(self) -> float:
        """Mean latency in seconds of the counted requests that were served."""
        lat = self.latency[self.counted & ~np.isnan(self.latency)]
        return float(lat.mean()) if lat.size else float("nan")

    @property
    def rejected(self) -> int:
        return int((self.counted & np.isnan(self.finish)).sum())


@dataclass(frozen=True)
class Tables:
    """A placement as arrays, built once and simulated many times: hosts of model m are
    `host_group[host_start[m]:host_start[m+1]]`; `latency[g, m, s]` is stage s of model m on
    group g (zero past the group's `stages[g]`), `receive[g, m, s]` its held-receive time."""

    host_start: np.ndarray
    host_group: np.ndarray
    latency: np.ndarray
    stages: np.ndarray
    receive: np.ndarray


def tables(groups: Sequence[SimGroup], models: Sequence[str]) -> Tables:
    """The arrays the kernel reads for `groups` serving `models` (names in workload order)."""
    index = {name: m for m, name in enumerate(models)}
    most = max([g.stages for g in groups] + [1])
    latency = np.zeros((max(len(groups), 1), max(len(models), 1), most))
    receive = np.zeros_like(latency)
    stages = np.ones(max(len(groups), 1), dtype=np.int64)
    hosts: list[list[int]] = [[] for _ in models]
    for g, group in enumerate(groups):
        if group.stage_latency and not group.stages:
            raise PlacementError(f"group {g}: its models have different numbers of stages; "
                                 f"a group runs one parallel configuration")
        stages[g] = max(group.stages, 1)
        for name, lat in group.stage_latency.items():
            if name not in index:
                continue  # a model the workload never asks for
            latency[g, index[name], :len(lat)] = lat
            held = (group.receive or {}).get(name, ())
            receive[g, index[name], :len(held)] = held
            hosts[index[name]].append(g)
    start = np.zeros(len(models) + 1, dtype=np.int64)
    start[1:] = np.cumsum([len(h) for h in hosts])
    flat = np.array([g for h in hosts for g in h], dtype=np.int64)
    return Tables(start, flat, latency, stages, receive)


@njit(cache=True)
def _finish_time(clock, lat, rcv, g, m, stages, start, scale):
    t = start
    for s in range(stages):
        if rcv is None:  # pruned at compile time: the plain stage clocks stay as fast
            t = max(clock[g, s], t) + lat[g, m, s] * scale
        else:
            t = max(clock[g, s] + rcv[g, m, s], t) + lat[g, m, s] * scale
    return t


@njit(cache=True)
def _run(arrivals, model_ids, slo, host_start, host_group, lat, rcv, stages, max_batch,
         batch_scale, draws, finish):
    groups, depth = lat.shape[0], lat.shape[2]
    clock = np.zeros((groups, depth))
    before = np.zeros((groups, depth))  # clocks before the group's last batch
    last_model = np.full(groups, -1)
    last_size = np.zeros(groups, dtype=np.int64)
    last_begin = np.zeros(groups)  # when the last batch starts its first stage
    last_deadline = np.zeros(groups)  # the earliest deadline among its members
    members = np.zeros((groups, max(max_batch, 1)), dtype=np.int64)
    for i in range(arrivals.size):
        t, m = arrivals[i], model_ids[i]
        deadline = t + slo[m]
        best, best_g, join = np.inf, -1, False
        for h in range(host_start[m], host_start[m + 1]):
            g = host_group[h]
            done = _finish_time(clock, lat, rcv, g, m, stages[g], t, 1.0)
            if done < best:
                best, best_g, join = done, g, False
            if (max_batch > 1 and last_model[g] == m and last_size[g] < max_batch
                    and t <= last_begin[g]):
                b = last_size[g] + 1
                done = _finish_time(before, lat, rcv, g, m, stages[g], last_begin[g],
                                    batch_scale[b])
                if done <= last_deadline[g] + 1e-9 and done < best:
                    best, best_g, join = done, g, True
        if best_g < 0 or best > deadline + 1e-9:
            finish[i] = np.nan
            continue
        g = best_g
        if join:
            b = last_size[g] + 1
            start, scale = last_begin[g], batch_scale[b]
            members[g, last_size[g]] = i
            last_size[g] = b
            last_deadline[g] = min(last_deadline[g], deadline)
        else:
            for s in range(depth):
                before[g, s] = clock[g, s]
            start, scale = max(clock[g, 0], t), 1.0
            last_model[g], last_size[g], last_begin[g] = m, 1, start
            last_deadline[g] = deadline
            members[g, 0] = i
        u = start
        for s in range(stages[g]):
            took = lat[g, m, s] * scale
            if draws is not None:  # pruned at compile time, as rcv
                took *= draws[members[g, 0], s]
            if rcv is None:
                u = max(before[g, s], u) + took
            else:
                u = max(before[g, s] + rcv[g, m, s], u) + took
            clock[g, s] = u
        for k in range(last_size[g]):
            finish[members[g, k]] = u


def run_tables(tab: Tables, workload: Workload, slo: np.ndarray, max_batch: int = 1,
               batch_scale: Sequence[float] | None = None,
               service_scale: np.ndarray | None = None) -> np.ndarray:
    """Finish time per request (NaN when rejected) for the placement `tab`."""
    draws = None
    if service_scale is not None:
        draws = np.asarray(service_scale, dtype=np.float64)
        depth = tab.latency.shape[2]
        if draws.ndim != 2 or draws.shape[0] != len(workload) or draws.shape[1] < depth:
            raise PlacementError(f"service_scale must be (requests, stages) = "
                                 f"({len(workload)}, {depth}) or wider; got {draws.shape}")
        if not (draws >= 0).all():
            raise PlacementError("service_scale must be non-negative (a multiple of each "
                                 "stage's latency)")
        draws = np.ascontiguousarray(draws)
    scale = np.ones(max(max_batch, 1) + 1)
    if batch_scale is not None:
        given = np.asarray(batch_scale, dtype=np.float64)
        if given.size < max_batch + 1:
            raise PlacementError(f"batch_scale needs entries for batch sizes 0..{max_batch}")
        scale = given[:max_batch + 1]
    finish = np.empty(len(workload))
    if len(workload):
        _run(workload.arrivals, workload.model_ids, np.asarray(slo, dtype=np.float64),
             tab.host_start, tab.host_group, tab.latency,
             tab.receive if tab.receive.any() else None, tab.stages,
             int(max_batch), scale, draws, finish)
    return finish


def result(workload: Workload, finish: np.ndarray, slo: np.ndarray, warmup: float = 0.0
           ) -> SimResult:
    latency = finish - workload.arrivals
    good = ~np.isnan(finish) & (latency <= slo[workload.model_ids] + _EPS)
    return SimResult(workload.models, finish, latency, good, workload.arrivals >= warmup,
                     workload.model_ids)


def slo_array(workload: Workload, slo: Mapping[str, float] | float) -> np.ndarray:
    """Per model of the workload its SLO in seconds (a number applies to every model)."""
    if isinstance(slo, Mapping):
        missing = [m for m in workload.models if m not in slo]
        if missing:
            raise PlacementError(f"no SLO for model(s) {', '.join(missing)}")
        return np.array([float(slo[m]) for m in workload.models])
    return np.full(len(workload.models), float(slo))


def simulate(groups: Sequence[SimGroup], workload: Workload,
             slo: Mapping[str, float] | float = np.inf, *, warmup: float = 0.0,
             max_batch: int = 1, batch_scale: Sequence[float] | None = None,
             service_scale: np.ndarray | None = None) -> SimResult:
    """Serve `workload` on `groups`; `slo` in seconds, per model or for all;
    `service_scale[i, s]`: what request i's stage s takes, as a multiple of its latency."""
    slos = slo_array(workload, slo)
    finish = run_tables(tables(groups, workload.models), workload, slos, max_batch,
                        batch_scale, service_scale)
    return result(workload, finish, slos, warmup)
