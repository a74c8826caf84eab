"""`graphpar serve`: an OpenAI-compatible HTTP server over the continuous-batching engine.

Wired into the `graphpar` command by graphpar.cli.main (``add_serve_parser``). The model and
engine options are generate's; the server is graphpar.serving.http (FastAPI on uvicorn). It
listens until Ctrl-C (exit 130) or SIGTERM (exit 143), letting requests in flight finish.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graphpar.cli.generate import add_engine_options, check_engine_options, engine_config
from graphpar.errors import UsageError


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `serve` subcommand to the `graphpar` parser's subparsers."""
    g = subparsers.add_parser(
        "serve", help="serve a causal LM over HTTP (OpenAI API: completions, chat, streaming)",
        description="Serve a causal LM (a model file whose build() returns it, or --example) "
                    "over an OpenAI-compatible HTTP API with graphpar's continuous-batching "
                    "engine: POST /v1/completions, /v1/chat/completions; GET /v1/models, "
                    "/health, /metrics (Prometheus). See docs/serving.md.")
    g.add_argument("model", nargs="?", help="model file defining build() (see README)")
    g.add_argument("--example", help="a bundled model instead, e.g. gpt:tiny or llama:tiny")
    g.add_argument("--model", dest="models", action="append", metavar="NAME=MODEL",
                   help="serve several models, routed by the request's \"model\": NAME=a model "
                        "file (*.py) or NAME=a bundled example (gpt:tiny); repeat it")
    g.add_argument("--placement", metavar="DIR/placement.json",
                   help="serve a placement that `graphpar place` wrote: each device group in "
                        "its own process, each request sent to the least-loaded group holding "
                        "its model; name each model's source with --model NAME=MODEL")
    g.add_argument("--policy", metavar="NAME",
                   help="which policy's placement to serve (a key of the file's \"policies\", "
                        "e.g. alpaserve)")
    g.add_argument("--served-model-name", metavar="NAME",
                   help="the name clients give as \"model\" (default: the model file's stem, "
                        "or the --example name)")
    g.add_argument("--tokenizer", default="bytes",
                   help="'bytes' (UTF-8 bytes as token ids), or a local Hugging Face tokenizer "
                        "directory (its chat template serves /v1/chat/completions)")
    h = g.add_argument_group("server")
    h.add_argument("--host", default="127.0.0.1", help="address to listen on (default "
                                                       "127.0.0.1: this machine only)")
    h.add_argument("--port", type=int, default=8000, help="port (0: any free one; the line "
                                                          "'serving ... on http://...' says it)")
    h.add_argument("--max-waiting", type=int, default=None, metavar="N",
                   help="answer 429 (with Retry-After) when N requests already wait for their "
                        "first token (default: no limit)")
    h.add_argument("--graceful-seconds", type=float, default=30.0,
                   help="on Ctrl-C / SIGTERM, how long requests in flight may take to finish")
    e = add_engine_options(g)
    e.add_argument("--threads", type=int, default=None,
                   help="torch threads of the engine (default: torch's)")
    g.set_defaults(fn=cmd_serve)
    return g


def _check(args: argparse.Namespace) -> None:
    if (args.placement is None) != (args.policy is None):
        raise UsageError("give --placement DIR/placement.json and --policy NAME together")
    if args.placement and not args.models:
        raise UsageError("--placement needs --model NAME=MODEL for each model it places (the "
                         "placement names models, not where they are)")
    if args.models and (args.model or args.example or args.served_model_name):
        raise UsageError("give --model NAME=MODEL (one or more), or one model file / --example "
                         "(with --served-model-name), not both")
    if not args.models and not args.model and not args.example:
        raise UsageError("serve needs a model file, --example (e.g. --example gpt:tiny) or "
                         "--model NAME=MODEL")
    if args.placement and args.tensor_parallel != 1:
        raise UsageError("--placement: the placement's groups give the parallelism; drop "
                         "--tensor-parallel")
    check_engine_options(args)
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be between 0 and 65535, got {args.port}")
    if args.max_waiting is not None and args.max_waiting < 0:
        raise UsageError(f"--max-waiting must be at least 0, got {args.max_waiting}")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads must be at least 1, got {args.threads}")
    if args.graceful_seconds < 0:
        raise UsageError(f"--graceful-seconds must be at least 0, got {args.graceful_seconds}")


def _targets(args: argparse.Namespace) -> list[tuple[str, argparse.Namespace]]:
    """(served name, options to load it with) per model."""
    if not args.models:
        name = args.served_model_name or (args.example if args.example
                                          else Path(args.model).stem)
        return [(name, args)]
    targets = []
    for item in args.models:
        name, sep, model = item.partition("=")
        if not sep or not name or not model:
            raise UsageError(f"--model {item}: give NAME=MODEL, e.g. chat=model.py or "
                             f"small=gpt:tiny")
        if name in [n for n, _ in targets]:
            raise UsageError(f"--model {item}: the name {name!r} is given twice")
        is_file = model.endswith(".py") or Path(model).exists()
        targets.append((name, argparse.Namespace(
            **{**vars(args), "model": model if is_file else None,
               "example": None if is_file else model})))
    return targets


def cmd_serve(args: argparse.Namespace) -> int:
    """Run `graphpar serve` until interrupted."""
    from contextlib import ExitStack

    from graphpar.serving.tokenizer import Tokenizer

    _check(args)
    targets = _targets(args)
    tokenizer = Tokenizer(args.tokenizer)
    groups = _placement_groups(args, [n for n, _ in targets]) if args.placement else None
    sock = _bind(args.host, args.port)
    try:
        if groups is not None:
            return _run_placement(args, groups, sock)
        if args.threads is not None:
            import torch

            torch.set_num_threads(args.threads)
        with ExitStack() as stack:
            engines = _load_engines(args, targets, tokenizer, stack)
            return _run(args, engines, tokenizer, sock)
    finally:
        sock.close()


def _load_engines(args: argparse.Namespace, targets: list[tuple[str, argparse.Namespace]],
                  tokenizer, stack) -> dict:
    """Each target's engine (served name -> LLMEngine), its LLM entered into `stack`."""
    from graphpar.cli.common import step
    from graphpar.cli.generate import _dump_programs, _where, load_model
    from graphpar.errors import GenerationError
    from graphpar.serving.llm import LLM

    config = _config(args)
    engines = {}
    for name, options in targets:
        with step(f"loading {name}" if args.models else "loading the model"):
            spec, module = load_model(options)
        start = time.perf_counter()
        progress = lambda message: print(f"graphpar: {message} ...", file=sys.stderr,
                                         flush=True)
        try:
            llm = LLM(module, _config(args), progress=progress,
                      detokenize=tokenizer.decode)
        except GenerationError as exc:
            if args.kv_memory and "kv_cache_bytes=" in str(exc):
                raise UsageError(f"--kv-memory {args.kv_memory}: "
                                 f"{str(exc).split(' ', 1)[1]}; give more memory") from None
            raise
        stack.enter_context(llm)
        engine = engines[name] = llm.engine
        info = engine.info
        where = (engine.model.ranks.summary() if config.pipeline_stages > 1
                 else _where(engine))
        print(f"graphpar: {name}: {spec.name} ({info.family}: {info.num_layers} layers, "
              f"context {info.max_model_len}) on {where}; KV cache "
              f"{engine.scheduler.num_device_blocks} blocks of {config.block_size} "
              f"tokens; setup {time.perf_counter() - start:.1f} s", file=sys.stderr,
              flush=True)
        if args.dump_programs:
            where = Path(args.dump_programs)
            _dump_programs(engine.model, where / name if args.models else where, False)
    return engines


def _config(args: argparse.Namespace):
    """The engine options as an EngineConfig; a pipelined group of a placement adds its stages
    (options no flag sets: the placement gives them)."""
    import dataclasses

    layers = getattr(args, "stage_layers", None)
    return dataclasses.replace(engine_config(args),
                               pipeline_stages=getattr(args, "pipeline_stages", 1),
                               stage_layers=tuple(layers) if layers else None)


def _bind(host: str, port: int):
    from graphpar.serving.http.app import bind

    try:
        return bind(host, port)
    except OSError as exc:
        raise UsageError(f"--host {host} --port {port}: cannot listen there: "
                         f"{exc.strerror or exc}; choose another port (or --port 0)") from None


def _run(args: argparse.Namespace, engines: dict, tokenizer, sock) -> int:
    from graphpar.serving.async_engine import AsyncEngine
    from graphpar.serving.http.app import ServedModel, build_app, run
    from graphpar.serving.http.metrics import ServerMetrics

    metrics = ServerMetrics()
    models = {}
    for name, engine in engines.items():
        metrics.update(name, engine, [])
        loop = AsyncEngine(engine, lambda e, outputs, name=name: metrics.update(name, e, outputs))
        models[name] = ServedModel(name, loop, tokenizer, int(time.time()))
    host, port = sock.getsockname()[:2]
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def ready() -> None:
        print(f"graphpar serve: serving {','.join(models)} on {url} (OpenAI API at {url}/v1; "
              f"metrics at {url}/metrics); Ctrl-C stops", file=sys.stderr, flush=True)

    for model in models.values():
        model.engine.start()
    try:
        run(build_app(models, metrics, args.max_waiting), sock, ready, args.graceful_seconds)
    finally:
        for model in models.values():
            model.engine.shutdown()
        print("graphpar serve: stopped", file=sys.stderr, flush=True)
    return 0


# --- a placement: a process per device group, a front routing by load ---------------------------

@dataclass
class _Group:
    """A device group of the placement as served: its devices, models, and how they run."""

    devices: list[int]
    models: list[str]
    stages: int = 1
    stage_layers: list[int] | None = None

    def where(self) -> str:
        if len(self.devices) == 1:
            return f"device {self.devices[0]}"
        span = f"devices {self.devices[0]}-{self.devices[-1]}"
        if self.stages == 1:
            return f"{span}, tensor parallel"
        layers = f", blocks {'+'.join(map(str, self.stage_layers))}" if self.stage_layers \
            else ""
        return f"{span}, {self.stages} pipeline stages{layers}"


def _placement_groups(args: argparse.Namespace, names: list[str]) -> list[_Group]:
    """The groups of `--policy`'s placement that host models. A group of several devices runs
    its models tensor-parallel over all of them (one stage, intra-op over every device), or
    pipelined (one device per stage; the decoder's blocks split as ``stage_layers`` says, else
    evenly)."""
    from graphpar.datafile import read_data_file
    from graphpar.errors import PlacementSpecError

    where = args.placement
    data = read_data_file(where, PlacementSpecError, "placement")
    policies = data.get("policies") if isinstance(data, dict) else None
    if not isinstance(policies, dict) or not policies:
        raise PlacementSpecError(f"{where}: no \"policies\": give the placement.json that "
                                 f"`graphpar place SPEC --out DIR` wrote")
    if args.policy not in policies:
        raise UsageError(f"--policy {args.policy}: {where} has no such policy; it has "
                         f"{', '.join(policies)}")
    groups = []
    for i, group in enumerate(policies[args.policy].get("groups") or []):
        field = f"{where}: policies.{args.policy}.groups[{i}]"
        try:
            devices = [int(d) for d in group["devices"]]
            models = [str(m) for m in group.get("models", [])]
            config = group.get("parallel_config", {})
            stages, intra = int(config.get("stages", 1)), int(config.get("intra_op", 1))
            layers = config.get("stage_layers")
            layers = None if layers is None else [int(n) for n in layers]
        except (KeyError, TypeError, ValueError, AttributeError):
            raise PlacementSpecError(f"{field}: not a group (\"devices\": [...], \"models\": "
                                     f"[...], \"parallel_config\": {{...}})") from None
        if not models:
            continue
        if stages < 1 or intra < 1 or stages * intra != len(devices):
            raise PlacementSpecError(f"{field}: {stages} stage(s) x {intra} intra-op is not "
                                     f"its {len(devices)} device(s) {devices}")
        if stages > 1 and intra > 1:
            raise UsageError(f"{field}: devices {devices} run {stages} stages x {intra} "
                             f"intra-op; serve --placement serves a group either pipelined "
                             f"(one device per stage) or tensor parallel (one stage), not both "
                             f"yet")
        if layers is not None and (len(layers) != stages or min(layers) < 1):
            raise PlacementSpecError(f"{field}: parallel_config.stage_layers {layers}: give "
                                     f"one count of decoder blocks (at least 1) per stage, "
                                     f"{stages} in all")
        groups.append(_Group(devices, models, stages, layers))
    placed = {m for g in groups for m in g.models}
    if not groups:
        raise PlacementSpecError(f"{where}: policy {args.policy} places no model")
    missing = sorted(placed - set(names))
    if missing:
        raise UsageError(f"--placement: give --model NAME=MODEL for {', '.join(missing)} (the "
                         f"placement places it)")
    unplaced = sorted(set(names) - placed)
    if unplaced:
        raise UsageError(f"--model {unplaced[0]}: policy {args.policy} of {where} does not "
                         f"place it; placed: {', '.join(sorted(placed))}")
    return groups


def _run_placement(args: argparse.Namespace, groups: list[_Group], sock) -> int:
    """Start each group's process (its engines behind its own server), then the front."""
    from graphpar.runtime.jobs import Job
    from graphpar.serving.http.app import run
    from graphpar.serving.http.router import GroupAddress, build_router

    sources = {}
    for item in args.models:
        name, _, model = item.partition("=")
        is_file = model.endswith(".py") or Path(model).exists()
        if is_file and not Path(model).is_file():  # found here, not in a group's process
            raise UsageError(f"--model {item}: {model}: no such file; give a model file "
                             f"defining build() or a bundled example (gpt:tiny)")
        sources[name] = str(Path(model).resolve()) if is_file else model
    options = {k: v for k, v in vars(args).items()
               if k not in ("fn", "models") and isinstance(v, (str, int, float, bool, type(None)))}
    jobs = []
    try:
        for i, group in enumerate(groups):
            job = Job(1, "graphpar.cli.serve:group_worker", prefix="serve-group",
                      timeout=600.0, name=f"device group {i}")
            jobs.append(job)
            parallel = ({"tensor_parallel": len(group.devices)} if group.stages == 1 else
                        {"pipeline_stages": group.stages, "stage_layers": group.stage_layers})
            job.folder.describe({"options": {**options, **parallel},
                                 "models": [f"{m}={sources[m]}" for m in group.models]})
            job.start()  # every group loads its models at once
        addresses = []
        for i, (group, job) in enumerate(zip(groups, jobs)):
            port = job.call("serve")[0]
            addresses.append(GroupAddress(f"group{i}", f"http://127.0.0.1:{port}",
                                          tuple(group.models)))
            print(f"graphpar serve: device group {i} ({group.where()}): "
                  f"{', '.join(group.models)} in process {job.group.processes[0].pid}",
                  file=sys.stderr, flush=True)
        host, port = sock.getsockname()[:2]
        url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        names = sorted({m for g in groups for m in g.models})

        def ready() -> None:
            print(f"graphpar serve: serving {','.join(names)} on {url} (OpenAI API at "
                  f"{url}/v1; {len(groups)} device groups, least-loaded routing; metrics at "
                  f"{url}/metrics); Ctrl-C stops", file=sys.stderr, flush=True)

        run(build_router(addresses), sock, ready, args.graceful_seconds)
    finally:
        for job in jobs:
            job.close()
        print("graphpar serve: stopped", file=sys.stderr, flush=True)
    return 0


def group_worker(jobdir: str, rank: int, world: int):
    """The worker of one device group (``graphpar.cli.serve:group_worker``): loads the
    group's models as `graphpar serve --model` would and hands their engines to a
    :class:`~graphpar.serving.http.group.GroupServer`."""
    from contextlib import ExitStack

    import torch

    from graphpar.runtime.jobs import JobFolder
    from graphpar.runtime.workers import worker_threads
    from graphpar.serving.http.group import GroupServer
    from graphpar.serving.tokenizer import Tokenizer

    description = JobFolder(jobdir).description
    args = argparse.Namespace(**description["options"], models=description["models"])
    if (args.tensor_parallel > 1 or getattr(args, "pipeline_stages", 1) > 1) \
            and torch.distributed.is_initialized():
        # This process is rank 0 of the engine's tensor-parallel (or pipeline) world, which it
        # starts; the
        # one-rank world the worker group gave it makes way (its store still carries commands).
        torch.distributed.destroy_process_group()
    torch.set_num_threads(args.threads or worker_threads())
    tokenizer = Tokenizer(args.tokenizer)
    engines = _load_engines(args, _targets(args), tokenizer, ExitStack())  # lives as long as
    return GroupServer(jobdir, rank, world, engines, tokenizer, args.max_waiting)  # the process
