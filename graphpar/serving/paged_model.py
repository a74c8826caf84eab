"""A causal LM being served: its paged step programs run on one rank or tensor-parallel ranks.

:class:`PagedDecoder` receives the model compiled for serving
(:func:`graphpar.serving.compile.compile_decoder`: paged prefill and decode programs captured at a
base size and one step per size symbol, and for ``tensor_parallel=n`` their plan for ``n``
ranks), fits each into a :class:`~graphpar.ir.graph_template.GraphTemplate` over the step's
sizes (prefill: tokens ``T`` and sequences ``N``; decode: sequences ``N``), so one capture serves
every batch shape. A step pads the step's token ids, positions, slot mapping, block tables and
context lengths to a bucket size and hands them to the ranks that run the programs.

A :class:`~graphpar.serving.model_rank.ModelRank` is one rank's share: the programs' templates,
its weights, its KV cache tensors (device pool and CPU swap pool). With one rank it holds the
whole model and runs the graphs on the reference interpreter (torch on the CPU, or the GPU with
the paged-attention CUDA kernels). With ``tensor_parallel=n``,
:mod:`graphpar.serving.tensor_parallel` runs rank 0 here and the others in their own processes
over gloo; the block manager stays one, here, and every rank gets the same step inputs. With
``pipeline_stages=n``, :mod:`graphpar.serving.pipeline_parallel` runs the programs cut into n
stages by layer, stage 0 here and the others in their own processes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from graphpar.ir.graph import Graph
from graphpar.ir.graph_template import GraphTemplate
from graphpar.serving.model_rank import ModelRank
from graphpar.serving.pipeline_parallel import PipelineRanks
from graphpar.serving.tensor_parallel import TensorParallelRanks

if TYPE_CHECKING:  # the compiler's result type only: the runtime does not compile
    from graphpar.serving.compile import ServingPrograms

__all__ = ["PagedDecoder", "StepInputs", "bucket"]


def bucket(n: int) -> int:
    """Step sizes run as: powers of two up to 16, then multiples of 16."""
    if n <= 16:
        return 1 << max(n - 1, 0).bit_length()
    return -(-n // 16) * 16


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


class PagedDecoder:
    """The paged programs of one model, run on one rank or on ``tensor_parallel`` CPU ranks.

    Args:
        programs: the model compiled for serving (:func:`graphpar.serving.compile.compile_decoder`:
            its block size, number of blocks, kernel and tensor-parallel plan).
        num_cpu_blocks: blocks of the CPU swap space.
        progress: called with a message before each slow setup step.
    """

    def __init__(self, programs: ServingPrograms, *, num_cpu_blocks: int = 0,
                 progress: Callable[[str], None] | None = None) -> None:
        say = progress or (lambda message: None)
        self.info = programs.info  # graphpar.capture.decoder.DecoderInfo
        self.device = programs.device
        self.kernel = programs.kernel
        self.uses_cuda_kernels = programs.uses_cuda_kernels
        self.block_size = programs.block_size
        self.num_blocks = programs.num_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.tensor_parallel = programs.tensor_parallel
        self.max_blocks_per_seq = programs.max_blocks_per_seq
        self.captured_prefill = programs.captured_prefill
        self.captured_decode = programs.captured_decode
        self.graphs = programs.graphs
        if programs.stages is not None:
            self.ranks = PipelineRanks(programs.stages, programs.state,
                                       num_cpu_blocks=num_cpu_blocks, kernel=self.kernel,
                                       progress=say)
        elif programs.device_programs is None:
            say("shape templates")
            templates = {name: GraphTemplate.fit(base, sizes, variants)
                         for name, (base, sizes, variants) in self.graphs.items()}
            self.ranks = ModelRank(templates["prefill"], templates["decode"], programs.state,
                                   num_cpu_blocks=num_cpu_blocks, kernel=self.kernel,
                                   device=self.device)
        else:
            self.ranks = TensorParallelRanks(programs.device_programs, programs.state,
                                             programs.tensor_parallel,
                                             num_cpu_blocks=num_cpu_blocks, kernel=self.kernel,
                                             progress=say)
        self.prefill_template = self.ranks.prefill_template
        self.decode_template = self.ranks.decode_template

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
