"""What a training run shows: a progress line, one JSON line per step, a loss curve at the end.

Every number says what it is: `loss` is the step's loss (before its update), `seconds` the
step's wall time on rank 0 (measured, clock), `tokens_per_second` the first input's elements
per measured second, `estimated_seconds` the plan's step time on the cost model's cluster
(estimated).
"""

from __future__ import annotations

import html
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import IO, Any

from graphpar.training.plan import TrainPlan


class Reporter:
    """Shows and logs the steps of one run (rank 0's records), then sums it up."""

    def __init__(self, plan: TrainPlan, options: Any, first_step: int = 0) -> None:
        self.plan, self.options = plan, options
        self.first_step, self.last_step = first_step, options.steps
        self.records: list[dict] = []
        self.log: IO[str] | None = None
        if options.log is not None:
            options.log.parent.mkdir(parents=True, exist_ok=True)
            # a resumed run continues its log; a fresh one starts it anew
            self.log = open(options.log, "a" if options.resume else "w",  # noqa: SIM115
                            encoding="utf-8")
        self.live = options.progress and sys.stderr.isatty()

    def record(self, record: dict) -> None:
        """One finished step (numbered 1..N after its update)."""
        self.records.append(record)
        if self.log is not None:
            self.log.write(json.dumps(record) + "\n")
            self.log.flush()
        if self.options.progress:
            self.show(record)

    def show(self, r: dict) -> None:
        done = r["step"] - self.first_step
        left = self.last_step - r["step"]
        recent = [x["seconds"] for x in self.records[-20:]]
        eta = left * statistics.median(recent)
        width = 24
        filled = int(width * r["step"] / max(self.last_step, 1))
        line = (f"[{'#' * filled}{'.' * (width - filled)}] step {r['step']}/{self.last_step}  "
                f"loss {r['loss']:.4f}  {r['tokens_per_second']:,.0f} tokens/s  "
                f"ETA {_clock(eta)}")
        if self.live:
            print("\r" + line, end="\n" if left == 0 else "", file=sys.stderr, flush=True)
        elif done == 1 or left == 0 or done % max(1, (self.last_step - self.first_step) // 10
                                                   ) == 0:
            print(line, file=sys.stderr, flush=True)

    def finish(self) -> dict:
        """Close the log, write the loss curve beside it, and return the run's summary."""
        if self.log is not None:
            self.log.close()
        timed = [r["seconds"] for r in self.records[1:]] or [r["seconds"]
                                                             for r in self.records]
        summary = {
            "model": self.plan.name, "mesh": "x".join(map(str, self.plan.mesh_shape)),
            "optimizer": self.plan.optimizer, "first_step": self.first_step,
            "steps": self.last_step,
            "losses": [r["loss"] for r in self.records],
            "step_seconds_measured": statistics.median(timed) if timed else None,
            "step_seconds_estimated": self.plan.estimated_seconds,
            "estimated_on": self.plan.cluster,
            "pipeline": self.plan.pipeline,
            "device": self.options.device,
            "plan": self.plan.plan_name,
            "shape": self.plan.shape_summary(),
        }
        if self.options.log is not None:
            curve = self.options.log.with_suffix(".html")
            records = read_log(self.options.log)
            write_atomically(curve, loss_curve_html(records, summary))
            summary["loss_curve"] = str(curve)
        return summary


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def write_atomically(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        file.write(text)
    os.replace(tmp, path)


def loss_curve_html(records: list[dict], summary: dict) -> str:
    """A self-contained page: the loss per step as an SVG line, and the measured step time
    beside the plan's estimate."""
    w, h, pad = 640, 320, 40
    points = ""
    if records:
        steps = [r["step"] for r in records]
        losses = [r["loss"] for r in records]
        lo, hi = min(losses), max(losses)
        span, width = (hi - lo) or 1.0, (max(steps) - min(steps)) or 1
        points = " ".join(
            f"{pad + (s - min(steps)) / width * (w - 2 * pad):.1f},"
            f"{h - pad - (v - lo) / span * (h - 2 * pad):.1f}" for s, v in zip(steps, losses))
        axis = (f"<text x='{pad}' y='{pad - 8}'>loss {hi:.4g}</text>"
                f"<text x='{pad}' y='{h - pad + 16}'>loss {lo:.4g} · steps {min(steps)}–"
                f"{max(steps)}</text>")
    else:
        axis = ""
    measured = summary.get("step_seconds_measured")
    timing = (f"step time {measured * 1e3:.2f} ms measured (median, rank 0's clock); "
              f"{summary['step_seconds_estimated'] * 1e3:.3f} ms estimated (cost model, "
              f"cluster {html.escape(str(summary['estimated_on']))})" if measured else "")
    planned = ("pipelined" if summary.get("pipeline")
               else f"plan {html.escape(str(summary.get('plan', 'auto')))}")
    return (f"<!doctype html><meta charset='utf-8'><title>{html.escape(summary['model'])} "
            f"loss</title><h1>{html.escape(summary['model'])} on mesh {summary['mesh']}, "
            f"{planned}</h1>"
            f"<svg width='{w}' height='{h}' style='border:1px solid #ccc'>{axis}"
            f"<polyline fill='none' stroke='#1f77b4' stroke-width='2' points='{points}'/>"
            f"</svg><p>{timing}</p>\n")
