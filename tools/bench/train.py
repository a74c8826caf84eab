"""Train the same model on the same ranks with graphpar's plans and with plain PyTorch
DistributedDataParallel and FSDP2 (`fully_shard`), on gloo CPU processes.

Each contender runs `--steps` Adam steps of the bundled GPT (`--model`, default gpt:tiny: batch
2 × 32 tokens) on `--ranks` processes after `--warmup` untimed ones. The contenders:

- `graphpar`: what `graphpar train --example MODEL --mesh RANKS --cluster CLUSTER` runs
  (`--plan auto`: the plan auto-shard chooses on `--cluster`, default `cpu-gloo`, the gloo
  CPU ranks' measured preset), compiled by the same code (`training.loop.prepare`);
- `graphpar-data`: the same with `--plan data`, graphpar's data-parallel hand plan
  (`passes/autoshard/hand_plans.py`: parameters and optimizer state replicated, every heavy op
  split by the batch, the cheap ops left to the solver), solved under the same cost model;
- `graphpar-ddp`: the same with `--plan ddp`, data parallelism as DDP runs it: the data rule
  on every node, the cheap ones too, the inputs sliced by the batch, parameters and optimizer
  state replicated, the gradients all-reduced (in buckets, overlapped with the backward:
  `graphpar.runtime.overlap`);
- `graphpar-ddp-unbucketed` (only with `--only`): the same plan with every gradient
  all-reduce run where the program has it, one at a time;
- `graphpar-pipeline`: `graphpar train --pipeline 2 --microbatches 2`'s run (2 stages, one
  on each of 2 ranks, schedule 1f1b), its ranks being `training.stage_rank.StageTrainWorker`
  (with `--ranks` other than 2 the stages are auto-shard's choice);
- `ddp`, `fsdp2`: the eager module wrapped in `DistributedDataParallel`, or `fully_shard`.

Every contender runs in the same harness: one process of this script per rank (a fresh
interpreter each, started the same way), `torch.distributed` over gloo on 127.0.0.1, one
intra-op thread. graphpar's ranks are `graphpar.training.rank.TrainRank` (a pipelined plan's:
`StageTrainWorker` on the pipeline job's folder), the classes `graphpar train` runs on each
rank (alone or under torchrun), given the plan compiled here.
A step's time is rank 0's wall clock from a barrier to the step's end (measured); the table
gives the median over every timed step of every round, tokens/s from it. The contenders run
`--rounds` times in turn (interleaved), so that a change of the machine's load hits them all;
the JSON keeps each round's median and the load average at its start.

Peak memory per rank is measured: each rank process's peak resident set (`VmHWM` of
/proc/self/status at the end: the high-water mark of this process's own memory since its
start, the Python interpreter and torch included), and what the steps added to it (`VmHWM` at
the end minus `VmRSS` just before the first step).

    python tools/bench/train.py                       # table; writes train.json here
    python tools/bench/train.py --steps 10 --warmup 2 --rounds 1 --out /tmp/train.json
    python tools/bench/train.py --cluster tools/bench/gloo_cluster.json   # the same numbers

Timings are measured on a shared machine; run it on an idle one for numbers to quote.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from graphpar.calibration.calibrate import cpu_model

OUT = Path(__file__).with_name("train.json")
CONTENDERS = ("graphpar", "graphpar-data", "graphpar-ddp", "graphpar-pipeline", "ddp", "fsdp2")
EXTRA = ("graphpar-ddp-unbucketed",)
# graphpar's contenders: `graphpar train`'s --plan, and its --pipeline (stages) or None
GRAPHPAR = {"graphpar": ("auto", None), "graphpar-data": ("data", None),
            "graphpar-ddp": ("ddp", None), "graphpar-ddp-unbucketed": ("ddp", None),
            "graphpar-pipeline": ("auto", 2)}
MICROBATCHES = 2  # graphpar-pipeline's, as `--microbatches 2`


def _batches(model: str, steps: int):
    from graphpar.models import example_batch, get_model

    name, _, preset = model.partition(":")
    config = get_model(name, preset or "tiny", device="meta").config
    return [example_batch(name, config, seed=s) for s in range(steps)]


def _memory_kib(field: str) -> int:
    """A field of /proc/self/status in KiB (VmHWM: peak resident set; VmRSS: now)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


# --- one rank ---------------------------------------------------------------------------------

def _rank(kind: str, rank: int, world: int, port: int, folder: str, model: str, steps: int,
          warmup: int) -> None:
    """One rank of contender `kind`; writes its step seconds and memory to the folder."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        step = (_graphpar_steps if kind.startswith("graphpar") else _torch_steps)(
            kind, rank, world, folder, model)
        seconds = []
        rss_before = _memory_kib("VmRSS")
        for index in range(warmup + steps):
            dist.barrier()
            began = time.perf_counter()
            step(index)
            if index >= warmup:
                seconds.append(time.perf_counter() - began)
        peak = _memory_kib("VmHWM")
        Path(folder, f"rank{rank}.json").write_text(json.dumps({
            "seconds": seconds, "peak_rss_mib": peak / 1024,
            "steps_added_mib": (peak - rss_before) / 1024}))
    finally:
        dist.destroy_process_group()


def _graphpar_steps(kind: str, rank: int, world: int, folder: str, model: str):
    from graphpar.runtime.overlap import DEFAULT_BUCKET_BYTES
    from graphpar.training.rank import TrainRank

    if GRAPHPAR[kind][1] is not None:  # a pipelined plan: a device of its job, as torchrun's
        from graphpar.training.stage_rank import StageTrainWorker

        return StageTrainWorker(Path(folder, "job"), rank, world).step
    start = torch.load(Path(folder, "start.pt"), weights_only=False)
    buckets = None if kind.endswith("-unbucketed") else DEFAULT_BUCKET_BYTES
    trainer = TrainRank(start["plan"], rank, start["data"], start["states"][rank],
                        bucket_bytes=buckets)
    return trainer.step


def _torch_steps(kind: str, rank: int, world: int, folder: str, model: str):
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
    batches = _batches(model, int(os.environ["BENCH_STEPS"]))

    def step(index: int) -> None:
        inputs, targets = batches[index]
        share = [t.chunk(world)[rank] for t in (*inputs, *targets)]
        loss = example.loss_fn(module(*share[:len(inputs)]), *share[len(inputs):])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return step


# --- the driver -------------------------------------------------------------------------------

def graphpar_start(model: str, ranks: int, cluster: str, name: str, folder: Path) -> dict:
    """Compile contender `name` as `graphpar train --example MODEL --mesh RANKS --cluster
    CLUSTER --plan P [--pipeline S --microbatches 2]` compiles it (the same steps as
    `cli/train.py`, then `training.loop.prepare`), and write what every rank starts from to
    `folder`: start.pt (the plan, each rank's shards, the data), or a pipelined plan's job
    folder. Returns its estimate and what its program's collectives are."""
    from graphpar.cli.common import load_target, plan_limits
    from graphpar.cost.cluster import mesh_for
    from graphpar.runtime.jobs import JobFolder
    from graphpar.training.loop import TrainOptions, prepare, write_pipeline_job

    plan, stages = GRAPHPAR[name]
    mesh = mesh_for(str(ranks), cluster)
    limits = plan_limits(argparse.Namespace(memory_limit=None, time_limit=None,
                                            cluster=cluster), mesh.cluster)
    torch.manual_seed(0)
    spec = load_target(None, model, "train")
    tokens = folder / "tokens.bin"
    vocab = spec.module.config.vocab_size if hasattr(spec.module, "config") else 256
    torch.randint(0, min(vocab, 256), (1 << 16,), dtype=torch.int32).to(
        torch.int16).numpy().tofile(tokens)
    options = TrainOptions(spec=spec, mesh=mesh, limits=limits, cluster=cluster, steps=1,
                           optimizer="adam", lr=1e-3, data=tokens, progress=False, plan=plan,
                           pipeline=None if stages is None else str(stages),
                           microbatches=MICROBATCHES, schedule="1f1b")
    start = prepare(options)
    if start.pipe is not None:
        (folder / "job").mkdir()
        write_pipeline_job(JobFolder(folder / "job"), start)
        return {"estimated_seconds": start.plan.estimated_seconds,
                "pipeline": start.plan.pipeline}
    torch.save({"plan": start.plan, "states": start.states, "data": start.data},
               folder / "start.pt")
    return {"estimated_seconds": start.plan.estimated_seconds,
            **_collectives(start.plan)}


def _collectives(plan) -> dict:
    """The program's group collectives, and how many a step runs with its all-reduces in
    buckets (counted: `TrainPlan.shape_summary`)."""
    shape = plan.shape_summary()
    return {"collectives_in_program": shape["collectives"],
            "collectives_run_bucketed": shape["collectives_run"]}


def run_ranks(kind: str, folder: Path, model: str, ranks: int, steps: int,
              warmup: int) -> dict:
    """`ranks` processes of this script (`--rank`), one rank of `kind` each."""
    from graphpar.runtime.workers import free_port

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BENCH_STEPS": str(warmup + steps),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                          os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen(
        [sys.executable, __file__, "--rank", f"{kind},{rank},{ranks},{port},{folder}",
         "--model", model, "--steps", str(steps), "--warmup", str(warmup)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for rank in range(ranks)]
    errors = [p.communicate()[1] for p in procs]
    if any(p.returncode for p in procs):  # FSDP2 may not run on CPU with this torch
        tail = next(e for p, e in zip(procs, errors) if p.returncode).strip()
        return {"error": tail.splitlines()[-1] if tail else "a rank failed"}
    per_rank = [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(ranks)]
    return {"seconds": per_rank[0]["seconds"],
            "peak_rss_mib": [r["peak_rss_mib"] for r in per_rank],
            "steps_added_mib": [r["steps_added_mib"] for r in per_rank]}


def _collective_cell(row: dict) -> str:
    """Collectives per step: as the program has them, and run (bucketed) where that differs."""
    if "collectives_in_program" not in row:
        return ""
    run = (row["collectives_in_program"] if row["contender"].endswith("-unbucketed")
           else row["collectives_run_bucketed"])
    return f"{row['collectives_in_program']} -> {run}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt:tiny")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cluster", default="cpu-gloo",
                        help="the cost model's cluster every graphpar plan is solved on: a "
                             "preset or a cluster file (tools/bench/gloo_cluster.json holds "
                             "cpu-gloo's measured numbers)")
    parser.add_argument("--only", help=f"comma-separated, of {', '.join(CONTENDERS + EXTRA)}")
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--rank", help=argparse.SUPPRESS)  # KIND,RANK,WORLD,PORT,FOLDER
    args = parser.parse_args(argv)
    if args.rank:
        kind, rank, world, port, folder = args.rank.split(",", 4)
        _rank(kind, int(rank), int(world), int(port), folder, args.model, args.steps,
              args.warmup)
        return 0
    from graphpar.cost.cluster import get_cluster
    from graphpar.errors import GraphparError

    try:
        get_cluster(args.cluster)
    except GraphparError as exc:  # cpu-gloo is a preset only where the cost model has it
        parser.error(f"--cluster {args.cluster}: {exc} (tools/bench/gloo_cluster.json holds "
                     "cpu-gloo's measured numbers)")
    contenders = (args.only or ",".join(CONTENDERS)).split(",")
    unknown = [c for c in contenders if c not in CONTENDERS + EXTRA]
    if unknown:
        parser.error(f"--only: unknown contender {unknown[0]!r}; choose from "
                     f"{', '.join(CONTENDERS + EXTRA)}")
    (inputs, _), = _batches(args.model, 1)
    tokens = int(inputs[0].numel())
    rows = {name: {"contender": name, "rounds": []} for name in contenders}
    with tempfile.TemporaryDirectory() as tmp:
        folders = {}
        for name in contenders:
            folders[name] = Path(tmp, name)
            folders[name].mkdir()
            if name in GRAPHPAR:
                try:
                    rows[name].update(graphpar_start(args.model, args.ranks, args.cluster,
                                                     name, folders[name]))
                except Exception as exc:
                    traceback.print_exc()
                    rows[name]["error"] = f"{type(exc).__name__}: {exc}"
        for _ in range(args.rounds):
            for name in contenders:
                row = rows[name]
                if "error" in row:
                    continue
                load = os.getloadavg()[0]
                result = run_ranks(name, folders[name], args.model, args.ranks, args.steps,
                                   args.warmup)
                if "error" in result:
                    row["error"] = result["error"]
                    continue
                row["rounds"].append({"load_average_1min": load, **result,
                                      "median_seconds": statistics.median(result["seconds"])})
    for row in rows.values():
        if row["rounds"] and "error" not in row:
            seconds = [s for r in row["rounds"] for s in r["seconds"]]
            row["step_seconds_median_measured"] = statistics.median(seconds)
            row["tokens_per_second_measured"] = tokens / row["step_seconds_median_measured"]
            row["peak_rss_mib_measured"] = [max(r["peak_rss_mib"][k] for r in row["rounds"])
                                            for k in range(args.ranks)]
            row["steps_added_mib_measured"] = [
                max(r["steps_added_mib"][k] for r in row["rounds"]) for k in range(args.ranks)]
    print(f"{args.model}, {args.ranks} gloo ranks, Adam, {tokens} tokens per step, "
          f"plans on cluster {args.cluster!r}, "
          f"{args.steps} timed steps after {args.warmup}, {args.rounds} interleaved rounds; "
          f"CPU: {cpu_model()} ({os.cpu_count()} cores)")
    print(f"{'contender':25} {'step ms (median)':>17} {'tokens/s':>10} "
          f"{'peak RSS MiB/rank':>18} {'steps added MiB':>16} {'collectives':>12}")
    for row in rows.values():
        if "error" in row:
            print(f"{row['contender']:25} did not run: {row['error']}")
            continue
        peak = "/".join(f"{m:.0f}" for m in row["peak_rss_mib_measured"])
        added = "/".join(f"{m:.1f}" for m in row["steps_added_mib_measured"])
        print(f"{row['contender']:25} {row['step_seconds_median_measured'] * 1e3:17.2f} "
              f"{row['tokens_per_second_measured']:10,.0f} {peak:>18} {added:>16} "
              f"{_collective_cell(row):>12}")
        print(f"{'':25} rounds: " + ", ".join(
            f"{r['median_seconds'] * 1e3:.1f} ms at load {r['load_average_1min']:.1f}"
            for r in row["rounds"]))
    tmp_out = Path(args.out).with_suffix(".json.partial")
    tmp_out.write_text(json.dumps({
        "model": args.model, "ranks": args.ranks, "steps": args.steps, "warmup": args.warmup,
        "rounds": args.rounds, "cluster": args.cluster, "tokens_per_step": tokens,
        "cpu": cpu_model(), "cores": os.cpu_count(),
        "memory": "peak_rss_mib: VmHWM of each rank process at its end (measured); "
                  "steps_added_mib: VmHWM at the end minus VmRSS before the first step",
        "rows": list(rows.values())}, indent=2) + "\n")
    os.replace(tmp_out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
