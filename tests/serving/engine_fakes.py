"""A fake paged model for driving the real engine, scheduler and block manager without a network.

The fake keeps a shadow KV memory of token ids per slot (device and CPU pools), performs the
engine's block copies exactly as the runtime would (checking the copy-on-write batch promise:
no block both a source and a destination), and computes each sequence's next-token logits from
the tokens it *reads through its block table*. A cache-free reference (:class:`FakeLM`) computes
the same function from the true token list, so any wrong block, copy or swap changes the tokens.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from graphpar.capture.decoder import DecoderInfo
from graphpar.serving.paged_model import StepInputs

VOCAB = 12
EOS = 11
POISON = -1  # a slot no write has reached, or a block swapped away


def next_logits(context: list[int]) -> torch.Tensor:
    """Deterministic logits of the next token after ``context`` (its last 3 tokens and length)."""
    rng = random.Random(hash((tuple(context[-3:]), len(context))))
    return torch.tensor([rng.uniform(-3.0, 3.0) for _ in range(VOCAB)])


class FakeLM:
    """The reference: logits by recomputing from the token ids (what eager_greedy calls)."""

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return next_logits(ids[0].tolist())[None, None, :]


def fake_info(max_model_len: int) -> DecoderInfo:
    return DecoderInfo("fake", 1, 1, 1, 1, VOCAB, max_model_len, (EOS,))


class FakeDecoder:
    """Stands in for PagedDecoder (same methods the engine calls)."""

    def __init__(self, programs, *, num_cpu_blocks: int, **_) -> None:
        self.info = programs.info
        block_size, num_blocks = programs.block_size, programs.num_blocks
        self.block_size = block_size
        self.max_blocks_per_seq = -(-self.info.max_model_len // block_size)
        self.device = [POISON] * (num_blocks * block_size)
        self.cpu = [POISON] * (num_cpu_blocks * block_size)

    def _block(self, memory: list[int], block: int) -> list[int]:
        b = self.block_size
        return memory[block * b:(block + 1) * b]

    def _put(self, memory: list[int], block: int, values: list[int]) -> None:
        b = self.block_size
        memory[block * b:(block + 1) * b] = values

    def swap_out(self, mapping: dict[int, int]) -> None:
        for dev, cpu in mapping.items():
            self._put(self.cpu, cpu, self._block(self.device, dev))
            self._put(self.device, dev, [POISON] * self.block_size)

    def swap_in(self, mapping: dict[int, int]) -> None:
        for cpu, dev in mapping.items():
            self._put(self.device, dev, self._block(self.cpu, cpu))
            self._put(self.cpu, cpu, [POISON] * self.block_size)

    def copy_blocks(self, pairs) -> None:
        sources, targets = {c.src for c in pairs}, [c.dst for c in pairs]
        assert not sources & set(targets), f"a block is both source and destination: {pairs}"
        assert len(set(targets)) == len(targets), f"a block is copied into twice: {pairs}"
        data = [self._block(self.device, c.src) for c in pairs]  # one launch: read all first
        for c, values in zip(pairs, data):
            self._put(self.device, c.dst, values)

    def _run(self, step: StepInputs) -> torch.Tensor:
        for token, slot in zip(step.input_ids, step.slot_mapping):
            self.device[slot] = token
        b = self.block_size
        out = []
        for table, length in zip(step.block_tables, step.context_lens):
            context = [self.device[table[p // b] * b + p % b] for p in range(length)]
            assert POISON not in context, f"a sequence reads an unwritten slot: {context}"
            out.append(next_logits(context))
        return torch.stack(out)

    def prefill(self, step: StepInputs) -> torch.Tensor:
        return self._run(step)

    def decode(self, step: StepInputs) -> torch.Tensor:
        return self._run(step)

    def close(self) -> None:
        pass


class FakeAdapter:
    def __init__(self, model) -> None:
        self.model = model

    def info(self) -> DecoderInfo:
        return self.model.info


class FakeModel(torch.nn.Module):
    """What the engine is given: carries its DecoderInfo."""

    def __init__(self, max_model_len: int) -> None:
        super().__init__()
        self.info = fake_info(max_model_len)


def fake_compile(model, *, block_size: int, num_blocks: int, **_) -> SimpleNamespace:
    """Stands in for compile_decoder: what the engine reads of the compiled programs."""
    return SimpleNamespace(model=model, info=model.info, block_size=block_size,
                           num_blocks=num_blocks)


def patch_engine(monkeypatch) -> None:
    """Make LLM build FakeDecoders (and read FakeModel's info) in this test."""
    import graphpar.serving.engine as engine
    import graphpar.serving.llm as serve

    monkeypatch.setattr(serve, "decoder_adapter", FakeAdapter)
    monkeypatch.setattr(serve, "compile_decoder", fake_compile)
    monkeypatch.setattr(engine, "PagedDecoder", FakeDecoder)
