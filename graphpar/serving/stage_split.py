"""A served decoder's paged programs cut into pipeline stages by layer (the serving compile).

:func:`split_stages` cuts each of the decoder's programs ("decode", "prefill"; their base
graph and every size variant alike) into one program per stage: stage ``s`` holds the decoder
blocks ``layers[s]`` (their weights and KV caches), the first stage also what comes before the
first block (the embeddings), the last also what comes after the last (the final norm, the LM
head). A node belongs to block ``i`` when its module is block ``i``'s (the module of the node
that writes ``key_cache.i``, up to its layer number: ``model.blocks.3``,
``transformer.h.3``); a node of no block stays with the stage before it, so the cut follows
the graph's order and data only flows forward.

What a stage computes and a later stage reads crosses between them (the residual stream, and
what a model computes once for every layer, such as LLaMA's rotary tables): stage ``s`` sends
``sends[kind][s]``, every such value made by stages ``<= s`` and read by stages ``> s``
(values for stages further on are relayed), named as
:func:`graphpar.passes.pipeline.partition.value_name` names them. Each stage's caches are
renamed ``key_cache.0 ..`` in its own order, so a stage is a model rank like any other
(:class:`graphpar.serving.model_rank.ModelRank`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from graphpar.errors import GenerationError
from graphpar.ir.graph import Graph
from graphpar.passes.pipeline.partition import stage_subgraph, value_name

__all__ = ["ServingStages", "even_layers", "split_stages"]


@dataclass
class ServingStages:
    """A decoder's programs cut into stages.

    ``programs[s]``: stage s's programs, ``kind -> (base graph, base sizes, {symbol: (size,
    graph)})`` as :attr:`graphpar.serving.compile.ServingPrograms.graphs`; ``sends[kind][s]``:
    the names stage s passes to stage s + 1 (empty for the last stage, which returns the
    logits); ``layers[s]``: its decoder blocks, ``(first, end)``.
    """

    programs: list[dict[str, tuple[Graph, dict, dict]]]
    sends: dict[str, list[list[str]]]
    layers: list[tuple[int, int]]

    def __len__(self) -> int:
        return len(self.programs)


def even_layers(num_layers: int, stages: int) -> list[int]:
    """Blocks per stage, as equal as can be (earlier stages take the remainder)."""
    if not 1 <= stages <= num_layers:
        raise GenerationError(f"cannot cut a decoder of {num_layers} blocks into {stages} "
                              f"pipeline stages; choose between 1 and {num_layers}")
    base, extra = divmod(num_layers, stages)
    return [base + (s < extra) for s in range(stages)]


def split_stages(graphs: dict[str, tuple[Graph, dict, dict]], num_layers: int,
                 layers_per_stage: Sequence[int]) -> ServingStages:
    """Cut every program of ``graphs`` (the serving compile's) into ``len(layers_per_stage)``
    stages of that many decoder blocks each."""
    counts = list(layers_per_stage)
    if sum(counts) != num_layers or any(c < 1 for c in counts):
        raise GenerationError(f"stage layers {counts} do not split the decoder's {num_layers} "
                              f"blocks: give each stage at least one, {num_layers} in all")
    bounds, first = [], 0
    for c in counts:
        bounds.append((first, first + c))
        first += c
    stage_of_layer = [s for s, c in enumerate(counts) for _ in range(c)]
    programs: list[dict] = [{} for _ in counts]
    sends: dict[str, list[list[str]]] = {}
    for kind, (base, sizes, variants) in graphs.items():
        stage_at = _stage_indices(base, stage_of_layer)
        sends[kind] = _sends(base, stage_at, len(counts))
        for s, (a, b) in enumerate(bounds):
            programs[s][kind] = (_cut(base, stage_at, s, a, b), dict(sizes),
                                 {sym: (size, _cut(g, stage_at, s, a, b))
                                  for sym, (size, g) in variants.items()})
    return ServingStages(programs, sends, bounds)


def _cut(graph: Graph, stage_at: list[int], s: int, first: int, end: int) -> Graph:
    """Stage s's program of `graph` (a size variant has the base's nodes in the same order)."""
    nodes = [n for n, at in zip(graph.nodes, stage_at) if at == s]
    return _local_caches(stage_subgraph(graph, nodes, f"{graph.name}_stage{s}"), first, end)


def _layer_prefixes(graph: Graph, num_layers: int) -> list[str]:
    """Each block's module path, from the node that writes its key cache."""
    prefixes = []
    for i in range(num_layers):
        writer = next((n for n in graph.nodes for v in n.input_values
                       if v.is_input and v.name == f"key_cache.{i}"), None)
        parts = (writer.module or "").split(".") if writer is not None else []
        number = next((j for j, p in enumerate(parts) if p.isdigit()), None)
        if number is None:
            raise GenerationError(
                f"cannot find decoder block {i}'s module in graph @{graph.name} (the node "
                f"that writes key_cache.{i} has module {writer.module if writer else None!r}, "
                f"no layer number): serve this model without pipeline stages")
        prefixes.append(".".join(parts[:number + 1]))
    return prefixes


def _stage_indices(graph: Graph, stage_of_layer: list[int]) -> list[int]:
    """Every node's stage, in node order: its block's, or the stage before it."""
    prefixes = _layer_prefixes(graph, len(stage_of_layer))
    stages, current = [], 0
    for node in graph.nodes:
        module = node.module or ""
        for i, prefix in enumerate(prefixes):
            if module == prefix or module.startswith(prefix + "."):
                current = max(current, stage_of_layer[i])
                break
        stages.append(current)
    return stages


def _sends(graph: Graph, stage_at: list[int], stages: int) -> list[list[str]]:
    where = {n: s for n, s in zip(graph.nodes, stage_at)}
    last_reader: dict[str, tuple[int, int]] = {}  # value name -> (made on, last read on)
    for node in graph.nodes:
        for v in node.input_values:
            if v.producer is not None and where[v.producer] < where[node]:
                name = value_name(graph, v)
                made, read = last_reader.get(name, (where[v.producer], 0))
                last_reader[name] = (made, max(read, where[node]))
    return [sorted((n for n, (made, read) in last_reader.items() if made <= s < read),
                   key=_by_index) for s in range(stages)]


def _by_index(name: str) -> tuple[int, str]:
    head = name[1:].split(".")[0]
    return (int(head), name) if head.isdigit() else (-1, name)


def _local_caches(graph: Graph, first: int, end: int) -> Graph:
    """Rename a stage's caches of blocks first..end-1 to ``key_cache.0`` .. in its order."""
    renames = {f"{kind}.{i}": f"{kind}.{i - first}" for i in range(first, end)
               for kind in ("key_cache", "value_cache")}
    for v in graph.inputs:
        if v.name in renames:
            v.name = renames[v.name]
    for out in graph.outputs:
        if out.target in renames:
            out.target = renames[out.target]
    graph._input_names = None  # names changed: the graph's lookup of them is rebuilt
    return graph

