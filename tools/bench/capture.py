"""Capture benchmark: per model and size, capture time, op count, IR print and parse time.

    python tools/bench/capture.py                 # the default set, writes capture.json here
    python tools/bench/capture.py --models gpt:350M --modes infer,train --out results.json

Weights are left uninitialized (capture needs shapes, not values), so building a large preset
costs no time. Times are measured wall-clock seconds on this machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from graphpar.capture import capture_inference, capture_training
from graphpar.ir.parser import parse_program
from graphpar.ir.printer import print_graph
from graphpar.models import example_batch, get_model

DEFAULT = ["mlp:tiny", "gpt:tiny", "gpt:125M", "gpt:350M", "llama:tiny", "bert:base",
           "moe:tiny", "wide_resnet:tiny"]


def measure(model: str, mode: str, batch_size: int) -> dict:
    name, _, preset = model.partition(":")
    ex = get_model(name, preset or "tiny", device="meta", train=(mode == "train"))
    # Uninitialized CPU storage: real tensors for autograd, without paying for random init.
    module = ex.module.to_empty(device="cpu")
    inputs, targets = example_batch(name, ex.config, batch_size)
    start = time.perf_counter()
    if mode == "infer":
        captured = capture_inference(module, inputs, name=name)
    else:
        captured = capture_training(module, inputs, ex.loss_fn, targets, name=name)
    capture_s = time.perf_counter() - start
    start = time.perf_counter()
    text = print_graph(captured.graph, show_source=True)
    print_s = time.perf_counter() - start
    start = time.perf_counter()
    parsed = parse_program(text)
    parse_s = time.perf_counter() - start
    assert next(iter(parsed)) == captured.graph, "round trip changed the graph"
    layers = getattr(ex.config, "n_layers", None)
    return {"model": model, "mode": mode, "layers": layers, "batch": batch_size,
            "nodes": len(captured.graph), "ir_kib": round(len(text) / 1024, 1),
            "capture_s": round(capture_s, 3), "print_s": round(print_s, 3),
            "parse_s": round(parse_s, 3)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(DEFAULT))
    parser.add_argument("--modes", default="infer,train")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    args = parser.parse_args(argv)
    rows = []
    header = (f"{'model':<18}{'mode':<7}{'layers':>7}{'nodes':>8}{'IR KiB':>9}"
              f"{'capture s':>11}{'print s':>9}{'parse s':>9}")
    print(header)
    print("-" * len(header))
    for model in args.models.split(","):
        for mode in args.modes.split(","):
            row = measure(model, mode, args.batch)
            rows.append(row)
            print(f"{row['model']:<18}{row['mode']:<7}{row['layers'] or '-':>7}{row['nodes']:>8}"
                  f"{row['ir_kib']:>9}{row['capture_s']:>11.2f}{row['print_s']:>9.3f}"
                  f"{row['parse_s']:>9.3f}", flush=True)
    result = {"benchmark": "capture", "units": "seconds (measured wall clock)",
              "machine": {"cpu_count": torch.get_num_threads(), "python": sys.version.split()[0],
                          "torch": torch.__version__, "platform": platform.platform()},
              "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
