"""Train the same model on the same ranks with graphpar's plans and with plain PyTorch
DistributedDataParallel and FSDP2 (`fully_shard`), on gloo CPU processes.

Each contender runs `--steps` Adam steps of the bundled GPT (`--model`, default gpt:tiny: batch
2 × 32 tokens) on `--ranks` processes after `--warmup` untimed ones. The contenders:

- `graphpar`: the plan auto-shard chooses on `--cluster` (default `cpu`), as `graphpar train`
  compiles it;
- `graphpar-data`: graphpar's data-parallel hand plan (`passes/autoshard/hand_plans.py`:
  parameters and optimizer state replicated, every heavy op split by the batch), solved under
  the same cost model;
- `graphpar-pure-data`: pure data parallelism, as DDP runs: the same hand plan's rules applied
  to every node, the cheap ones too (`hand_plans` leaves elementwise ops, norms and reshapes
  to the solver, which on the `cpu` preset's 20 us collectives gathers activations to run
  them replicated); only the inputs are sliced and the gradients all-reduced;
- `graphpar-pure-data-unbucketed` (only with `--only`): the same plan with every gradient
  all-reduce run where the program has it, one at a time, instead of in overlapped buckets
  (`graphpar.runtime.overlap`);
- `ddp`, `fsdp2`: the eager module wrapped in `DistributedDataParallel`, or `fully_shard`.

Every contender runs in the same harness: one process of this script per rank (a fresh
interpreter each, started the same way), `torch.distributed` over gloo on 127.0.0.1, one
intra-op thread. graphpar's ranks are `graphpar.training.rank.TrainRank`, the class
`graphpar train` runs on each rank (alone or under torchrun), given the plan compiled here.
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
CONTENDERS = ("graphpar", "graphpar-data", "graphpar-pure-data", "ddp", "fsdp2")
EXTRA = ("graphpar-pure-data-unbucketed",)


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

def graphpar_start(model: str, ranks: int, cluster: str, plan: str, folder: Path) -> dict:
    """Compile `plan` ("auto": auto-shard's; "data", "pure-data": `_hand_compiled`) as
    `graphpar train` compiles,
    and write what every rank starts from to `folder`/start.pt. Returns its estimate."""
    from graphpar.capture.optim import optimizer_from_name
    from graphpar.cli.common import example_spec, plan_limits
    from graphpar.cost.cluster import mesh_for
    from graphpar.training.plan import initial_state, plan_from

    spec = example_spec(model, train=True)
    mesh = mesh_for(str(ranks), cluster)
    limits = plan_limits(argparse.Namespace(memory_limit=None, time_limit=None,
                                            cluster=cluster), mesh.cluster)
    optimizer = optimizer_from_name("adam", 1e-3)
    if plan == "auto":
        from graphpar.compiler.api import compile_training

        compiled = compile_training(spec, mesh, limits, optimizer)
    else:
        compiled = _hand_compiled(spec, mesh, limits, optimizer, plan)
    train_plan = plan_from(compiled, spec.name, cluster)
    tokens = folder / "tokens.bin"
    vocab = spec.module.config.vocab_size if hasattr(spec.module, "config") else 256
    torch.randint(0, min(vocab, 256), (1 << 16,), dtype=torch.int32).to(
        torch.int16).numpy().tofile(tokens)
    torch.save({"plan": train_plan, "states": initial_state(compiled, train_plan),
                "data": {"kind": "tokens", "path": str(tokens), "seed": 0}},
               folder / "start.pt")
    return {"estimated_seconds": train_plan.estimated_seconds,
            **_collectives(train_plan.program)}


def _collectives(program: str) -> dict:
    """The program's group collectives, and how many a step runs with its all-reduces in
    buckets (`TrainRank` runs it so; counted)."""
    from graphpar.ir.parser import parse
    from graphpar.ir.spmd_ops import GROUP_OPS
    from graphpar.runtime.overlap import DEFAULT_BUCKET_BYTES, defer_reduced, plan_buckets

    graph = parse(program)
    defer_reduced(graph)
    buckets = plan_buckets(graph, DEFAULT_BUCKET_BYTES)
    total = sum(1 for n in graph.nodes if n.op in GROUP_OPS)
    return {"collectives_in_program": total,
            "collectives_run_bucketed": total - sum(len(b.members) for b in buckets)
            + len(buckets)}


def _hand_compiled(spec, mesh, limits, optimizer, name: str):
    """The training step under hand plan `name` ("data"; "pure-data": its rules on every
    node), solved by the same ILP under `limits`."""
    from graphpar.compiler.api import lower
    from graphpar.compiler.driver import compile_model
    from graphpar.cost.compute import Roofline
    from graphpar.ir.graph import Role, Value
    from graphpar.ir.ops import OpKind, get_op
    from graphpar.passes import parse_pipeline
    from graphpar.passes.autoshard.apply import shard_graph
    from graphpar.passes.autoshard.auto_shard import ShardingPlans
    from graphpar.passes.autoshard.hand_plans import _axis_roles, _Filter, hand_plan
    from graphpar.passes.autoshard.ilp import Problem, Reduced

    result = compile_model(spec, "train", parse_pipeline("cleanup"), optimizer=optimizer)
    graph = result.captured.graph
    reduced = Reduced(Problem(graph, mesh, Roofline.of(mesh.cluster, "fp32")))
    if name == "pure-data":
        class EveryNode(_Filter):  # the data plan's rule on the inputs and on every op
            def __call__(self, item, choice):
                if isinstance(item, Value):
                    return None if item.role is Role.INPUT else self._input(item, choice)
                return None if get_op(item.op).kind is OpKind.CREATION else self._heavy(
                    item, choice)

        plan = reduced.solve(limits.memory_bytes, limits.time_seconds,
                             allow=EveryNode(reduced, _axis_roles("data", mesh)), name=name)
    else:
        plan = hand_plan(reduced, name, limits.memory_bytes, time_limit=limits.time_seconds)
    shard_graph(graph, mesh, plan)
    result.context.result(ShardingPlans)[graph.name] = plan
    return lower(result.captured, result.context, spec=spec, optimizer=optimizer)


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
    parser.add_argument("--cluster", default="cpu")
    parser.add_argument("--only", help=f"comma-separated, of {', '.join(CONTENDERS + EXTRA)}")
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--rank", help=argparse.SUPPRESS)  # KIND,RANK,WORLD,PORT,FOLDER
    args = parser.parse_args(argv)
    if args.rank:
        kind, rank, world, port, folder = args.rank.split(",", 4)
        _rank(kind, int(rank), int(world), int(port), folder, args.model, args.steps,
              args.warmup)
        return 0
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
            if name.startswith("graphpar"):
                plan = ("auto" if name == "graphpar" else
                        "pure-data" if name.startswith("graphpar-pure-data") else "data")
                try:
                    rows[name].update(graphpar_start(args.model, args.ranks, args.cluster,
                                                     plan, folders[name]))
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
