"""tiny_causal_lm, whose rank $DIE_RANK exits at step $DIE_STEP: a rank that dies mid-run."""

import os

from tiny_causal_lm import batch as _batch
from tiny_causal_lm import build, loss, targets  # noqa: F401


def batch(step):
    if os.environ.get("RANK") == os.environ.get("DIE_RANK") and step == int(
            os.environ.get("DIE_STEP", "-1")):
        print(f"rank {os.environ['RANK']} exits at step {step}", flush=True)
        os._exit(7)
    return _batch(step)
