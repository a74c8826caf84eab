"""Training steps the pipeline tests share, captured once per session."""

from functools import cache

import pytest

from graphpar.capture import Adam, capture_training
from graphpar.models import example_batch, get_model


@cache
def _gpt_step(n_layers: int):
    # A heavy head (vocab 4096 at width 64: about 2.5 blocks' FLOPs), as GPT-1.3B's is, is
    # what made plain Eq. 6 cut each block at a different place.
    ex = get_model("gpt", "tiny", device="meta", train=True, n_layers=n_layers,
                   vocab_size=4096)
    inputs, targets = example_batch("gpt", ex.config, 2)
    return capture_training(ex.module, inputs, ex.loss_fn, targets, optimizer=Adam(lr=1e-3),
                            name="gpt").graph


@pytest.fixture
def gpt_step():
    """gpt_step(n_layers): a tiny GPT's training step with a heavy head (do not modify it)."""
    return _gpt_step
