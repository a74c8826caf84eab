"""Fit TeraPipe's latency model (Eq. 2.9) to a stage measured on this CPU, and report the fit's
error on held-back points.

A stage here is `--layers` GPT blocks (pre-norm attention + 4h MLP, fp32, one thread). For a
slice of l tokens after c tokens of context, one forward and backward of the stage is timed
with the context's keys and values given (as a token-pipelined stage holds them, gradients
flowing into them). `graphpar.passes.pipeline.token_slicing.fit` then takes t(l, 0) from the
points without context and fits t_ctx(l, c) = a0 + a1 l + a2 c + a3 l c by least squares on
all but a random quarter of the points with context; the error is the mean relative error on
that quarter (the paper reports < 2 % on GPUs).

    python tools/bench/token_latency_fit.py            # table; writes token_latency_fit.json
    python tools/bench/token_latency_fit.py --quick    # fewer points (CI size)

Every time here is measured (median of `--repeats` calls after a warm-up, wall clock).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from graphpar.passes.pipeline.token_slicing import fit
from graphpar.runtime.timing import median_seconds


class Block(nn.Module):
    """A GPT block whose attention reads `past` keys and values before the slice's own."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x, past_k, past_v):
        b, length, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(h, dim=-1)
        split = lambda t: t.view(b, -1, self.heads, h // self.heads).transpose(1, 2)  # noqa: E731
        q, k, v = split(q), torch.cat([past_k, split(k)], 2), torch.cat([past_v, split(v)], 2)
        context = past_k.shape[2]
        # token i of the slice sees the context and slice tokens <= i
        mask = torch.ones(length, context + length, dtype=torch.bool).tril(context)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(a.transpose(1, 2).reshape(b, length, h))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


def measure(blocks: nn.ModuleList, hidden: int, heads: int, length: int, context: int,
            repeats: int) -> float:
    """Seconds of one forward + backward of the stage on a slice of `length` tokens after
    `context` (measured)."""
    x = torch.randn(1, length, hidden, requires_grad=True)
    past = [(torch.randn(1, heads, context, hidden // heads, requires_grad=True),
             torch.randn(1, heads, context, hidden // heads, requires_grad=True))
            for _ in blocks]

    def step():
        y = x
        for block, (k, v) in zip(blocks, past):
            y = block(y, k, v)
        y.sum().backward()

    return median_seconds(step, repeats, warmup=2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer points (CI size)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    blocks = nn.ModuleList(Block(args.hidden, args.heads) for _ in range(args.layers))
    lengths = [16, 64, 128] if args.quick else [8, 16, 32, 64, 128, 192, 256]
    contexts = [0, 64, 256] if args.quick else [0, 32, 64, 128, 192, 256]
    start = time.perf_counter()
    points = [(length, context, measure(blocks, args.hidden, args.heads, length, context,
                                        args.repeats))
              for length in lengths for context in contexts
              if length + context <= args.seq_len]
    measure_s = time.perf_counter() - start
    model = fit(points, seq_len=args.seq_len, holdout=0.25, seed=0)
    print(f"{'l':>5} {'c':>5} {'measured ms':>12} {'model ms':>9} {'rel err':>8}")
    rows = []
    for length, context, seconds in points:
        predicted = model(length, context)
        rows.append({"length": length, "context": context, "measured_s": seconds,
                     "model_s": predicted, "relative_error": predicted / seconds - 1})
        print(f"{length:5d} {context:5d} {seconds * 1e3:12.3f} {predicted * 1e3:9.3f} "
              f"{predicted / seconds - 1:+8.1%}")
    a0, a1, a2, a3 = model.ctx
    print(f"t_ctx(l, c) = {a0 * 1e3:.4f} ms + {a1 * 1e6:.3f} us*l + {a2 * 1e6:.3f} us*c + "
          f"{a3 * 1e9:.3f} ns*l*c;  held-back mean relative error {model.fit_error:.1%}")
    result = {
        "benchmark": "token_latency_fit",
        "units": {"measured_s": "s (measured)", "model_s": "s (fitted model)",
                  "coefficients": "a0 s, a1 s/token, a2 s/token, a3 s/token^2"},
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "torch": torch.__version__, "threads": 1},
        "stage": {"hidden": args.hidden, "heads": args.heads, "layers": args.layers,
                  "seq_len": args.seq_len},
        "coefficients": list(model.ctx),
        "held_back_mean_relative_error": model.fit_error,
        "measure_seconds_wall": measure_s,
        "points": rows,
    }
    if not math.isfinite(model.fit_error):
        raise SystemExit("the fit has no held-back points: give more lengths or contexts")
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
