"""`graphpar place SPEC [--out DIR]`: serving placement for many models (AlpaServe)."""

from __future__ import annotations

import argparse

FILES = ("placement.json", "placement.html")  # what place writes into --out, as one output


def add_place_parser(sub) -> None:
    p = sub.add_parser("place", help="place many models on a cluster for a serving workload "
                                     "(AlpaServe), simulated against baselines")
    p.add_argument("spec", help="a SPEC file (.yaml, .yml or .json): cluster, models, "
                                "workload, slo, policies; see docs/placement.md")
    p.add_argument("--out", default="graphpar-place",
                   help="directory for placement.json and placement.html")
    p.add_argument("--no-plots", action="store_true",
                   help="skip the sweeps behind the attainment plots (faster)")
    p.set_defaults(fn=cmd_place)


def cmd_place(args: argparse.Namespace) -> int:
    from graphpar.cli.common import check_output_dir, publish, staged_output
    from graphpar.placement.api import place
    from graphpar.placement.spec import read_spec

    out = check_output_dir(args.out, "--out", FILES)  # before the SPEC's models are priced
    spec = read_spec(args.spec, plots=False if args.no_plots else None)
    with staged_output(out) as staging:
        place(spec, out=staging, echo=True)
        publish(staging, out)
    print(f"wrote {out / FILES[0]} and {out / FILES[1]}")
    return 0
