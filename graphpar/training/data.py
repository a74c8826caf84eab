"""The batches a training run reads: a model file's `batch(step)`, or windows of a token file.

A batch source gives the global batch of step `step` (0, 1, 2, ...) as `(inputs, targets)`,
the same for every rank and every run with the same seed, so a resumed run reads what an
uninterrupted one would have: its position is the step alone (`state`).

`TokenWindows` feeds a causal LM from a flat token file, nanoGPT-style: `.bin` holds uint16
tokens (`.u32.bin` uint32: the suffix says the dtype), `.npy` any integer array, anything else
is UTF-8 text read as bytes (a vocabulary of 256). Each step draws `batch` window starts from a
generator seeded with (seed, step) and cuts `[batch, seq + 1]` windows: inputs are the first
`seq` tokens, targets the next-token labels. The file is memory-mapped and a rank reads only
the rows it holds (`rows`), and of them only the tensors it reads (`parts`: a pipeline's first
stage the inputs, its loss stage the targets).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path

import numpy as np
import torch

from graphpar.errors import UsageError

Batch = tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]


def step_generator(seed: int, step: int) -> torch.Generator:
    """The generator of step `step`'s draws: the same for a given (seed, step) everywhere."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) % (2 ** 63))


class TokenWindows:
    """`[batch, seq + 1]` windows of the token file at `path`, drawn per step from `seed`."""

    def __init__(self, path: str | Path, batch: int, seq: int, seed: int = 0,
                 vocab: int | None = None) -> None:
        self.path, self.batch, self.seq, self.seed = Path(path), batch, seq, seed
        self.tokens = open_tokens(self.path)
        if len(self.tokens) < seq + 2:
            raise UsageError(f"--data {path}: {len(self.tokens)} tokens, fewer than one window "
                             f"of {seq + 1} (the model's sequence length + 1); give a longer "
                             "file")
        self.vocab = vocab
        self.tokens_read = 0  # from the file, over every call (counted)

    def starts(self, step: int) -> torch.Tensor:
        """Where step `step`'s windows start in the file."""
        high = len(self.tokens) - self.seq - 1
        return torch.randint(0, high, (self.batch,), generator=step_generator(self.seed, step))

    def __call__(self, step: int, rows: slice | None = None,
                 parts: Collection[int] = (0, 1)) -> Batch:
        """Step `step`'s (inputs, targets), int64 `[batch, seq]`; with `rows`, only those rows
        are read, and of `parts` (0: the inputs, 1: the targets) only those (the others are
        zeros: this rank does not hold them)."""
        rows = slice(0, self.batch) if rows is None else rows
        windows = torch.zeros((self.batch, self.seq + 1), dtype=torch.int64)
        # window positions 0..seq-1 are the inputs, 1..seq the targets
        first, stop = (0 if 0 in parts else 1), (self.seq + 1 if 1 in parts else self.seq)
        for row, start in enumerate(self.starts(step).tolist()):
            if rows.start <= row < rows.stop and parts:
                windows[row, first:stop] = torch.from_numpy(
                    np.asarray(self.tokens[start + first:start + stop], dtype=np.int64))
                self.tokens_read += stop - first
        if self.vocab is not None and int(windows.max()) >= self.vocab:
            raise UsageError(f"--data {self.path}: token {int(windows.max())} is outside the "
                             f"model's vocabulary of {self.vocab}")
        return (windows[:, :-1].contiguous(),), (windows[:, 1:].contiguous(),)


# a flat `.bin` token file's dtype, from the suffix before `.bin`; a bare `.bin` is nanoGPT's
# uint16 (the file holds no header that could say otherwise)
BIN_DTYPES = {"": np.uint16, ".u16": np.uint16, ".uint16": np.uint16,
              ".u32": np.uint32, ".uint32": np.uint32}


def bin_dtype(path: Path) -> np.dtype:
    """The dtype of the `.bin` token file `path`: `x.bin` and `x.u16.bin` uint16, `x.u32.bin`
    uint32; another inner suffix that names a dtype is an error naming the ones there are."""
    inner = Path(path.stem).suffix.lower()
    if inner in BIN_DTYPES:
        return np.dtype(BIN_DTYPES[inner])
    if inner.lstrip(".") in {"i8", "u8", "i16", "i32", "i64", "u64", "int32", "int64", "uint8",
                             "uint64", "f16", "f32"}:
        raise UsageError(f"--data {path}: a .bin of {inner.lstrip('.')} tokens is not "
                         "supported: name it .u16.bin (uint16) or .u32.bin (uint32), or save "
                         "it as .npy (any integer dtype)")
    return np.dtype(np.uint16)


def open_tokens(path: Path) -> np.ndarray:
    """The file's tokens, memory-mapped: `.bin` uint16 (`.u32.bin` uint32), `.npy` as saved,
    else bytes."""
    if not path.is_file():
        raise UsageError(f"--data {path}: no such file; give a token file (.bin of uint16, "
                         ".u32.bin of uint32, .npy) or a text file")
    try:
        if path.suffix == ".npy":
            tokens = np.load(path, mmap_mode="r")
        elif path.suffix == ".bin":
            dtype = bin_dtype(path)
            if path.stat().st_size % dtype.itemsize:
                raise UsageError(f"--data {path}: {path.stat().st_size} bytes is not a whole "
                                 f"number of {dtype} tokens ({dtype.itemsize} bytes each); "
                                 "is it a token file of another dtype?")
            tokens = np.memmap(path, dtype=dtype, mode="r")
        else:
            tokens = np.memmap(path, dtype=np.uint8, mode="r")
    except (ValueError, OSError) as exc:
        raise UsageError(f"--data {path}: cannot read it as tokens ({exc})") from None
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise UsageError(f"--data {path}: holds a {tokens.dtype} array of shape "
                         f"{tuple(tokens.shape)}; give a flat array of integer tokens")
    return tokens


class ModelFileBatches:
    """A model file's `batch(step)`, checked against the shapes the step was compiled for."""

    def __init__(self, batch: Callable[[int], object], path: str,
                 inputs: list[tuple[tuple[int, ...], torch.dtype]],
                 targets: list[tuple[tuple[int, ...], torch.dtype]]) -> None:
        self.batch, self.path = batch, path
        self.shapes = (inputs, targets)

    def __call__(self, step: int, rows: slice | None = None,
                 parts: Collection[int] = (0, 1)) -> Batch:
        """Step `step`'s batch: the model file's function makes every tensor of it, whatever
        `rows` and `parts` a rank reads (a rank that reads none does not call it)."""
        try:
            got = self.batch(step)
        except Exception as exc:
            raise UsageError(f"{self.path}: batch({step}) failed: {type(exc).__name__}: {exc}"
                             ) from None
        if not (isinstance(got, tuple) and len(got) == 2):
            raise UsageError(f"{self.path}: batch({step}) must return (inputs, targets), two "
                             f"tuples of tensors; got {type(got).__name__}")
        batch = tuple(_tensors(part) for part in got)
        if not all(isinstance(t, torch.Tensor) for part in batch for t in part):
            raise UsageError(f"{self.path}: batch({step}) must return (inputs, targets), two "
                             "tuples of tensors")
        for what, part, want in zip(("inputs", "targets"), batch, self.shapes):
            have = [(tuple(t.shape), t.dtype) for t in part]
            if have != want:
                raise UsageError(
                    f"{self.path}: batch({step}) {what} are {_shapes(have)}; the step was "
                    f"compiled for {_shapes(want)} (build()'s inputs and targets())")
        return batch  # type: ignore[return-value]


def _tensors(value: object) -> tuple[torch.Tensor, ...]:
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, (tuple, list)):
        return tuple(value)
    return (value,)  # type: ignore[return-value]


def _shapes(items) -> str:
    return ", ".join(f"{str(d).removeprefix('torch.')}{list(s)}" for s, d in items) or "nothing"
