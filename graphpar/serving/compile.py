"""Compiling a causal LM for serving: its paged prefill and decode programs, and their TP plan.

:func:`compile_decoder` captures the model's prefill and decode graphs
(:mod:`graphpar.capture.decoder`) at a base size and one step per size symbol (prefill: tokens
``T`` and sequences ``N``; decode: sequences ``N``), runs ``paged-attention,cleanup`` on them and,
for ``tensor_parallel > 1``, plans and lowers them for that many ranks
(:mod:`graphpar.passes.autoshard.serving`), or for ``pipeline_stages > 1`` cuts them into that
many stages by layer (:mod:`graphpar.serving.stage_split`). The serving runtime
(:class:`graphpar.serving.paged_model.PagedDecoder`) receives the result and only runs it.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

import graphpar.passes.paged_attention  # noqa: F401  (registers the pass and the paged ops)
from graphpar.backends.paged import cuda_kernels_available
from graphpar.capture.capture import Captured
from graphpar.capture.decoder import (
    DecoderAdapter,
    DecoderInfo,
    capture_decode,
    capture_prefill,
    decoder_adapter,
)
from graphpar.errors import BackendError, GenerationError
from graphpar.ir.graph import Graph
from graphpar.ir.paged_ops import KERNELS
from graphpar.ir.paged_reference import SUPPORTED_HEAD_SIZES
from graphpar.passes import parse_pipeline, run_pipeline
from graphpar.passes.autoshard.serving import ServingProgram, plan_serving
from graphpar.passes.paged_attention import PagedAttention
from graphpar.serving.stage_split import ServingStages, even_layers, split_stages

__all__ = ["ServingPrograms", "compile_decoder"]

# Sizes the graphs are captured at: a base and one step per symbol (see GraphTemplate.fit).
PREFILL_BASE = {"T": 6, "N": 2}
PREFILL_VARIANTS = {"T": 7, "N": 3}
DECODE_BASE = {"N": 2}
DECODE_VARIANTS = {"N": 3}
DECODE_PAST = 2

# Captured (pre-pass) graphs per model object, so engines over one model capture once.
_CAPTURES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass
class ServingPrograms:
    """A causal LM compiled for serving.

    ``graphs``: the paged global programs, ``name -> (base graph, base sizes, {symbol: (size,
    graph)})`` for "decode" and "prefill" (in planning order); ``state``: the weights by graph
    input name; ``device_programs``: with ``tensor_parallel > 1``, each program planned and
    lowered for that many ranks (else None); ``stages``: with ``pipeline_stages > 1``, the
    programs cut into stages by layer (else None).
    """

    info: DecoderInfo
    device: torch.device
    block_size: int
    num_blocks: int
    max_blocks_per_seq: int
    kernel: str
    uses_cuda_kernels: bool
    graphs: dict[str, tuple[Graph, dict, dict]]
    state: dict[str, torch.Tensor]
    captured_prefill: Captured
    captured_decode: Captured
    tensor_parallel: int = 1
    device_programs: dict[str, ServingProgram] | None = None
    stages: ServingStages | None = None


def compile_decoder(model: torch.nn.Module, *, block_size: int = 16, num_blocks: int = 256,
                    kernel: str = "auto", tensor_parallel: int = 1, tp_plan: str = "auto",
                    tp_cluster: str = "cpu", pipeline_stages: int = 1,
                    stage_layers: Sequence[int] | None = None,
                    progress: Callable[[str], None] | None = None) -> ServingPrograms:
    """Compile ``model`` (a causal LM :func:`~graphpar.capture.decoder.decoder_adapter`
    accepts, in eval mode, on its device, in the dtype to serve in) for serving; arguments as
    :class:`graphpar.serving.paged_model.PagedDecoder`'s; ``stage_layers``: decoder blocks
    per pipeline stage (default: as even as can be)."""
    if kernel not in KERNELS:
        raise GenerationError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    if tensor_parallel < 1:
        raise GenerationError(f"tensor_parallel must be at least 1, got {tensor_parallel}")
    if pipeline_stages > 1 and tensor_parallel > 1:
        raise GenerationError("serve with tensor_parallel or pipeline_stages, not both (a "
                              "stage of several tensor-parallel ranks is not built)")
    say = progress or (lambda message: None)
    adapter = decoder_adapter(model)
    info = adapter.info()
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    uses_cuda = _uses_cuda_kernels(kernel, device, info)
    if max(tensor_parallel, pipeline_stages) > 1 and device.type != "cpu":
        raise GenerationError("tensor-parallel serving runs on CPU ranks over gloo; move "
                              "the model to the CPU or serve with tensor_parallel=1")
    max_blocks_per_seq = math.ceil(info.max_model_len / block_size)
    pipeline = [PagedAttention(block_size=block_size, num_blocks=num_blocks,
                               max_blocks_per_seq=max_blocks_per_seq, kernel=kernel),
                *parse_pipeline("cleanup")]

    def paged(captured: Captured) -> Graph:
        graph = captured.graph.copy()
        run_pipeline(graph, pipeline)
        return graph

    say(f"capturing the prefill graph ({info.num_layers} layers)")
    prefill = {}
    for sym, size in [(None, None), *PREFILL_VARIANTS.items()]:
        sizes = dict(PREFILL_BASE)
        if sym is not None:
            sizes[sym] = size
        key = ("prefill", sizes["T"], sizes["N"])
        prefill[sym] = _captured(adapter, key, lambda s=sizes: capture_prefill(
            adapter, s["T"], s["N"]))
    say("capturing the decode graph")
    decode = {}
    for sym, size in [(None, None), *DECODE_VARIANTS.items()]:
        n = DECODE_BASE["N"] if sym is None else size
        decode[sym] = _captured(adapter, ("decode", n, DECODE_PAST),
                                lambda n=n: capture_decode(adapter, n, DECODE_PAST))
    say("paged-attention pass")
    # planning order: decode first (it runs most steps; prefill keeps its weight layouts)
    graphs = {
        "decode": (paged(decode[None]), dict(DECODE_BASE),
                   {s: (n, paged(decode[s])) for s, n in DECODE_VARIANTS.items()}),
        "prefill": (paged(prefill[None]), dict(PREFILL_BASE),
                    {s: (n, paged(prefill[s])) for s, n in PREFILL_VARIANTS.items()}),
    }
    state = dict(prefill[None].state)
    missing = [v.name for v in graphs["decode"][0].inputs
               if v.role.value in ("param", "buffer") and v.name not in state
               and not v.name.startswith(("key_cache.", "value_cache."))]
    if missing:
        raise GenerationError(f"the decode graph reads tensors the prefill graph does not: "
                              f"{', '.join(missing)}")
    device_programs = None
    if tensor_parallel > 1:
        say(f"planning for {tensor_parallel} tensor-parallel ranks ({tp_plan})")
        device_programs = plan_serving(graphs, tensor_parallel, tp_plan, tp_cluster)
    stages = None
    if pipeline_stages > 1 or stage_layers is not None:
        layers = (list(stage_layers) if stage_layers is not None
                  else even_layers(info.num_layers, pipeline_stages))
        if len(layers) != pipeline_stages:
            raise GenerationError(f"stage_layers {layers} name {len(layers)} stages, not "
                                  f"pipeline_stages={pipeline_stages}")
        say(f"cutting the programs into {pipeline_stages} pipeline stages")
        stages = split_stages(graphs, info.num_layers, layers)
    return ServingPrograms(info, device, block_size, num_blocks, max_blocks_per_seq, kernel,
                           uses_cuda, graphs, state, prefill[None], decode[None],
                           tensor_parallel, device_programs, stages)


def _uses_cuda_kernels(kernel: str, device: torch.device, info: DecoderInfo) -> bool:
    uses_cuda = kernel == "cuda" or (
        kernel == "auto" and device.type == "cuda" and cuda_kernels_available())
    if not uses_cuda:
        return False
    if info.head_size not in SUPPORTED_HEAD_SIZES:
        raise GenerationError(
            f"head size {info.head_size} is not supported by the paged-attention CUDA "
            f"kernels (supported: {', '.join(map(str, SUPPORTED_HEAD_SIZES))}); serve with "
            "kernel='torch' or 'reference' instead")
    if device.type != "cuda":
        raise BackendError("kernel='cuda' needs the model on a CUDA device")
    return True


def _captured(adapter: DecoderAdapter, key: tuple, make: Callable[[], Captured]) -> Captured:
    model = adapter.model
    info = adapter.info()
    per_model = _CAPTURES.setdefault(model, {})
    full_key = (key, info.dtype, str(next((p.device for p in model.parameters()), "cpu")))
    cached = per_model.get(full_key)
    if cached is not None and _same_tensors(cached, model):
        return cached
    per_model[full_key] = captured = make()
    return captured


def _same_tensors(captured: Captured, model: torch.nn.Module) -> bool:
    current = {t.data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    return all(t.data_ptr() in current for t in captured.state.values())
