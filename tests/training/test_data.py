"""graphpar train's batches from a token file: windows and next-token labels, the same for a
(seed, step) everywhere, a rank reading only its rows."""

import re

import numpy as np
import pytest
import torch

from graphpar.errors import UsageError
from graphpar.training.data import TokenWindows


def test_windows_are_the_files_tokens_and_their_next_tokens(tmp_path):
    tokens = np.arange(1000, dtype=np.uint16)
    tokens.tofile(tmp_path / "t.bin")
    windows = TokenWindows(tmp_path / "t.bin", batch=3, seq=5, seed=7)
    (inputs,), (targets,) = windows(4)
    starts = windows.starts(4)
    assert inputs.dtype == torch.int64 and inputs.shape == (3, 5)
    assert torch.equal(inputs, starts[:, None] + torch.arange(5))  # the tokens are positions
    assert torch.equal(targets, inputs + 1)
    again = TokenWindows(tmp_path / "t.bin", batch=3, seq=5, seed=7)(4)
    assert torch.equal(again[0][0], inputs)  # a resumed run reads the same step
    assert not torch.equal(windows(5)[0][0], inputs)


def test_a_rank_reads_only_its_rows(tmp_path):
    np.save(tmp_path / "t.npy", np.arange(500, dtype=np.int32))
    windows = TokenWindows(tmp_path / "t.npy", batch=4, seq=3, seed=0)
    (whole,), _ = windows(0)
    (mine,), _ = windows(0, rows=slice(2, 4))
    assert torch.equal(mine[2:], whole[2:]) and not mine[:2].any()


def test_text_is_read_as_bytes(tmp_path):
    (tmp_path / "t.txt").write_text("abcdefghij" * 10)
    (inputs,), _ = TokenWindows(tmp_path / "t.txt", batch=2, seq=4, seed=1)(0)
    assert set(inputs.flatten().tolist()) <= set(b"abcdefghij")


def test_a_file_shorter_than_a_window(tmp_path):
    (tmp_path / "t.txt").write_text("abc")
    with pytest.raises(UsageError, match="fewer than one window of 9"):
        TokenWindows(tmp_path / "t.txt", batch=2, seq=8)


def test_a_u32_bin_holds_uint32_tokens(tmp_path):
    """Tokens above 65535 (a vocabulary of 100k) survive: the suffix says uint32."""
    tokens = np.arange(70_000, 71_000, dtype=np.uint32)
    tokens.tofile(tmp_path / "t.u32.bin")
    windows = TokenWindows(tmp_path / "t.u32.bin", batch=2, seq=4, seed=3)
    (inputs,), (targets,) = windows(0)
    assert torch.equal(inputs, 70_000 + windows.starts(0)[:, None] + torch.arange(4))
    assert torch.equal(targets, inputs + 1)


@pytest.mark.parametrize("name, size, message", [
    ("t.i32.bin", 400, "a .bin of i32 tokens is not supported: name it .u16.bin (uint16) or "
                       ".u32.bin (uint32)"),
    ("t.u32.bin", 402, "402 bytes is not a whole number of uint32 tokens"),
    ("t.bin", 401, "401 bytes is not a whole number of uint16 tokens"),
])
def test_a_bin_of_another_dtype_is_named(tmp_path, name, size, message):
    (tmp_path / name).write_bytes(bytes(size))
    with pytest.raises(UsageError, match=re.escape(message)):
        TokenWindows(tmp_path / name, batch=2, seq=4)
