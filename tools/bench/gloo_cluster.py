"""This machine as a cluster of gloo CPU processes: `graphpar calibrate` writing here.

    python tools/bench/gloo_cluster.py            # = graphpar calibrate --ranks 2 --out <here>
    python tools/bench/gloo_cluster.py --quick    # any other calibrate option passes through
    graphpar compile --example gpt:tiny --mesh 2 --cluster tools/bench/gloo_cluster.json

Writes `gloo_cluster.json` (the cluster file other benches use) and `gloo_cluster.timings.json`
(every measurement and its fit) beside this script. What is measured and how it is fitted:
docs/calibration.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

OUT = Path(__file__).with_name("gloo_cluster.json")


def main(argv: list[str] | None = None) -> int:
    from graphpar.cli.main import main as graphpar

    argv = list(sys.argv[1:] if argv is None else argv)
    defaults = [] if "--ranks" in argv else ["--ranks", "2"]
    defaults += [] if "--out" in argv else ["--out", str(OUT)]
    return graphpar(["calibrate", *defaults, *argv])


if __name__ == "__main__":
    sys.exit(main())
