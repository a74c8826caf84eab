"""`graphpar calibrate [--ranks N] [--out FILE]`: measure this machine into a cluster file."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from graphpar.cli.common import ProgressBar, atomic_output, check_output_file
from graphpar.errors import UsageError


def add_calibrate_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="measure this machine (ops per class, collectives over "
                                         "N ranks) and write a cluster file")
    p.add_argument("--ranks", type=int, default=2,
                   help="processes the collectives run on (default 2; at least 2)")
    p.add_argument("--out", default="cluster.json",
                   help="the cluster file to write (default cluster.json); the measurements go "
                        "beside it, to <name>.timings.json")
    p.add_argument("--base", default=None,
                   help="the preset that gives what is not measured (memory, inter-node links): "
                        "cpu (default), or dgx-h100 etc. on GPUs")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="measure the CPU (gloo) or the GPUs (NCCL); default: cuda when one is "
                        "present")
    p.add_argument("--quick", action="store_true",
                   help="fewer shapes, sizes and repeats (a rough fit in a fraction of the time)")
    p.add_argument("--loop-only", action="store_true",
                   help="fit the ops timed alone only: skip the calibration programs that "
                        "measure how much slower they run inside a step (CPU ranks)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(fn=cmd_calibrate)


RANKS_PER_CORE = 4  # CPU ranks beyond this many per core measure contention, not the machine
RANK_BYTES = 0.5 * 2**30  # what one rank process (torch, gloo, its tensors) holds, estimated


def check_cpu_ranks(ranks: int) -> None:
    """Refuse, before any process starts, more CPU ranks than this machine's cores and memory
    can hold: `RANKS_PER_CORE` per core, `RANK_BYTES` each."""
    cores = os.cpu_count() or 1
    if ranks > cores * RANKS_PER_CORE:
        raise UsageError(f"--ranks {ranks}: more than {RANKS_PER_CORE} CPU ranks per core on "
                         f"this machine's {cores} cores; give --ranks {cores * RANKS_PER_CORE} "
                         "or fewer")
    from graphpar.cost.cluster import host_memory_available

    free = host_memory_available()
    if free is not None and ranks * RANK_BYTES > free:
        raise UsageError(f"--ranks {ranks}: about {ranks * RANK_BYTES / 2**30:.1f} GiB for "
                         f"{ranks} rank processes (estimated, {RANK_BYTES / 2**30:.1f} GiB "
                         f"each), more than the {free / 2**30:.1f} GiB free here; give "
                         f"--ranks {max(2, int(free // RANK_BYTES))} or fewer")


def cmd_calibrate(args: argparse.Namespace) -> int:
    import torch

    from graphpar.calibration.calibrate import calibrate, planned_measurements, report, timings
    from graphpar.calibration.measure import contention_note
    from graphpar.cost.cluster import PRESETS

    if args.ranks < 2:
        raise UsageError(f"--ranks {args.ranks}: collectives need at least 2 ranks; give "
                         "--ranks 2 or more")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        check_cpu_ranks(args.ranks)
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA GPU is visible to torch here; use --device cpu")
    if device == "cuda" and args.ranks > torch.cuda.device_count():
        raise UsageError(f"--ranks {args.ranks}: NCCL needs one GPU per rank and torch sees "
                         f"{torch.cuda.device_count()}; give --ranks "
                         f"{max(2, torch.cuda.device_count())} or fewer, or --device cpu")
    base = args.base or ("cpu" if device == "cpu" else "dgx-h100")
    if base not in PRESETS:
        raise UsageError(f"--base {base!r}: not a preset; presets: {', '.join(PRESETS)}")
    out = Path(args.out)
    check_output_file(out, "--out")
    note = contention_note(args.ranks) if device == "cpu" else None
    if note:
        print(f"graphpar: warning: {note}", file=sys.stderr)

    in_step = not args.loop_only and device == "cpu"
    bar = ProgressBar(planned_measurements(args.quick, in_step), "calibrating",
                      enabled=not args.quiet)
    try:
        cal = calibrate(args.ranks, base=base, quick=args.quick, device=device,
                        in_step=not args.loop_only, progress=bar.advance)
    finally:
        bar.close()
    print(report(cal))
    timing_file = out.with_name(out.stem + ".timings.json")
    with atomic_output(timing_file, "--out") as f:
        f.write(json.dumps(timings(cal), indent=2) + "\n")
    with atomic_output(out, "--out") as f:
        f.write(json.dumps(cal.cluster.to_dict(), indent=2) + "\n")
    print(f"wrote {out} (cluster file: --cluster {out}) and {timing_file} (measured in "
          f"{cal.seconds:.0f} s: ops {cal.compute_seconds:.0f} s, collectives "
          f"{cal.seconds - cal.compute_seconds - cal.in_step_seconds:.0f} s, in step "
          f"{cal.in_step_seconds:.0f} s; {os.cpu_count()} CPUs, load average "
          f"{cal.load_average:.1f} at the start)")
    return 0
