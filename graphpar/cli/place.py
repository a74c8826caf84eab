"""`graphpar place SPEC [--out DIR]`: serving placement for many models (AlpaServe)."""

from __future__ import annotations

import argparse


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
    import dataclasses

    from graphpar.placement.api import place
    from graphpar.placement.spec import read_spec

    spec = read_spec(args.spec)
    if args.no_plots:
        spec = dataclasses.replace(spec, plots=False)
    place(spec, out=args.out, echo=True)
    print(f"wrote {args.out}/placement.json and {args.out}/placement.html")
    return 0
