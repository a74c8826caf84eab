"""`graphpar generate`: serve a causal LM over a file of prompts with the continuous-batching
engine, showing progress and throughput while it runs.

Wired into the `graphpar` command by graphpar.cli.main (``add_generate_parser``). The prompts
file has one request per line: plain text (tokenized by ``--tokenizer``), a JSON list of token
ids, or a JSON object ``{"prompt": text or ids, "max_tokens": 32, "temperature": 0.8, ...}``
whose other keys override the command line's sampling options for that request. Blank lines
and lines starting with ``#`` are skipped. Results are JSON lines (stdout, or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from graphpar.errors import GraphparError, UsageError
from graphpar.serving.tokenizer import Tokenizer

_SAMPLING_KEYS = {"max_tokens", "temperature", "top_k", "top_p", "n", "beam_width",
                  "length_penalty", "stop_token_ids", "stop", "ignore_eos", "seed"}
_INT_KEYS = {"max_tokens", "top_k", "n", "beam_width"}
_FLOAT_KEYS = {"temperature", "top_p", "length_penalty"}
_DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
           "bfloat16": "bfloat16", "bf16": "bfloat16"}


def add_generate_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `generate` subcommand to the `graphpar` parser's subparsers."""
    g = subparsers.add_parser(
        "generate", help="generate text for a file of prompts (continuous batching, paged "
                         "attention)",
        description="Serve a causal LM (a model file whose build() returns it, or --example) "
                    "over a file of prompts with graphpar's continuous-batching engine.")
    g.add_argument("model", nargs="?", help="model file defining build() (see README)")
    g.add_argument("--example", help="a bundled model instead, e.g. gpt:tiny or llama:tiny")
    g.add_argument("--prompts", required=True, help="prompts file: one request per line")
    g.add_argument("--out", help="write results here as JSON lines (default: stdout)")
    g.add_argument("--system-prompt", metavar="TEXT",
                   help="text every prompt starts with: prefilled once, its KV blocks shared")
    g.add_argument("--tokenizer", default="bytes",
                   help="'bytes' (UTF-8 bytes as token ids), or a local Hugging Face tokenizer "
                        "directory")
    s = g.add_argument_group("sampling (defaults for every request)")
    s.add_argument("--max-tokens", type=int, default=16)
    s.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    s.add_argument("--top-k", type=int, default=0, help="0: off")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("-n", "--n", type=int, default=1, help="parallel samples per prompt")
    s.add_argument("--beam-width", type=int, default=0, help="beam search with this many beams")
    s.add_argument("--stop-token-ids", default="", help="comma-separated token ids")
    s.add_argument("--ignore-eos", action="store_true")
    s.add_argument("--seed", type=int, default=None)
    e = add_engine_options(g)
    e.add_argument("--quiet", action="store_true", help="no progress lines")
    g.set_defaults(fn=cmd_generate)
    return g


def add_engine_options(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The engine's options, as generate and serve take them; returns the group."""
    e = parser.add_argument_group("engine")
    e.add_argument("--max-num-seqs", type=int, default=16, help="sequences per step")
    e.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                   help="at most N tokens a step: longer prompts are prefilled in chunks beside "
                        "the running decodes (default: prompts prefill whole)")
    e.add_argument("--no-prefix-caching", action="store_true",
                   help="do not keep and reuse the KV blocks of earlier prompts' prefixes")
    e.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    e.add_argument("--num-blocks", type=int, default=0,
                   help="device KV blocks (default: from --kv-memory, or max-num-seqs full "
                        "contexts)")
    e.add_argument("--kv-memory", help="KV cache memory, e.g. 256MB (instead of --num-blocks)")
    e.add_argument("--swap-blocks", type=int, default=None, help="CPU swap blocks")
    e.add_argument("--preemption", choices=["auto", "swap", "recompute"], default="auto")
    e.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    e.add_argument("--dtype", choices=sorted(_DTYPES), help="serve in this dtype")
    e.add_argument("--kernel", choices=["auto", "torch", "reference", "cuda"], default="auto",
                   help="paged-attention implementation")
    e.add_argument("--tensor-parallel", "--tp", type=int, default=1, metavar="N",
                   help="shard the model over N CPU ranks (gloo processes)")
    e.add_argument("--tp-plan", choices=["auto", "megatron"], default="auto",
                   help="tensor-parallel plan: the ILP's (auto) or Megatron-LM's")
    e.add_argument("--cluster", default="cpu",
                   help="cluster preset or file the tensor-parallel plan is costed on")
    e.add_argument("--dump-programs", metavar="DIR",
                   help="write the prefill/decode programs it runs (IR text) to DIR")
    return e


@dataclass
class _Line:
    number: int
    prompt: list[int]
    overrides: dict[str, Any]


def read_prompts(path: str, tokenizer: Tokenizer) -> list[_Line]:
    """The requests of a prompts file; a malformed line is a UsageError naming it."""
    from graphpar.ir.parser import read_text_file

    file = Path(path)
    if not file.exists():
        raise UsageError(f"--prompts {path}: no such file")
    try:
        text = read_text_file(file, "prompts file")
    except GraphparError as exc:
        raise UsageError(f"--prompts {exc}") from None
    lines = []
    for number, raw in enumerate(text.splitlines(), start=1):
        text = raw.strip()
        if not text or text.startswith("#"):
            continue
        where = f"{path}:{number}"
        overrides: dict[str, Any] = {}
        if text[0] in "[{":
            try:
                item = json.loads(text)
            except json.JSONDecodeError as exc:
                raise UsageError(f"{where}: not valid JSON: {exc.msg} (column {exc.colno})"
                                 ) from None
            if isinstance(item, dict):
                unknown = set(item) - _SAMPLING_KEYS - {"prompt"}
                if "prompt" not in item or unknown:
                    raise UsageError(
                        f"{where}: a JSON request needs \"prompt\" and may set "
                        f"{', '.join(sorted(_SAMPLING_KEYS))}" +
                        (f"; unknown: {', '.join(sorted(unknown))}" if unknown else ""))
                overrides = {k: v for k, v in item.items() if k != "prompt"}
                for key, value in overrides.items():
                    problem = _type_problem(key, value)
                    if problem:
                        raise UsageError(f"{where}: \"{key}\": {json.dumps(value)} {problem}")
                item = item["prompt"]
            if isinstance(item, str):
                prompt = tokenizer.encode(item)
            elif isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                                for t in item):
                prompt = item
            else:
                raise UsageError(f"{where}: a prompt is text or a list of token ids")
        else:
            prompt = tokenizer.encode(text)
        lines.append(_Line(number, prompt, overrides))
    if not lines:
        raise UsageError(f"--prompts {path}: no prompts in the file")
    return lines


def _type_problem(key: str, value: Any) -> str | None:
    """Why a JSON request's sampling option has the wrong type, or None."""
    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if key in _INT_KEYS and not is_int(value):
        return "is not a whole number"
    if key in _FLOAT_KEYS and not (is_int(value) or isinstance(value, float)):
        return "is not a number"
    if key == "seed" and not (value is None or is_int(value)):
        return "is not a whole number (or null)"
    if key == "ignore_eos" and not isinstance(value, bool):
        return "is not true or false"
    if key == "stop_token_ids" and not (isinstance(value, list) and all(map(is_int, value))):
        return "is not a list of token ids"
    return None


def _stop_token_ids(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise UsageError(f"--stop-token-ids {text!r}: give token ids separated by commas, "
                         "e.g. 2,13") from None


def _check_options(args: argparse.Namespace) -> None:
    """Usage errors in generate's options, found before the model is loaded."""
    from graphpar.errors import GenerationError

    try:
        _base_sampling(args).validate()
    except GenerationError as exc:
        field, _, rest = str(exc).partition(" ")
        flag = "-n" if field == "n" else "--" + field.replace("_", "-")
        raise UsageError(f"{flag}: {rest}" if field in _SAMPLING_KEYS else str(exc)) from None
    check_engine_options(args)
    if args.out is not None:
        from graphpar.cli.common import check_output_file

        check_output_file(Path(args.out), "--out")


def check_engine_options(args: argparse.Namespace) -> None:
    """Usage errors in the engine's options (add_engine_options)."""
    for flag, value, least in (("--block-size", args.block_size, 1),
                               ("--max-num-seqs", args.max_num_seqs, 1),
                               ("--max-num-batched-tokens", args.max_num_batched_tokens, 1),
                               ("--tensor-parallel", args.tensor_parallel, 1),
                               ("--num-blocks", args.num_blocks, 0),
                               ("--swap-blocks", args.swap_blocks, 0)):
        if value is not None and value < least:
            raise UsageError(f"{flag} must be at least {least}, got {value}")
    if args.kernel == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--kernel cuda: torch sees no CUDA GPU here; use --kernel auto, "
                             "torch or reference")


def engine_config(args: argparse.Namespace):
    """The engine options (add_engine_options) as an EngineConfig."""
    from graphpar.serving.engine import EngineConfig

    return EngineConfig(
        block_size=args.block_size, num_blocks=args.num_blocks,
        kv_cache_bytes=_bytes(args.kv_memory) if args.kv_memory else 0,
        swap_blocks=args.swap_blocks, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        preemption_mode=None if args.preemption == "auto" else args.preemption,
        kernel=args.kernel, tensor_parallel=args.tensor_parallel, tp_plan=args.tp_plan,
        tp_cluster=args.cluster)


def _bytes(text: str) -> int:
    units = {"KB": 2**10, "MB": 2**20, "GB": 2**30, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
             "B": 1}
    upper = text.strip().upper()
    for unit in sorted(units, key=len, reverse=True):
        if upper.endswith(unit):
            try:
                return int(float(upper[:-len(unit)]) * units[unit])
            except ValueError:
                break
    raise UsageError(f"--kv-memory {text!r}: give a size such as 256MB or 2GB")


def load_model(args: argparse.Namespace):
    import torch

    from graphpar.cli.common import load_target

    spec = load_target(args.model, args.example)
    module = spec.real_module().eval()
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise UsageError(f"--device {args.device!r} is not a torch device") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: torch sees no CUDA GPU")
    module = module.to(device)
    if args.dtype:
        module = module.to(getattr(torch, _DTYPES[args.dtype]))
    return spec, module


def _base_sampling(args: argparse.Namespace):
    """The command line's sampling options, the defaults of every request."""
    from graphpar.serving.sampling import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, n=args.n,
                          beam_width=args.beam_width,
                          stop_token_ids=_stop_token_ids(args.stop_token_ids),
                          ignore_eos=args.ignore_eos, seed=args.seed)


def _sampling(args: argparse.Namespace, overrides: dict[str, Any], where: str):
    from graphpar.errors import GenerationError
    from graphpar.serving.sampling import SamplingParams

    known = {f.name for f in fields(SamplingParams)}
    try:
        params = replace(_base_sampling(args),
                         **{k: v for k, v in overrides.items() if k in known})
        params.validate()
    except (TypeError, ValueError, GenerationError) as exc:
        raise UsageError(f"{where}: bad sampling option: {exc}") from None
    return params


def cmd_generate(args: argparse.Namespace) -> int:
    """Run `graphpar generate`; returns the exit status (1 if any request failed)."""
    from graphpar.cli.common import step
    from graphpar.errors import GenerationError
    from graphpar.serving.llm import LLM

    if not args.model and not args.example:
        raise UsageError("generate needs a model file or --example (e.g. --example gpt:tiny)")
    _check_options(args)
    tokenizer = Tokenizer(args.tokenizer)
    lines = read_prompts(args.prompts, tokenizer)
    params = [_sampling(args, line.overrides, f"{args.prompts}:{line.number}") for line in lines]
    config = engine_config(args)
    with step("loading the model"):
        spec, module = load_model(args)
    progress = None if args.quiet else (
        lambda message: print(f"graphpar: {message} ...", file=sys.stderr, flush=True))
    start = time.perf_counter()
    try:
        llm = LLM(module, config, progress=progress, detokenize=tokenizer.decode)
    except GenerationError as exc:
        if args.kv_memory and "kv_cache_bytes=" in str(exc):  # name the option, not the field
            raise UsageError(f"--kv-memory {args.kv_memory}: "
                             f"{str(exc).split(' ', 1)[1]}; give more memory") from None
        raise
    with llm:
        return _serve(args, llm, spec, lines, params, tokenizer, start)


def _serve(args: argparse.Namespace, llm, spec, lines, params, tokenizer, start: float) -> int:
    from graphpar.cli.common import atomic_output
    from graphpar.serving.llm import progress_printer

    engine, config = llm.engine, llm.engine.config
    info = engine.info
    if not args.quiet:
        print(f"graphpar: serving {spec.name} ({info.family}: {info.num_layers} layers, "
              f"{info.num_heads} heads / {info.num_kv_heads} kv heads of {info.head_size}, "
              f"context {info.max_model_len}) on {_where(engine)}; KV cache "
              f"{engine.scheduler.num_device_blocks} blocks of {config.block_size} tokens "
              f"({engine.model.kv_bytes / 2**20:.1f} MiB); setup "
              f"{time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        if config.tensor_parallel > 1:
            print(f"graphpar: {engine.model.ranks.summary()}", file=sys.stderr, flush=True)
    if config.tensor_parallel > 1 and info.num_heads % config.tensor_parallel:
        print(f"graphpar: note: --tensor-parallel {config.tensor_parallel} does not divide the "
              f"model's {info.num_heads} attention heads, so attention is not split across "
              "ranks; choose a divisor of the head count to shard it", file=sys.stderr)
    if args.dump_programs:
        _dump_programs(engine.model, Path(args.dump_programs), args.quiet)
    on_step = None if args.quiet else progress_printer(engine, len(lines))
    run_start = time.perf_counter()
    system, prefix = [], None
    if args.system_prompt:
        system = tokenizer.encode(args.system_prompt)
        try:
            prefix = engine.register_prefix(system)
        except GraphparError as exc:
            raise UsageError(f"--system-prompt: {exc}") from None
    ids = [engine.add_request(system + line.prompt, p, prefix=prefix)
           for line, p in zip(lines, params)]
    results = {o.request_id: o for o in engine.run(on_step)}
    if on_step is not None:
        on_step.final(engine)  # type: ignore[attr-defined]
    failed = 0
    records = []
    for line, request_id in zip(lines, ids):
        result = results[request_id]
        record: dict[str, Any] = {"line": line.number, "prompt_tokens": len(line.prompt)}
        if result.error:
            failed += 1
            record["error"] = result.error
            print(f"graphpar: error: request on {args.prompts}:{line.number}: "
                  f"{result.error}", file=sys.stderr)
        else:
            record["outputs"] = [{"text": c.text,
                                  "token_ids": c.token_ids,
                                  "finish_reason": c.finish_reason,
                                  "cumulative_logprob": round(c.cumulative_logprob, 6)}
                                 for c in result.outputs]
            record["cached_tokens"] = result.num_cached_tokens
            record["latency_s"] = round(result.latency or 0.0, 6)
        records.append(json.dumps(record) + "\n")
    if args.out:
        with atomic_output(args.out, "--out") as out:
            out.writelines(records)
    else:
        sys.stdout.writelines(records)
    stats, seconds = engine.stats, time.perf_counter() - run_start
    print(f"graphpar generate: {len(lines) - failed}/{len(lines)} requests served, "
          f"{stats.generated_tokens} tokens generated in {seconds:.2f} s "
          f"({stats.generated_tokens / max(seconds, 1e-9):.1f} tokens/s, measured), "
          f"{stats.preemptions} preemptions, {stats.prefix_cache_hits}/"
          f"{stats.prefix_cache_queries} prompt tokens from the prefix cache (counted)"
          + (f", wrote {args.out}" if args.out else ""),
          file=sys.stderr)
    return 1 if failed else 0


def _dump_programs(model, directory: Path, quiet: bool) -> None:
    from graphpar.cli.common import atomic_output
    from graphpar.cost.communication import annotate_comm
    from graphpar.ir.printer import print_graph

    directory.mkdir(parents=True, exist_ok=True)
    programs = model.programs()
    for name, graph in programs.items():
        with atomic_output(directory / name, "--dump-programs") as file:
            file.write(print_graph(graph, show_source=True, annotate=annotate_comm))
    if not quiet:
        print(f"graphpar: wrote {', '.join(programs)} to {directory}", file=sys.stderr)


def _where(engine) -> str:
    tp = engine.config.tensor_parallel
    device = engine.model.device
    return f"{tp} tensor-parallel {device} ranks ({engine.config.tp_plan} plan)" if tp > 1 \
        else str(device)
