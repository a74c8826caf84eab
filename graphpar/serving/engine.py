"""The serving engine: requests in, tokens out, one model step per iteration.

:class:`LLMEngine` joins the pieces of vLLM's design: the iteration-level FCFS scheduler
(:mod:`graphpar.serving.scheduler`, which owns the KV block manager), the model's paged
prefill/decode programs (:mod:`graphpar.serving.paged_model`) and the output processor
(:mod:`graphpar.serving.outputs`: samplers, beams, stop conditions). Each :meth:`LLMEngine.step`
asks the scheduler for a step plan, performs the block copies it lists (swap-out, swap-in,
copy-on-write), runs one prefill or decode step over the plan's block tables and slots, then
samples, applies stop conditions and finishes requests.

The engine never touches KV blocks (vLLM v1's split): parallel sampling forks the prompt's
sequence after the prefill and beam search forks and frees beams every step through the
scheduler (:meth:`Scheduler.fork`, :meth:`Scheduler.free`), which shares blocks by reference
counts; the first write into a shared block copies it (copy-on-write), so only the last, partly
filled block is ever copied.

A request the engine can never serve (a prompt longer than the model's context, a request whose
KV can never fit, a bad token id or sampling parameter) finishes at once with an error; the
engine keeps serving the others. No scheduling state the engine reaches makes :meth:`step`
raise: a request the pool can no longer hold is failed alone with the reason.
"""

from __future__ import annotations

import itertools
import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from graphpar.errors import GenerationError, GraphparError
from graphpar.serving.outputs import CompletionOutput, EngineStats, OutputProcessor, RequestOutput
from graphpar.serving.paged_model import PagedDecoder, StepInputs
from graphpar.serving.sampling import SamplingParams
from graphpar.serving.scheduler import (
    CacheConfig,
    PrefillItem,
    Request,
    Scheduler,
    SchedulerConfig,
    SequenceState,
    StepPlan,
)

if TYPE_CHECKING:  # the compiler's result type only: the runtime does not compile
    from graphpar.serving.compile import ServingPrograms

__all__ = ["CompletionOutput", "EngineConfig", "EngineStats", "LLMEngine", "RequestOutput",
           "engine_config", "kv_blocks_for", "token_ids_of"]


def token_ids_of(tokens: Sequence[int], what: str = "a prompt") -> list[int]:
    """``tokens`` as a list of ints; GenerationError when it is text or holds non-integers."""
    if isinstance(tokens, (str, bytes)):
        raise GenerationError(f"{what} is text ({tokens[:20]!r}); the engine takes token ids: "
                              f"tokenize it first")
    try:
        ids = list(tokens)
    except TypeError:
        raise GenerationError(f"{what} is a {type(tokens).__name__}, not a sequence of token "
                              f"ids") from None
    out = []
    for t in ids:
        try:
            out.append(operator.index(t))
        except TypeError:
            raise GenerationError(f"{what} holds {t!r}, not a token id (an integer)") from None
    return out


@dataclass
class EngineConfig:
    """Engine settings.

    KV memory is ``num_blocks`` blocks of ``block_size`` tokens, or, when ``num_blocks`` is 0,
    as many as fit in ``kv_cache_bytes`` (default: enough for ``max_num_seqs`` sequences of the
    model's full context). ``swap_blocks``: CPU swap space, in blocks (default: as many as the
    device pool). ``kernel``: ``auto``, ``reference`` or ``cuda`` (see graphpar.ir.paged_ops).
    ``tensor_parallel``: CPU ranks to shard the model over (gloo processes; one block manager,
    every rank holds its kv heads of each block); ``tp_plan``: ``auto`` (the ILP) or
    ``megatron`` (see graphpar.passes.autoshard.serving); ``tp_cluster``: the cluster preset or
    file the ILP costs the ranks with (``cpu``; `graphpar calibrate` measures one).
    ``pipeline_stages``: CPU ranks to cut the model's layers over (gloo processes, one batch in
    flight; graphpar.serving.pipeline_parallel), ``stage_layers`` decoder blocks each (default:
    as even as can be).

    ``max_num_batched_tokens``: at most this many tokens in one step (decodes and prompt
    chunks together): a longer prompt is prefilled in chunks over several steps beside the
    running decodes (chunked prefill). None: every prompt is prefilled whole, and a step admits
    new prompts up to 2048 tokens (always at least one). ``enable_prefix_caching``: keep full
    KV blocks by a hash of their tokens and everything before them after their request ends,
    and reuse them for any later prompt that starts with the same tokens.
    """

    block_size: int = 16
    num_blocks: int = 0
    kv_cache_bytes: int = 0
    swap_blocks: int | None = None
    max_num_seqs: int = 16
    max_num_batched_tokens: int | None = None  # a step's tokens; None: prompts prefill whole
    enable_prefix_caching: bool = True
    watermark: float = 0.01
    preemption_mode: str | None = None  # None (auto), "swap" or "recompute"
    kernel: str = "auto"
    tensor_parallel: int = 1
    tp_plan: str = "auto"
    tp_cluster: str = "cpu"
    pipeline_stages: int = 1
    stage_layers: tuple[int, ...] | None = None
    seed: int = 0


class LLMEngine:
    """Continuous-batching generation over paged attention.

    ``programs`` are a causal LM compiled for serving with ``config``'s block size and block
    count (:func:`graphpar.serving.compile.compile_decoder`; :class:`graphpar.serving.llm.LLM` does
    both). Prompts are token ids. ``detokenize`` (token ids -> text, optional) gives outputs
    their ``text`` and lets requests stop on strings (``SamplingParams.stop``).
    """

    def __init__(self, programs: ServingPrograms, config: EngineConfig,
                 progress: Callable[[str], None] | None = None,
                 detokenize: Callable[[list[int]], str] | None = None) -> None:
        self.config = config
        self.detokenize = detokenize
        num_blocks = programs.num_blocks
        swap = num_blocks if config.swap_blocks is None else config.swap_blocks
        self.model = PagedDecoder(programs, num_cpu_blocks=swap, progress=progress)
        self.info = self.model.info
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                            self.info.max_model_len),
            CacheConfig(num_blocks, swap, config.block_size,
                        watermark_blocks=int(config.watermark * num_blocks),
                        preemption_mode=config.preemption_mode,
                        enable_prefix_caching=config.enable_prefix_caching))
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats(kv_blocks_free=num_blocks)
        self.outputs = OutputProcessor(self.scheduler, self.info.eos_token_ids,
                                       self.info.max_model_len, self.stats, detokenize)
        self._ids = itertools.count()
        self._generator = torch.Generator().manual_seed(config.seed)
        self._done: list[RequestOutput] = []
        self._prefixes: dict[str, list[int]] = {}  # registered prefix id -> its tokens

    # --- requests ---------------------------------------------------------------------------

    def register_prefix(self, token_ids: Sequence[int]) -> str:
        """Prefill a prompt prefix many requests share (a system prompt) once; returns its id.

        Its KV blocks stay in the cache until :meth:`unregister_prefix`. A request added with
        ``prefix=`` that id starts with these tokens; its prefill computes only the tokens after
        them, and its blocks map the prefix's (reference counts; the partly filled last block is
        copied on write). Raises GenerationError if the tokens are invalid or do not fit now.
        """
        tokens = token_ids_of(token_ids, "the prefix")
        probe = Request("prefix", tokens, SamplingParams())
        self._validate(probe)
        self.scheduler.check_prefix_room(len(tokens))
        prefix_id = f"prefix-{next(self._ids)}"
        blocks = self.scheduler.register_prefix(prefix_id, len(tokens), tokens)
        self.model.prefill(StepInputs(
            input_ids=tokens, positions=list(range(len(tokens))),
            slot_mapping=blocks.slot_mapping, block_tables=[self._padded(blocks.block_table)],
            context_lens=[len(tokens)], query_start_loc=[0, len(tokens)],
            logits_indices=[len(tokens) - 1]))
        self._prefixes[prefix_id] = tokens
        self.stats.prompt_tokens += len(tokens)
        return prefix_id

    def unregister_prefix(self, prefix_id: str) -> None:
        """Release a prefix's blocks (requests still using them keep them alive; requests not
        yet admitted prefill its tokens themselves)."""
        if self._prefixes.pop(prefix_id, None) is None:
            raise GenerationError(f"unknown prefix {prefix_id!r}")
        self.scheduler.unregister_prefix(prefix_id)

    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    prefix: str | None = None) -> str:
        """Queue a request; returns its id. A request that can never be served finishes at once
        with an error (see :meth:`step`'s outputs) instead of raising. ``prefix``: the id of a
        registered prefix (:meth:`register_prefix`) the prompt starts with."""
        params = params or SamplingParams()
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise GenerationError(f"request id {request_id!r} is already in use")
        prompt = token_ids_of(prompt_token_ids)
        request = Request(request_id, prompt, params,
                          time.perf_counter() if arrival_time is None else arrival_time,
                          prefix=prefix)
        self.requests[request_id] = request
        try:
            self._validate(request)
            generator = None
            if params.temperature > 0:
                generator = torch.Generator()
                generator.manual_seed(params.seed if params.seed is not None else
                                      int(torch.randint(0, 2**62, (1,),
                                                        generator=self._generator)))
            request.seqs.append(SequenceState(request.new_seq_id(), list(prompt), len(prompt),
                                              generator))
            self.scheduler.add(request)
        except GraphparError as exc:
            self._fail(request, str(exc))
        return request_id

    def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise GenerationError if :meth:`add_request` would refuse this prompt and these
        parameters (it reads nothing a step changes, so a server's threads may call it)."""
        self._validate(Request("check", token_ids_of(prompt_token_ids), params))

    def _validate(self, request: Request) -> None:
        params, prompt, info = request.params, request.prompt, self.info
        params.validate()
        if params.stop_strings and self.detokenize is None:
            raise GenerationError(
                f"stop string {params.stop_strings[0]!r} needs a tokenizer: the engine serves "
                f"token ids (give LLM(..., detokenize=...) or stop token ids)")
        if not prompt:
            raise GenerationError("empty prompt: give at least one token")
        bad = [t for t in prompt if not 0 <= t < info.vocab_size]
        if bad:
            raise GenerationError(f"token id {bad[0]} is outside the vocabulary "
                                  f"(0..{info.vocab_size - 1})")
        bad = [t for t, _ in params.logit_bias if not 0 <= t < info.vocab_size]
        if bad:
            raise GenerationError(f"logit_bias names token id {bad[0]}, outside the vocabulary "
                                  f"(0..{info.vocab_size - 1})")
        if params.num_seqs > self.config.max_num_seqs:
            what = "beams" if params.use_beam_search else "parallel samples"
            raise GenerationError(
                f"{params.num_seqs} {what} do not fit in a step of at most max_num_seqs="
                f"{self.config.max_num_seqs} sequences; raise max_num_seqs or lower n/beam_width")
        if len(prompt) >= info.max_model_len:
            raise GenerationError(
                f"prompt of {len(prompt)} tokens is too long for the model's context of "
                f"{info.max_model_len} positions (it must leave room for a new token: at most "
                f"{info.max_model_len - 1} prompt tokens)")
        if request.prefix is not None:
            shared = self._prefixes.get(request.prefix)
            if shared is None:
                raise GenerationError(f"unknown prefix {request.prefix!r}: register it first")
            if params.prompt_logprobs is not None:
                raise GenerationError("prompt_logprobs cannot be used with a registered prefix "
                                      "(its tokens are not computed again)")
            if len(prompt) <= len(shared) or prompt[:len(shared)] != shared:
                raise GenerationError(f"the prompt does not start with prefix {request.prefix!r} "
                                      f"({len(shared)} tokens) followed by at least one token")

    def _fail_stalled(self) -> None:
        """A step that can run nothing fails the request blocking the queues, with the state
        that blocked it, so the others are served (never reached unless the scheduler has a
        bug: stats.stalled counts it)."""
        sched = self.scheduler
        request = sched.stalled()
        seqs = len(request.seqs)
        sched.remove(request)
        self.stats.stalled += 1
        self._fail(request, (
            f"the engine could not schedule this {request.status.value} request of {seqs} "
            f"sequences with nothing else running: {len(sched.waiting)} waiting, "
            f"{len(sched.swapped)} swapped, {len(sched.recompute)} preempted requests, "
            f"{sched.num_free_blocks} of {sched.num_device_blocks} KV blocks free (an engine "
            f"bug: please report it)"))

    def _fail(self, request: Request, message: str) -> None:
        request.error = message
        self.scheduler.finish(request)
        request.finish_time = time.perf_counter()
        self.stats.failed += 1
        self._done.append(self.outputs.output(request))

    def abort_request(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is not None and not request.finished:
            self.outputs.finish(request, "abort")
            self._done.append(self.outputs.output(request))

    def discard_request(self, request_id: str) -> None:
        """Forget a request as if never added: dequeued, its blocks freed, no output."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        if not request.finished:
            self.scheduler.remove(request)
        self._done = [o for o in self._done if o.request_id != request_id]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or bool(self._done)

    # --- stepping ---------------------------------------------------------------------------

    def step(self, stream: bool = False) -> list[RequestOutput]:
        """Run one iteration; returns the requests that finished in it (errors included).

        ``stream``: also the requests still running that gained tokens in this step
        (``finished`` False, every token so far), after the finished ones, so that a server can
        send each new token as it comes.
        """
        plan = self.scheduler.schedule()
        for request, reason in plan.failed:
            self._fail(request, f"the KV cache can no longer hold this request: {reason}")
        if (plan.kind == "idle" and not plan.preempted and not plan.failed
                and self.scheduler.has_work()):
            self._fail_stalled()
        finished, self._done = self._done, []
        self._copies(plan)
        start = time.perf_counter()
        if plan.prefill or plan.decode:
            self._forward(plan, finished)
        self.stats.model_seconds += time.perf_counter() - start
        self._update_stats(plan)
        if stream:
            finished.extend(self._progressed(plan))
        return finished

    def _progressed(self, plan: StepPlan) -> list[RequestOutput]:
        """The unfinished requests that sampled a token in this step (re-prefills sample none)."""
        seen: dict[str, Request] = {}
        for request in plan.decode:
            seen[request.request_id] = request
        for item in plan.prefill:
            if item.sample:
                seen[item.request.request_id] = item.request
        return [self.outputs.output(r) for r in seen.values() if not r.finished]

    def close(self) -> None:
        """Stop the tensor-parallel worker processes, if any (the engine cannot step after)."""
        self.model.close()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run(self, on_step: Callable[[LLMEngine], None] | None = None) -> list[RequestOutput]:
        """Step until every request has finished; outputs in the order requests were added."""
        outputs: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                outputs[out.request_id] = out
            if on_step is not None:
                on_step(self)
        return [outputs[r] for r in self.requests if r in outputs]

    def _copies(self, plan: StepPlan) -> None:
        self.model.swap_out(plan.swap_out)
        self.model.swap_in(plan.swap_in)
        self.model.copy_blocks(plan.copies)
        self.stats.preemptions += len(plan.preempted)
        self.stats.swap_preemptions += plan.num_swap_preemptions
        self.stats.swapped_blocks += len(plan.swap_out) + len(plan.swap_in)
        self.stats.cow_copies += len(plan.copies)

    def _forward(self, plan: StepPlan, finished: list[RequestOutput]) -> None:
        """One model step: the decode tokens of running sequences, then the prefill items.

        Without prefill items this is the decode graph (one query per sequence); with them, the
        prefill graph, where a decode token is a sequence with one new token.
        """
        step = StepInputs([], [], [], [], [], [0], [])
        decode_rows: list[tuple[Request, int, int]] = []
        for request in plan.decode:
            first = len(step.context_lens)
            for seq in request.seqs:
                step.input_ids.append(seq.tokens[-1])
                step.positions.append(len(seq.tokens) - 1)
                step.slot_mapping.append(plan.slots[seq.seq_id])
                step.block_tables.append(self._padded(plan.block_tables[seq.seq_id]))
                step.context_lens.append(len(seq.tokens))
                step.query_start_loc.append(len(step.input_ids))
                step.logits_indices.append(len(step.input_ids) - 1)
            decode_rows.append((request, first, len(step.context_lens)))
        scored: list[tuple[PrefillItem, int]] = []  # items whose prompt logprobs are asked
        for item in plan.prefill:
            if item.request.params.prompt_logprobs is not None:
                scored.append((item, len(step.input_ids)))
            step.input_ids.extend(item.seq.tokens[item.start:item.end])
            step.positions.extend(range(item.start, item.end))
            step.slot_mapping.extend(item.slot_mapping)
            step.block_tables.append(self._padded(item.block_table))
            step.context_lens.append(item.end)
            step.query_start_loc.append(len(step.input_ids))
            step.logits_indices.append(len(step.input_ids) - 1)
            self.stats.prompt_tokens += item.end - item.start
        first_prefill_row = len(step.context_lens) - len(plan.prefill)
        # Logits at every position of a scored chunk come back as extra rows: each is an empty
        # sequence (as the step's padding) whose logits index is that position.
        scored_rows = []
        for item, begin in scored:
            scored_rows.append((item, len(step.context_lens)))
            for index in range(begin, begin + item.end - item.start):
                step.block_tables.append(self._padded([]))
                step.context_lens.append(0)
                step.query_start_loc.append(len(step.input_ids))
                step.logits_indices.append(index)
        if plan.prefill:
            logits = self.model.prefill(step)
            self.stats.prefill_steps += 1
        else:
            logits = self.model.decode(step)
            self.stats.decode_steps += 1
        for item, row in scored_rows:
            self.outputs.prompt_logprobs(item, logits[row:row + item.end - item.start])
        self.outputs.step(decode_rows, plan.prefill, first_prefill_row, logits, finished)

    def _padded(self, table: list[int]) -> list[int]:
        """A block table padded to the model's width (the kernels never read the pad)."""
        width = self.model.max_blocks_per_seq
        if len(table) > width:
            raise ValueError(f"width {width} < {len(table)} blocks of a block table")
        return table + [0] * (width - len(table))

    def _update_stats(self, plan: StepPlan) -> None:
        s, sched = self.stats, self.scheduler
        s.steps += 1
        s.running = sched.num_running_seqs
        s.waiting = len(sched.waiting) + len(sched.recompute)
        s.swapped = len(sched.swapped)
        s.prefix_cache_queries = sched.prefix_cache_queries
        s.prefix_cache_hits = sched.prefix_cache_hits
        s.kv_blocks_free = sched.num_free_blocks
        s.kv_blocks_used = sched.num_device_blocks - s.kv_blocks_free
        s.kv_used = s.kv_blocks_used / max(sched.num_device_blocks, 1)


def engine_config(config: EngineConfig | None, overrides: dict) -> EngineConfig:
    """`config` (or the defaults) with keyword overrides; unknown names are errors."""
    config = config or EngineConfig()
    for key, value in overrides.items():
        if not hasattr(config, key):
            raise GenerationError(f"unknown engine option {key!r}")
        setattr(config, key, value)
    return config


def kv_blocks_for(config: EngineConfig, info) -> int:
    """How many KV blocks the engine gets: `num_blocks`, or what `kv_cache_bytes` holds, or
    enough for `max_num_seqs` sequences of the model's full length."""
    if config.num_blocks:
        return config.num_blocks
    per_block = config.block_size * info.kv_bytes_per_token
    if config.kv_cache_bytes:
        blocks = config.kv_cache_bytes // per_block
        if blocks < 1:
            raise GenerationError(f"kv_cache_bytes={config.kv_cache_bytes} holds no block of "
                                  f"{config.block_size} tokens ({per_block} bytes)")
        return int(blocks)
    per_seq = -(-info.max_model_len // config.block_size)
    return per_seq * config.max_num_seqs
