"""The serving engine: requests in, tokens out, one model step per iteration.

:class:`LLMEngine` joins the pieces of vLLM's design: the KV block manager
(:mod:`graphpar.serving.kv_cache_manager`), the iteration-level FCFS scheduler
(:mod:`graphpar.serving.scheduler`), the model's paged prefill/decode programs
(:mod:`graphpar.serving.paged_model`) and the samplers (:mod:`graphpar.serving.sampling`).
Each :meth:`LLMEngine.step` schedules, performs the block copies the block manager asked for
(swap-out, swap-in, copy-on-write), runs one prefill or decode step, samples, applies stop
conditions and frees finished sequences.

Parallel sampling forks the prompt's sequence after the prefill (every block shared, reference
counts); beam search forks and frees beams every step. The first write into a shared block copies
it (copy-on-write), so only the last, partly filled block is ever copied.

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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from graphpar.errors import GenerationError, GraphparError
from graphpar.serving.kv_cache_manager import BlockManager
from graphpar.serving.paged_model import PagedDecoder, StepInputs
from graphpar.serving.sampling import SamplingParams, beam_candidates, beam_score, sample_tokens
from graphpar.serving.scheduler import Request, Scheduler, SchedulerConfig, StepPlan
from graphpar.serving.scheduler import Sequence as Seq

if TYPE_CHECKING:  # the compiler's result type only: the runtime does not compile
    from graphpar.serving.compile import ServingPrograms

__all__ = ["CompletionOutput", "EngineConfig", "EngineStats", "LLMEngine", "RequestOutput",
           "token_ids_of"]


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
    """

    block_size: int = 16
    num_blocks: int = 0
    kv_cache_bytes: int = 0
    swap_blocks: int | None = None
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    watermark: float = 0.01
    preemption_mode: str | None = None  # None (auto), "swap" or "recompute"
    kernel: str = "auto"
    tensor_parallel: int = 1
    tp_plan: str = "auto"
    tp_cluster: str = "cpu"
    seed: int = 0


@dataclass
class CompletionOutput:
    """One generated sequence of a request."""

    index: int
    token_ids: list[int]
    cumulative_logprob: float
    logprobs: list[float]
    finish_reason: str | None  # "stop", "length", or None while running
    text: str | None = None  # the decoded tokens, when the engine has a tokenizer


@dataclass
class RequestOutput:
    """The state of a request: its completions, and timing once finished (seconds)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def latency(self) -> float | None:
        """End-to-end latency in seconds (measured), once finished."""
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class EngineStats:
    """Counters since the engine started (times in seconds, measured)."""

    steps: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    swapped_blocks: int = 0
    cow_copies: int = 0
    finished: int = 0
    failed: int = 0
    stalled: int = 0  # requests failed because a step could run nothing (an engine bug)
    running: int = 0
    waiting: int = 0
    swapped: int = 0
    kv_used: float = 0.0  # fraction of device blocks in use
    start: float = field(default_factory=time.perf_counter)
    model_seconds: float = 0.0

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / max(self.elapsed, 1e-9)


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
        self.block_manager = BlockManager(
            num_blocks, swap, config.block_size,
            watermark_blocks=int(config.watermark * num_blocks),
            preemption_mode=config.preemption_mode)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs,
                                                   config.max_num_batched_tokens,
                                                   self.info.max_model_len), self.block_manager)
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
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
        bm = self.block_manager
        if not bm.can_register_prefix(len(tokens)):
            raise GenerationError(f"no room for a prefix of {len(tokens)} tokens: it needs "
                                  f"{bm.blocks_for_tokens(len(tokens))} blocks, "
                                  f"{bm.num_free_blocks()} are free")
        prefix_id = f"prefix-{next(self._ids)}"
        blocks = list(bm.register_prefix(prefix_id, len(tokens)))
        self._check_in_flight_fit(prefix_id)
        width = self.model.max_blocks_per_seq
        self.model.prefill(StepInputs(
            input_ids=tokens, positions=list(range(len(tokens))),
            slot_mapping=bm.prefix_slot_mapping(prefix_id),
            block_tables=[blocks + [0] * (width - len(blocks))], context_lens=[len(tokens)],
            query_start_loc=[0, len(tokens)], logits_indices=[len(tokens) - 1]))
        self._prefixes[prefix_id] = tokens
        self.stats.prompt_tokens += len(tokens)
        return prefix_id

    def _check_in_flight_fit(self, prefix_id: str) -> None:
        """Take a just reserved prefix back, raising GenerationError, if its blocks would leave
        a request in flight too little KV memory to finish even alone."""
        for request in self.requests.values():
            if request.finished:
                continue
            try:
                self.scheduler.check_fits(request)
            except GraphparError as exc:
                self.block_manager.unregister_prefix(prefix_id)
                raise GenerationError(
                    f"cannot register the prefix now: its blocks would leave request "
                    f"{request.request_id!r} (in flight) too little KV memory to finish ({exc}) "
                    f"Register it when fewer requests run, or give the KV cache more memory."
                ) from None

    def unregister_prefix(self, prefix_id: str) -> None:
        """Release a prefix's blocks (requests still using them keep them alive; requests not
        yet admitted prefill its tokens themselves)."""
        if self._prefixes.pop(prefix_id, None) is None:
            raise GenerationError(f"unknown prefix {prefix_id!r}")
        self.block_manager.unregister_prefix(prefix_id)
        for request in self.requests.values():
            if request.prefix == prefix_id:
                request.prefix = None

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
            request.seqs.append(Seq(request.new_seq_id(), list(prompt), len(prompt), generator))
            self.scheduler.add(request)
        except GraphparError as exc:
            self._fail(request, str(exc))
        return request_id

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
            if len(prompt) <= len(shared) or prompt[:len(shared)] != shared:
                raise GenerationError(f"the prompt does not start with prefix {request.prefix!r} "
                                      f"({len(shared)} tokens) followed by at least one token")

    def _fail_stalled(self) -> None:
        """A step that can run nothing fails the request blocking the queues, with the state
        that blocked it, so the others are served (never reached unless the scheduler has a
        bug: stats.stalled counts it)."""
        sched, bm = self.scheduler, self.block_manager
        request = sched.stalled()
        seqs = len(request.seqs)
        sched.remove(request)
        self.stats.stalled += 1
        self._fail(request, (
            f"the engine could not schedule this {request.status} request of {seqs} sequences "
            f"with nothing else running: {len(sched.waiting)} waiting, {len(sched.swapped)} "
            f"swapped, {len(sched.recompute)} preempted requests, {bm.num_free_blocks()} of "
            f"{bm.num_device_blocks} KV blocks free (an engine bug: please report it)"))

    def _fail(self, request: Request, message: str) -> None:
        request.error = message
        request.status = "finished"
        request.finish_time = time.perf_counter()
        self.stats.failed += 1
        self._done.append(self._output(request))

    def abort_request(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is not None and not request.finished:
            self._finish(request, "abort")
            self._done.append(self._output(request))

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

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns the requests that finished in it (errors included)."""
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
        return finished

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
        self.stats.swapped_blocks += len(plan.swap_out) + len(plan.swap_in)
        self.stats.cow_copies += len(plan.copies)

    def _forward(self, plan: StepPlan, finished: list[RequestOutput]) -> None:
        """One model step: the decode tokens of running sequences, then the prefill items.

        Without prefill items this is the decode graph (one query per sequence); with them, the
        prefill graph, where a decode token is a sequence with one new token.
        """
        bm, width = self.block_manager, self.model.max_blocks_per_seq
        step = StepInputs([], [], [], [], [], [0], [])
        decode_rows: list[tuple[Request, int, int]] = []
        for request in plan.decode:
            first = len(step.context_lens)
            for seq in request.seqs:
                step.input_ids.append(seq.tokens[-1])
                step.positions.append(len(seq.tokens) - 1)
                step.slot_mapping.append(plan.slots[seq.seq_id])
                step.block_tables.append(bm.block_table(seq.seq_id, width))
                step.context_lens.append(len(seq.tokens))
                step.query_start_loc.append(len(step.input_ids))
                step.logits_indices.append(len(step.input_ids) - 1)
            decode_rows.append((request, first, len(step.context_lens)))
        for item in plan.prefill:
            seq_id = item.seq.seq_id
            step.input_ids.extend(item.seq.tokens[item.start:item.end])
            step.positions.extend(range(item.start, item.end))
            step.slot_mapping.extend(bm.slot_mapping(seq_id, item.start, item.end))
            step.block_tables.append(bm.block_table(seq_id, width))
            step.context_lens.append(item.end)
            step.query_start_loc.append(len(step.input_ids))
            step.logits_indices.append(len(step.input_ids) - 1)
            self.stats.prompt_tokens += item.end - item.start
        if plan.prefill:
            logits = self.model.prefill(step)
            self.stats.prefill_steps += 1
        else:
            logits = self.model.decode(step)
            self.stats.decode_steps += 1
        self._decode_tokens(decode_rows, logits, finished)
        now = time.perf_counter()
        for row, item in enumerate(plan.prefill, start=len(step.context_lens) -
                                   len(plan.prefill)):
            if not item.sample:
                continue
            request = item.request
            request.first_token_time = now
            row_logits = logits[row:row + 1]
            if request.params.use_beam_search:
                self._beam_step(request, row_logits, finished)
            else:
                self._first_samples(request, row_logits, finished)

    def _first_samples(self, request: Request, logits: torch.Tensor,
                       finished: list[RequestOutput]) -> None:
        """The prompt's first tokens: one per parallel sample, forking the prompt's blocks."""
        params = request.params
        parent = request.seqs[0]
        for _ in range(params.n - 1):
            child = parent.fork(request.new_seq_id())
            if params.temperature > 0:
                child.generator = torch.Generator().manual_seed(
                    int(torch.randint(0, 2**62, (1,), generator=parent.generator)))
            self.block_manager.fork(parent.seq_id, child.seq_id)
            request.seqs.append(child)
        rows = logits.expand(len(request.seqs), -1)
        tokens, logprobs = sample_tokens(rows, [params] * len(request.seqs),
                                         [s.generator for s in request.seqs])
        for seq, token, logprob in zip(list(request.seqs), tokens, logprobs):
            self._append(request, seq, token, logprob)
        self._maybe_finish(request, finished)

    def _decode_tokens(self, rows: list[tuple[Request, int, int]], logits: torch.Tensor,
                       finished: list[RequestOutput]) -> None:
        """Next tokens of running sequences from their logits rows ``[a, b)`` per request."""
        sampled = [(r, a, b) for r, a, b in rows if not r.params.use_beam_search]
        if sampled:
            index = [i for _, a, b in sampled for i in range(a, b)]
            rows_logits = logits[:len(index)] if index == list(range(len(index))) else \
                logits[torch.tensor(index)]
            seqs = [s for r, _, _ in sampled for s in r.seqs]
            params = [r.params for r, a, b in sampled for _ in range(a, b)]
            tokens, logprobs = sample_tokens(rows_logits, params, [s.generator for s in seqs])
            owners = [r for r, a, b in sampled for _ in range(a, b)]
            for request, seq, token, logprob in zip(owners, seqs, tokens, logprobs):
                self._append(request, seq, token, logprob)
            for request, _, _ in sampled:
                self._maybe_finish(request, finished)
        for request, a, b in rows:
            if request.params.use_beam_search:
                self._beam_step(request, logits[a:b], finished)

    # --- tokens and stop conditions -----------------------------------------------------------

    def _stop_reason(self, request: Request, seq: Seq) -> str | None:
        params, token = request.params, seq.tokens[-1]
        if not params.ignore_eos and token in self.info.eos_token_ids:
            return "stop"
        if token in params.stop_token_ids:
            return "stop"
        for stop in params.stop_sequences:
            if seq.num_generated >= len(stop) and seq.tokens[-len(stop):] == list(stop):
                return "stop"
        if params.stop_strings:
            text = self.detokenize(seq.output_tokens)
            found = [(text.find(s), s) for s in params.stop_strings if s in text]
            if found:
                at, stop = min(found)
                seq.text = text[:at + len(stop)] if params.include_stop_str_in_output \
                    else text[:at]
                return "stop"
        if seq.num_generated >= params.max_tokens or len(seq.tokens) >= self.info.max_model_len:
            return "length"
        return None

    def _append(self, request: Request, seq: Seq, token: int, logprob: float) -> None:
        seq.append(token, logprob)
        self.stats.generated_tokens += 1
        reason = self._stop_reason(request, seq)
        if reason is not None:
            seq.finish_reason = reason
            request.seqs.remove(seq)
            request.finished_seqs.append(seq)
            self.scheduler.free_seq(seq)

    def _maybe_finish(self, request: Request, finished: list[RequestOutput]) -> None:
        if not request.seqs:
            self._finish(request, None)
            finished.append(self._output(request))

    def _finish(self, request: Request, reason: str | None) -> None:
        for seq in list(request.seqs):
            seq.finish_reason = seq.finish_reason or reason
            self.scheduler.free_seq(seq)
            request.finished_seqs.append(seq)
        request.seqs = []
        self.scheduler.remove(request)
        request.status = "finished"
        request.finish_time = time.perf_counter()
        self.stats.finished += 1

    def _beam_step(self, request: Request, logits: torch.Tensor,
                   finished: list[RequestOutput]) -> None:
        """One beam-search step: keep the ``beam_width`` best extensions, fork and free beams."""
        params, width = request.params, request.params.beam_width
        beams = request.seqs
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos
                                             else set(self.info.eos_token_ids))
        children: list[tuple[int, int, float]] = []  # (parent, token, new cumulative)
        for rank, cand in enumerate(beam_candidates(logits, [b.cumulative_logprob for b in beams],
                                                    width)):
            parent = beams[cand.parent]
            if cand.token in stops:
                if rank < width:  # a finished hypothesis, as Hugging Face's BeamSearchScorer
                    hyp = parent.fork(request.new_seq_id())
                    hyp.append(cand.token, cand.score - parent.cumulative_logprob)
                    hyp.finish_reason = "stop"
                    self._add_hypothesis(request, hyp)
                continue
            children.append((cand.parent, cand.token, cand.score))
            if len(children) == width:
                break
        self.stats.generated_tokens += len(children)
        extended: list[tuple[Seq, int, float]] = []  # (beam, token, its logprob)
        taken: set[int] = set()
        for parent_index, token, score in children:
            parent = beams[parent_index]
            if parent_index in taken:  # fork before the parent takes its own token
                beam = parent.fork(request.new_seq_id())
                self.block_manager.fork(parent.seq_id, beam.seq_id)
            else:
                beam = parent  # the first child continues the parent's sequence in place
                taken.add(parent_index)
            extended.append((beam, token, score - parent.cumulative_logprob))
        for index, parent in enumerate(beams):
            if index not in taken:
                self.scheduler.free_seq(parent)  # refcounts drop; shared blocks survive
        request.seqs = []
        for beam, token, logprob in extended:
            beam.append(token, logprob)
            request.seqs.append(beam)
        self._beam_done(request, finished)

    def _add_hypothesis(self, request: Request, seq: Seq) -> None:
        params = request.params
        score = beam_score(seq.cumulative_logprob, seq.num_generated, params.length_penalty)
        request.hypotheses.append((score, seq))
        request.hypotheses.sort(key=lambda h: -h[0])
        del request.hypotheses[params.beam_width:]

    def _beam_done(self, request: Request, finished: list[RequestOutput]) -> None:
        params = request.params
        beams = request.seqs
        at_limit = bool(beams) and (beams[0].num_generated >= params.max_tokens
                                    or len(beams[0].tokens) >= self.info.max_model_len)
        done = not beams or at_limit
        if not done and len(request.hypotheses) >= params.beam_width:
            best = max(b.cumulative_logprob for b in beams)
            worst = request.hypotheses[-1][0]
            done = worst >= beam_score(best, beams[0].num_generated, params.length_penalty)
        if not done:
            return
        for beam in beams:
            self.scheduler.free_seq(beam)
            if at_limit:
                beam.finish_reason = "length"
                self._add_hypothesis(request, beam)
        request.seqs = []
        request.finished_seqs = [seq for _, seq in request.hypotheses[:params.n]]
        self._finish(request, None)
        finished.append(self._output(request))

    # --- outputs ----------------------------------------------------------------------------

    def _output(self, request: Request) -> RequestOutput:
        if request.params.use_beam_search:  # best first once finished; the live beams before
            seqs = request.finished_seqs if request.finished else list(request.seqs)
        else:  # samples in the order they were created
            seqs = sorted(request.finished_seqs + request.seqs,
                          key=lambda s: int(s.seq_id.rsplit(".", 1)[1]))
        outputs = [CompletionOutput(i, s.output_tokens, s.cumulative_logprob, list(s.logprobs),
                                    s.finish_reason, self._text(s)) for i, s in enumerate(seqs)]
        return RequestOutput(request.request_id, list(request.prompt), outputs,
                             request.finished, request.error, request.arrival_time,
                             request.first_token_time, request.finish_time)

    def _text(self, seq: Seq) -> str | None:
        if seq.text is not None or self.detokenize is None:
            return seq.text
        return self.detokenize(seq.output_tokens)

    def _update_stats(self, plan: StepPlan) -> None:
        s, sched, bm = self.stats, self.scheduler, self.block_manager
        s.steps += 1
        s.running = sched.num_running_seqs
        s.waiting = len(sched.waiting) + len(sched.recompute)
        s.swapped = len(sched.swapped)
        s.kv_used = 1.0 - bm.num_free_blocks() / max(bm.num_device_blocks, 1)


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
