"""Iteration-level scheduling (Orca / vLLM): which requests run in the next model step.

Every step feeds the model one token for every running sequence (decode) and, in the same
forward, the prompts of newly admitted requests and the re-prefills of requests preempted by
recompute (Orca's iteration-level scheduling with selective batching: prefill and decode tokens
of different requests share one step). Policy, as vLLM's (PagedAttention §4.5):

* FCFS with memory-aware admission: waiting requests are admitted in arrival order while the
  KV block manager can hold their prompt (keeping a watermark of free blocks), the number of
  running sequences stays within ``max_num_seqs`` and the step's tokens within
  ``max_num_batched_tokens``; the first request that does not fit stops admission.
* Preempted requests come back before any new one is admitted, and nothing is admitted in a
  step that had to preempt.
* A step that cannot get a block for every running sequence preempts the latest arrived
  request (all its sequences at once): by swapping its blocks to CPU memory or by dropping them
  for a later re-prefill. The mode is the block manager's one policy
  (:meth:`BlockManager.preemption_mode_for`: the configured mode; in auto mode, recompute a
  single sequence and swap a group). A step decides all its preemptions before it reserves any
  decode slot, so a block a step copies from (copy-on-write) is never freed and reused as a
  destination in the same step.
* Liveness: when nothing runs, any preempted request that fits may resume (not only the
  oldest), and a request that no longer fits even alone (the pool shrank under it: a prefix was
  registered) is failed by itself with the reason (``StepPlan.failed``), never the whole engine.

The scheduler owns the KV block manager and is the only one that changes KV state (vLLM v1's
split): it allocates, appends, forks, frees, preempts and resumes, and registers shared
prefixes. The engine gets, per step, a :class:`StepPlan` that says what to run with which
blocks (block tables, slots, the block copies and swaps to do first), and asks the scheduler to
:meth:`~Scheduler.fork` and :meth:`~Scheduler.free` sequences as sampling and beams go.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from graphpar.errors import GenerationError, GraphparError, KVCacheError
from graphpar.serving.kv_cache_manager import (
    BlockCopy,
    BlockManager,
    PreemptionMode,
    RequestStatus,
)
from graphpar.serving.sampling import SamplingParams

__all__ = ["CacheConfig", "PrefillItem", "PrefixBlocks", "Request", "RequestStatus", "Scheduler",
           "SchedulerConfig", "SequenceState", "StepPlan"]


class SequenceState:
    """One token stream of a request (a sample or a beam).

    Between steps, a running sequence's KV is in the cache for all tokens but the last one,
    which the next decode step feeds to the model.
    """

    __slots__ = ("seq_id", "tokens", "prompt_len", "cumulative_logprob", "logprobs",
                 "finish_reason", "generator", "text", "top_logprobs")

    def __init__(self, seq_id: str, tokens: list[int], prompt_len: int,
                 generator: torch.Generator | None = None) -> None:
        self.seq_id = seq_id
        self.tokens = tokens
        self.prompt_len = prompt_len
        self.cumulative_logprob = 0.0
        self.logprobs: list[float] = []
        self.finish_reason: str | None = None
        self.generator = generator
        self.text: str | None = None  # the output text, once a text stop string ended it
        # per generated token, the most likely (token, logprob) pairs, when the request asks
        self.top_logprobs: list[list[tuple[int, float]]] = []

    @property
    def output_tokens(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    def append(self, token: int, logprob: float) -> None:
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.cumulative_logprob += logprob

    def fork(self, seq_id: str) -> SequenceState:
        """A copy of this stream's tokens and scores (its blocks: :meth:`Scheduler.fork`)."""
        child = SequenceState(seq_id, list(self.tokens), self.prompt_len, self.generator)
        child.cumulative_logprob = self.cumulative_logprob
        child.logprobs = list(self.logprobs)
        child.top_logprobs = list(self.top_logprobs)
        return child


@dataclass(eq=False)
class Request:
    """A sequence group: one prompt, its sampling parameters and its running sequences."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.perf_counter)
    seqs: list[SequenceState] = field(default_factory=list)  # running (not finished)
    finished_seqs: list[SequenceState] = field(default_factory=list)
    hypotheses: list[tuple[float, SequenceState]] = field(default_factory=list)  # beam search
    next_seq: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    error: str | None = None
    status: RequestStatus = RequestStatus.WAITING
    prefix: str | None = None  # a registered shared prefix the prompt starts with
    num_cached_tokens: int = 0  # prompt tokens whose KV was found in the cache at admission
    # Chunked prefill: the rest of the first sequence's prefill, (next position, end, sample),
    # while the request is running but its prompt is not all computed; None otherwise.
    pending: tuple[int, int, bool] | None = None
    # With params.prompt_logprobs: per prompt position, (logprob of that token given those
    # before it, the most likely (token, logprob) pairs) once computed; position 0 stays None.
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None

    def new_seq_id(self) -> str:
        seq_id = f"{self.request_id}.{self.next_seq}"
        self.next_seq += 1
        return seq_id

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def prefilling(self) -> bool:
        """Running, with prompt positions still to compute (it decodes nothing yet)."""
        return self.pending is not None


@dataclass
class PrefillItem:
    """Compute token positions ``start .. end - 1`` of ``seq``; sample from the last one when
    ``sample`` (a new prompt), not for a re-prefill after preemption. Their KV goes to
    ``slot_mapping`` (one slot per position); attention reads ``block_table``."""

    request: Request
    seq: SequenceState
    start: int
    end: int
    sample: bool
    slot_mapping: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)


@dataclass
class StepPlan:
    """What the engine does in one step, in this order: swap-out copies, swap-in copies,
    copy-on-write copies, then one forward over the ``decode`` requests' sequences (one token
    each, written at ``slots``, reading ``block_tables``) and the ``prefill`` items.

    Block tables are the physical block ids of each sequence, unpadded; the engine pads them to
    the model's width. The engine reads the plan and never asks the block manager itself."""

    prefill: list[PrefillItem] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)
    slots: dict[str, int] = field(default_factory=dict)  # decode: seq_id -> slot of its token
    block_tables: dict[str, list[int]] = field(default_factory=dict)  # decode: seq_id -> blocks
    swap_out: dict[int, int] = field(default_factory=dict)
    swap_in: dict[int, int] = field(default_factory=dict)
    copies: list[BlockCopy] = field(default_factory=list)
    preempted: list[tuple[Request, PreemptionMode]] = field(default_factory=list)
    failed: list[tuple[Request, str]] = field(default_factory=list)  # dropped from every queue

    @property
    def num_swap_preemptions(self) -> int:
        """Requests this step preempted by swapping (the others by recompute)."""
        return sum(mode is PreemptionMode.SWAP for _, mode in self.preempted)

    @property
    def kind(self) -> str:
        if self.prefill:
            return "mixed" if self.decode else "prefill"
        return "decode" if self.decode else "idle"


class PrefixBlocks(NamedTuple):
    """Where a registered prefix's prefill writes (``slot_mapping``) and reads
    (``block_table``)."""

    block_table: list[int]
    slot_mapping: list[int]


# A step's new prompt tokens when prefill is not chunked (a longer prompt still runs alone).
UNCHUNKED_PROMPT_TOKENS = 2048


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64  # sequences in one step
    max_num_batched_tokens: int | None = None  # a step's tokens; None: prompts prefill whole
    max_model_len: int = 2048

    @property
    def chunked_prefill(self) -> bool:
        return self.max_num_batched_tokens is not None

    @property
    def token_budget(self) -> int:
        """The tokens one step may run (decodes and prompt chunks)."""
        if self.max_num_batched_tokens is None:
            return UNCHUNKED_PROMPT_TOKENS
        return self.max_num_batched_tokens


@dataclass
class CacheConfig:
    """The KV block manager the scheduler builds and owns (see :class:`BlockManager`)."""

    num_device_blocks: int
    num_cpu_blocks: int = 0
    block_size: int = 16
    watermark_blocks: int = 0
    preemption_mode: str | None = None  # None/"auto", "swap" or "recompute"
    enable_prefix_caching: bool = True


class Scheduler:
    """Waiting, running, swapped and recompute queues over the KV block manager it owns.

    ``cache``: the settings of the block manager to build, or a manager already built (tests
    that set up block state first); either way only the scheduler changes it afterwards.
    """

    def __init__(self, config: SchedulerConfig, cache: CacheConfig | BlockManager) -> None:
        self.config = config
        if isinstance(cache, BlockManager):
            self.block_manager = cache
        else:
            self.block_manager = BlockManager(
                cache.num_device_blocks, cache.num_cpu_blocks, cache.block_size,
                watermark_blocks=cache.watermark_blocks, preemption_mode=cache.preemption_mode,
                enable_prefix_caching=cache.enable_prefix_caching)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.recompute: list[Request] = []
        # Sequences whose KV the last planned step wrote, and up to which position: their full
        # blocks are offered to the prefix cache once that step has run (next schedule or free).
        self._written: dict[str, tuple[SequenceState, int]] = {}
        self.prefix_cache_queries = 0  # prompt tokens of admitted requests
        self.prefix_cache_hits = 0  # of those, tokens found in the cache (not computed)

    # --- queues -----------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.check_fits(request)
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def check_fits(self, request: Request) -> None:
        """Raise KVCacheError if the request could never be held, even alone."""
        bm, params = self.block_manager, request.params
        prompt = len(request.prompt)
        total = min(prompt + params.max_tokens, self.config.max_model_len)
        bm.check_request(prompt, total - prompt, prefix=request.prefix)
        seqs = params.num_seqs
        if seqs > 1:
            b = bm.block_size
            # The prompt's full blocks stay shared through a swap and a recompute alike (the
            # block manager re-maps them on resume); everything past them may be private.
            shared = prompt // b
            needed = shared + seqs * (-(-total // b) - shared)
            if request.prefix is not None:  # its full blocks are reserved already
                needed -= bm.prefix_num_tokens(request.prefix) // b
            if needed > bm.num_device_blocks - bm.num_reserved_blocks:
                what = "beams" if params.use_beam_search else "parallel samples"
                raise KVCacheError(
                    f"KV cache too small for a request of {prompt} prompt tokens, up to "
                    f"{total - prompt} new tokens and {seqs} {what}: it may need {needed} blocks "
                    f"of {b} tokens, the device pool has {bm.num_device_blocks}"
                    f"{self._reserved_text()}. Give the KV "
                    f"cache more memory, or lower max_tokens, n or beam_width.")

    def _reserved_text(self) -> str:
        reserved = self.block_manager.num_reserved_blocks
        return f" ({reserved} reserved by registered prefixes)" if reserved else ""

    @property
    def num_running_seqs(self) -> int:
        return sum(len(r.seqs) for r in self.running)

    @property
    def num_device_blocks(self) -> int:
        """Blocks of the device KV pool."""
        return self.block_manager.num_device_blocks

    @property
    def num_free_blocks(self) -> int:
        """Free blocks of the device KV pool now."""
        return self.block_manager.num_free_blocks()

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.recompute)

    def in_flight(self) -> list[Request]:
        """Every queued request (waiting, running or preempted), in arrival order."""
        queued = [*self.running, *self.swapped, *self.recompute, *self.waiting]
        return sorted(queued, key=lambda r: r.arrival_time)

    def remove(self, request: Request) -> None:
        """Drop a finished or aborted request from every queue and free its blocks."""
        request.pending = None
        for queue in (self.running, self.swapped, self.recompute):
            if request in queue:
                queue.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        for seq in request.seqs:
            self.free(seq)

    def finish(self, request: Request) -> None:
        """The request is done (served, failed or aborted): out of every queue, its running
        sequences' blocks freed, in order."""
        self.remove(request)
        request.status = RequestStatus.FINISHED

    # --- sequences (parallel samples and beams) ---------------------------------------------

    def fork(self, parent: SequenceState, child: SequenceState) -> None:
        """``child`` (a fork of ``parent``, same request) shares every block of ``parent``
        (reference counts); its first write into the shared last block copies it."""
        self.block_manager.fork(parent.seq_id, child.seq_id)

    def free(self, seq: SequenceState) -> None:
        """Drop a finished or discarded sequence's blocks (shared blocks live on; with prefix
        caching its full blocks stay cached until evicted)."""
        self._cache_written()
        if self.block_manager.has_seq(seq.seq_id):
            self.block_manager.free(seq.seq_id)

    def _cache_written(self) -> None:
        """Offer the prefix cache the full blocks the last step wrote (it has run by now)."""
        bm = self.block_manager
        if not bm.prefix_caching:
            self._written.clear()
            return
        for seq_id, (seq, end) in self._written.items():
            if bm.has_seq(seq_id):
                bm.cache_blocks(seq_id, seq.tokens, end)
        self._written.clear()

    # --- shared prefixes --------------------------------------------------------------------

    def check_prefix_room(self, num_tokens: int) -> None:
        """Raise GenerationError if a prefix of ``num_tokens`` does not fit now (KVCacheError if
        it never could)."""
        bm = self.block_manager
        if not bm.can_register_prefix(num_tokens):
            raise GenerationError(f"no room for a prefix of {num_tokens} tokens: it needs "
                                  f"{bm.blocks_for_tokens(num_tokens)} blocks, "
                                  f"{bm.num_free_blocks()} are free")

    def register_prefix(self, prefix_id: str, num_tokens: int,
                        tokens: list[int] | None = None) -> PrefixBlocks:
        """Reserve blocks for a shared prefix; returns where its prefill writes and reads.

        Takes the prefix back and raises GenerationError if its blocks would leave a request in
        flight too little KV memory to finish even alone. With ``tokens`` (and prefix caching)
        its full blocks are cached blocks too: prompts that start with them find them."""
        self.check_prefix_room(num_tokens)
        bm = self.block_manager
        blocks = list(bm.register_prefix(prefix_id, num_tokens))
        for request in self.in_flight():
            try:
                self.check_fits(request)
            except GraphparError as exc:
                # Taken back unkeyed: its blocks were never written (issue 28).
                bm.unregister_prefix(prefix_id)
                raise GenerationError(
                    f"cannot register the prefix now: its blocks would leave request "
                    f"{request.request_id!r} (in flight) too little KV memory to finish ({exc}) "
                    f"Register it when fewer requests run, or give the KV cache more memory."
                ) from None
        if tokens is not None:  # kept: the caller prefills it before the next step
            bm.cache_prefix(prefix_id, tokens)
        return PrefixBlocks(blocks, bm.prefix_slot_mapping(prefix_id))

    def unregister_prefix(self, prefix_id: str) -> None:
        """Release a prefix's blocks: running requests keep what they map; queued ones prefill
        its tokens themselves."""
        self.block_manager.unregister_prefix(prefix_id)
        for request in self.in_flight():
            if request.prefix == prefix_id:
                request.prefix = None

    # --- one step ---------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """The next step: decode every running sequence, continue the prompts being prefilled
        in chunks, then admit what fits beside them."""
        self._cache_written()
        plan = StepPlan()
        self._schedule_decode(plan)
        tokens_left = self._schedule_chunks(plan)
        if not self.swapped and not plan.preempted:
            self._schedule_prefill(plan, tokens_left)
        self._attach_blocks(plan)
        return plan

    def _attach_blocks(self, plan: StepPlan) -> None:
        """The step's block tables and prefill slots, once every block of the step is placed."""
        bm = self.block_manager
        for request in plan.decode:
            for seq in request.seqs:
                plan.block_tables[seq.seq_id] = bm.block_table(seq.seq_id)
                self._written[seq.seq_id] = (seq, len(seq.tokens))
        for item in plan.prefill:
            item.block_table = bm.block_table(item.seq.seq_id)
            item.slot_mapping = bm.slot_mapping(item.seq.seq_id, item.start, item.end)
            self._written[item.seq.seq_id] = (item.seq, item.end)

    def _schedule_chunks(self, plan: StepPlan) -> int:
        """The next chunks of prompts being prefilled, oldest first, within the step's token
        budget after the decodes; returns the tokens left for new prompts. Their blocks are
        held already, so they go on even while requests wait swapped."""
        tokens_left = self.config.token_budget - len(plan.slots)
        for request in self.running:
            if request.pending is None or tokens_left <= 0:
                continue
            start, end, sample = request.pending
            tokens_left -= self._plan_prefill(plan, request, request.seqs[0], start, end, sample,
                                              tokens_left)
        return tokens_left

    def _plan_prefill(self, plan: StepPlan, request: Request, seq: SequenceState, start: int,
                      end: int, sample: bool, tokens_left: int) -> int:
        """Plan positions ``start .. end - 1`` of ``seq``: with chunked prefill at most
        ``tokens_left`` of them now and the rest in later steps (``request.pending``). Returns
        the tokens planned."""
        if self.config.chunked_prefill and end - start > tokens_left:
            cut = start + max(tokens_left, 0)
            plan.prefill.append(PrefillItem(request, seq, start, cut, sample=False))
            request.pending = (cut, end, sample)
            return cut - start
        plan.prefill.append(PrefillItem(request, seq, start, end, sample))
        request.pending = None
        return end - start

    def _schedule_prefill(self, plan: StepPlan, tokens_left: int) -> None:
        """Resume preempted requests, then admit waiting ones, within ``tokens_left``.

        Without chunked prefill a prompt is prefilled whole, and one larger than what is left
        waits unless the step has nothing else. With it, a single-sequence prompt (new, or a
        re-prefill) takes what is left of the budget and continues in later steps; a group of
        several sequences re-prefills whole, as before."""
        bm = self.block_manager
        chunked = self.config.chunked_prefill
        seqs_left = self.config.max_num_seqs - self.num_running_seqs
        busy = bool(plan.slots) or bool(plan.prefill)
        for request in list(self.recompute):
            group, shared = request.request_id, len(request.prompt)
            tokens = sum(bm.num_tokens(s.seq_id) for s in request.seqs)
            chunk = chunked and len(request.seqs) == 1
            if len(request.seqs) > seqs_left or (busy and (tokens_left <= 0 if chunk
                                                           else tokens > tokens_left)):
                return
            try:
                fits_now = bm.can_resume(group, shared)
            except KVCacheError as exc:
                self._fail(request, plan, str(exc))
                continue
            if not self._room(bm.blocks_to_resume(group, shared), fits_now):
                if self.running:
                    return
                continue  # nothing runs: a later preempted request that fits may go first
            resumed = bm.resume(group, shared)
            plan.copies.extend(c for a in resumed.allocations for c in a.copies)
            by_id = {s.seq_id: s for s in request.seqs}
            for alloc in resumed.allocations:
                seq = by_id[alloc.seq]
                # A prompt preempted before its first token (mid chunked prefill) samples it.
                tokens_left -= self._plan_prefill(plan, request, seq, alloc.num_cached_tokens,
                                                  alloc.num_tokens, seq.num_generated == 0,
                                                  tokens_left if chunk else tokens)
            self.recompute.remove(request)
            self._start(request)
            seqs_left -= len(request.seqs)
            busy = True
        if self.recompute:
            return  # preempted requests come back before any new one is admitted
        while self.waiting:
            request = self.waiting[0]
            prompt = len(request.prompt)
            seqs = request.params.num_seqs
            if seqs > seqs_left or (busy and (tokens_left <= 0 if chunked
                                              else prompt > tokens_left)):
                return
            prefix = request.prefix
            # a prompt whose log-probabilities are asked for is computed whole: no cache hits
            looked_up = None if request.params.prompt_logprobs is not None else request.prompt
            try:
                fits_now = bm.can_allocate(prompt, prefix, looked_up)
            except KVCacheError as exc:
                self.waiting.popleft()
                self._fail(request, plan, str(exc))
                continue
            if not self._room(bm.blocks_to_allocate(prompt, prefix, looked_up), fits_now):
                return
            self.waiting.popleft()
            seq = request.seqs[0]
            alloc = bm.allocate(seq.seq_id, prompt, group=request.request_id, prefix=prefix,
                                tokens=looked_up)
            plan.copies.extend(alloc.copies)  # the prefix's partly filled last block
            request.num_cached_tokens = alloc.num_cached_tokens
            self.prefix_cache_queries += prompt
            self.prefix_cache_hits += alloc.num_cached_tokens
            self._start(request)
            tokens_left -= self._plan_prefill(plan, request, seq, alloc.num_cached_tokens, prompt,
                                              True, tokens_left if chunked else prompt)
            seqs_left -= seqs
            busy = True

    def _room(self, needed: int, within_watermark: bool) -> bool:
        """Admit within the watermark, or past it when nothing else runs (else a request as
        large as the pool would wait forever)."""
        if within_watermark:
            return True
        return not self.running and needed <= self.block_manager.num_free_blocks()

    def _start(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self.running.sort(key=lambda r: r.arrival_time)

    def _schedule_decode(self, plan: StepPlan) -> None:
        """Keep the oldest running requests whose next tokens fit, preempting from the latest;
        then reserve their slots (every preemption before any copy-on-write of the step)."""
        bm = self.block_manager
        queue = deque(self.running)
        scheduled: list[Request] = []
        reserved = 0  # blocks the kept requests' appends take
        while queue:
            request = queue.popleft()
            needed = self._blocks_to_append(request)
            while needed > bm.num_free_blocks() - reserved and queue:
                self._preempt(queue.pop(), plan)
                # A preempted group may have shared a block with a kept one, which then
                # writes in place instead of copying: count the kept groups again.
                reserved = sum(self._blocks_to_append(r) for r in scheduled)
                needed = self._blocks_to_append(request)
            if needed > bm.num_free_blocks() - reserved:
                self._preempt(request, plan)
                continue
            reserved += needed
            scheduled.append(request)
        self.running = scheduled
        for request in scheduled:
            self._append_slots(request, plan)
        if not plan.preempted:
            self._swap_in(plan)
        plan.decode = [r for r in self.running if not r.prefilling]

    def _blocks_to_append(self, request: Request) -> int:
        """Blocks a request's decode step takes (none while its prompt is being prefilled:
        the prompt's blocks are all held from its admission)."""
        return 0 if request.prefilling else \
            self.block_manager.num_blocks_to_append(request.request_id)

    def _append_slots(self, request: Request, plan: StepPlan) -> None:
        if request.prefilling:
            return
        for seq in request.seqs:
            result = self.block_manager.append_slot(seq.seq_id)
            plan.slots[seq.seq_id] = result.slot_index
            if result.copy is not None:
                plan.copies.append(result.copy)

    def _swap_in(self, plan: StepPlan) -> None:
        bm = self.block_manager
        seqs_left = self.config.max_num_seqs - self.num_running_seqs
        for request in list(self.swapped):
            group = request.request_id
            # The group's blocks, and the blocks of its first decode step right after.
            needed = bm.blocks_to_swap_in(group) + (0 if request.prefilling
                                                    else bm.num_blocks_to_append(group))
            if len(request.seqs) > seqs_left or not self._room(
                    needed, bm.num_free_blocks() - needed >= bm.watermark_blocks):
                if self.running:
                    return
                continue  # nothing runs: a later swapped request that fits may go first
            plan.swap_in.update(bm.swap_in(group))
            self.swapped.remove(request)
            self._start(request)
            self._append_slots(request, plan)
            seqs_left -= len(request.seqs)

    def _fail(self, request: Request, plan: StepPlan, reason: str) -> None:
        """Drop a request the pool can no longer hold; the engine reports ``reason``."""
        self.remove(request)
        plan.failed.append((request, reason))

    def stalled(self) -> Request | None:
        """The request that blocks the queues when a step can run nothing, or None."""
        for queue in (self.swapped, self.recompute, self.waiting):
            if queue:
                return queue[0]
        return None

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        """Evict a running request, by the block manager's policy (the only one: the mode
        configured, or auto), and queue it to come back."""
        preemption = self.block_manager.preempt(request.request_id)
        plan.preempted.append((request, preemption.mode))
        if preemption.mode is PreemptionMode.RECOMPUTE:
            request.pending = None  # its prompt is re-prefilled from the start on resume
        if preemption.mode is PreemptionMode.SWAP:
            plan.swap_out.update(preemption.mapping)
            request.status = RequestStatus.SWAPPED
            _insert_by_arrival(self.swapped, request)
        else:
            request.status = RequestStatus.RECOMPUTE
            _insert_by_arrival(self.recompute, request)
        if request in self.running:
            self.running.remove(request)


def _insert_by_arrival(queue: list[Request], request: Request) -> None:
    queue.append(request)
    queue.sort(key=lambda r: r.arrival_time)
