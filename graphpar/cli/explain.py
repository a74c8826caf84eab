"""`graphpar explain`: why the auto-shard plan is what it is, and what another strategy for a
node would cost (graphpar/passes/autoshard/explain.py)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from graphpar.cli.common import (
    add_model_options,
    add_plan_options,
    atomic_output,
    auto_shard_pass,
    check_output_file,
    check_plan_options,
    check_size_options,
    load_target,
    step,
)
from graphpar.errors import ShardingError, UsageError
from graphpar.units import format_seconds


def add_explain_parser(sub) -> None:
    from graphpar.passes.autoshard.explain import CHANGED_SHOWN, DEFAULT_TOP, DEFAULT_TRIES

    e = sub.add_parser("explain", help="why the auto-shard plan is what it is: the costliest "
                                       "nodes and what other strategies would cost")
    add_model_options(e)
    add_plan_options(e, "the device mesh to plan on, e.g. 2x4 (2-D) or 8 (1-D); required")
    e.add_argument("--top", type=int, default=DEFAULT_TOP,
                   help=f"how many of the costliest nodes to explain (default {DEFAULT_TOP})")
    e.add_argument("--tries", type=int, default=DEFAULT_TRIES,
                   help="other strategies re-solved per node, the cheapest with the rest of "
                        f"the plan kept (default {DEFAULT_TRIES})")
    e.add_argument("--node", help="explain one node instead (module:op as explain prints it, "
                                  "or its value number %%N)")
    e.add_argument("--strategy", help=f"with --node: re-solve with the node forced to this "
                                      f"strategy, e.g. '({{S(0)}}, {{R}}) -> {{S(0)}}', and list "
                                      f"the nodes that change (first {CHANGED_SHOWN})")
    e.add_argument("--json", metavar="FILE", help="also write the explanation as JSON")
    e.set_defaults(fn=cmd_explain)


def _check_options(args: argparse.Namespace) -> None:
    """Usage errors, found before the model is loaded."""
    if not args.mesh:
        raise UsageError("explain needs --mesh: the device mesh to plan on, e.g. --mesh 2x4")
    check_plan_options(args)
    check_size_options(args)
    for option in ("top", "tries"):
        if getattr(args, option) < 1:
            raise UsageError(f"--{option} {getattr(args, option)}: give a number >= 1")
    if args.strategy is not None and args.node is None:
        raise UsageError("--strategy needs --node: the node to force to that strategy")
    if args.json is not None:
        check_output_file(Path(args.json), "--json")


def cmd_explain(args: argparse.Namespace) -> int:
    from graphpar.capture.optim import optimizer_from_name
    from graphpar.compiler.driver import compile_model
    from graphpar.passes.autoshard.explain import Explainer, Explanation, plan_dict

    _check_options(args)
    auto_shard = auto_shard_pass(args)  # a bad mesh too is an error before any slow work
    started, cpu_started = time.perf_counter(), time.process_time()
    with step("loading the model"):
        spec = load_target(args.model, args.example, args.mode, weights=False,
                           batch=args.batch, seq_len=args.seq_len)
    optimizer = optimizer_from_name(args.optimizer) if args.mode == "train" else None
    with step(f"capturing {spec.name} ({args.mode})"):
        graph = compile_model(spec, args.mode, "cleanup", optimizer=optimizer).graph
    with step(f"solving the plan on mesh {args.mesh}"):
        reduced, plan = auto_shard.solve(graph)
    explainer = Explainer(reduced, plan, auto_shard.limits)
    try:
        node = explainer.node(args.node) if args.node is not None else None
        strategy = (explainer.strategy(node, args.strategy) if args.strategy is not None
                    else None)
    except ShardingError as exc:
        raise UsageError(str(exc)) from None
    header = {"model": spec.name, "source": spec.source, "mode": args.mode,
              "cluster": args.cluster}
    if strategy is not None:
        with step(f"re-solving with {explainer.names[node]} forced"):
            forced = explainer.force(node, strategy)
        row = explainer.row(node)
        report = {**header, **plan_dict(plan), "node": row.as_dict(),
                  "forced": forced.as_dict()}
        lines = [*_plan_lines(header, plan), *_row_lines(row, "node", with_tried=False),
                 *_forced_lines(forced)]
    else:
        rows = [explainer.row(node)] if node is not None else explainer.costliest(args.top)
        with step(f"re-solving up to {args.tries} alternatives for each of {len(rows)} nodes"):
            rows = [explainer.explain_row(r, args.tries) for r in rows]
        explanation = Explanation(plan, rows, args.tries)
        report = {**header, **explanation.as_dict()}
        lines = _plan_lines(header, plan)
        if node is None:
            lines.append(_rows_title(rows, len(graph.nodes), args))
        first_of_class: dict[int, int] = {}
        for k, row in enumerate(rows, 1):
            lines += _row_lines(row, "node" if node is not None else f"{k}.", with_tried=True,
                                same_as=first_of_class.setdefault(row.ilp_class, k))
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    report["explain_seconds_measured"], report["explain_cpu_seconds_measured"] = wall, cpu
    lines.append(f"  took       {wall:.1f} s wall, {cpu:.1f} s CPU (measured, capture "
                 "included)")
    if args.json is not None:
        with atomic_output(args.json, "--json") as file:
            file.write(json.dumps(report, indent=2) + "\n")
        lines.append(f"  wrote      {args.json}")
    print("\n".join(lines))
    return 0


def _delta(f) -> str:
    sign = "+" if f.delta_seconds >= 0 else "-"
    percent = "" if f.delta_percent is None else f", {f.delta_percent:+.2f} %"
    return f"{sign}{format_seconds(abs(f.delta_seconds))}{percent}"


def _changed(f) -> str:
    n = len(f.changed)
    return f"{n} other node{'' if n == 1 else 's'} change{'s' if n == 1 else ''}"


def _plan_lines(header: dict, plan) -> list[str]:
    stats = plan.stats
    return [
        f"graphpar explain: {header['model']} ({header['mode']}) on mesh {plan.mesh}, "
        f"{header['cluster']} (compute as a roofline, {plan.compute_model})",
        f"  step       {format_seconds(plan.step_seconds)} estimated = compute "
        f"{format_seconds(plan.compute_seconds)} + resharding {format_seconds(plan.comm_seconds)} "
        f"(the ILP's objective: {format_seconds(stats['objective_seconds'])}; {stats['status']}, "
        f"{stats['variables']} variables, {stats['classes']} classes)",
    ]


def _rows_title(rows, nodes: int, args) -> str:
    return (f"  costliest  {len(rows)} of {nodes} nodes under the plan (compute + resharding into "
            f"their operands); for each, up to {args.tries} other strategies re-solved, the "
            "cheapest with the rest of the plan kept. A node of repeated layers stands for its "
            "copies (one ILP variable): costs summed, forced together.")


def _row_lines(row, label: str, with_tried: bool, same_as: int | None = None) -> list[str]:
    node = row.node
    where = ", ".join(x for x in (node.module, node.loc) if x)
    copies = f", x{len(row.copies)} (one ILP variable)" if len(row.copies) > 1 else ""
    follows = ", follows its operand" if row.follows else ""
    shared = (f", the same ILP variable as row {same_as}" if same_as is not None
              and label != f"{same_as}." else "")
    lines = [f"  {label:<10} {row.name} (%{row.number} {node.op}"
             f"{', ' + where if where else ''}{copies}{follows}{shared})",
             f"    plan     {row.strategy}: compute {format_seconds(row.compute_seconds)} + "
             f"resharding {format_seconds(row.resharding_seconds)} = "
             f"{format_seconds(row.cost_seconds)}"]
    if not with_tried:
        return lines
    tried = sorted(row.tried, key=lambda f: (f.plan is None,
                                             f.plan.step_seconds if f.plan else 0.0))
    for j, f in enumerate(tried):
        then = "instead" if j == 0 else ""
        if f.plan is None:
            lines.append(f"    {then:<8} {f.strategy}: {f.why_not}")
        else:
            lines.append(f"    {then:<8} {f.strategy}: step {format_seconds(f.plan.step_seconds)} "
                         f"({_delta(f)}), {_changed(f)}")
    if not row.open_alternatives:
        lines.append("    instead  nothing: the ILP can give this node no other strategy")
    elif len(row.tried) < row.open_alternatives:
        lines.append(f"             (tried {len(row.tried)} of {row.open_alternatives} other "
                     "strategies)")
    return lines


def _forced_lines(f) -> list[str]:
    from graphpar.passes.autoshard.explain import CHANGED_SHOWN

    if f.plan is None:
        return [f"  forced     {f.strategy}: {f.why_not}"]
    lines = [f"  forced     {f.strategy}: step {format_seconds(f.plan.step_seconds)} estimated "
             f"({_delta(f)}; {f.plan.stats['status']}), {_changed(f)}"
             + (":" if f.changed else "")]
    lines += [f"    {name}: {was} => {now}" for name, was, now in f.changed[:CHANGED_SHOWN]]
    if len(f.changed) > CHANGED_SHOWN:
        lines.append(f"    ... and {len(f.changed) - CHANGED_SHOWN} more (--json lists "
                     f"the first {CHANGED_SHOWN} too)")
    return lines
