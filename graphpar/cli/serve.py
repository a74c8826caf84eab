"""`graphpar serve`: an OpenAI-compatible HTTP server over the continuous-batching engine.

Wired into the `graphpar` command by graphpar.cli.main (``add_serve_parser``). The model and
engine options are generate's; the server is graphpar.serving.http (FastAPI on uvicorn). It
listens until Ctrl-C (exit 130) or SIGTERM (exit 143), letting requests in flight finish.
"""

from __future__ import annotations

import argparse
import sys
import time
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
    if args.models and (args.model or args.example or args.served_model_name):
        raise UsageError("give --model NAME=MODEL (one or more), or one model file / --example "
                         "(with --served-model-name), not both")
    if not args.models and not args.model and not args.example:
        raise UsageError("serve needs a model file, --example (e.g. --example gpt:tiny) or "
                         "--model NAME=MODEL")
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

    from graphpar.cli.common import step
    from graphpar.cli.generate import _dump_programs, _where, load_model
    from graphpar.errors import GenerationError
    from graphpar.serving.llm import LLM
    from graphpar.serving.tokenizer import Tokenizer

    _check(args)
    targets = _targets(args)
    tokenizer = Tokenizer(args.tokenizer)
    config = engine_config(args)
    sock = _bind(args.host, args.port)
    try:
        if args.threads is not None:
            import torch

            torch.set_num_threads(args.threads)
        with ExitStack() as stack:
            engines = {}
            for name, options in targets:
                with step(f"loading {name}" if args.models else "loading the model"):
                    spec, module = load_model(options)
                start = time.perf_counter()
                progress = lambda message: print(f"graphpar: {message} ...", file=sys.stderr,
                                                 flush=True)
                try:
                    llm = LLM(module, engine_config(args), progress=progress,
                              detokenize=tokenizer.decode)
                except GenerationError as exc:
                    if args.kv_memory and "kv_cache_bytes=" in str(exc):
                        raise UsageError(f"--kv-memory {args.kv_memory}: "
                                         f"{str(exc).split(' ', 1)[1]}; give more memory"
                                         ) from None
                    raise
                stack.enter_context(llm)
                engine = engines[name] = llm.engine
                info = engine.info
                print(f"graphpar: {name}: {spec.name} ({info.family}: {info.num_layers} layers, "
                      f"context {info.max_model_len}) on {_where(engine)}; KV cache "
                      f"{engine.scheduler.num_device_blocks} blocks of {config.block_size} "
                      f"tokens; setup {time.perf_counter() - start:.1f} s", file=sys.stderr,
                      flush=True)
                if args.dump_programs:
                    where = Path(args.dump_programs)
                    _dump_programs(engine.model, where / name if args.models else where, False)
            return _run(args, engines, tokenizer, sock)
    finally:
        sock.close()


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
