"""Certificate benchmark: how close correct plans come to the rounding bound, and how far past it
a planted bug lands, per model.

    python tools/bench/certificate.py                  # the default set, writes certificate.json
    python tools/bench/certificate.py --cases gpt:tiny --steps 1 --out results.json

Each case is auto-sharded on a 2x2 mesh for its training step (Adam) and checked against eager
PyTorch in float64 for `--steps` steps, in this process (`Compiled.check`): `clean` is the
largest share of its rounding bound any element uses (counted: at most 1 passes). Then the same
plan runs with every collective's result 1e-4 of its value too large, and `planted` is that
share again, with where the check found the plan first differs. Times are measured wall-clock
seconds of the check (reference and run).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import graphpar
import graphpar.runtime.spmd as spmd
from graphpar.capture import Adam
from graphpar.compiler.model_file import load_model_file
from graphpar.ir.spmd_ops import GROUP_OPS
from graphpar.models import get_model

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DEFAULT = ["gpt:tiny", "llama:tiny", "bert:tiny", "hf_opt", "hf_gpt2", "hf_vit"]
PLANT = 1e-4


def case(name: str):
    """(module, inputs, loss, targets) of a bundled model (name:preset) or an example file."""
    if ":" in name:
        model, preset = name.split(":")
        ex = get_model(model, preset, train=True)
        return ex.module, tuple(ex.inputs), ex.loss_fn, tuple(ex.targets)
    spec = load_model_file(EXAMPLES / f"{name}.py", "train")
    return spec.module, spec.inputs, spec.loss_fn, spec.targets


def measure(name: str, steps: int) -> dict:
    module, inputs, loss, targets = case(name)
    compiled = graphpar.compile(module, inputs, mesh="2x2", mode="train", loss_fn=loss,
                                targets=targets, optimizer=Adam(), cluster="cpu", time_limit=10,
                                keep_grads=True)
    start = time.perf_counter()
    clean = compiled.check(steps=steps)
    seconds = time.perf_counter() - start
    outputs = spmd.group_outputs  # what the in-process ranks' collectives compute
    spmd.group_outputs = lambda op, xs, attrs: [t * (1 + PLANT) if t.is_floating_point() else t
                                                for t in outputs(op, xs, attrs)]
    try:
        planted = compiled.check(steps=steps)
    finally:
        spmd.group_outputs = outputs
    return {"case": name, "plan": "2x2 train", "steps": steps,
            "collectives": sum(n.op in GROUP_OPS for n in compiled.spmd.nodes),
            "clean_tolerance_used": clean.tolerance_used,
            "clean_by_kind": {k: e.tolerance_used for k, e in clean.errors.items()},
            "clean_passes": clean.within_tolerance,
            "planted_tolerance_used": planted.tolerance_used,
            "planted_fails": not planted.within_tolerance,
            "planted_first_difference": planted.where,
            "check_seconds": round(seconds, 2)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(DEFAULT))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    args = parser.parse_args(argv)
    header = (f"{'case':<12}{'collectives':>12}{'clean':>9}{'planted':>11}  {'check s':>8}  "
              "first difference (planted)")
    print(header)
    print("-" * len(header))
    rows = []
    for name in args.cases.split(","):
        row = measure(name, args.steps)
        rows.append(row)
        where = (row["planted_first_difference"] or "-").split(":")[0]
        print(f"{name:<12}{row['collectives']:>12}{row['clean_tolerance_used']:>9.3f}"
              f"{row['planted_tolerance_used']:>11.1f}  {row['check_seconds']:>8.1f}  {where}",
              flush=True)
    from graphpar.calibration.calibrate import cpu_model

    result = {"benchmark": "certificate",
              "units": "share of the rounding bound (counted; <= 1 passes), seconds (measured)",
              "planted": f"every collective's result {PLANT:g} of its value too large",
              "machine": {"cpu": cpu_model(), "torch": torch.__version__,
                          "python": sys.version.split()[0]},
              "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
