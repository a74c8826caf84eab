"""Serving benchmark: graphpar's engine against naive Hugging Face-style generation, on the CPU.

Same model, same prompts, same greedy decoding, in one run:

* **engine**: ``graphpar.serving.llm.LLM``: continuous batching (at most ``batch`` sequences
  per step) over paged attention, the model's captured prefill/decode graphs on the CPU executor;
* **naive**: ``graphpar.serving.naive.naive_generate``: the requests in arrival order in static
  batches of ``batch``, left-padded, a contiguous KV cache grown by ``torch.cat``, each batch
  decoded until its longest request is done (what ``model.generate`` does for a batch), the model
  run eagerly in PyTorch.

Workload: Alpaca-like lengths, as in tools/bench/kv_memory.py (log-normal, means 19.31 input and
58.45 output tokens, log-space sigma 0.8; PagedAttention §6), clipped to the model's context;
random prompt tokens; every request arrives at time 0 (offline throughput). Each side runs the
workload once to warm up, then ``--repeat`` times, alternating with the other side; the median
run of each side is reported. Throughput counts generated tokens; latency is
per request, from time 0 to when its output is returned (a static batch returns as one).
Both sides must produce the same tokens (greedy); the table says so.

    python tools/bench/serve.py                         # gpt:tiny, llama:tiny; batch 1, 8, 16
    python tools/bench/serve.py --models gpt:tiny --batch 8 --requests 32 --out r.json
    python tools/bench/serve.py --models gpt:125M --batch 8 --requests 16 --tensor-parallel 2
    python tools/bench/serve.py ... --tensor-parallel 2 --tp-cluster tools/bench/gloo_cluster.json

With ``--tensor-parallel N`` the engine runs on N CPU ranks (gloo processes, each with
``--threads`` torch threads; the naive side keeps one process), system ``engine-tpN``.

Prints a table and writes ``serve.json`` next to this file (or ``--out``). Engine setup
(capture, pass, templates) is timed separately and not part of the throughput.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from graphpar.models import get_model
from graphpar.serving.llm import LLM, SamplingParams
from graphpar.serving.naive import naive_generate

ALPACA = (19.31, 58.45, 0.8)  # mean input, mean output, log-space sigma
CONTEXT = 256  # positions given to the tiny models (their presets have 32)


def workload(requests: int, vocab: int, context: int, seed: int
             ) -> tuple[list[list[int]], list[int]]:
    """Prompts (random token ids) and output lengths, Alpaca-like and clipped to ``context``."""
    rng = np.random.default_rng(seed)
    mean_in, mean_out, sigma = ALPACA
    # A log-normal with mean m has mu = ln m - sigma^2 / 2.
    inputs = rng.lognormal(np.log(mean_in) - sigma**2 / 2, sigma, requests)
    outputs = rng.lognormal(np.log(mean_out) - sigma**2 / 2, sigma, requests)
    prompts, lengths = [], []
    for i, o in zip(inputs, outputs):
        n_in = int(np.clip(round(i), 1, context // 2))
        n_out = int(np.clip(round(o), 1, context - n_in - 1))
        prompts.append(rng.integers(0, vocab, n_in).tolist())
        lengths.append(n_out)
    return prompts, lengths


def _latency_stats(latencies: list[float]) -> dict[str, float]:
    ordered = sorted(latencies)
    return {"latency_mean_s": statistics.fmean(ordered),
            "latency_p50_s": ordered[len(ordered) // 2],
            "latency_p90_s": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]}


def run_engine(llm: LLM, prompts, params) -> tuple[dict, list[list[int]]]:
    stats = llm.engine.stats
    steps, preemptions = stats.steps, stats.preemptions
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outputs]
    generated = sum(len(t) for t in tokens)
    tp = llm.engine.config.tensor_parallel
    row = {"system": "engine" if tp == 1 else f"engine-tp{tp}", "seconds": seconds,
           "generated_tokens": generated,
           "tokens_per_s": generated / seconds, "steps": stats.steps - steps,
           "preemptions": stats.preemptions - preemptions,
           **_latency_stats([o.finish_time - start for o in outputs])}
    return row, tokens


def run_naive(module, prompts, params, batch: int) -> tuple[dict, list[list[int]]]:
    result = naive_generate(module, prompts, params, batch_size=batch)
    row = {"system": "naive", "seconds": result.seconds, "generated_tokens": result.generated,
           "tokens_per_s": result.generated / result.seconds, "steps": result.steps,
           "preemptions": 0, **_latency_stats(result.finish_times)}
    return row, result.tokens


def measure(module, prompts, params, batch: int, repeat: int, tp: int = 1,
            tp_cluster: str = "cpu") -> tuple[dict, list[list[int]], dict, list[list[int]]]:
    """Warm up both sides once, then run them alternately ``repeat`` times; keep each side's
    median run (by seconds), so load from other processes hits both alike."""
    start = time.perf_counter()
    with LLM(module, max_num_seqs=batch, tensor_parallel=tp, tp_cluster=tp_cluster) as llm:
        setup = time.perf_counter() - start
        run_engine(llm, prompts, params)  # warm-up: builds the step programs of every bucket
        run_naive(module, prompts, params, batch)
        engine_runs, naive_runs = [], []
        for _ in range(repeat):
            engine_runs.append(run_engine(llm, prompts, params))
            naive_runs.append(run_naive(module, prompts, params, batch))
    engine = sorted(engine_runs, key=lambda r: r[0]["seconds"])[len(engine_runs) // 2]
    naive = sorted(naive_runs, key=lambda r: r[0]["seconds"])[len(naive_runs) // 2]
    engine[0]["setup_s"] = setup
    naive[0]["setup_s"] = 0.0
    return engine[0], engine[1], naive[0], naive[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt:tiny,llama:tiny",
                        help="bundled models, NAME:PRESET, comma-separated")
    parser.add_argument("--batch", default="1,8,16", help="max sequences per step, comma list")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=3,
                        help="measured runs per side (alternating); the median is reported")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1: steady numbers on a shared machine)")
    parser.add_argument("--tensor-parallel", type=int, default=1,
                        help="CPU ranks the engine shards the model over")
    parser.add_argument("--tp-cluster", default="cpu",
                        help="cluster preset or file the tensor-parallel plan is costed on")
    parser.add_argument("--out", default=str(Path(__file__).with_name("serve.json")))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    batches = [int(b) for b in args.batch.split(",")]
    rows = []
    header = (f"{'model':<11} {'batch':>5} {'system':<7} {'tok/s':>9} {'seconds':>8} "
              f"{'steps':>6} {'lat mean s':>10} {'lat p90 s':>9} {'speedup':>8} {'same':>5}")
    print(header)
    print("-" * len(header))
    for spec in args.models.split(","):
        name, _, preset = spec.partition(":")
        example = get_model(name, preset or "tiny", seq_len=CONTEXT)
        module = example.module
        prompts, lengths = workload(args.requests, example.config.vocab_size, CONTEXT,
                                    args.seed)
        params = [SamplingParams(max_tokens=n) for n in lengths]
        for batch in batches:
            engine, engine_tokens, naive, naive_tokens = measure(module, prompts, params,
                                                                 batch, args.repeat,
                                                                 args.tensor_parallel,
                                                                 args.tp_cluster)
            same = engine_tokens == naive_tokens
            speedup = engine["tokens_per_s"] / naive["tokens_per_s"]
            for row in (naive, engine):
                row.update(model=spec, batch=batch, requests=args.requests,
                           same_tokens=same, speedup=speedup if row is engine else 1.0)
                rows.append(row)
                print(f"{spec:<11} {batch:>5} {row['system']:<7} {row['tokens_per_s']:>9.0f} "
                      f"{row['seconds']:>8.3f} {row['steps']:>6} {row['latency_mean_s']:>10.3f} "
                      f"{row['latency_p90_s']:>9.3f} {row['speedup']:>7.2f}x "
                      f"{'yes' if same else 'NO':>5}")
    print("tok/s: generated tokens per second (measured, CPU); latency: seconds from arrival "
          "(all at t=0) to the request's output; speedup: engine tok/s / naive tok/s")
    result = {
        "benchmark": "serve",
        "units": {"tokens_per_s": "generated tokens / s (measured)", "seconds": "s (measured)",
                  "latency": "s (measured)"},
        "workload": {"dataset": "alpaca-like", "mean_input": ALPACA[0],
                     "mean_output": ALPACA[1], "sigma": ALPACA[2], "context": CONTEXT,
                     "requests": args.requests, "seed": args.seed, "arrival": "all at t=0"},
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0],
                    "torch": torch.__version__, "threads": args.threads,
                    "tensor_parallel": args.tensor_parallel, "tp_cluster": args.tp_cluster},
        "load_average_1m": {"before": load_before, "after": os.getloadavg()[0]},
        "rows": rows,
    }
    print(f"load average (1 min): {load_before:.1f} before, "
          f"{result['load_average_1m']['after']:.1f} after")
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
