"""CUDA listings of sharded plans on CPU ranks (one process per rank, NCCL calls over gloo)
compute what eager PyTorch computes, with freed buffers poisoned, and every rank writes
exactly the arena its plan reserved.

Random valid plans (as in test_sharded_execution) make every collective appear: all-reduce,
all-gather, reduce-scatter, all-to-all as grouped send/recv, and the free local steps."""

from __future__ import annotations

import copy
import zlib

import pytest
from test_sharded_execution import sharded

from graphpar.capture import Adam, capture_inference, capture_training
from graphpar.compiler.driver import ModelSpec
from graphpar.models import MODEL_NAMES, get_model

NCCL_KINDS = {"nccl.allReduce", "nccl.allGather", "nccl.reduceScatter", "nccl.send",
              "nccl.recv", "nccl.groupStart", "nccl.groupEnd"}


def _check(compiled):
    check = compiled.check(backend="cuda", poison=True)
    assert check.within_tolerance, "\n".join(check.lines())
    listings = compiled.cuda_listings()
    assert compiled.peak_arena_bytes == [listing.arena_bytes for listing in listings]
    return listings


def test_mlp_inference_on_2_ranks_runs_every_collective():
    ex = get_model("mlp", "tiny", batch_size=4)
    spec = ModelSpec("mlp", ex.module, ex.inputs)
    compiled = sharded(capture_inference(ex.module, ex.inputs), "2", seed=6, spec=spec)
    listings = _check(compiled)
    kinds = {c.kind for listing in listings for c in listing.calls}
    assert kinds >= {"nccl.allGather", "nccl.reduceScatter", "nccl.groupStart", "nccl.send",
                     "nccl.recv"}, kinds


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["2x2", "2x2x2"])
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_inference_on_many_ranks(name, mesh):
    ex = get_model(name, "tiny", batch_size=4)
    spec = ModelSpec(name, ex.module, ex.inputs)
    compiled = sharded(capture_inference(ex.module, ex.inputs), mesh,
                       seed=zlib.crc32(name.encode()) % 1000, spec=spec)
    _check(compiled)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["2x2", "2x2x2"])
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_adam_training_step_on_many_ranks(name, mesh):
    ex = get_model(name, "tiny", batch_size=4, train=True)
    spec = ModelSpec(name, ex.module, ex.inputs, ex.loss_fn, ex.targets)
    captured = capture_training(copy.deepcopy(ex.module), ex.inputs, ex.loss_fn, ex.targets,
                                optimizer=Adam(), keep_grads=True)
    compiled = sharded(captured, mesh, seed=7, spec=spec, optimizer=Adam())
    listings = _check(compiled)
    assert NCCL_KINDS & {c.kind for listing in listings for c in listing.calls}
