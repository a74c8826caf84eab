"""The simulator against a real run (issue item 6): two small bundled models (MLPs) served on
two CPU processes started by the worker group, under one Poisson trace, placed either one
model per process ("simple") or as a 2-stage pipeline over both processes holding half of
each model ("pipeline", activations sent over gloo). Each process first measures its service
time per model (median of repeated runs); the simulator gets those times and the same trace.
Latencies are wall-clock on this machine; on a shared machine they are noisy."""

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
from graphpar.runtime.timing import median_seconds

MODELS = ("a", "b")
_HIDDEN, _LAYERS, _ROWS = 1536, 8, 32  # tens of ms per request on one CPU thread


def _model(seed: int) -> nn.Sequential:
    from graphpar.models import get_model

    return get_model("mlp", "tiny", seed=seed, in_dim=_HIDDEN, hidden_dim=_HIDDEN,
                     out_dim=_HIDDEN, n_layers=_LAYERS).module.layers


class ServingRank:
    """A worker: holds its part of the models and replays the trace in real time."""

    def __init__(self, jobdir: str, rank: int, world: int) -> None:
        torch.set_num_threads(1)
        self.jobdir, self.rank = Path(jobdir), rank
        self.models = [_model(seed) for seed in range(len(MODELS))]
        half = len(self.models[0]) // 2
        # the pipeline's stage of this rank, of each model
        self.stages = [m[:half] if rank == 0 else m[half:] for m in self.models]
        self.x = torch.randn(_ROWS, _HIDDEN)

    @torch.no_grad()
    def calibrate(self) -> None:
        times = {"whole": [median_seconds(lambda m=m: m(self.x), 15) for m in self.models],
                 "stage": [median_seconds(lambda s=s: s(self.x), 15) for s in self.stages]}
        (self.jobdir / f"service{self.rank}.json").write_text(json.dumps(times))

    @torch.no_grad()
    def serve(self, mode: str, trace: str, start_at: float) -> None:
        w = load_trace(trace, MODELS)
        finish = np.full(len(w), np.nan)
        wait = lambda t: time.sleep(max(0.0, start_at + t - time.time()))  # noqa: E731
        if mode == "simple":
            for i in np.flatnonzero(w.model_ids == self.rank):
                wait(w.arrivals[i])
                self.models[self.rank](self.x)
                finish[i] = time.time() - start_at
        elif self.rank == 0:
            for i in range(len(w)):
                wait(w.arrivals[i])
                dist.send(self.stages[w.model_ids[i]](self.x).contiguous(), 1)
        else:
            buf = torch.empty(_ROWS, _HIDDEN)
            for i in range(len(w)):
                dist.recv(buf, 0)
                self.stages[w.model_ids[i]](buf)
                finish[i] = time.time() - start_at
        np.save(self.jobdir / f"finish_{mode}{self.rank}.npy", finish)


def factory(jobdir: str, rank: int, world: int) -> ServingRank:
    return ServingRank(jobdir, rank, world)


def real_check(rate: float = 10.0, duration: float = 30.0, slo_scale: float = 5.0,
               seed: int = 0, warmup: float = 2.0) -> dict:
    """Measured and simulated mean latency (s) and SLO attainment of both placements."""
    from graphpar.runtime.workers import WorkerGroup

    w = gamma_workload(MODELS, rate, 1.0, duration, seed=seed)
    out: dict = {"requests": len(w), "rate": rate, "duration_s": duration}
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp)
        save_trace(w, job / "trace.csv")
        group = WorkerGroup(2, "graphpar.placement.real_check:factory", job, name="serving")
        group.start()
        try:
            group.wait_started()
            group.wait(group.send("calibrate"))
            service = [json.loads((job / f"service{r}.json").read_text()) for r in (0, 1)]
            for mode in ("simple", "pipeline"):
                group.timeout = duration + 60.0
                group.wait(group.send("serve", mode, str(job / "trace.csv"), time.time() + 1.0))
                parts = [np.load(job / f"finish_{mode}{r}.npy") for r in (0, 1)]
                out[mode] = {"finish": np.fmax(parts[0], parts[1])}
        finally:
            group.stop()
    whole = {m: service[r]["whole"][r] for r, m in enumerate(MODELS)}
    stage = {m: (service[0]["stage"][k], service[1]["stage"][k]) for k, m in enumerate(MODELS)}
    slo = {m: slo_scale * whole[m] for m in MODELS}
    sims = {"simple": [SimGroup({m: [whole[m]]}) for m in MODELS],
            "pipeline": [SimGroup({m: list(stage[m]) for m in MODELS})]}
    counted = w.arrivals >= warmup
    for mode, groups in sims.items():
        sim = simulate(groups, w, warmup=warmup)  # no rejection: compare latencies as served
        measured = out[mode].pop("finish") - w.arrivals
        out[mode] |= {
            "measured_mean_s": float(measured[counted].mean()),
            "simulated_mean_s": sim.mean_latency,
            "measured_attainment": _attainment(measured, w, slo, counted),
            "simulated_attainment": _attainment(sim.latency, w, slo, counted)}
    out["service_s"] = {"whole": whole, "stages": stage}
    return out


def _attainment(latency: np.ndarray, w: Workload, slo: dict, counted: np.ndarray) -> float:
    limit = np.array([slo[m] for m in w.models])[w.model_ids]
    return float((latency[counted] <= limit[counted]).mean())
