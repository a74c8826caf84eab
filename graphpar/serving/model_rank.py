"""One rank's share of a served model: its step programs, weights and paged KV cache."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from graphpar.backends.interpreter import Interpreter
from graphpar.backends.paged import paged_kernels
from graphpar.errors import GenerationError
from graphpar.ir import paged_reference as reference_paged
from graphpar.ir.graph_template import GraphTemplate

__all__ = ["STEP_INPUTS", "ModelRank"]

# the inputs a step replaces; the others (weights, caches) are checked on a program's first run
STEP_INPUTS = ("input_ids", "positions", "logits_indices", "slot_mapping", "block_tables",
               "context_lens", "query_start_loc")


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
        self._programs: dict[tuple, Interpreter] = {}

    def run(self, kind: str, sizes: dict[str, int], step: dict[str, torch.Tensor]
            ) -> torch.Tensor:
        """Run the ``kind`` ("prefill" or "decode") program at ``sizes`` on the step's tensors;
        returns its logits (whole on every rank)."""
        return self.run_all(kind, sizes, step)[0]

    def run_all(self, kind: str, sizes: dict[str, int], step: dict[str, torch.Tensor]
                ) -> list[torch.Tensor]:
        """:meth:`run`, returning every output of the program in order (a pipeline stage's
        are what it passes on)."""
        key = (kind, *sizes.values())
        program = self._programs.get(key)
        if program is None:
            if len(self._programs) >= 512:
                self._programs.clear()
            template = self.prefill_template if kind == "prefill" else self.decode_template
            # prepared once and run under inference_mode, its weights and caches checked on
            # the first call only
            program = Interpreter(template.specialize(**sizes), self.comm, checked=STEP_INPUTS,
                                  inference=True)
            self._programs[key] = program
        inputs = self._inputs  # weights and caches stay; the step's tensors are replaced
        inputs.update(step)
        if self.device.type == "cpu":
            return program.run(inputs)
        with torch.device(self.device):  # creation ops (full, arange) on the model's device
            return program.run(inputs)

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
