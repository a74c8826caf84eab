"""Serving from Python: ``LLM(model).generate(prompts, SamplingParams(...))``.

::

    from graphpar.serving.llm import LLM, SamplingParams
    from graphpar.models import get_model

    llm = LLM(get_model("gpt", "tiny").module, max_num_seqs=8)
    outputs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=16))
    print(outputs[0].outputs[0].token_ids, llm.stats.tokens_per_second)

Prompts are token ids. Requests that cannot be served (too long for the context, too large for
the KV cache, bad parameters) come back with ``error`` set; the others are served as usual.
The engine underneath is :class:`graphpar.serving.engine.LLMEngine` (continuous batching over
paged attention); see docs/serving.md.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence

import torch

from graphpar.capture.decoder import decoder_adapter
from graphpar.serving.compile import compile_decoder
from graphpar.serving.engine import (
    CompletionOutput,
    EngineConfig,
    EngineStats,
    LLMEngine,
    RequestOutput,
    engine_config,
    kv_blocks_for,
    token_ids_of,
)
from graphpar.serving.sampling import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "RequestOutput", "SamplingParams",
           "generate", "progress_printer"]


def progress_printer(engine: LLMEngine, total: int, stream=None, interval: float = 0.5
                     ) -> Callable[[LLMEngine], None]:
    """An ``on_step`` callback printing requests done, queues, KV use and tokens/s, counted from
    now (create it before adding the run's requests)."""
    stream = stream or sys.stderr
    s = engine.stats
    base = (time.perf_counter(), s.finished + s.failed, s.generated_tokens, s.preemptions)
    last = [0.0]

    def show(engine: LLMEngine, final: bool = False) -> None:
        now = time.perf_counter()
        if not final and now - last[0] < interval:
            return
        last[0] = now
        s = engine.stats
        elapsed = now - base[0]
        tokens = s.generated_tokens - base[2]
        rate = tokens / elapsed if elapsed > 0 else 0.0
        line = (f"graphpar: [{elapsed:6.1f} s] {s.finished + s.failed - base[1]}/{total} "
                f"requests | running {s.running} waiting {s.waiting} swapped {s.swapped} | "
                f"KV {100 * s.kv_used:3.0f}% | {rate:7.1f} tok/s generated, {tokens} tokens, "
                f"{s.preemptions - base[3]} preemptions")
        if getattr(stream, "isatty", lambda: False)():
            stream.write("\r" + line + ("\n" if final else ""))
        else:
            stream.write(line + "\n")
        stream.flush()

    show.final = lambda engine: show(engine, final=True)  # type: ignore[attr-defined]
    return show


class LLM:
    """A model served by a continuous-batching engine (keyword options: EngineConfig fields;
    ``detokenize``: token ids -> text, for outputs' ``text`` and text stop strings)."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig | None = None,
                 progress: Callable[[str], None] | None = None,
                 detokenize: Callable[[list[int]], str] | None = None, **options) -> None:
        config = engine_config(config, options)
        info = decoder_adapter(model).info()
        programs = compile_decoder(model, block_size=config.block_size,
                                   num_blocks=kv_blocks_for(config, info), kernel=config.kernel,
                                   tensor_parallel=config.tensor_parallel,
                                   tp_plan=config.tp_plan, tp_cluster=config.tp_cluster,
                                   pipeline_stages=config.pipeline_stages,
                                   stage_layers=config.stage_layers,
                                   progress=progress)
        self.engine = LLMEngine(programs, config, progress=progress, detokenize=detokenize)

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats

    def close(self) -> None:
        """Stop the tensor-parallel worker processes, if any."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def register_prefix(self, token_ids: Sequence[int]) -> str:
        """Prefill a shared prompt prefix once (see LLMEngine.register_prefix); returns its id."""
        return self.engine.register_prefix(token_ids)

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 show_progress: bool = False, prefix: str | None = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs in prompt order. ``prefix``: a registered prefix
        every prompt starts with (its KV is reused, not recomputed). All or nothing: when a
        prompt is not token ids (or anything else raises), no request of the call stays queued.
        """
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        # Check every prompt before queueing any: a bad one raises with nothing left behind.
        prompts = [token_ids_of(p, f"prompt {i}") for i, p in enumerate(prompts)]
        on_step = progress_printer(self.engine, len(prompts)) if show_progress else None
        ids: list[str] = []
        try:
            for p, sp in zip(prompts, params):
                ids.append(self.engine.add_request(p, sp, prefix=prefix))
        except BaseException:
            for request_id in ids:
                self.engine.discard_request(request_id)
            raise
        outputs = {o.request_id: o for o in self.engine.run(on_step)}
        if on_step is not None:
            on_step.final(self.engine)  # type: ignore[attr-defined]
        return [outputs[i] for i in ids]


def generate(model: torch.nn.Module, prompts: Sequence[Sequence[int]],
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             **options) -> list[RequestOutput]:
    """One-shot: build an engine for ``model`` and generate for ``prompts``."""
    with LLM(model, **options) as llm:
        return llm.generate(prompts, params)
