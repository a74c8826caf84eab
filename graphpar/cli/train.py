"""`graphpar train MODEL.py --mesh 2x2 --steps N`: train with the plan, alone or under torchrun."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from graphpar.cli.common import (
    add_pipeline_options,
    add_plan_options,
    check_plan_options,
    plan_limits,
    plan_mesh,
)
from graphpar.errors import UsageError
from graphpar.passes.autoshard.hand_plans import HAND_PLANS

TRAIN_PLANS = ("auto", *HAND_PLANS)


def add_train_parser(sub) -> None:
    t = sub.add_parser("train", help="train a model with its plan for many steps, alone or "
                                     "under torchrun, with DCP checkpoints (docs/training.md)")
    t.add_argument("model", nargs="?", help="model file defining build(), loss(), targets() "
                                            "and, for its data, batch(step) (see README)")
    t.add_argument("--example", help="a bundled model instead, e.g. gpt:tiny (with --data)")
    add_plan_options(t, "the device mesh to train on, e.g. 2x2 (one rank per device)")
    # the default cluster is where the ranks run: cpu-gloo (this kind of machine, measured)
    # on CPU ranks, dgx-a100 on GPUs
    t.set_defaults(cluster=None, mode="train")
    add_pipeline_options(t, "train with a pipelined plan: 'auto' or a number of stages on "
                            "sub-meshes of --mesh (one process per device)")
    t.add_argument("--plan", choices=TRAIN_PLANS, default="auto",
                   help="auto: the plan auto-shard's ILP chooses; or a hand plan solved by the "
                        "same ILP under its rules: data, ddp (DistributedDataParallel's), zero, "
                        "zero-3, megatron, data+megatron (docs/autoshard.md); not with "
                        "--pipeline")
    t.add_argument("--steps", type=int, required=True, help="train up to this step")
    t.add_argument("--optimizer", choices=["sgd", "adam"], default="adam")
    t.add_argument("--lr", type=float, help="learning rate (default: torch.optim's)")
    t.add_argument("--data", type=Path,
                   help="a causal LM's data: a flat token file (.bin of uint16, .u32.bin of "
                        "uint32, .npy) or a text file read as bytes (default: the model file's "
                        "batch(step))")
    t.add_argument("--checkpoint-dir", type=Path, help="write DCP checkpoints to DIR/step-<N>")
    t.add_argument("--checkpoint-every", type=int, metavar="K",
                   help="a checkpoint every K steps (and always after the last)")
    t.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --checkpoint-dir")
    t.add_argument("--log", "--log-file", dest="log", type=Path,
                   help="one JSON line per step; the loss curve goes beside it (FILE.html). "
                        "Under torchrun write --log-file: torchrun reads --log as its --log-dir")
    t.add_argument("--seed", type=int, default=0, help="seeds the weights (torch.manual_seed "
                                                       "before build()) and the data sampler")
    t.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="where the ranks run: cpu (gloo), cuda (one GPU per rank, NCCL), or "
                        "auto: cuda when every rank on this machine gets a GPU, else cpu")
    t.add_argument("--no-progress", action="store_true", help="no progress line")
    t.set_defaults(fn=cmd_train)


def check_train_options(args: argparse.Namespace) -> None:
    """Usage errors in train's own options, found before the model is loaded."""
    if not args.mesh:
        raise UsageError("train needs --mesh, e.g. --mesh 2x2 (one rank per device)")
    if args.steps < 1:
        raise UsageError(f"--steps {args.steps}: give the number of steps to train, 1 or more")
    if args.lr is not None and not args.lr > 0:
        raise UsageError(f"--lr {args.lr}: give a positive learning rate")
    if args.checkpoint_every is not None:
        if args.checkpoint_every < 1:
            raise UsageError(f"--checkpoint-every {args.checkpoint_every}: give 1 or more steps")
        if args.checkpoint_dir is None:
            raise UsageError("--checkpoint-every writes checkpoints: give --checkpoint-dir DIR")
    if args.resume and args.checkpoint_dir is None:
        raise UsageError("--resume continues from a checkpoint: give --checkpoint-dir DIR")
    if args.checkpoint_dir is not None and args.checkpoint_dir.exists() \
            and not args.checkpoint_dir.is_dir():
        raise UsageError(f"--checkpoint-dir {args.checkpoint_dir}: exists and is not a folder")
    if args.log is not None and args.log.is_dir():
        raise UsageError(f"--log {args.log}: is a folder; give a file (FILE.jsonl)")
    check_plan_options(args)
    from graphpar.cli.pipeline import check_pipeline_options, check_pipeline_options_need_pipeline

    check_pipeline_options_need_pipeline(args)
    if args.pipeline:
        check_pipeline_options(args)
        if args.plan != "auto":
            raise UsageError(f"--plan {args.plan} with --pipeline: a pipelined plan's stages are "
                             "auto-sharded on their sub-meshes; drop --plan or --pipeline")


def cmd_train(args: argparse.Namespace) -> int:
    import torch

    from graphpar.cli.common import load_target
    from graphpar.training.loop import (
        TrainOptions,
        choose_device,
        local_ranks,
        train,
        under_torchrun,
    )

    cluster_given = args.cluster is not None
    args.cluster = args.cluster or "cpu-gloo"
    check_train_options(args)
    mesh = plan_mesh(args)
    # a pipelined plan's world is its stages' devices, checked once it is compiled
    if under_torchrun() and not args.pipeline and int(os.environ["WORLD_SIZE"]) != mesh.size:
        raise UsageError(f"torchrun started {os.environ['WORLD_SIZE']} processes (WORLD_SIZE) "
                         f"but --mesh {args.mesh} has {mesh.size} devices: start one process "
                         "per device (--nnodes x --nproc-per-node)")
    device = choose_device(args.device, cuda=torch.cuda.is_available(),
                           gpus=torch.cuda.device_count(), ranks=local_ranks(mesh),
                           pipelined=bool(args.pipeline))
    if device == "cuda" and not cluster_given:
        args.cluster = "dgx-a100"
        mesh = plan_mesh(args)
    limits = plan_limits(args, mesh.cluster)
    torch.manual_seed(args.seed)
    spec = load_target(args.model, args.example, "train")
    if args.pipeline:
        from graphpar.cli.pipeline import check_microbatches_fit, default_microbatches

        check_microbatches_fit(args, spec)
        if args.microbatches is None:
            args.microbatches = default_microbatches(len(spec.inputs[0]))
    options = TrainOptions(
        spec=spec, mesh=mesh, limits=limits, cluster=args.cluster, steps=args.steps,
        optimizer=args.optimizer, lr=args.lr, data=args.data, plan=args.plan,
        checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
        resume=args.resume, log=args.log, seed=args.seed, progress=not args.no_progress,
        pipeline=args.pipeline or None, microbatches=args.microbatches or 4,
        schedule=args.schedule or "1f1b", token_slices=args.token_slices, device=device)
    summary = train(options)
    if summary:
        losses = summary["losses"]
        if losses:
            # a pipelined run's stages are auto-sharded: its own line below says how
            plan = "" if summary.get("pipeline") else f" with plan {summary['plan']}"
            print(f"trained {summary['model']} on mesh {summary['mesh']}{plan}: steps "
                  f"{summary['first_step'] + 1}..{summary['steps']}, loss {losses[0]:.4f} -> "
                  f"{losses[-1]:.4f}")
            on = "cuda, NCCL" if summary["device"] == "cuda" else "cpu, gloo"
            print(f"step time  {summary['step_seconds_measured'] * 1e3:.2f} ms measured "
                  f"(median, rank 0, {on}), {summary['step_seconds_estimated'] * 1e3:.3f} ms "
                  f"estimated (cost model, cluster {summary['estimated_on']})")
        if summary.get("shape"):
            shape = summary["shape"]
            print(f"plan       {summary['plan']} on {summary['estimated_on']}: "
                  f"{shape['sharded']} of {shape['tensors']} parameter and buffer tensors split "
                  f"across devices, {shape['collectives']} collectives a step in the program, "
                  f"{shape['collectives_run']} run with the all-reduces in buckets")
        if summary.get("pipeline"):
            p = summary["pipeline"]
            slices = f", token slices {p['token_slices']}" if p.get("token_slices") else ""
            print(f"pipeline   {p['stages']} stages on devices {p['devices']}, "
                  f"{p['microbatches']} microbatches, schedule {p['schedule']}{slices}")
        if args.checkpoint_dir is not None:
            print(f"checkpoint {args.checkpoint_dir / f'step-{args.steps}'}")
        if "loss_curve" in summary:
            print(f"log {args.log}, loss curve {summary['loss_curve']}")
    return 0
