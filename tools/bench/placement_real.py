"""The placement simulator against a real run on CPU processes (docs/placement.md): two MLPs
served one per process vs as a 2-stage pipeline over both, under one Poisson trace, through
graphpar's worker group; measured (wall clock) against simulated mean latency and SLO
attainment. Times are wall clock on this machine: on a shared machine they are noisy.

    python tools/bench/placement_real.py --rate 12 --duration 30
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from graphpar.placement.real_check import real_check


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=12.0, help="total req/s")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of trace")
    parser.add_argument("--slo-scale", type=float, default=5.0)
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    args = parser.parse_args()
    r = real_check(args.rate, args.duration, args.slo_scale)
    print(f"{r['requests']} requests at {args.rate} req/s over {args.duration} s; service "
          f"(measured, median): " + ", ".join(f"{m} {t * 1e3:.1f} ms"
                                              for m, t in r["service_s"]["whole"].items()))
    print(f"  {'placement':10s} {'measured mean':>14s} {'simulated mean':>15s} {'error':>7s} "
          f"{'measured SLO':>13s} {'simulated SLO':>14s}")
    for mode in ("simple", "pipeline"):
        m = r[mode]
        err = m["simulated_mean_s"] / m["measured_mean_s"] - 1
        print(f"  {mode:10s} {m['measured_mean_s'] * 1e3:11.1f} ms "
              f"{m['simulated_mean_s'] * 1e3:12.1f} ms {err * 100:+6.1f}% "
              f"{m['measured_attainment'] * 100:12.1f}% {m['simulated_attainment'] * 100:13.1f}%")
    Path(args.out).write_text(json.dumps(r, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
