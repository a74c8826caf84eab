"""Request workloads for the placement simulator: Poisson and Gamma arrivals, power-law rate
splits across models, and CSV traces of (model, arrival_s). Plain numpy, deterministic seeds."""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from graphpar.datafile import read_text, shown
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
        lo, hi = np.searchsorted(self.arrivals, (start, end), side="left")  # sorted: a slice
        return Workload(self.models, self.arrivals[lo:hi], self.model_ids[lo:hi],
                        self.duration)


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


MAX_TRACE_REQUESTS = 2_000_000  # as many as a generated workload may have (spec.MAX_REQUESTS)


def load_trace(path: str | Path, models: Sequence[str] | None = None,
               max_requests: int = MAX_TRACE_REQUESTS) -> Workload:
    """A UTF-8 CSV trace with a header `model,arrival_s` and one request per line, at most
    `max_requests`. `models` fixes the model order (and rejects unknown names); otherwise
    models are ordered by first use."""
    path = Path(path)
    if not path.is_file():
        raise PlacementSpecError(f"trace {path}: no such file (a CSV with columns "
                                 f"model,arrival_s)")
    text = read_text(path, PlacementSpecError, "trace CSV",
                     max_bytes=64 * (max_requests + 1))
    try:
        return _parse_trace(path, text, models, max_requests)
    except csv.Error as exc:
        raise PlacementSpecError(f"{path}: not a CSV trace: {shown(str(exc), 120)}") from None


def _parse_trace(path: Path, text: str, models: Sequence[str] | None, max_requests: int
                 ) -> Workload:
    names = list(models) if models is not None else []
    arrivals, ids = [], []
    rows = csv.reader(io.StringIO(text, newline=""))
    header = next(rows, None)
    if header is None or [h.strip() for h in header[:2]] != ["model", "arrival_s"]:
        raise PlacementSpecError(f"{path}:1: the header must be 'model,arrival_s' "
                                 f"(got {shown(','.join(header or []))})")
    for line, row in enumerate(rows, start=2):
        if not row or not "".join(row).strip():
            continue
        if len(row) != 2:
            raise PlacementSpecError(f"{path}:{line}: expected 'model,arrival_s', got "
                                     f"{shown(','.join(row))}")
        name, when = row[0].strip(), row[1].strip()
        try:
            t = float(when)
        except ValueError:
            t = float("nan")
        if not np.isfinite(t) or t < 0:
            raise PlacementSpecError(f"{path}:{line}: arrival_s {shown(when)} is not a "
                                     f"non-negative number of seconds")
        if name not in names:
            if models is not None:
                raise PlacementSpecError(f"{path}:{line}: unknown model {shown(name)} (the "
                                         f"placement serves {', '.join(models)})")
            names.append(name)
        if len(arrivals) == max_requests:
            raise PlacementSpecError(f"{path}:{line}: more than {max_requests:,} requests, "
                                     "more than the simulator replays per placement; give "
                                     "a shorter trace")
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


@dataclass(frozen=True)
class WindowFit:
    """Per window (rows) and model (columns): the Gamma process fitted to its arrivals —
    rate (req/s) and CV of inter-arrival times (1.0 where fewer than 3 requests)."""

    window: float
    rates: np.ndarray  # [W, M]
    cvs: np.ndarray  # [W, M]


def fit_windows(workload: Workload, window: float) -> WindowFit:
    """Fit a Gamma process per window and model, as the paper does with real traces."""
    count = max(1, int(np.ceil(workload.duration / window)))
    rates = np.zeros((count, len(workload.models)))
    cvs = np.ones((count, len(workload.models)))
    for w in range(count):
        part = workload.window(w * window, (w + 1) * window)
        if not len(part):
            continue
        for m in range(len(workload.models)):
            times = part.arrivals[part.model_ids == m]
            rates[w, m] = times.size / window
            if times.size >= 3:
                gaps = np.diff(times)
                cvs[w, m] = max(float(gaps.std() / gaps.mean()), 1e-3) if gaps.mean() else 1.0
    return WindowFit(window, rates, cvs)


def resample(fit: WindowFit, models: Sequence[str], rate_scale: float = 1.0,
             cv_scale: float = 1.0, seed: int = 0) -> Workload:
    """A new workload from per-window Gamma fits, rates and CVs scaled (the paper's way of
    sweeping a real trace's rate and burstiness)."""
    rng = np.random.default_rng(seed)
    times, ids = [], []
    for w in range(fit.rates.shape[0]):
        for m in range(fit.rates.shape[1]):
            t = gamma_arrivals(fit.rates[w, m] * rate_scale, fit.cvs[w, m] * cv_scale,
                               fit.window, rng)
            times.append(t + w * fit.window)
            ids.append(np.full(t.size, m, dtype=np.int64))
    return _merged(tuple(models), np.concatenate(times), np.concatenate(ids),
                   fit.rates.shape[0] * fit.window)


def maf_like(kind: str, models: Sequence[str], total_rate: float, duration: float,
             window: float = 60.0, seed: int = 0) -> Workload:
    """Synthetic stand-ins for the paper's Azure Functions traces, per window a Gamma process
    per model. "maf1" (2019: steady, dense): rates split evenly, drifting ±20 % between
    windows, CV 1. "maf2" (2021: bursty, skewed): rates split by a power law of exponent 1.5,
    varying 4× between windows (log-normal), CV log-normal around 4. The shapes follow the
    paper's description; the parameters are this module's assumptions, not fitted to the
    traces, which are not bundled."""
    if kind not in ("maf1", "maf2"):
        raise PlacementSpecError(f"trace kind {kind!r}: use maf1 or maf2")
    rng = np.random.default_rng(seed)
    count = max(1, int(np.ceil(duration / window)))
    base = power_law_split(total_rate, len(models), 0.0 if kind == "maf1" else 1.5)
    if kind == "maf1":
        rates = base * rng.uniform(0.8, 1.2, size=(count, len(models)))
        cvs = np.ones((count, len(models)))
    else:
        rates = base * rng.lognormal(0.0, np.log(4.0) / 2, size=(count, len(models)))
        cvs = rng.lognormal(np.log(4.0), 0.5, size=(count, len(models)))
    return resample(WindowFit(window, rates, cvs), models, seed=seed + 1)
