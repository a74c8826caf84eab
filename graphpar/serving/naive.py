"""Naive Hugging Face-style generation: static batches, left padding, a contiguous KV cache.

The baseline the serving engine is measured against (tools/bench/serve.py). Requests are cut into
batches of ``batch_size`` in arrival order; each batch is left-padded to its longest prompt,
prefilled with a causal + padding mask, then decoded one token per step with the cache grown by
concatenation (``torch.cat``, as Hugging Face's DynamicCache) until *every* request of the batch
has finished: finished rows keep computing (their tokens are discarded), and the next batch
starts only when the whole batch is done. The model runs eagerly in PyTorch through the same
adapter as the captured graphs (graphpar.capture.decoder), so both sides compute the same
function.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from graphpar.capture.decoder import KVState, decoder_adapter, kv_cache_attention
from graphpar.errors import GenerationError
from graphpar.serving.sampling import SamplingParams, sample_tokens

__all__ = ["NaiveResult", "naive_generate"]


@dataclass
class NaiveResult:
    """Generated tokens per request, and measured times in seconds."""

    tokens: list[list[int]]
    finish_times: list[float]  # seconds from the start, per request
    seconds: float
    steps: int = 0
    padded_token_steps: int = 0  # row-steps computed for padding or finished rows
    extra: dict = field(default_factory=dict)

    @property
    def generated(self) -> int:
        return sum(len(t) for t in self.tokens)


def naive_generate(model: torch.nn.Module, prompts: Sequence[Sequence[int]],
                   params: SamplingParams | Sequence[SamplingParams] | None = None,
                   batch_size: int = 8) -> NaiveResult:
    """Generate with static batches over a contiguous cache (no beam search)."""
    adapter = decoder_adapter(model)
    info = adapter.info()
    if params is None or isinstance(params, SamplingParams):
        params = [params or SamplingParams()] * len(prompts)
    if any(p.use_beam_search or p.n != 1 for p in params):
        raise GenerationError("the naive baseline does one sample per request (no beam search)")
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    result = NaiveResult([[] for _ in prompts], [0.0] * len(prompts), 0.0)
    start = time.perf_counter()
    generators = [torch.Generator().manual_seed(p.seed or 0) if p.temperature > 0 else None
                  for p in params]
    with torch.no_grad():
        for first in range(0, len(prompts), batch_size):
            rows = list(range(first, min(first + batch_size, len(prompts))))
            _generate_batch(adapter, info, [prompts[i] for i in rows], [params[i] for i in rows],
                            [generators[i] for i in rows], device, result, rows)
            now = time.perf_counter() - start
            for i in rows:  # the batch returns as one, as model.generate does
                result.finish_times[i] = now
    result.seconds = time.perf_counter() - start
    return result


def _generate_batch(adapter, info, prompts, params, generators, device, result: NaiveResult,
                    rows: list[int]) -> None:
    batch, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(batch, width, dtype=torch.long)
    valid = torch.zeros(batch, width, dtype=torch.bool)
    for r, prompt in enumerate(prompts):
        ids[r, width - len(prompt):] = torch.tensor(prompt)
        valid[r, width - len(prompt):] = True
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    # Padding queries attend to themselves only, so no row of the softmax is empty.
    mask = (causal[None] & valid[:, None, :]) | torch.eye(width, dtype=torch.bool)[None]
    ids, positions, valid = ids.to(device), positions.to(device), valid.to(device)
    state = KVState(mask=mask[:, None].to(device))
    with kv_cache_attention(state, adapter):
        logits = adapter(ids, positions, torch.tensor([width - 1], device=device))[:, -1]
    past = state.present
    result.padded_token_steps += int((~valid).sum())
    lengths = [len(p) for p in prompts]
    done = [False] * batch
    last = positions[:, -1]
    while True:
        histories = [(list(prompts[r]) + result.tokens[rows[r]], lengths[r])
                     for r in range(batch)]  # for penalties
        tokens, _ = sample_tokens(logits, params, generators, histories=histories)
        for r, token in enumerate(tokens):
            if done[r]:
                continue
            out = result.tokens[rows[r]]
            out.append(token)
            p = params[r]
            if (not p.ignore_eos and token in info.eos_token_ids) or token in p.stop_token_ids \
                    or len(out) >= p.max_tokens or lengths[r] + len(out) >= info.max_model_len:
                done[r] = True
        if all(done):
            return
        result.steps += 1
        result.padded_token_steps += sum(done)
        valid = torch.cat([valid, torch.ones(batch, 1, dtype=torch.bool, device=device)], 1)
        last = last + 1
        state = KVState(past=past, mask=valid[:, None, None, :])
        step_ids = torch.tensor(tokens, device=device)[:, None]
        with kv_cache_attention(state, adapter):
            logits = adapter(step_ids, last[:, None])[:, -1]
        past = state.present
