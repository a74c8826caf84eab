"""Pipeline schedule benchmark: bubbles, memory, Alpa's Eq. 2 against the simulator, and the
cost of generating and validating the lists.

    python tools/bench/schedules.py            # writes schedules.json here
    python tools/bench/schedules.py --quick    # CI size

Three tables, all from `graphpar.ir.schedule`:

1. For GPipe, 1F1B and ZB-H1 on p stages and m microbatches with uniform stages (F = 1,
   B = 2, and for ZB-H1 I = W = 1; no transfer time): the simulated step and bubble fraction
   against (p-1)/(m+p-1), and the most microbatches a stage holds.
2. Alpa's Eq. 2, sum(t) + (m-1) max(t), against the simulated GPipe and 1F1B steps on random
   plans (B = 2F per stage, no transfer time): the ratio simulated / Eq. 2, for balanced
   stages (times within 4x of each other) and unbalanced ones (within 40x).
3. Measured CPU time (time.process_time) to generate and validate each schedule, and to
   simulate it, at the largest size.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

from graphpar.cost.timeline import simulate
from graphpar.ir.schedule import peak_in_flight, validate
from graphpar.passes.pipeline.schedules import SCHEDULES


def bubble_rows(sizes: list[tuple[int, int]]) -> list[dict]:
    rows = []
    for stages, microbatches in sizes:
        for name, generate in SCHEDULES.items():
            schedule = generate(stages, microbatches)
            timeline = simulate(schedule, 1.0, 2.0, 0.0, weight_grad_s=1.0)
            peaks = peak_in_flight(schedule)
            rows.append(
                {
                    "schedule": name,
                    "stages": stages,
                    "microbatches": microbatches,
                    "step_units": timeline.step_seconds,
                    "bubble_fraction": timeline.bubble_fraction,
                    "formula_p_minus_1_over_m_plus_p_minus_1": (stages - 1)
                    / (microbatches + stages - 1),
                    "peak_microbatches_first_stage": peaks[0],
                    "peak_microbatches_last_stage": peaks[stages - 1],
                }
            )
    return rows


def eq2_rows(plans: int, seed: int) -> list[dict]:
    rows = []
    for spread_name, (low, high) in {
        "balanced (4x)": (0.5, 2.0),
        "unbalanced (40x)": (0.1, 4.0),
    }.items():
        rng = random.Random(seed)
        ratios: dict[str, list[float]] = {"gpipe": [], "1f1b": []}
        for _ in range(plans):
            stages = rng.randint(2, 6)
            microbatches = rng.randint(stages, 3 * stages)
            times = [rng.uniform(low, high) for _ in range(stages)]
            forward, backward = [t / 3 for t in times], [2 * t / 3 for t in times]
            eq2 = sum(times) + (microbatches - 1) * max(times)
            for name, found in ratios.items():
                schedule = SCHEDULES[name](stages, microbatches)
                found.append(simulate(schedule, forward, backward, 0.0).step_seconds / eq2)
        for name, found in ratios.items():
            rows.append(
                {
                    "stage_times": spread_name,
                    "schedule": name,
                    "plans": plans,
                    "min_ratio": min(found),
                    "mean_ratio": sum(found) / len(found),
                    "max_ratio": max(found),
                }
            )
    return rows


def timing_rows(stages: int, microbatches: int) -> list[dict]:
    rows = []
    for name, generate in SCHEDULES.items():
        start = time.process_time()
        schedule = generate(stages, microbatches)
        validate(schedule)
        generated = time.process_time() - start
        start = time.process_time()
        simulate(schedule, 1.0, 2.0, 0.1)
        simulated = time.process_time() - start
        rows.append(
            {
                "schedule": name,
                "stages": stages,
                "microbatches": microbatches,
                "actions": sum(len(order) for order in schedule.values()),
                "generate_and_validate_cpu_s": generated,
                "simulate_cpu_s": simulated,
            }
        )
    return rows


def print_table(title: str, rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    print(f"\n{title}")
    print("  ".join(f"{header:>{len(header)}}" for header, _, _ in columns))
    for row in rows:
        cells = []
        for header, key, fmt in columns:
            cells.append(f"{format(row[key], fmt):>{len(header)}}")
        print("  ".join(cells))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI size: small pipelines")
    parser.add_argument("--plans", type=int, default=400, help="random plans for Eq. 2")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    args = parser.parse_args(argv)

    depths = [2, 4] if args.quick else [2, 4, 8]
    sizes = [(p, m) for p in depths for m in (p, 2 * p, 4 * p, 8 * p)]
    plans = 20 if args.quick else args.plans
    largest = (4, 16) if args.quick else (8, 64)

    bubbles = bubble_rows(sizes)
    print_table(
        "Uniform stages (F=1, B=2; ZB-H1: I=W=1), simulated, no transfer time",
        bubbles,
        [
            ("schedule", "schedule", ""),
            ("p", "stages", "d"),
            (" m", "microbatches", "d"),
            ("step (units)", "step_units", ".1f"),
            ("bubble", "bubble_fraction", ".3f"),
            ("(p-1)/(m+p-1)", "formula_p_minus_1_over_m_plus_p_minus_1", ".3f"),
            ("held on stage 0", "peak_microbatches_first_stage", "d"),
            ("on last", "peak_microbatches_last_stage", "d"),
        ],
    )
    eq2 = eq2_rows(plans, args.seed)
    print_table(
        "Simulated step / Alpa Eq. 2 on random plans (B = 2F, no transfer time)",
        eq2,
        [
            ("stage times     ", "stage_times", ""),
            ("schedule", "schedule", ""),
            ("plans", "plans", "d"),
            ("min  ", "min_ratio", ".3f"),
            ("mean ", "mean_ratio", ".3f"),
            ("max  ", "max_ratio", ".3f"),
        ],
    )
    timings = timing_rows(*largest)
    print_table(
        f"CPU time at p={largest[0]}, m={largest[1]} (measured, time.process_time)",
        timings,
        [
            ("schedule", "schedule", ""),
            ("actions", "actions", "d"),
            ("generate+validate s", "generate_and_validate_cpu_s", ".4f"),
            ("simulate s", "simulate_cpu_s", ".4f"),
        ],
    )
    result = {
        "machine": {"python": sys.version.split()[0], "platform": platform.platform()},
        "bubbles": bubbles,
        "eq2": eq2,
        "timings": timings,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
