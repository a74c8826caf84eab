"""A causal LM ready to serve: its paged prefill and decode programs, weights and KV cache.

:class:`PagedDecoder` captures the model's prefill and decode graphs
(:mod:`graphpar.capture.decoder`), runs ``paged-attention,cleanup`` on them, and fits each into
a :class:`~graphpar.runtime.graph_template.GraphTemplate` over the step's sizes (prefill: tokens
``T`` and sequences ``N``; decode: sequences ``N``), so one capture serves every batch shape.
A step pads the step's token ids, positions, slot mapping, block tables and context lengths to a
bucket size and hands them to the ranks that run the programs.

A :class:`ModelRank` is one rank's share: the programs' templates, its weights, its KV cache
tensors (device pool and CPU swap pool). With one rank it holds the whole model and runs the
graphs on the reference executor (torch on the CPU, or the GPU with the paged-attention CUDA
kernels). With ``tensor_parallel=n`` the graphs are planned for ``n`` ranks first
(:mod:`graphpar.passes.autoshard.serving`: attention by heads, caches by kv heads, step inputs
replicated), and :mod:`graphpar.runtime.tensor_parallel` runs rank 0 here and the others in
their own processes over gloo; the block manager stays one, here, and every rank gets the same
step inputs.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

import graphpar.passes.paged_attention  # noqa: F401  (registers the pass and the paged ops)
from graphpar.backends import reference_paged
from graphpar.backends.reference_paged import SUPPORTED_HEAD_SIZES
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
from graphpar.ir.paged_ops import KERNELS, cuda_kernels_available, paged_kernels
from graphpar.passes import run_pipeline
from graphpar.runtime.executor import CompiledGraph
from graphpar.runtime.graph_template import GraphTemplate

__all__ = ["PagedDecoder", "StepInputs"]

# Sizes the graphs are captured at: a base and one step per symbol (see GraphTemplate.fit).
PREFILL_BASE = {"T": 6, "N": 2}
PREFILL_VARIANTS = {"T": 7, "N": 3}
DECODE_BASE = {"N": 2}
DECODE_VARIANTS = {"N": 3}
DECODE_PAST = 2
STEP_INPUTS = ("input_ids", "positions", "logits_indices", "slot_mapping", "block_tables",
               "context_lens", "query_start_loc")


def bucket(n: int) -> int:
    """Step sizes run as: powers of two up to 16, then multiples of 16."""
    if n <= 16:
        return 1 << max(n - 1, 0).bit_length()
    return -(-n // 16) * 16


# Captured (pre-pass) graphs per model object, so engines over one model capture once.
_CAPTURES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass
class StepInputs:
    """What one prefill or decode step feeds the model, as flat Python lists."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    block_tables: list[list[int]]
    context_lens: list[int]
    query_start_loc: list[int] | None = None  # prefill only
    logits_indices: list[int] | None = None  # prefill only


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


class ModelRank:
    """One rank's programs, weights and KV cache; runs steps, block copies and swaps.

    Args:
        prefill, decode: the programs' templates (whole graphs, or one rank's device programs).
        state: the weights (this rank's shards), by graph input name.
        num_cpu_blocks: blocks of the CPU swap space.
        kernel: the paged-attention kernel choice (graphpar.ir.paged_ops.KERNELS).
        comm: this rank's communicator when the programs are device programs of several ranks.
        device: where the caches live (the weights' device).

    The caches are allocated from the programs' ``key_cache.i`` / ``value_cache.i`` input types
    (on a tensor-parallel rank: its kv heads only).
    """

    def __init__(self, prefill: GraphTemplate, decode: GraphTemplate,
                 state: dict[str, torch.Tensor], *, num_cpu_blocks: int = 0,
                 kernel: str = "auto", comm=None, device: torch.device | str = "cpu") -> None:
        self.prefill_template, self.decode_template = prefill, decode
        self.kernel, self.comm = kernel, comm
        self.device = torch.device(device)
        self.key_caches: list[torch.Tensor] = []
        self.value_caches: list[torch.Tensor] = []
        self.cpu_key_caches: list[torch.Tensor] = []
        self.cpu_value_caches: list[torch.Tensor] = []
        self.state = dict(state)
        caches = {v.name: v.type for v in decode.base.inputs if v.name.startswith("key_cache.")}
        for i in range(len(caches)):
            blocks, block_size, kv_heads, head_size = caches[f"key_cache.{i}"].shape
            dtype = caches[f"key_cache.{i}"].dtype
            k, v = reference_paged.allocate_kv_cache(blocks, block_size, kv_heads, head_size,
                                                     dtype, self.device)
            self.key_caches.append(k)
            self.value_caches.append(v)
            if num_cpu_blocks:
                k, v = reference_paged.allocate_kv_cache(num_cpu_blocks, block_size, kv_heads,
                                                         head_size, dtype, "cpu")
                self.cpu_key_caches.append(k)
                self.cpu_value_caches.append(v)
            self.state[f"key_cache.{i}"] = self.key_caches[i]
            self.state[f"value_cache.{i}"] = self.value_caches[i]
        self._inputs: dict[str, torch.Tensor] = dict(self.state)
        self._programs: dict[tuple, CompiledGraph] = {}

    def run(self, kind: str, sizes: dict[str, int], step: dict[str, torch.Tensor]
            ) -> torch.Tensor:
        """Run the ``kind`` ("prefill" or "decode") program at ``sizes`` on the step's tensors;
        returns its logits (whole on every rank)."""
        key = (kind, *sizes.values())
        program = self._programs.get(key)
        if program is None:
            if len(self._programs) >= 512:
                self._programs.clear()
            template = self.prefill_template if kind == "prefill" else self.decode_template
            program = CompiledGraph(template.specialize(**sizes), checked=STEP_INPUTS,
                                    comm=self.comm)
            self._programs[key] = program
        inputs = self._inputs  # weights and caches stay; the step's tensors are replaced
        inputs.update(step)
        if self.device.type == "cpu":
            return program.run(inputs)[0]
        with torch.device(self.device):  # creation ops (full, arange) on the model's device
            return program.run(inputs)[0]

    def copy_blocks(self, pairs: Sequence) -> None:
        """Copy-on-write: copy device blocks ``src -> dst`` in every layer, one batched call."""
        if pairs:
            caches = self.key_caches + self.value_caches
            paged_kernels(caches[0], self.kernel).copy_blocks(caches, pairs)

    def swap_out(self, mapping: dict[int, int]) -> None:
        """Copy device blocks to CPU blocks (``device -> cpu`` mapping) in every layer."""
        self._swap(mapping, self.key_caches + self.value_caches,
                   self.cpu_key_caches + self.cpu_value_caches)

    def swap_in(self, mapping: dict[int, int]) -> None:
        """Copy CPU blocks back to device blocks (``cpu -> device`` mapping)."""
        self._swap(mapping, self.cpu_key_caches + self.cpu_value_caches,
                   self.key_caches + self.value_caches)

    @staticmethod
    def _swap(mapping: dict[int, int], sources: list[torch.Tensor],
              targets: list[torch.Tensor]) -> None:
        if not mapping:
            return
        if not targets or not sources:
            raise GenerationError("swapping needs CPU swap blocks (num_cpu_blocks > 0)")
        src = torch.tensor(list(mapping.keys()), dtype=torch.long)
        dst = torch.tensor(list(mapping.values()), dtype=torch.long)
        for s, t in zip(sources, targets):
            t.index_copy_(0, dst.to(t.device), s.index_select(0, src.to(s.device)).to(t.device))

    def close(self) -> None:
        pass


class PagedDecoder:
    """The paged programs of one model, run on one rank or on ``tensor_parallel`` CPU ranks.

    Args:
        model: a causal LM :func:`~graphpar.capture.decoder.decoder_adapter` accepts (in eval
            mode, on ``device``, in the dtype to serve in).
        block_size, num_blocks: the paged KV cache (tokens per block, device blocks).
        num_cpu_blocks: blocks of the CPU swap space.
        kernel: ``auto`` (CUDA kernels for CUDA tensors when CuPy is present), ``reference``
            (torch), or ``cuda``. Raises GenerationError if the CUDA kernels are to be used and
            the head size is not one they are built for.
        tensor_parallel: ranks to shard the model over (CPU processes over gloo).
        tp_plan: ``auto`` (the ILP's plan) or ``megatron``; see
            :mod:`graphpar.passes.autoshard.serving`. tp_cluster: the cluster (preset or file)
            the plan is costed on.
        progress: called with a message before each slow setup step.
    """

    def __init__(self, model: torch.nn.Module, *, block_size: int = 16, num_blocks: int = 256,
                 num_cpu_blocks: int = 0, kernel: str = "auto", tensor_parallel: int = 1,
                 tp_plan: str = "auto", tp_cluster: str = "cpu",
                 progress: Callable[[str], None] | None = None) -> None:
        if kernel not in KERNELS:
            raise GenerationError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
        if tensor_parallel < 1:
            raise GenerationError(f"tensor_parallel must be at least 1, got {tensor_parallel}")
        say = progress or (lambda message: None)
        self.adapter = decoder_adapter(model)
        self.info: DecoderInfo = self.adapter.info()
        info = self.info
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.kernel = kernel
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.tensor_parallel = tensor_parallel
        self.max_blocks_per_seq = math.ceil(info.max_model_len / block_size)
        self._check_kernel()
        if tensor_parallel > 1 and self.device.type != "cpu":
            raise GenerationError("tensor-parallel serving runs on CPU ranks over gloo; move "
                                  "the model to the CPU or serve with tensor_parallel=1")
        pipeline = (f"paged-attention{{block_size={block_size},num_blocks={num_blocks},"
                    f"max_blocks_per_seq={self.max_blocks_per_seq},kernel={kernel}}},cleanup")

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
            prefill[sym] = _captured(self.adapter, key, lambda s=sizes: capture_prefill(
                self.adapter, s["T"], s["N"]))
        say("capturing the decode graph")
        decode = {}
        for sym, size in [(None, None), *DECODE_VARIANTS.items()]:
            n = DECODE_BASE["N"] if sym is None else size
            decode[sym] = _captured(self.adapter, ("decode", n, DECODE_PAST),
                                    lambda n=n: capture_decode(self.adapter, n, DECODE_PAST))
        self.captured_prefill = prefill[None]
        self.captured_decode = decode[None]
        say("paged-attention pass")
        # planning order: decode first (it runs most steps; prefill keeps its weight layouts)
        self.graphs = {
            "decode": (paged(decode[None]), dict(DECODE_BASE),
                       {s: (n, paged(decode[s])) for s, n in DECODE_VARIANTS.items()}),
            "prefill": (paged(prefill[None]), dict(PREFILL_BASE),
                        {s: (n, paged(prefill[s])) for s, n in PREFILL_VARIANTS.items()}),
        }
        state = dict(prefill[None].state)
        missing = [v.name for v in self.graphs["decode"][0].inputs
                   if v.role.value in ("param", "buffer") and v.name not in state
                   and not v.name.startswith(("key_cache.", "value_cache."))]
        if missing:
            raise GenerationError(f"the decode graph reads tensors the prefill graph does not: "
                                  f"{', '.join(missing)}")
        if tensor_parallel == 1:
            say("shape templates")
            templates = {name: GraphTemplate.fit(base, sizes, variants)
                         for name, (base, sizes, variants) in self.graphs.items()}
            self.ranks = ModelRank(templates["prefill"], templates["decode"], state,
                                   num_cpu_blocks=num_cpu_blocks, kernel=kernel,
                                   device=self.device)
        else:
            from graphpar.runtime.tensor_parallel import TensorParallelRanks

            say(f"planning for {tensor_parallel} tensor-parallel ranks ({tp_plan})")
            self.ranks = TensorParallelRanks(self.graphs, state, tensor_parallel, plan=tp_plan,
                                             cluster=tp_cluster, num_cpu_blocks=num_cpu_blocks,
                                             kernel=kernel, progress=say)
        self.prefill_template = self.ranks.prefill_template
        self.decode_template = self.ranks.decode_template

    def _check_kernel(self) -> None:
        uses_cuda = self.kernel == "cuda" or (
            self.kernel == "auto" and self.device.type == "cuda" and cuda_kernels_available())
        self.uses_cuda_kernels = uses_cuda
        if not uses_cuda:
            return
        if self.info.head_size not in SUPPORTED_HEAD_SIZES:
            raise GenerationError(
                f"head size {self.info.head_size} is not supported by the paged-attention CUDA "
                f"kernels (supported: {', '.join(map(str, SUPPORTED_HEAD_SIZES))}); serve with "
                "kernel='torch' or 'reference' instead")
        if self.device.type != "cuda":
            raise BackendError("kernel='cuda' needs the model on a CUDA device")

    # --- running ----------------------------------------------------------------------------

    @property
    def kv_bytes(self) -> int:
        """Bytes of the device KV cache (all layers, K and V, all ranks together)."""
        return self.num_blocks * self.block_size * self.info.kv_bytes_per_token

    def _tensor(self, values: Sequence, dtype: torch.dtype) -> torch.Tensor:
        tensor = torch.tensor(values, dtype=dtype)
        return tensor if self.device.type == "cpu" else tensor.to(self.device, non_blocking=True)

    def prefill(self, step: StepInputs) -> torch.Tensor:
        """Run a prefill step; returns the logits ``[sequences, vocab]`` at ``logits_indices``.

        Tokens and sequences are padded up to :func:`bucket` sizes (padding tokens write
        nowhere and belong to no sequence; padding sequences have no context), so a few
        specialized programs serve every step.
        """
        tokens, seqs = len(step.input_ids), len(step.context_lens)
        t, n = bucket(tokens), bucket(seqs)
        pad_t, pad_n = t - tokens, n - seqs
        logits = self.ranks.run("prefill", {"T": t, "N": n}, {
            "input_ids": self._tensor([step.input_ids + [0] * pad_t], torch.long),
            "positions": self._tensor([step.positions + [0] * pad_t], torch.long),
            "logits_indices": self._tensor(step.logits_indices + [0] * pad_n, torch.long),
            "slot_mapping": self._tensor(step.slot_mapping + [-1] * pad_t, torch.long),
            "block_tables": self._tensor(step.block_tables + self._zero_rows(pad_n), torch.int32),
            "context_lens": self._tensor(step.context_lens + [0] * pad_n, torch.int32),
            "query_start_loc": self._tensor(step.query_start_loc + [tokens] * pad_n,
                                            torch.int32),
        })
        return logits.reshape(n, -1)[:seqs]

    def decode(self, step: StepInputs) -> torch.Tensor:
        """Run a decode step (one token per sequence); returns logits ``[sequences, vocab]``.

        Sequences are padded up to a :func:`bucket` size with empty ones."""
        seqs = len(step.input_ids)
        n = bucket(seqs)
        pad = n - seqs
        logits = self.ranks.run("decode", {"N": n}, {
            "input_ids": self._tensor(step.input_ids + [0] * pad, torch.long).view(n, 1),
            "positions": self._tensor(step.positions + [0] * pad, torch.long).view(n, 1),
            "slot_mapping": self._tensor(step.slot_mapping + [-1] * pad, torch.long),
            "block_tables": self._tensor(step.block_tables + self._zero_rows(pad), torch.int32),
            "context_lens": self._tensor(step.context_lens + [0] * pad, torch.int32),
        })
        return logits.reshape(n, -1)[:seqs]

    def _zero_rows(self, n: int) -> list[list[int]]:
        return [[0] * self.max_blocks_per_seq for _ in range(n)]

    # --- block copies (every rank copies its share of each block) ---------------------------

    def copy_blocks(self, pairs: Sequence) -> None:
        self.ranks.copy_blocks(pairs)

    def swap_out(self, mapping: dict[int, int]) -> None:
        self.ranks.swap_out(mapping)

    def swap_in(self, mapping: dict[int, int]) -> None:
        self.ranks.swap_in(mapping)

    @property
    def key_caches(self) -> list[torch.Tensor]:
        """Rank 0's key caches (all of them with one rank)."""
        return self.ranks.key_caches

    @property
    def value_caches(self) -> list[torch.Tensor]:
        return self.ranks.value_caches

    def programs(self) -> dict[str, Graph]:
        """The programs it runs, at their base sizes, by file name: ``prefill.gpir`` and
        ``decode.gpir`` (paged, whole model) and, on tensor-parallel ranks, the device programs
        ``prefill.spmd.gpir`` and ``decode.spmd.gpir``."""
        found = {f"{name}.gpir": graphs[0] for name, graphs in self.graphs.items()}
        for name in self.graphs:
            template = getattr(self.ranks, f"{name}_template")
            if template.base.attrs.get("spmd"):
                found[f"{name}.spmd.gpir"] = template.base
        return found

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do with one rank)."""
        self.ranks.close()
