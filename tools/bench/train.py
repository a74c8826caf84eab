"""Train the same model on the same batches and ranks with graphpar's plan and with plain
PyTorch DistributedDataParallel and FSDP2 (`fully_shard`), on gloo CPU processes.

Each contender runs `--steps` Adam steps of the bundled GPT (`--model`, default gpt:tiny: batch
2 × 32 tokens) on `--ranks` processes after `--warmup` untimed ones; a step's time is rank 0's
wall clock from the step's start to its end (measured), the table gives the median, tokens/s
from it (global batch tokens over the median step). Peak memory per rank is not measured yet
(`ru_maxrss` keeps the high-water mark of the process a rank was started from, so it read the
same for every contender). graphpar runs as
`graphpar train` does (`graphpar.training.loop`: its plan chosen by auto-shard on `--cluster`,
default `cpu`, one persistent worker per device).

    python tools/bench/train.py                 # table; writes train.json here
    python tools/bench/train.py --steps 10 --warmup 2 --out /tmp/train.json

Timings are measured on a shared machine; run it on an idle one for numbers to quote.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from graphpar.calibration.calibrate import cpu_model

OUT = Path(__file__).with_name("train.json")


def _batches(model: str, steps: int):
    from graphpar.models import example_batch, get_model

    name, _, preset = model.partition(":")
    config = get_model(name, preset or "tiny", device="meta").config
    return [example_batch(name, config, seed=s) for s in range(steps)]


def _torch_rank(rank: int, world: int, port: int, kind: str, model: str, steps: int,
                warmup: int, out: str) -> None:
    """One rank of a plain PyTorch run: DDP or FSDP2 over gloo, its share of each batch."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from graphpar.models import get_model

        name, _, preset = model.partition(":")
        example = get_model(name, preset or "tiny", train=True)
        module = example.module
        if kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            module = DistributedDataParallel(module)
        else:
            from torch.distributed.fsdp import fully_shard

            fully_shard(module)
        optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
        seconds = []
        for step, (inputs, targets) in enumerate(_batches(model, warmup + steps)):
            share = [t.chunk(world)[rank] for t in (*inputs, *targets)]
            dist.barrier()
            began = time.perf_counter()
            loss = example.loss_fn(module(*share[:len(inputs)]), *share[len(inputs):])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step >= warmup:
                seconds.append(time.perf_counter() - began)
        if rank == 0:
            Path(out).write_text(json.dumps({"seconds": seconds}))
    finally:
        dist.destroy_process_group()


def run_torch(kind: str, model: str, ranks: int, steps: int, warmup: int) -> dict:
    """`ranks` processes of this script (`--torch-rank`), one plain PyTorch rank each."""
    import subprocess

    from graphpar.runtime.workers import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out, port = os.path.join(tmp, "rank0.json"), free_port()
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                              os.environ.get("PYTHONPATH", "")])}
        procs = [subprocess.Popen(
            [sys.executable, __file__, "--torch-rank", f"{kind},{rank},{ranks},{port},{out}",
             "--model", model, "--steps", str(steps), "--warmup", str(warmup)],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for rank in range(ranks)]
        errors = [p.communicate()[1] for p in procs]
        if any(p.returncode for p in procs):  # FSDP2 may not run on CPU with this torch
            tail = next(e for p, e in zip(procs, errors) if p.returncode).strip()
            return {"error": tail.splitlines()[-1] if tail else "a rank failed"}
        return json.loads(Path(out).read_text())


def run_graphpar(model: str, ranks: int, steps: int, warmup: int, cluster: str) -> dict:
    from graphpar.cli.common import example_spec, plan_limits
    from graphpar.cost.cluster import mesh_for
    from graphpar.training.loop import TrainOptions, prepare, run_alone
    from graphpar.training.report import Reporter

    spec = example_spec(model, train=True)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "tokens.bin"
        vocab = spec.module.config.vocab_size if hasattr(spec.module, "config") else 256
        torch.randint(0, min(vocab, 256), (1 << 16,), dtype=torch.int32).to(
            torch.int16).numpy().tofile(data)
        mesh = mesh_for(str(ranks), cluster)
        args = argparse.Namespace(memory_limit=None, time_limit=None, cluster=cluster)
        options = TrainOptions(spec=spec, mesh=mesh, limits=plan_limits(args, mesh.cluster),
                               cluster=cluster, steps=warmup + steps, optimizer="adam",
                               lr=1e-3, data=data, progress=False)
        start = prepare(options)
        reporter = Reporter(start.plan, options)
        run_alone(start, options, reporter)
    seconds = [r["seconds"] for r in reporter.records[warmup:]]
    return {"seconds": seconds, "estimated_seconds": start.plan.estimated_seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt:tiny")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--cluster", default="cpu")
    parser.add_argument("--only", help="comma-separated: graphpar,ddp,fsdp2")
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--torch-rank", help=argparse.SUPPRESS)  # KIND,RANK,WORLD,PORT,OUT
    args = parser.parse_args(argv)
    if args.torch_rank:
        kind, rank, world, port, out = args.torch_rank.split(",", 4)
        _torch_rank(int(rank), int(world), int(port), kind, args.model, args.steps,
                    args.warmup, out)
        return 0
    contenders = (args.only or "graphpar,ddp,fsdp2").split(",")
    (inputs, _), = _batches(args.model, 1)
    tokens = int(inputs[0].numel())
    rows = []
    for name in contenders:
        try:
            if name == "graphpar":
                result = run_graphpar(args.model, args.ranks, args.steps, args.warmup,
                                      args.cluster)
            else:
                result = run_torch(name, args.model, args.ranks, args.steps, args.warmup)
        except Exception as exc:
            traceback.print_exc()
            result = {"error": f"{type(exc).__name__}: {exc}"}
        row = {"contender": name, **result}
        if "seconds" in result:
            row["step_seconds_median_measured"] = statistics.median(result["seconds"])
            row["tokens_per_second_measured"] = tokens / row["step_seconds_median_measured"]
        rows.append(row)
    print(f"{args.model}, {args.ranks} gloo ranks, Adam, {tokens} tokens per step, "
          f"{args.steps} timed steps after {args.warmup}; "
          f"CPU: {cpu_model()} ({os.cpu_count()} cores)")
    print(f"{'contender':10} {'step ms (median)':>17} {'tokens/s':>10}")
    for row in rows:
        if "error" in row:
            print(f"{row['contender']:10} did not run: {row['error']}")
            continue
        print(f"{row['contender']:10} {row['step_seconds_median_measured'] * 1e3:17.2f} "
              f"{row['tokens_per_second_measured']:10,.0f}")
    Path(args.out).write_text(json.dumps({
        "model": args.model, "ranks": args.ranks, "steps": args.steps, "warmup": args.warmup,
        "tokens_per_step": tokens, "cpu": cpu_model(), "cores": os.cpu_count(),
        "load_average": os.getloadavg(), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
