"""From a step's logits to requests' tokens: samples, beams, stop conditions, request outputs.

:class:`OutputProcessor` is the engine's half after the model step: it samples the next token
of every sequence (greedy, temperature / top-k / top-p), forks a prompt's sequence into ``n``
parallel samples, runs beam search (the ``2k`` best extensions; a parent chosen twice is forked,
an unchosen one freed), applies the stop conditions and builds :class:`RequestOutput`. It
changes no KV state itself: forks and frees go through the scheduler, which owns the blocks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from graphpar.serving.sampling import beam_candidates, beam_score, sample_tokens, top_logprobs
from graphpar.serving.scheduler import PrefillItem, Request, Scheduler, SequenceState

__all__ = ["CompletionOutput", "EngineStats", "OutputProcessor", "RequestOutput"]


@dataclass
class CompletionOutput:
    """One generated sequence of a request."""

    index: int
    token_ids: list[int]
    cumulative_logprob: float
    logprobs: list[float]
    finish_reason: str | None  # "stop", "length", or None while running
    text: str | None = None  # the decoded tokens, when the engine has a tokenizer
    # per token, the request's top_logprobs most likely (token id, logprob), most likely first
    top_logprobs: list[list[tuple[int, float]]] | None = None


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
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the cache, not a prefill
    # with SamplingParams.prompt_logprobs: per prompt token, None for the first, else (its
    # logprob given those before it, the most likely (token id, logprob) pairs)
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None

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
    swap_preemptions: int = 0  # preemptions by swapping to CPU blocks (the others recompute)
    swapped_blocks: int = 0
    cow_copies: int = 0
    finished: int = 0
    failed: int = 0
    stalled: int = 0  # requests failed because a step could run nothing (an engine bug)
    running: int = 0
    waiting: int = 0
    swapped: int = 0
    kv_used: float = 0.0  # fraction of device blocks in use
    kv_blocks_used: int = 0  # device KV blocks held by requests or registered prefixes
    kv_blocks_free: int = 0  # device KV blocks free (cached blocks no one holds count as free)
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens whose KV was found there
    start: float = field(default_factory=time.perf_counter)
    model_seconds: float = 0.0

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / max(self.elapsed, 1e-9)


DecodeRows = list[tuple[Request, int, int]]  # a request and its logits rows [a, b)


class OutputProcessor:
    """Samples, beams and stops for the engine (see the module docstring).

    ``eos_token_ids`` and ``max_model_len`` are the model's; ``detokenize`` (token ids ->
    text, optional) gives outputs their text and checks stop strings; ``stats`` counts the
    generated tokens and finished requests.
    """

    def __init__(self, scheduler: Scheduler, eos_token_ids: tuple[int, ...], max_model_len: int,
                 stats: EngineStats,
                 detokenize: Callable[[list[int]], str] | None = None) -> None:
        self.scheduler = scheduler
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.stats = stats
        self.detokenize = detokenize

    def step(self, decode_rows: DecodeRows, prefill: list[PrefillItem], first_prefill_row: int,
             logits: torch.Tensor, finished: list[RequestOutput]) -> None:
        """The tokens of one model step: decode rows first, then each new prompt's first
        tokens (prefill rows from ``first_prefill_row`` on; re-prefills sample nothing)."""
        self._decode_tokens(decode_rows, logits, finished)
        now = time.perf_counter()
        for row, item in enumerate(prefill, start=first_prefill_row):
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
            self.scheduler.fork(parent, child)
            request.seqs.append(child)
        rows = logits.expand(len(request.seqs), -1)
        seqs = list(request.seqs)
        tokens, logprobs = sample_tokens(rows, [params] * len(seqs), [s.generator for s in seqs],
                                         [self._banned(request, s) for s in seqs],
                                         [(s.tokens, s.prompt_len) for s in seqs])
        tops = top_logprobs(logits, [params.top_logprobs])[0]
        for seq, token, logprob in zip(seqs, tokens, logprobs):
            if tops is not None:
                seq.top_logprobs.append(tops)
            self._append(request, seq, token, logprob)
        self._maybe_finish(request, finished)

    def _decode_tokens(self, rows: DecodeRows, logits: torch.Tensor,
                       finished: list[RequestOutput]) -> None:
        """Next tokens of running sequences from their logits rows ``[a, b)`` per request."""
        sampled = [(r, a, b) for r, a, b in rows if not r.params.use_beam_search]
        if sampled:
            index = [i for _, a, b in sampled for i in range(a, b)]
            rows_logits = logits[:len(index)] if index == list(range(len(index))) else \
                logits[torch.tensor(index)]
            seqs = [s for r, _, _ in sampled for s in r.seqs]
            params = [r.params for r, a, b in sampled for _ in range(a, b)]
            owners = [r for r, a, b in sampled for _ in range(a, b)]
            tokens, logprobs = sample_tokens(rows_logits, params, [s.generator for s in seqs],
                                             [self._banned(r, s) for r, s in zip(owners, seqs)],
                                             [(s.tokens, s.prompt_len) for s in seqs])
            tops = top_logprobs(rows_logits, [p.top_logprobs for p in params])
            for request, seq, token, logprob, top in zip(owners, seqs, tokens, logprobs, tops):
                if top is not None:
                    seq.top_logprobs.append(top)
                self._append(request, seq, token, logprob)
            for request, _, _ in sampled:
                self._maybe_finish(request, finished)
        for request, a, b in rows:
            if request.params.use_beam_search:
                self._beam_step(request, logits[a:b], finished)

    def prompt_logprobs(self, item: PrefillItem, logits: torch.Tensor) -> None:
        """Record the prompt tokens' log-probabilities from ``logits``, one row per position
        ``item.start .. item.end - 1`` (row ``p`` predicts the token at ``p + 1``)."""
        request = item.request
        prompt = request.prompt
        if request.prompt_logprobs is None:
            request.prompt_logprobs = [None] * len(prompt)
        end = min(item.end, len(prompt) - 1)  # the last rows predict generated tokens
        if end <= item.start:
            return
        rows = logits[:end - item.start]
        logprobs = torch.log_softmax(rows.float(), dim=-1)
        targets = torch.tensor(prompt[item.start + 1:end + 1])
        chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
        tops = top_logprobs(rows, [request.params.prompt_logprobs] * len(chosen))
        for j, position in enumerate(range(item.start + 1, end + 1)):
            request.prompt_logprobs[position] = (chosen[j], tops[j] or [])

    # --- tokens and stop conditions -----------------------------------------------------------

    def _banned(self, request: Request, seq: SequenceState) -> tuple[int, ...]:
        """Tokens the sequence may not sample now: EOS and stop tokens before min_tokens."""
        params = request.params
        if seq.num_generated >= params.min_tokens:
            return ()
        eos = () if params.ignore_eos else self.eos_token_ids
        return tuple(eos) + params.stop_token_ids

    def _stop_reason(self, request: Request, seq: SequenceState) -> str | None:
        params, token = request.params, seq.tokens[-1]
        if seq.num_generated < params.min_tokens:  # only the length limits apply yet
            return "length" if len(seq.tokens) >= self.max_model_len else None
        if not params.ignore_eos and token in self.eos_token_ids:
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
        if seq.num_generated >= params.max_tokens or len(seq.tokens) >= self.max_model_len:
            return "length"
        return None

    def _append(self, request: Request, seq: SequenceState, token: int, logprob: float) -> None:
        seq.append(token, logprob)
        self.stats.generated_tokens += 1
        reason = self._stop_reason(request, seq)
        if reason is not None:
            seq.finish_reason = reason
            request.seqs.remove(seq)
            request.finished_seqs.append(seq)
            self.scheduler.free(seq)

    def _maybe_finish(self, request: Request, finished: list[RequestOutput]) -> None:
        if not request.seqs:
            self.finish(request, None)
            finished.append(self.output(request))

    def finish(self, request: Request, reason: str | None) -> None:
        """End a request: its running sequences finish with ``reason`` (unless they have one),
        and the scheduler frees their blocks and drops it from its queues."""
        for seq in request.seqs:
            seq.finish_reason = seq.finish_reason or reason
            request.finished_seqs.append(seq)
        self.scheduler.finish(request)
        request.seqs = []
        request.finish_time = time.perf_counter()
        self.stats.finished += 1

    # --- beam search --------------------------------------------------------------------------

    def _beam_step(self, request: Request, logits: torch.Tensor,
                   finished: list[RequestOutput]) -> None:
        """One beam-search step: keep the ``beam_width`` best extensions, fork and free beams."""
        params, width = request.params, request.params.beam_width
        beams = request.seqs
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos
                                             else set(self.eos_token_ids))
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
        extended: list[tuple[SequenceState, int, float]] = []  # (beam, token, its logprob)
        taken: set[int] = set()
        for parent_index, token, score in children:
            parent = beams[parent_index]
            if parent_index in taken:  # fork before the parent takes its own token
                beam = parent.fork(request.new_seq_id())
                self.scheduler.fork(parent, beam)
            else:
                beam = parent  # the first child continues the parent's sequence in place
                taken.add(parent_index)
            extended.append((beam, token, score - parent.cumulative_logprob))
        for index, parent in enumerate(beams):
            if index not in taken:
                self.scheduler.free(parent)  # refcounts drop; shared blocks survive
        request.seqs = []
        for beam, token, logprob in extended:
            beam.append(token, logprob)
            request.seqs.append(beam)
        self._beam_done(request, finished)

    def _add_hypothesis(self, request: Request, seq: SequenceState) -> None:
        params = request.params
        score = beam_score(seq.cumulative_logprob, seq.num_generated, params.length_penalty)
        request.hypotheses.append((score, seq))
        request.hypotheses.sort(key=lambda h: -h[0])
        del request.hypotheses[params.beam_width:]

    def _beam_done(self, request: Request, finished: list[RequestOutput]) -> None:
        params = request.params
        beams = request.seqs
        at_limit = bool(beams) and (beams[0].num_generated >= params.max_tokens
                                    or len(beams[0].tokens) >= self.max_model_len)
        done = not beams or at_limit
        if not done and len(request.hypotheses) >= params.beam_width:
            best = max(b.cumulative_logprob for b in beams)
            worst = request.hypotheses[-1][0]
            done = worst >= beam_score(best, beams[0].num_generated, params.length_penalty)
        if not done:
            return
        for beam in beams:
            self.scheduler.free(beam)
            if at_limit:
                beam.finish_reason = "length"
                self._add_hypothesis(request, beam)
        request.seqs = []
        request.finished_seqs = [seq for _, seq in request.hypotheses[:params.n]]
        self.finish(request, None)
        finished.append(self.output(request))

    # --- outputs ----------------------------------------------------------------------------

    def output(self, request: Request) -> RequestOutput:
        """The request's state as the engine reports it."""
        if request.params.use_beam_search:  # best first once finished; the live beams before
            seqs = request.finished_seqs if request.finished else list(request.seqs)
        elif len(request.seqs) + len(request.finished_seqs) == 1:  # one sample: most requests
            seqs = request.seqs or request.finished_seqs
        else:  # samples in the order they were created
            seqs = sorted(request.finished_seqs + request.seqs,
                          key=lambda s: int(s.seq_id.rsplit(".", 1)[1]))
        outputs = [CompletionOutput(i, s.output_tokens, s.cumulative_logprob, list(s.logprobs),
                                    s.finish_reason, self._text(s),
                                    list(s.top_logprobs) if request.params.top_logprobs else None)
                   for i, s in enumerate(seqs)]
        return RequestOutput(request.request_id, list(request.prompt), outputs,
                             request.finished, request.error, request.arrival_time,
                             request.first_token_time, request.finish_time,
                             request.num_cached_tokens,
                             None if request.prompt_logprobs is None
                             else list(request.prompt_logprobs))

    def _text(self, seq: SequenceState) -> str | None:
        if seq.text is not None or self.detokenize is None:
            return seq.text
        return self.detokenize(seq.output_tokens)
