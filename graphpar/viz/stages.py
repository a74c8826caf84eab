"""The pipeline view's data: an MPMD program's stages as bands, sub-meshes as colours, and the
send/recv pairs between stages as edges.

An MPMD program (`graphpar.passes.pipeline.lower_mpmd`) names its graphs `stage<s>_forward`,
`stage<s>_backward` and `stage<s>_update`, each declared on its stage's sub-mesh. Everything here
is read from the IR alone (names, meshes, `send`/`recv` attributes), so a `.gpir` file is enough:

- `stages`: one band per stage: its graphs (index into the page's graph list, phase, node
  count, FLOPs), totals, its sub-mesh (devices, shape) and that sub-mesh's colour; estimated
  time and memory where the graphs' attributes carry them (`est_seconds`, `mem_bytes`) or the
  caller passes a stage plan;
- `submeshes`: each distinct sub-mesh once, with its colour;
- `transfers`: matched pairs, a `send` in one stage's graph and the `recv` that takes it in
  another (same phase, the sender's lead device is the receiver's `src`, the receiver's lead
  device is the sender's `dst`, same tag and type), with type and bytes; between sub-meshes
  of several devices a `send_tiles` and its `recv_tile` (the first tile's devices are the
  leads);
- `unmatched`: sends or receives with no partner (a truncated or hand-edited program);
- `token_slices`, `batch_slices`: the token slicing (TeraPipe) the stage graphs' attributes
  record, when `slice-tokens` ran: tokens per slice and sequences per microbatch.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from graphpar.ir.graph import Graph, Node

# One colour per sub-mesh, in the order stages first use them; distinct from the op-kind fills.
SUBMESH_PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#e15759", "#76b7b2",
                   "#edc948", "#ff9da7", "#9c755f", "#bab0ac")
PHASES = {"forward": "forward", "backward": "backward", "update": "update",
          "backward_input": "backward", "backward_weight": "backward"}
_STAGE_GRAPH = re.compile(r"^stage(\d+)_([a-z_]+)$")


def stage_of_graph(graph: Graph) -> tuple[int, str] | None:
    """(stage, phase) of an MPMD stage graph by its name, or None for any other graph."""
    m = _STAGE_GRAPH.match(graph.name)
    if m is None or m.group(2) not in PHASES:
        return None
    return int(m.group(1)), m.group(2)


def submesh_color(index: int) -> str:
    return SUBMESH_PALETTE[index % len(SUBMESH_PALETTE)]


def pipeline_data(graphs: Sequence[Graph], summaries: Sequence[Mapping[str, Any]],
                  stage_estimates: Sequence[Mapping[str, float]] | None = None
                  ) -> dict[str, Any] | None:
    """The pipeline view of `graphs` (the page's graph list, in order; `summaries[i]` is graph
    i's summary from `graph_data`, for its node count and FLOPs), or None when none of them is
    an MPMD stage graph.

    `stage_estimates[s]` may give stage s's `est_seconds` (per microbatch) and `mem_bytes` (per
    device), both estimates of the cost model; they override what the graphs' attrs say."""
    members: dict[int, list[tuple[int, Graph, str]]] = {}
    for index, graph in enumerate(graphs):
        found = stage_of_graph(graph)
        if found is not None:
            members.setdefault(found[0], []).append((index, graph, found[1]))
    if not members:
        return None

    submeshes: list[dict[str, Any]] = []
    submesh_index: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
    lead: dict[int, int] = {}  # stage -> the device that sends and receives for it
    stages = []
    for s in sorted(members):
        entries = members[s]
        mesh = next((g.mesh for _, g, _ in entries if g.mesh is not None), None)
        devices = tuple(mesh.device_ids) if mesh is not None else (s,)
        shape = tuple(mesh.shape) if mesh is not None else (1,)
        key = (shape, devices)
        if key not in submesh_index:
            submesh_index[key] = len(submeshes)
            submeshes.append({"id": len(submeshes), "shape": "x".join(map(str, shape)),
                              "devices": list(devices), "color": submesh_color(len(submeshes))})
        lead[s] = devices[0]
        band: dict[str, Any] = {
            "stage": s,
            "submesh": submesh_index[key],
            "devices": list(devices),
            "shape": "x".join(map(str, shape)),
            "color": submeshes[submesh_index[key]]["color"],
            "graphs": [{"graph": i, "name": g.name, "phase": PHASES[phase],
                        "nodes": summaries[i]["nodes"], "flops": summaries[i]["flops"]}
                       for i, g, phase in entries],
        }
        band["nodes"] = sum(e["nodes"] for e in band["graphs"])
        band["flops"] = sum(e["flops"] for e in band["graphs"])
        for key_name in ("est_seconds", "mem_bytes"):
            value = next((g.attrs[key_name] for _, g, _ in entries if key_name in g.attrs), None)
            if stage_estimates is not None and s < len(stage_estimates):
                value = stage_estimates[s].get(key_name, value)
            if value is not None:
                band[key_name] = value
        stages.append(band)

    transfers, unmatched = _match_transfers(members, lead)
    data = {"stages": stages, "submeshes": submeshes, "transfers": transfers,
            "unmatched": unmatched}
    for key in ("token_slices", "batch_slices"):  # slice-tokens' record, on every stage graph
        value = next((g.attrs[key] for e in members.values() for _, g, _ in e
                      if key in g.attrs), None)
        if value is not None:
            data[key] = list(value)
    return data


def _match_transfers(members: Mapping[int, list[tuple[int, Graph, str]]],
                     lead: Mapping[int, int]) -> tuple[list[dict], list[dict]]:
    """Pair every send with its recv: key (phase, sender's lead, receiver's lead, tag)."""
    stage_at = {device: s for s, device in lead.items()}
    sends: dict[tuple, tuple[int, int, int, Node]] = {}
    recvs: dict[tuple, tuple[int, int, int, Node]] = {}
    for s, entries in members.items():
        for index, graph, phase in entries:
            for i, node in enumerate(graph.nodes):
                # tiles: the first tile goes from the sending stage's lead device to the
                # receiving stage's (`graphpar.ir.cross_mesh`)
                if node.op in ("send", "send_tiles"):
                    dst = node.attrs.get("dst")
                    key = (PHASES[phase], lead[s], dst[0] if isinstance(dst, (list, tuple))
                           else dst, node.attrs.get("tag"))
                    sends[key] = (s, index, i, node)
                elif node.op in ("recv", "recv_tile"):
                    src = node.attrs.get("src")
                    key = (PHASES[phase], src[0] if isinstance(src, (list, tuple)) else src,
                           lead[s], node.attrs.get("tag"))
                    recvs[key] = (s, index, i, node)
    transfers, unmatched = [], []
    for key in sorted(sends, key=_sort_key):
        s, gi, ni, node = sends[key]
        partner = recvs.pop(key, None)
        sent_type = node.input_values[0].type
        if partner is None or partner[3].output.type != _received_type(node):
            unmatched.append({"op": "send", "stage": s, "graph": gi, "node": ni,
                              "to_stage": stage_at.get(key[2]), "tag": key[3]})
            if partner is not None:
                recvs[key] = partner  # its type differs: it stays unmatched too
            continue
        transfers.append({"phase": key[0], "tag": key[3], "type": str(sent_type),
                          "bytes": sent_type.nbytes,
                          "src": {"stage": s, "graph": gi, "node": ni},
                          "dst": {"stage": partner[0], "graph": partner[1], "node": partner[2]}})
    for key in sorted(recvs, key=_sort_key):
        s, gi, ni, _ = recvs[key]
        unmatched.append({"op": "recv", "stage": s, "graph": gi, "node": ni,
                          "from_stage": stage_at.get(key[1]), "tag": key[3]})
    return transfers, unmatched


def _received_type(send: Node):
    """What one receiving device gets of a `send` or `send_tiles`: the tensor, or its tile."""
    from graphpar.ir.cross_mesh import TileTransfer

    whole = send.input_values[0].type
    if send.op == "send":
        return whole
    a = send.attrs
    return TileTransfer(whole, tuple(a["src"]), tuple(a["dst"]), a.get("dim")).tile_type


def _sort_key(key: tuple) -> tuple:
    phase, src, dst, tag = key
    order = {"forward": 0, "backward": 1, "update": 2}
    return (order.get(phase, 3), -1 if src is None else src, -1 if dst is None else dst,
            -1 if tag is None else tag)
