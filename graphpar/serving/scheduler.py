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
  for a later re-prefill (the block manager's policy: recompute a single sequence, swap a group).
  A step decides all its preemptions before it reserves any decode slot, so a block a step
  copies from (copy-on-write) is never freed and reused as a destination in the same step.
* Liveness: when nothing runs, any preempted request that fits may resume (not only the
  oldest), and a request that no longer fits even alone (the pool shrank under it: a prefix was
  registered) is failed by itself with the reason (``StepPlan.failed``), never the whole engine.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from graphpar.errors import KVCacheError
from graphpar.serving.kv_cache_manager import BlockCopy, BlockManager, PreemptionMode
from graphpar.serving.sampling import SamplingParams

__all__ = ["PrefillItem", "Request", "Scheduler", "SchedulerConfig", "Sequence", "StepPlan"]


class Sequence:
    """One token stream of a request (a sample or a beam).

    Between steps, a running sequence's KV is in the cache for all tokens but the last one,
    which the next decode step feeds to the model.
    """

    __slots__ = ("seq_id", "tokens", "prompt_len", "cumulative_logprob", "logprobs",
                 "finish_reason", "generator", "text")

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

    def fork(self, seq_id: str) -> Sequence:
        child = Sequence(seq_id, list(self.tokens), self.prompt_len, self.generator)
        child.cumulative_logprob = self.cumulative_logprob
        child.logprobs = list(self.logprobs)
        return child


@dataclass(eq=False)
class Request:
    """A sequence group: one prompt, its sampling parameters and its running sequences."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.perf_counter)
    seqs: list[Sequence] = field(default_factory=list)  # running (not finished)
    finished_seqs: list[Sequence] = field(default_factory=list)
    hypotheses: list[tuple[float, Sequence]] = field(default_factory=list)  # beam search
    next_seq: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    error: str | None = None
    status: str = "waiting"  # waiting | running | swapped | recompute | finished
    prefix: str | None = None  # a registered shared prefix the prompt starts with

    def new_seq_id(self) -> str:
        seq_id = f"{self.request_id}.{self.next_seq}"
        self.next_seq += 1
        return seq_id

    @property
    def finished(self) -> bool:
        return self.status == "finished"


@dataclass
class PrefillItem:
    """Compute token positions ``start .. end - 1`` of ``seq``; sample from the last one when
    ``sample`` (a new prompt), not for a re-prefill after preemption."""

    request: Request
    seq: Sequence
    start: int
    end: int
    sample: bool


@dataclass
class StepPlan:
    """What the engine does in one step, in this order: swap-out copies, swap-in copies,
    copy-on-write copies, then one forward over the ``decode`` requests' sequences (one token
    each, at ``slots``) and the ``prefill`` items."""

    prefill: list[PrefillItem] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)
    slots: dict[str, int] = field(default_factory=dict)  # decode: seq_id -> slot of its token
    swap_out: dict[int, int] = field(default_factory=dict)
    swap_in: dict[int, int] = field(default_factory=dict)
    copies: list[BlockCopy] = field(default_factory=list)
    preempted: list[tuple[Request, PreemptionMode]] = field(default_factory=list)
    failed: list[tuple[Request, str]] = field(default_factory=list)  # dropped from every queue

    @property
    def kind(self) -> str:
        if self.prefill:
            return "mixed" if self.decode else "prefill"
        return "decode" if self.decode else "idle"


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64  # sequences in one step
    max_num_batched_tokens: int = 2048  # prompt tokens in one prefill step
    max_model_len: int = 2048


class Scheduler:
    """Waiting, running, swapped and recompute queues over one :class:`BlockManager`."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.bm = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.recompute: list[Request] = []

    # --- queues -----------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.check_fits(request)
        request.status = "waiting"
        self.waiting.append(request)

    def check_fits(self, request: Request) -> None:
        """Raise KVCacheError if the request could never be held, even alone."""
        params = request.params
        prompt = len(request.prompt)
        total = min(prompt + params.max_tokens, self.config.max_model_len)
        self.bm.check_request(prompt, total - prompt, prefix=request.prefix)
        seqs = params.num_seqs
        if seqs > 1:
            b = self.bm.block_size
            # The prompt's full blocks stay shared through a swap and a recompute alike (the
            # block manager re-maps them on resume); everything past them may be private.
            shared = prompt // b
            needed = shared + seqs * (-(-total // b) - shared)
            if request.prefix is not None:  # its full blocks are reserved already
                needed -= self.bm.prefix_num_tokens(request.prefix) // b
            if needed > self.bm.num_device_blocks - self.bm.num_reserved_blocks:
                what = "beams" if params.use_beam_search else "parallel samples"
                raise KVCacheError(
                    f"KV cache too small for a request of {prompt} prompt tokens, up to "
                    f"{total - prompt} new tokens and {seqs} {what}: it may need {needed} blocks "
                    f"of {b} tokens, the device pool has {self.bm.num_device_blocks}"
                    f"{self._reserved_text()}. Give the KV "
                    f"cache more memory, or lower max_tokens, n or beam_width.")

    def _reserved_text(self) -> str:
        reserved = self.bm.num_reserved_blocks
        return f" ({reserved} reserved by registered prefixes)" if reserved else ""

    @property
    def num_running_seqs(self) -> int:
        return sum(len(r.seqs) for r in self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.recompute)

    def remove(self, request: Request) -> None:
        """Drop a finished or aborted request from every queue and free its blocks."""
        for queue in (self.running, self.swapped, self.recompute):
            if request in queue:
                queue.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        for seq in request.seqs:
            if self.bm.has_seq(seq.seq_id):
                self.bm.free(seq.seq_id)

    def free_seq(self, seq: Sequence) -> None:
        if self.bm.has_seq(seq.seq_id):
            self.bm.free(seq.seq_id)

    # --- one step ---------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """The next step: decode every running sequence, then admit what fits beside it."""
        plan = StepPlan()
        self._schedule_decode(plan)
        if not self.swapped and not plan.preempted:
            self._schedule_prefill(plan)
        return plan

    def _schedule_prefill(self, plan: StepPlan) -> None:
        tokens_left = self.config.max_num_batched_tokens - len(plan.slots)
        seqs_left = self.config.max_num_seqs - self.num_running_seqs
        busy = bool(plan.slots)
        for request in list(self.recompute):
            group, shared = request.request_id, len(request.prompt)
            tokens = sum(self.bm.num_tokens(s.seq_id) for s in request.seqs)
            if len(request.seqs) > seqs_left or (busy and tokens > tokens_left):
                return
            try:
                fits_now = self.bm.can_resume(group, shared)
            except KVCacheError as exc:
                self._fail(request, plan, str(exc))
                continue
            if not self._room(self.bm.blocks_to_resume(group, shared), fits_now):
                if self.running:
                    return
                continue  # nothing runs: a later preempted request that fits may go first
            resumed = self.bm.resume(group, shared)
            plan.copies.extend(c for a in resumed.allocations for c in a.copies)
            by_id = {s.seq_id: s for s in request.seqs}
            for alloc in resumed.allocations:
                plan.prefill.append(PrefillItem(request, by_id[alloc.seq], alloc.num_cached_tokens,
                                                alloc.num_tokens, sample=False))
            self.recompute.remove(request)
            self._start(request)
            tokens_left -= tokens
            seqs_left -= len(request.seqs)
            busy = True
        if self.recompute:
            return  # preempted requests come back before any new one is admitted
        while self.waiting:
            request = self.waiting[0]
            prompt = len(request.prompt)
            seqs = request.params.num_seqs
            if seqs > seqs_left or (busy and prompt > tokens_left):
                return
            prefix = request.prefix
            try:
                fits_now = self.bm.can_allocate(prompt, prefix)
            except KVCacheError as exc:
                self.waiting.popleft()
                self._fail(request, plan, str(exc))
                continue
            if not self._room(self.bm.blocks_to_allocate(prompt, prefix), fits_now):
                return
            self.waiting.popleft()
            seq = request.seqs[0]
            alloc = self.bm.allocate(seq.seq_id, prompt, group=request.request_id, prefix=prefix)
            plan.copies.extend(alloc.copies)  # the prefix's partly filled last block
            plan.prefill.append(PrefillItem(request, seq, alloc.num_cached_tokens, prompt,
                                            sample=True))
            self._start(request)
            tokens_left -= prompt
            seqs_left -= seqs
            busy = True

    def _room(self, needed: int, within_watermark: bool) -> bool:
        """Admit within the watermark, or past it when nothing else runs (else a request as
        large as the pool would wait forever)."""
        if within_watermark:
            return True
        return not self.running and needed <= self.bm.num_free_blocks()

    def _start(self, request: Request) -> None:
        request.status = "running"
        self.running.append(request)
        self.running.sort(key=lambda r: r.arrival_time)

    def _schedule_decode(self, plan: StepPlan) -> None:
        """Keep the oldest running requests whose next tokens fit, preempting from the latest;
        then reserve their slots (every preemption before any copy-on-write of the step)."""
        queue = deque(self.running)
        scheduled: list[Request] = []
        reserved = 0  # blocks the kept requests' appends take
        while queue:
            request = queue.popleft()
            needed = self.bm.num_blocks_to_append(request.request_id)
            while needed > self.bm.num_free_blocks() - reserved and queue:
                self._preempt(queue.pop(), plan)
                # A preempted group may have shared a block with a kept one, which then
                # writes in place instead of copying: count the kept groups again.
                reserved = sum(self.bm.num_blocks_to_append(r.request_id) for r in scheduled)
                needed = self.bm.num_blocks_to_append(request.request_id)
            if needed > self.bm.num_free_blocks() - reserved:
                self._preempt(request, plan)
                continue
            reserved += needed
            scheduled.append(request)
        self.running = scheduled
        for request in scheduled:
            self._append_slots(request, plan)
        if not plan.preempted:
            self._swap_in(plan)
        plan.decode = list(self.running)

    def _append_slots(self, request: Request, plan: StepPlan) -> None:
        for seq in request.seqs:
            result = self.bm.append_slot(seq.seq_id)
            plan.slots[seq.seq_id] = result.slot_index
            if result.copy is not None:
                plan.copies.append(result.copy)

    def _swap_in(self, plan: StepPlan) -> None:
        seqs_left = self.config.max_num_seqs - self.num_running_seqs
        for request in list(self.swapped):
            group = request.request_id
            # The group's blocks, and the blocks of its first decode step right after.
            needed = self.bm.blocks_to_swap_in(group) + self.bm.num_blocks_to_append(group)
            if len(request.seqs) > seqs_left or not self._room(
                    needed, self.bm.num_free_blocks() - needed >= self.bm.watermark_blocks):
                if self.running:
                    return
                continue  # nothing runs: a later swapped request that fits may go first
            plan.swap_in.update(self.bm.swap_in(group))
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
        group = request.request_id
        mode = self.bm.preemption_mode_for(group)
        if len(request.seqs) > 1 and self.bm.can_swap_out(group):
            # Samples and beams share blocks; a recompute would re-prefill each on its own
            # and could need more blocks than the pool (vLLM swaps such groups too).
            mode = PreemptionMode.SWAP
        if mode is PreemptionMode.SWAP and not self.bm.can_swap_out(group):
            mode = PreemptionMode.RECOMPUTE
        preemption = self.bm.preempt(group, mode)
        plan.preempted.append((request, preemption.mode))
        if preemption.mode is PreemptionMode.SWAP:
            plan.swap_out.update(preemption.mapping)
            request.status = "swapped"
            _insert_by_arrival(self.swapped, request)
        else:
            request.status = "recompute"
            _insert_by_arrival(self.recompute, request)
        if request in self.running:
            self.running.remove(request)


def _insert_by_arrival(queue: list[Request], request: Request) -> None:
    queue.append(request)
    queue.sort(key=lambda r: r.arrival_time)
