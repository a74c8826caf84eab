"""`graphpar viz`: one self-contained HTML page (inline CSS, JS and JSON data) that draws IR graphs.

    from graphpar.viz import write_html
    write_html(program, "graph.html")      # a Program or a single Graph

The page needs no network: no CDN scripts, no web fonts; a Content-Security-Policy forbids any
fetch. Layout (layered, with module groups as collapsible clusters) runs in the page's script,
so expanding a group re-lays out the graph in place.
"""

from __future__ import annotations

import html
import json
import os
import re
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from graphpar.ir.graph import Graph, Node, Program
from graphpar.viz.data import NodeInfo, as_program, graph_data, program_data
from graphpar.viz.stages import pipeline_data

__all__ = ["NodeInfo", "graph_data", "page_data", "pipeline_data", "program_data",
           "render_html", "write_html"]

_ASSETS = ("page.html", "page.css", "page.js")
_MARKER = re.compile(r"/\*@(CSS|JS)@\*/|@(TITLE|DATA)@")


def page_data(program_or_graph: Program | Graph, title: str | None = None,
              node_info: NodeInfo | None = None, *, stage_of: Mapping[Node, int] | None = None,
              stage_estimates: Sequence[Mapping[str, float]] | None = None) -> dict[str, Any]:
    """What the page embeds as JSON: `program_data` plus the page title."""
    program = as_program(program_or_graph)
    data = program_data(program, node_info, stage_of, stage_estimates)
    data["title"] = title if title is not None else ", ".join(g.name for g in program)
    return data


def render_html(program_or_graph: Program | Graph, title: str | None = None,
                node_info: NodeInfo | None = None, *,
                stage_of: Mapping[Node, int] | None = None,
                stage_estimates: Sequence[Mapping[str, float]] | None = None) -> str:
    """The HTML page for a Program (one panel per graph) or a Graph, as a string.

    `title` defaults to the graph names; `node_info(node)` may return extra rows for a node's
    details (strings by label), e.g. estimated time or bytes moved from a cost model.

    Pipelines: an MPMD program (graphs `stage<s>_forward|backward|update`) gets a pipeline view
    (one band per stage, coloured by sub-mesh, send/recv pairs as edges). `stage_of` (a
    `StagePlan.stage_of`) colours a sliced global graph's nodes by stage; `stage_estimates[s]`
    adds stage s's estimated `est_seconds` and `mem_bytes` to its band.
    """
    data = page_data(program_or_graph, title, node_info, stage_of=stage_of,
                     stage_estimates=stage_estimates)
    page, css, js = (_asset(name) for name in _ASSETS)
    parts = {"CSS": css, "JS": js, "TITLE": html.escape(data["title"]),
             "DATA": _script_json(data)}
    # One pass over the template only: nothing inserted (module names, string attributes) is
    # ever read as a marker.
    return _MARKER.sub(lambda m: parts[m.group(1) or m.group(2)], page)


def write_html(program_or_graph: Program | Graph, path: str | os.PathLike[str],
               title: str | None = None, node_info: NodeInfo | None = None, *,
               stage_of: Mapping[Node, int] | None = None,
               stage_estimates: Sequence[Mapping[str, float]] | None = None) -> Path:
    """Write `render_html(...)` to `path`; returns the path."""
    path = Path(path)
    path.write_text(render_html(program_or_graph, title, node_info, stage_of=stage_of,
                                stage_estimates=stage_estimates), encoding="utf-8")
    return path


def _asset(name: str) -> str:
    return resources.files(__name__).joinpath(name).read_text(encoding="utf-8")


def _script_json(data: dict[str, Any]) -> str:
    """JSON safe inside <script>: `<`, `>` and `&` escaped so no string can close the tag."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
