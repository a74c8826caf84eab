"""Sampling parameters and the samplers of the serving engine: greedy, temperature, top-k,
top-p (nucleus), parallel samples and beam search."""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from graphpar.errors import GenerationError

__all__ = ["BeamCandidate", "SamplingParams", "adjust_logits", "beam_candidates", "beam_score",
           "sample_tokens", "top_logprobs"]

MAX_TOP_LOGPROBS = 20  # most likely tokens a request may ask for at each position (vLLM's default)


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded.

    ``temperature == 0`` is greedy. ``n`` independent samples share the prompt's KV blocks
    (copy-on-write). ``beam_width > 0`` is beam search: ``beam_width`` beams, the best ``n``
    finished hypotheses returned, scored ``sum logprob / generated_len ** length_penalty``.
    Generation stops at ``max_tokens`` new tokens, the model's context length, an EOS token
    (unless ``ignore_eos``), a token of ``stop_token_ids``, or an entry of ``stop``: a sequence
    of token ids, or a string (text stops need the engine to have a tokenizer; the output text
    then ends before the stop string unless ``include_stop_str_in_output``, as in vLLM). Before
    ``min_tokens`` new tokens only ``max_tokens`` and the context stop a sequence: EOS and
    ``stop_token_ids`` cannot be sampled (their logits are masked, as in vLLM) and stop
    sequences and strings are not looked for.

    Before sampling (and before temperature), the logits are adjusted as OpenAI and vLLM do:
    ``logit_bias`` ((token id, bias) pairs, or a dict) is added; ``repetition_penalty`` (vLLM's,
    as in CTRL) divides the positive and multiplies the negative logits of every token seen in
    the prompt or the output; ``frequency_penalty * count[t] + presence_penalty * (count[t] > 0)``
    is subtracted, ``count`` over the sequence's generated tokens. The reported log-probabilities
    stay the model's (log-softmax of the raw logits). ``top_logprobs``: also return this many
    most likely tokens (by the model's log-probabilities) at each generated position.
    ``prompt_logprobs`` (None: off): each prompt token's log-probability given the tokens before
    it, with this many most likely tokens at each position; such a prompt is computed whole
    (the prefix cache is not looked up for it).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    n: int = 1
    beam_width: int = 0
    length_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[tuple[int, ...] | str, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    top_logprobs: int = 0
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        object.__setattr__(self, "stop", tuple(_stop_entry(s) for s in stop))

    # cached (the engine asks for every generated token); a frozen dataclass's fields never
    # change, so neither do these
    @functools.cached_property
    def stop_strings(self) -> tuple[str, ...]:
        """The text entries of ``stop``."""
        return tuple(s for s in self.stop if isinstance(s, str))

    @functools.cached_property
    def stop_sequences(self) -> tuple[tuple[int, ...], ...]:
        """The token-id entries of ``stop``."""
        return tuple(s for s in self.stop if isinstance(s, tuple))

    @property
    def adjusts_logits(self) -> bool:
        """Whether a penalty or a bias changes this request's logits before sampling."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty != 1.0)

    @property
    def use_beam_search(self) -> bool:
        return self.beam_width > 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 and not self.use_beam_search

    @property
    def num_seqs(self) -> int:
        """Sequences the request holds at once (samples or beams)."""
        return self.beam_width if self.use_beam_search else self.n

    def validate(self) -> None:
        """Raise GenerationError for values no request can use."""
        checks = [
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 = off), got {self.top_k}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.n >= 1, f"n must be >= 1, got {self.n}"),
            (0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), got "
             f"{self.min_tokens}"),
            (not self.min_tokens or not self.use_beam_search,
             "min_tokens is not supported with beam search"),
            (self.beam_width >= 0, f"beam_width must be >= 0, got {self.beam_width}"),
            (not self.use_beam_search or self.n <= self.beam_width,
             f"n ({self.n}) must be <= beam_width ({self.beam_width})"),
            (not self.use_beam_search or self.temperature == 0,
             "beam search is deterministic: leave temperature at 0"),
            (all(isinstance(s, (str, tuple)) for s in self.stop),
             f"a stop entry is a string or a sequence of token ids, got {self.stop!r}"),
            (all(len(s) > 0 for s in self.stop if isinstance(s, (str, tuple))),
             "stop sequences must not be empty"),
            (not self.stop_strings or not self.use_beam_search,
             "stop strings are not supported with beam search: give stop token ids"),
            (-2 <= self.presence_penalty <= 2,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (0 < self.repetition_penalty <= 2,
             f"repetition_penalty must be in (0, 2] (1 = off), got {self.repetition_penalty}"),
            (all(-100 <= b <= 100 for _, b in self.logit_bias),
             "logit_bias values must be in [-100, 100], got "
             f"{[b for _, b in self.logit_bias if not -100 <= b <= 100][:1]}"),
            (0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
             f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {self.top_logprobs}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS,
             f"prompt_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got "
             f"{self.prompt_logprobs}"),
            (not self.use_beam_search or not (self.adjusts_logits or self.top_logprobs
                                              or self.prompt_logprobs is not None),
             "penalties, logit_bias, top_logprobs and prompt_logprobs are not supported with "
             "beam search"),
        ]
        for ok, message in checks:
            if not ok:
                raise GenerationError(message)


def _stop_entry(stop):
    """A stop entry as a string or a tuple of ints; anything else is kept for validate()."""
    if isinstance(stop, str):
        return stop
    try:
        return tuple(operator.index(t) for t in stop)
    except TypeError:
        return stop


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
                        ) -> torch.Tensor:
    """Logits with everything outside each row's top-k and top-p nucleus set to -inf."""
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    drop = rank >= k[:, None]
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above this one
    drop |= before >= top_p[:, None]
    drop[:, 0] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample_tokens(logits: torch.Tensor, params: Sequence[SamplingParams],
                  generators: Sequence[torch.Generator | None],
                  banned: Sequence[Sequence[int]] | None = None,
                  histories: Sequence[tuple[Sequence[int], int]] | None = None
                  ) -> tuple[list[int], list[float]]:
    """One token per row of ``logits`` ``[rows, vocab]`` under that row's params.

    Returns the tokens and their log-probabilities under the model (log-softmax of the raw
    logits, before temperature and filtering). Greedy rows take the argmax (first on ties, as
    torch and Hugging Face do); sampled rows draw from ``softmax(logits / T)`` restricted to
    top-k and top-p, with the row's generator. ``banned[i]``: token ids row ``i`` may not take
    (a sequence short of its ``min_tokens``: EOS and stop tokens). ``histories[i]``: row
    ``i``'s tokens so far and how many of them are the prompt, for its penalties
    (:func:`adjust_logits`; rows whose params adjust nothing may give anything).
    """
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    if banned is not None and any(banned):
        logits = logits.clone()
        for row, tokens in enumerate(banned):
            if tokens:
                logits[row, list(tokens)] = float("-inf")
    if histories is not None:
        logits = adjust_logits(logits, params, histories)
    tokens = logits.argmax(dim=-1)
    sampled = [i for i, p in enumerate(params) if p.temperature > 0]
    if sampled:
        rows = torch.tensor(sampled, device=logits.device)
        temps = torch.tensor([params[i].temperature for i in sampled], device=logits.device)
        top_k = torch.tensor([params[i].top_k for i in sampled], device=logits.device)
        top_p = torch.tensor([params[i].top_p for i in sampled], device=logits.device)
        scaled = _filter_top_k_top_p(logits[rows] / temps[:, None], top_k, top_p)
        probs = scaled.softmax(dim=-1).cpu()
        for j, i in enumerate(sampled):
            tokens[i] = int(torch.multinomial(probs[j], 1, generator=generators[i]))
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    return tokens.tolist(), chosen.tolist()


def adjust_logits(logits: torch.Tensor, params: Sequence[SamplingParams],
                  histories: Sequence[tuple[Sequence[int], int]]) -> torch.Tensor:
    """``logits`` ``[rows, vocab]`` with each row's logit bias and penalties applied (see
    :class:`SamplingParams`), batched over the rows that have any; ``histories[i]`` is row
    ``i``'s (tokens so far, prompt length). Returns ``logits`` itself when no row has any."""
    rows = [i for i, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return logits
    logits = logits.clone()
    device, vocab = logits.device, logits.shape[-1]
    bias = [(i, t, b) for i in rows for t, b in params[i].logit_bias]
    if bias:
        at, token, value = zip(*bias)
        logits.index_put_((torch.tensor(at, device=device), torch.tensor(token, device=device)),
                          torch.tensor(value, device=device), accumulate=True)
    repeat = [i for i in rows if params[i].repetition_penalty != 1.0]
    if repeat:  # every token of the prompt and the output
        seen = _token_counts([histories[i][0] for i in repeat], vocab, device) > 0
        penalty = torch.tensor([params[i].repetition_penalty for i in repeat],
                               device=device)[:, None]
        sub = _rows(logits, repeat)
        sub.copy_(torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub))
        _put_rows(logits, repeat, sub)
    counted = [i for i in rows if params[i].presence_penalty or params[i].frequency_penalty]
    if counted:  # the generated tokens only
        counts = _token_counts([histories[i][0][histories[i][1]:] for i in counted], vocab,
                               device)
        frequency = torch.tensor([params[i].frequency_penalty for i in counted], device=device)
        presence = torch.tensor([params[i].presence_penalty for i in counted], device=device)
        sub = _rows(logits, counted)
        sub -= frequency[:, None] * counts + presence[:, None] * (counts > 0)
        _put_rows(logits, counted, sub)
    return logits


def _token_counts(token_lists: Sequence[Sequence[int]], vocab: int, device: torch.device
                  ) -> torch.Tensor:
    """``[len(token_lists), vocab]``: how often each token occurs in each list (one scatter)."""
    counts = torch.zeros(len(token_lists), vocab, device=device)
    flat = [t for tokens in token_lists for t in tokens]
    if flat:
        row = torch.repeat_interleave(torch.arange(len(token_lists), device=device),
                                      torch.tensor([len(t) for t in token_lists], device=device))
        counts.index_put_((row, torch.tensor(flat, dtype=torch.long, device=device)),
                          torch.ones(len(flat), device=device), accumulate=True)
    return counts


def _rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The rows of ``logits`` as a view when they are all of them, else a copy."""
    return logits if len(rows) == logits.shape[0] else logits[rows]


def _put_rows(logits: torch.Tensor, rows: list[int], values: torch.Tensor) -> None:
    if values is not logits:
        logits[rows] = values


def top_logprobs(logits: torch.Tensor, ks: Sequence[int]) -> list[list[tuple[int, float]] | None]:
    """Row ``i``'s ``ks[i]`` most likely tokens as (token id, log-probability), most likely
    first, under the model (log-softmax of the raw logits); None for rows with ``ks[i] == 0``."""
    rows = [i for i, k in enumerate(ks) if k > 0]
    result: list[list[tuple[int, float]] | None] = [None] * len(ks)
    if not rows:
        return result
    logprobs = torch.log_softmax(logits[rows].float(), dim=-1)
    values, ids = logprobs.topk(min(max(ks[i] for i in rows), logprobs.shape[-1]), dim=-1)
    values, ids = values.tolist(), ids.tolist()
    for j, i in enumerate(rows):
        result[i] = list(zip(ids[j][:ks[i]], values[j][:ks[i]]))
    return result


@dataclass(frozen=True)
class BeamCandidate:
    """A possible extension of beam ``parent`` by ``token``: cumulative logprob ``score``."""

    parent: int
    token: int
    score: float


def beam_candidates(logits: torch.Tensor, cumulative: Sequence[float], width: int
                    ) -> list[BeamCandidate]:
    """The ``2 * width`` best one-token extensions of the running beams, best first.

    ``logits`` ``[beams, vocab]``; ``cumulative[b]`` is beam ``b``'s summed logprob. Ties are
    broken by (beam, token) order, as ``torch.topk`` on the flattened scores does.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    scores = logprobs + torch.tensor(cumulative, dtype=torch.float32,
                                     device=logprobs.device)[:, None]
    vocab = scores.shape[-1]
    k = min(2 * width, scores.numel())
    values, flat = scores.flatten().topk(k)
    return [BeamCandidate(int(i) // vocab, int(i) % vocab, float(v))
            for v, i in zip(values.tolist(), flat.tolist())]


def beam_score(cumulative: float, generated: int, length_penalty: float) -> float:
    """Hypothesis score: summed logprob over generated length ** length_penalty."""
    return cumulative / (max(generated, 1) ** length_penalty)

