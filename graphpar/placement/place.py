"""The placement search (AlpaServe §4.2) and its baselines.

- `greedy_selection` (Algorithm 1): add one model replica at a time to the group where the
  simulator says it raises SLO attainment most, keeping the best `beam` selections; or, with
  `fast=True`, the paper's heuristic: simulate once, then put the model with the most
  unserved requests on the least-utilised group it fits.
- `alpaserve` (Algorithm 2): enumerate model buckets (models of very different latency apart),
  device buckets, group partitions (equal groups, the remainder in one more) and the parallel
  configuration shared by a partition's groups, run the greedy selection on each and keep the
  best. Group size 1 with the 1×1 configuration is among the candidates, so the result is
  never worse than selective replication on the same simulator.
- Baselines: `selective_replication` (the same search, one device per group),
  `round_robin` (replicas dealt round-robin over equal groups, no simulator in the choice of
  models) and `clockwork_pp` (selective replication re-placed every window, at zero swap
  cost, each window simulated from idle).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from graphpar.errors import PlacementError
from graphpar.placement.configs import LayerProfile, ParallelConfig, configs_for
from graphpar.placement.simulator import SimGroup, SimResult, result, run_tables, tables
from graphpar.placement.workload import Workload

POLICIES = ("alpaserve", "alpaserve-fast", "selective-replication", "round-robin",
            "clockwork++")


@dataclass(frozen=True)
class Group:
    """A device group of a placement: its devices, its parallel configuration (stages ×
    intra-op degree) and the models it hosts."""

    devices: tuple[int, ...]
    stages: int
    intra: int
    models: tuple[str, ...]


@dataclass
class Placement:
    """A policy's placement and its simulated SLO attainment on the workload."""

    policy: str
    groups: list[Group]
    attainment: float
    per_model: dict[str, float]
    mean_latency: float
    search_seconds: float = 0.0
    windows: list[list[Group]] = field(default_factory=list)  # clockwork++: per window

    def to_json(self) -> dict:
        return {"policy": self.policy,
                "groups": [{"devices": list(g.devices), "parallel_config":
                            {"stages": g.stages, "intra_op": g.intra},
                            "models": list(g.models)} for g in self.groups],
                "slo_attainment": {"overall": self.attainment, "per_model": self.per_model},
                "mean_latency_s": self.mean_latency,
                "search_seconds": self.search_seconds,
                "windows": len(self.windows)}


@dataclass(frozen=True)
class Problem:
    """What every policy places: models (by name, their layer profiles), `devices` devices of
    `memory` bytes each for weights, the workload and each model's SLO in seconds."""

    profiles: Mapping[str, LayerProfile]
    devices: int
    memory: float
    workload: Workload
    slo: Mapping[str, float]
    cluster: str = "dgx-a100"
    warmup: float = 0.0
    max_batch: int = 1  # requests per batch (1: no batching)
    batch_growth: float = 0.5  # a batch of b takes 1 + growth·(b − 1) times one request

    def batch_scale(self) -> np.ndarray:
        return 1.0 + self.batch_growth * (np.arange(self.max_batch + 1) - 1.0)

    def slo_array(self, workload: Workload | None = None) -> np.ndarray:
        return np.array([self.slo[m] for m in (workload or self.workload).models])

    # the search asks for the same (model, group size, stages) many times per step
    _memo: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def config(self, model: str, size: int, stages: int) -> ParallelConfig | None:
        key = (model, size, stages)
        if key not in self._memo:
            self._memo[key] = _configs(self.profiles[model], size, self.cluster).get(stages)
        return self._memo[key]


_CONFIG_CACHE: dict = {}


def _configs(profile: LayerProfile, size: int, cluster: str) -> dict[int, ParallelConfig]:
    """The configurations of `profile` on `size` devices by number of stages, cached per
    (model, group size, cluster)."""
    key = (profile, size, cluster)
    if key not in _CONFIG_CACHE:
        _CONFIG_CACHE[key] = {c.stages: c for c in configs_for(profile, size, cluster)}
    return _CONFIG_CACHE[key]


# ---------------------------------------------------------------------------------------
# Algorithm 1


@dataclass(frozen=True)
class _Slot:
    """A group during the search: its size, stages, hosted models and weight bytes/device."""

    size: int
    stages: int
    models: tuple[str, ...] = ()
    used: float = 0.0


def _sim_groups(problem: Problem, slots: Sequence[_Slot]) -> list[SimGroup]:
    return [SimGroup({m: problem.config(m, s.size, s.stages).stage_latency for m in s.models})
            for s in slots]


def _score(problem: Problem, slots: Sequence[_Slot], workload: Workload, slo: np.ndarray
           ) -> SimResult:
    finish = run_tables(tables(_sim_groups(problem, slots), workload.models), workload, slo,
                        problem.max_batch, problem.batch_scale())
    return result(workload, finish, slo, problem.warmup)


def _fits(problem: Problem, slot: _Slot, model: str) -> ParallelConfig | None:
    if model in slot.models:
        return None
    config = problem.config(model, slot.size, slot.stages)
    if config is None or slot.used + config.weight_bytes_per_device > problem.memory:
        return None
    return config


def _add(slot: _Slot, model: str, config: ParallelConfig) -> _Slot:
    return _Slot(slot.size, slot.stages, slot.models + (model,),
                 slot.used + config.weight_bytes_per_device)


def greedy_selection(problem: Problem, models: Sequence[str], slots: Sequence[_Slot],
                     workload: Workload, beam: int = 1, fast: bool = False
                     ) -> tuple[list[_Slot], float]:
    """Algorithm 1 on empty `slots`: the selection and its attainment on `workload` (whose
    requests for models outside `models` are left out)."""
    keep = np.isin(workload.model_ids, [workload.models.index(m) for m in models])
    workload = Workload(workload.models, workload.arrivals[keep], workload.model_ids[keep],
                        workload.duration)
    slo = problem.slo_array(workload)
    if fast:
        return _fast_selection(problem, models, list(slots), workload, slo)
    frontier = [list(slots)]
    best, best_score = list(slots), _score(problem, slots, workload, slo).attainment
    while True:
        scored = []
        for sel in frontier:
            for m, g in itertools.product(models, range(len(sel))):
                config = _fits(problem, sel[g], m)
                if config is None:
                    continue
                cand = sel[:g] + [_add(sel[g], m, config)] + sel[g + 1:]
                scored.append((_score(problem, cand, workload, slo).attainment, cand))
        if not scored:
            break
        scored.sort(key=lambda x: -x[0])  # stable: ties keep the enumeration order
        frontier = [cand for _, cand in scored[:beam]]
        if scored[0][0] > best_score:
            best_score, best = scored[0][0], scored[0][1]
        if best_score >= 1.0:
            break
    return best, best_score


def _fast_selection(problem, models, slots, workload, slo):
    """The paper's heuristic: simulate, then place the model with the most unserved requests
    on the least-utilised group it fits; stop when nothing fits."""
    best, best_score = list(slots), -1.0
    blocked: set[str] = set()
    while True:
        res = _score(problem, slots, workload, slo)
        if res.attainment > best_score:
            best, best_score = list(slots), res.attainment
        if best_score >= 1.0:
            break
        missed = np.bincount(workload.model_ids[~res.good & res.counted],
                             minlength=len(workload.models))
        busy = _utilisation(problem, slots, workload, res)
        order = [m for m in sorted(models, key=lambda m: -missed[workload.models.index(m)])
                 if m not in blocked and missed[workload.models.index(m)] > 0]
        placed = False
        for m in order:
            fits = [(busy[g], g) for g in range(len(slots)) if _fits(problem, slots[g], m)]
            if not fits:
                blocked.add(m)
                continue
            g = min(fits)[1]
            slots = slots[:g] + [_add(slots[g], m, _fits(problem, slots[g], m))] + slots[g + 1:]
            placed = True
            break
        if not placed:
            break
    return best, best_score


def _utilisation(problem, slots, workload, res) -> list[float]:
    """Per group: the busy time of its slowest stage over the served requests, per second."""
    busy = [0.0] * len(slots)
    served = ~np.isnan(res.finish)
    counts = np.bincount(workload.model_ids[served], minlength=len(workload.models))
    hosts = Counter(m for s in slots for m in s.models)
    index = {m: i for i, m in enumerate(workload.models)}
    for g, slot in enumerate(slots):
        for m in slot.models:
            config = problem.config(m, slot.size, slot.stages)
            busy[g] += counts[index[m]] / hosts[m] * max(config.stage_latency)
    return [b / max(workload.duration, 1e-9) for b in busy]


# ---------------------------------------------------------------------------------------
# Algorithm 2 and the baselines


def _partitions(devices: int, sizes: Sequence[int]) -> list[list[int]]:
    """Group sizes covering `devices`: equal groups of each size, the remainder in one more."""
    out = []
    for n in sizes:
        if n <= devices:
            groups = [n] * (devices // n) + ([devices % n] if devices % n else [])
            out.append(groups)
    return out


def _model_buckets(problem: Problem, models: Sequence[str], ratio: float = 2.0
                   ) -> list[list[list[str]]]:
    """All models together, and (when latencies differ by more than `ratio`) split at the
    largest latency gap: two buckets."""
    ordered = sorted(models, key=lambda m: problem.profiles[m].latency)
    out = [[list(ordered)]]
    lat = [problem.profiles[m].latency for m in ordered]
    gaps = [lat[i + 1] / max(lat[i], 1e-12) for i in range(len(lat) - 1)]
    if gaps and max(gaps) > ratio:
        cut = int(np.argmax(gaps)) + 1
        out.append([ordered[:cut], ordered[cut:]])
    return out


def _device_buckets(problem: Problem, buckets: list[list[str]]) -> list[list[int]]:
    """Device counts per bucket: in proportion to each bucket's load (rate × latency), and a
    step either side."""
    if len(buckets) == 1:
        return [[problem.devices]]
    load = [sum(problem.workload.rate(m) * problem.profiles[m].latency for m in b) + 1e-12
            for b in buckets]
    first = round(problem.devices * load[0] / sum(load))
    options = []
    for d in (first - 1, first, first + 1):
        if 1 <= d < problem.devices:
            options.append([d, problem.devices - d])
    return options


def _search(problem: Problem, buckets: list[list[str]], split: list[int], sizes: Sequence[int],
            model_parallel: bool, beam: int, fast: bool) -> tuple[list[_Slot], float]:
    chosen: list[_Slot] = []
    for models, devices in zip(buckets, split):
        best, best_score = None, -1.0
        for partition in _partitions(devices, sizes):
            for stages in _stage_options(partition[0], model_parallel):
                slots = [_Slot(n, min(stages, n)) for n in partition]
                sel, score = greedy_selection(problem, models, slots, problem.workload,
                                              beam, fast)
                if score > best_score:
                    best, best_score = sel, score
        chosen.extend(best or [])
    return chosen, _score(problem, chosen, problem.workload, problem.slo_array()).attainment


def _stage_options(size: int, model_parallel: bool) -> list[int]:
    if not model_parallel:
        return [1]
    return [s for s in range(1, size + 1) if size % s == 0]


def _as_groups(slots: Sequence[_Slot]) -> list[Group]:
    out, start = [], 0
    for s in slots:
        out.append(Group(tuple(range(start, start + s.size)), s.stages, s.size // s.stages,
                         s.models))
        start += s.size
    return out


def _finish(policy: str, problem: Problem, slots: Sequence[_Slot], seconds: float
            ) -> Placement:
    res = _score(problem, slots, problem.workload, problem.slo_array())
    return Placement(policy, _as_groups(slots), res.attainment, res.attainment_per_model(),
                     res.mean_latency, seconds)


def group_sizes(devices: int) -> list[int]:
    return [n for n in (1, 2, 4, 8, 16, 32, 64) if n <= devices]


def place(problem: Problem, policy: str = "alpaserve", beam: int = 1,
          window: float = 60.0, fast: bool = False) -> Placement:
    """Place `problem`'s models with `policy` (one of POLICIES). `fast` makes every policy's
    model selection the paper's one-simulation-per-step heuristic (for sweeps)."""
    import time

    check(problem)
    start = time.process_time()
    models = list(problem.profiles)
    if policy in ("alpaserve", "alpaserve-fast"):
        fast = fast or policy == "alpaserve-fast"
        best, best_score = [], -1.0
        for buckets in _model_buckets(problem, models):
            for split in _device_buckets(problem, buckets):
                sel, score = _search(problem, buckets, split, group_sizes(problem.devices),
                                     True, beam, fast)
                if score > best_score:
                    best, best_score = sel, score
        return _finish(policy, problem, best, time.process_time() - start)
    if policy == "selective-replication":
        sel, _ = _search(problem, [models], [problem.devices], [1], False, beam, fast)
        return _finish(policy, problem, sel, time.process_time() - start)
    if policy == "round-robin":
        return _round_robin(problem, start)
    if policy == "clockwork++":
        return _clockwork(problem, window, start, beam, fast)
    raise PlacementError(f"unknown policy {policy!r}: use one of {', '.join(POLICIES)}")


def _round_robin(problem: Problem, start: float) -> Placement:
    """Replicas dealt over equal groups in turn until no model fits anywhere; the group size
    and stage count with the best simulated attainment are kept."""
    import time

    best, best_score = [], -1.0
    models = list(problem.profiles)
    for partition in _partitions(problem.devices, group_sizes(problem.devices)):
        for stages in _stage_options(partition[0], True):
            slots = [_Slot(n, min(stages, n)) for n in partition]
            progress, turn = True, 0
            while progress:
                progress = False
                for m in models:
                    for k in range(len(slots)):
                        g = (turn + k) % len(slots)
                        config = _fits(problem, slots[g], m)
                        if config is not None:
                            slots[g] = _add(slots[g], m, config)
                            turn, progress = g + 1, True
                            break
            score = _score(problem, slots, problem.workload, problem.slo_array()).attainment
            if score > best_score:
                best, best_score = slots, score
    return _finish("round-robin", problem, best, time.process_time() - start)


def _clockwork(problem: Problem, window: float, start: float, beam: int, fast: bool
               ) -> Placement:
    """Selective replication re-placed for every window on that window's requests (the
    placement knows the future window, swaps are free); each window is simulated from idle."""
    import time

    models, good, counted, lat, windows = list(problem.profiles), 0, 0, [], []
    per_good = np.zeros(len(problem.workload.models))
    per_count = np.zeros(len(problem.workload.models))
    t = 0.0
    while t < problem.workload.duration:
        part = problem.workload.window(t, t + window)
        shifted = Workload(part.models, part.arrivals - t, part.model_ids, window)
        sub = replace(problem, workload=shifted, warmup=max(problem.warmup - t, 0.0))
        sel, _ = _search(sub, [models], [problem.devices], [1], False, beam, fast)
        res = _score(sub, sel, shifted, sub.slo_array())
        mask = res.counted
        good += int(res.good[mask].sum())
        counted += int(mask.sum())
        per_good += np.bincount(part.model_ids[mask & res.good], minlength=per_good.size)
        per_count += np.bincount(part.model_ids[mask], minlength=per_count.size)
        lat.extend(res.latency[mask & ~np.isnan(res.latency)].tolist())
        windows.append(_as_groups(sel))
        t += window
    per_model = {m: float(per_good[i] / per_count[i]) if per_count[i] else 1.0
                 for i, m in enumerate(problem.workload.models)}
    return Placement("clockwork++", windows[0] if windows else [],
                     good / counted if counted else 1.0, per_model,
                     float(np.mean(lat)) if lat else float("nan"),
                     time.process_time() - start, windows)


def check(problem: Problem) -> None:
    """Refuse a problem no placement can serve: a model that fits no group of the cluster's
    devices, or an SLO below the model's fastest configuration."""
    for name, profile in problem.profiles.items():
        options = [c for n in group_sizes(problem.devices)
                   for c in _configs(profile, n, problem.cluster).values()]
        fitting = [c for c in options if c.weight_bytes_per_device <= problem.memory]
        if not fitting:
            raise PlacementError(
                f"model {name!r} ({profile.weights / 1e9:.2f} GB of weights) fits no device "
                f"group: {problem.memory / 1e9:.2f} GB per device on up to "
                f"{problem.devices} devices; give more devices or memory_per_device")
        fastest = min(sum(c.stage_latency) for c in fitting)
        if problem.slo[name] < fastest:
            raise PlacementError(
                f"model {name!r}: SLO {problem.slo[name] * 1e3:.3g} ms is below its fastest "
                f"configuration's latency ({fastest * 1e3:.3g} ms, estimated); raise the "
                f"slo")
