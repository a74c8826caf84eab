"""Distributed checkpoints of a training run, laid out as torchtitan lays them out.

`DIR/step-<N>/` is a `torch.distributed.checkpoint` (DCP) folder of the state dict
``{"model": <the module's state_dict keys>, "optimizer": {"state": {param: {"exp_avg": ...}},
"param_groups": [...]}, "step": N, "data": {"seed": S, "step": N}}``. Parameters and
optimizer state are DTensors with the plan's placements, each rank writing its own shards, so
DCP reshards them when a run on another mesh or plan loads them, and `dcp_to_torch_save` makes
a file whose ``["model"]`` loads into the plain module.

A checkpoint is written into ``DIR/.step-<N>.partial/`` and renamed to ``step-<N>`` once every
rank's shards and DCP's metadata are in: a crash mid-save leaves the previous checkpoint as it
was, and `latest` never sees a half-written one.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from graphpar.errors import CheckpointError, UsageError

CHECKPOINT = re.compile(r"step-(\d+)")
METADATA = ".metadata"  # DCP's; written last, by the coordinator


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"step-{step}"


def partial_path(directory: Path, step: int) -> Path:
    return directory / f".step-{step}.partial"


def latest(directory: Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint in `directory` as (step, path), or None."""
    found = [(int(m.group(1)), p) for p in directory.iterdir() if p.is_dir()
             and (m := CHECKPOINT.fullmatch(p.name))] if directory.is_dir() else []
    return max(found) if found else None


def publish(directory: Path, step: int) -> Path:
    """Rename the finished partial folder of `step` to its checkpoint (rank 0, after every
    rank has written); an older checkpoint of the same step is replaced."""
    final = checkpoint_path(directory, step)
    if final.exists():
        shutil.rmtree(final)
    partial_path(directory, step).rename(final)
    return final


def resume_point(directory: Path | None) -> tuple[int, Path]:
    """The checkpoint `--resume` continues from, or a clear error when there is none."""
    if directory is None:
        raise UsageError("--resume continues from a checkpoint: give --checkpoint-dir DIR")
    found = latest(directory)
    if found is None:
        raise UsageError(f"--resume: no checkpoint in {directory} (no step-<N> folder); train "
                         "without --resume first, or give the --checkpoint-dir it wrote")
    return found


def expected_keys(plan) -> dict[str, tuple[int, ...]]:
    """The flattened DCP keys of a plan's tensors and their global shapes."""
    keys = {f"model.{key}": plan.state[name].shape for key, name in plan.model_keys.items()}
    keys.update({f"model.{key}": tuple(t.shape) for key, t in plan.constants.items()})
    for param, slots in plan.optimizer_keys.items():
        for slot, name in slots.items():
            keys[f"optimizer.state.{param}.{slot}"] = plan.state[name].shape
    return keys


def check_resumable(path: Path, plan) -> None:
    """Raise a CheckpointError naming the first difference when the checkpoint at `path`
    cannot resume `plan`'s model and optimizer (a corrupt folder, another model)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # a missing or truncated .metadata: DCP's own error, any kind
        raise CheckpointError(f"{path}: not a readable checkpoint ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else 'unreadable'}); "
                              "delete it to resume from an older one") from None
    have = {k: tuple(m.size) for k, m in metadata.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata)}
    want = expected_keys(plan)
    for key, shape in want.items():
        if key not in have:
            raise CheckpointError(f"{path}: has no {key!r}: it was written for another model "
                                  f"or optimizer ({plan.optimizer['kind']}); resume with the "
                                  "same model file and --optimizer, or use another "
                                  "--checkpoint-dir")
        if have[key] != tuple(shape):
            raise CheckpointError(f"{path}: {key!r} has shape {list(have[key])}, the model has "
                                  f"{list(shape)}: it was written for another model")
    extra = sorted(k for k in have if k.startswith("model.") and k not in want)
    if extra:
        raise CheckpointError(f"{path}: holds {extra[0]!r}, which the model does not have: it "
                              "was written for another model")
    for part in ("step", "data.step"):
        if part not in metadata.state_dict_metadata:
            raise CheckpointError(f"{path}: has no {part!r} entry: not a graphpar train "
                                  "checkpoint")
