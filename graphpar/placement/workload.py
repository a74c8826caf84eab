"""Request workloads for the placement simulator: Poisson and Gamma arrivals, power-law rate
splits across models, and CSV traces of (model, arrival_s). Plain numpy, deterministic seeds."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from graphpar.errors import PlacementSpecError


@dataclass(frozen=True)
class Workload:
    """Requests sorted by arrival: `arrivals[i]` seconds after the start, for model
    `model_ids[i]` (an index into `models`)."""

    models: tuple[str, ...]
    arrivals: np.ndarray  # float64 [N], ascending
    model_ids: np.ndarray  # int64 [N]
    duration: float

    def __len__(self) -> int:
        return int(self.arrivals.size)

    def rate(self, model: str | None = None) -> float:
        """Mean request rate (req/s) over the duration, of one model or of all."""
        if model is None:
            return len(self) / self.duration
        return int((self.model_ids == self.models.index(model)).sum()) / self.duration

    def window(self, start: float, end: float) -> Workload:
        """The requests arriving in [start, end), times kept as they are."""
        keep = (self.arrivals >= start) & (self.arrivals < end)
        return Workload(self.models, self.arrivals[keep], self.model_ids[keep], self.duration)


def gamma_arrivals(rate: float, cv: float, duration: float, rng: np.random.Generator
                   ) -> np.ndarray:
    """Arrival times of a Gamma renewal process over [0, duration): inter-arrival times drawn
    from gamma(shape=1/CV², scale=CV²/rate), so the mean gap is 1/rate and its coefficient of
    variation is `cv` (cv=1 is Poisson)."""
    if rate < 0 or cv <= 0 or duration <= 0:
        raise PlacementSpecError(f"arrivals need rate >= 0, cv > 0 and duration > 0 "
                                 f"(got rate={rate}, cv={cv}, duration={duration})")
    if rate == 0:
        return np.zeros(0)
    shape, scale = 1.0 / cv**2, cv**2 / rate
    chunks, end, expect = [], 0.0, int(rate * duration * 1.2) + 16
    while end < duration:
        times = end + np.cumsum(rng.gamma(shape, scale, size=expect))
        chunks.append(times)
        end = float(times[-1])
    times = np.concatenate(chunks)
    return times[times < duration]


def power_law_split(total_rate: float, models: int, exponent: float) -> np.ndarray:
    """Per-model rates summing to `total_rate`, the i-th (from 1) proportional to i^-exponent
    (exponent 0 splits evenly)."""
    weights = np.arange(1, models + 1, dtype=np.float64) ** -exponent
    return total_rate * weights / weights.sum()


def synthetic(models: Sequence[str], rates: Sequence[float], cvs: float | Sequence[float],
              duration: float, seed: int = 0) -> Workload:
    """Independent Gamma arrivals per model (rates in req/s), merged in time order."""
    if len(models) != len(rates):
        raise PlacementSpecError(f"{len(models)} models but {len(rates)} rates")
    cvs = [float(cvs)] * len(models) if np.isscalar(cvs) else list(cvs)
    rng = np.random.default_rng(seed)
    times = [gamma_arrivals(float(r), float(c), duration, rng) for r, c in zip(rates, cvs)]
    ids = [np.full(t.size, m, dtype=np.int64) for m, t in enumerate(times)]
    return _merged(tuple(models), np.concatenate(times) if times else np.zeros(0),
                   np.concatenate(ids) if ids else np.zeros(0, np.int64), duration)


def _merged(models: tuple[str, ...], arrivals: np.ndarray, ids: np.ndarray, duration: float
            ) -> Workload:
    order = np.argsort(arrivals, kind="stable")
    return Workload(models, arrivals[order].astype(np.float64), ids[order].astype(np.int64),
                    float(duration))


def gamma_workload(models: Sequence[str], total_rate: float, cv: float, duration: float,
                   power_law: float = 0.0, seed: int = 0) -> Workload:
    """The paper's synthetic workload: `total_rate` split across models by a power law, each
    model's requests a Gamma process of the same CV."""
    return synthetic(models, power_law_split(total_rate, len(models), power_law), cv,
                     duration, seed)


def load_trace(path: str | Path, models: Sequence[str] | None = None) -> Workload:
    """A CSV trace with a header `model,arrival_s` and one request per line. `models` fixes
    the model order (and rejects unknown names); otherwise models are ordered by first use."""
    path = Path(path)
    if not path.is_file():
        raise PlacementSpecError(f"trace {path}: no such file (a CSV with columns "
                                 f"model,arrival_s)")
    names = list(models) if models is not None else []
    arrivals, ids = [], []
    with path.open(newline="") as f:
        rows = csv.reader(f)
        header = next(rows, None)
        if header is None or [h.strip() for h in header[:2]] != ["model", "arrival_s"]:
            raise PlacementSpecError(f"{path}:1: the header must be 'model,arrival_s' "
                                     f"(got {','.join(header or [])!r})")
        for line, row in enumerate(rows, start=2):
            if not row or not "".join(row).strip():
                continue
            if len(row) != 2:
                raise PlacementSpecError(f"{path}:{line}: expected 'model,arrival_s', got "
                                         f"{','.join(row)!r}")
            name, when = row[0].strip(), row[1].strip()
            try:
                t = float(when)
            except ValueError:
                t = float("nan")
            if not np.isfinite(t) or t < 0:
                raise PlacementSpecError(f"{path}:{line}: arrival_s {when!r} is not a "
                                         f"non-negative number of seconds")
            if name not in names:
                if models is not None:
                    raise PlacementSpecError(f"{path}:{line}: unknown model {name!r} (the "
                                             f"placement serves {', '.join(models)})")
                names.append(name)
            arrivals.append(t)
            ids.append(names.index(name))
    if not arrivals:
        raise PlacementSpecError(f"{path}: the trace has no requests")
    times = np.array(arrivals)
    return _merged(tuple(names), times, np.array(ids, dtype=np.int64),
                   float(times.max()) + 1e-9)


def save_trace(workload: Workload, path: str | Path) -> None:
    """Write `workload` as a CSV trace that `load_trace` reads back."""
    with Path(path).open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["model", "arrival_s"])
        for t, m in zip(workload.arrivals, workload.model_ids):
            out.writerow([workload.models[m], repr(float(t))])
