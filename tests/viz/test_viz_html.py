"""graphpar.viz: the page's embedded data (nodes, groups, phases, layouts, totals) and its HTML."""

import json
import re
import time
from html.parser import HTMLParser

import pytest
import torch
from viz_graphs import gpt_training_graph, interleaved_graph, mlp_graph, sharded_program

from graphpar.ir.graph import Graph, OutputRole, Program, Role
from graphpar.ir.parser import parse
from graphpar.ir.types import TensorType
from graphpar.viz import graph_data, render_html, write_html

BLOCKS_IR = """\
graph @blocks(
    %x: f32[2,8] input,
    %blocks.0.fc.weight: f32[8,8] param,
    %blocks.1.fc.weight: f32[8,8] param,
    %head.weight: f32[4,8] param,
) {
  %0 = linear(%x, %blocks.0.fc.weight, none)   : f32[2,8]  loc("m.py:3", "blocks.0.fc")
  %1 = relu(%0)                                : f32[2,8]  loc("m.py:4", "blocks.0.act")
  %2 = add(%1, %x)                             : f32[2,8]  loc("m.py:5", "blocks.0")
  %3 = linear(%2, %blocks.1.fc.weight, none)   : f32[2,8]  loc("m.py:3", "blocks.1.fc")
  %4 = relu(%3)                                : f32[2,8]  loc("m.py:4", "blocks.1.act")
  %5 = add(%4, %2)                             : f32[2,8]  loc("m.py:5", "blocks.1")
  %6 = linear(%5, %head.weight, none)          : f32[2,4]  loc("m.py:9", "head")
  %7 = mul(%6, 0.5)                            : f32[2,4]
  return %7 output
}
"""


def embedded(page: str) -> dict:
    """The JSON the page embeds."""
    m = re.search(r'<script type="application/json" id="graphpar-data">(.*?)</script>', page,
                  re.S)
    assert m, "no embedded graph data"
    return json.loads(m.group(1))


def test_nodes_inputs_and_outputs_are_embedded():
    g = mlp_graph()
    data = embedded(render_html(g))
    assert data["version"] == 1 and data["title"] == "tiny_mlp"
    (gd,) = data["graphs"]
    assert [n["op"] for n in gd["nodes"]] == ["linear", "relu", "linear", "sum"]
    first = gd["nodes"][0]
    assert first["kind"] == "matmul" and first["module"] == "fc1" and first["loc"] == "mlp.py:12"
    assert first["flops"] == 2 * 4 * 16 * 32 + 4 * 32  # x[4,16] @ w.T[16,32], plus the bias
    assert first["outputs"] == [{"name": "%0", "type": "f32[4,32]", "bytes": 4 * 32 * 4}]
    assert first["inputs"] == [
        {"value": "%x", "type": "f32[4,16]", "input": 0},
        {"value": "%fc1.weight", "type": "f32[32,16]", "input": 1},
        {"value": "%fc1.bias", "type": "f32[32]", "input": 2},
    ]
    fc2 = gd["nodes"][2]
    assert fc2["inputs"][0] == {"value": "%1", "type": "f32[4,32]", "node": 1}
    assert fc2["inputs"][2] == {"literal": "none"}
    assert gd["nodes"][3]["attrs"] == {"dims": "[1]", "keepdim": "false"}
    assert [(v["name"], v["role"]) for v in gd["inputs"]] == [
        ("x", "input"), ("fc1.weight", "param"), ("fc1.bias", "param"), ("fc2.weight", "param")]
    assert gd["outputs"] == [{"value": "%2", "type": "f32[4,8]", "node": 2, "role": "output"},
                             {"value": "%3", "type": "f32[4]", "node": 3, "role": "loss"}]
    s = gd["summary"]
    assert s["nodes"] == 4 and s["parameter_tensors"] == 3
    assert s["parameters"] == 32 * 16 + 32 + 8 * 32
    assert s["parameter_bytes"] == 4 * s["parameters"]
    # linear with bias, relu (one per element), linear without bias, sum (one per input element)
    assert s["flops"] == (2 * 4 * 16 * 32 + 4 * 32) + 4 * 32 + 2 * 4 * 32 * 8 + 4 * 8
    assert s["kinds"] == {"matmul": 2, "elementwise": 1, "reduction": 1}
    assert data["totals"]["nodes"] == 4 and data["totals"]["graphs"] == 1


def test_groups_follow_module_paths():
    gd = graph_data(parse(BLOCKS_IR))
    groups = {g["label"]: g for g in gd["groups"]}
    # `blocks` (a module list) and single-node modules (fc, act, head) are not groups
    assert list(groups) == ["blocks.0", "blocks.1"]
    assert all("parent" not in g for g in groups.values())
    by_group = {}
    for n in gd["nodes"]:
        by_group.setdefault(n.get("group"), []).append(n["id"])
    assert by_group == {groups["blocks.0"]["id"]: [0, 1, 2], groups["blocks.1"]["id"]: [3, 4, 5],
                        None: [6, 7]}
    # an input is drawn with its first user
    assert gd["inputs"][1]["group"] == groups["blocks.0"]["id"]
    assert "group" not in gd["inputs"][3]


def test_training_graph_is_split_into_phases():
    g = gpt_training_graph(layers=2)
    gd = graph_data(g)
    top = [grp["label"] for grp in gd["groups"] if "parent" not in grp]
    assert top == ["forward", "backward", "optimizer"]
    children = {}
    for grp in gd["groups"]:
        if "parent" in grp:
            children.setdefault(gd["groups"][grp["parent"]]["label"], []).append(grp["label"])
    assert children["forward"] == ["blocks.0", "blocks.1"]
    assert children["blocks.0"][:2] == ["blocks.0.attn", "blocks.0.mlp"]
    assert set(children["backward"]) >= {"blocks.0", "blocks.1"}
    assert set(children["optimizer"]) >= {"blocks.0", "blocks.1"}  # grouped by updated param
    phases = {n["phase"] for n in gd["nodes"]}
    assert phases == {"forward", "backward", "optimizer"}
    loss = next(o for o in gd["outputs"] if o["role"] == "loss")
    assert gd["nodes"][loss["node"]]["phase"] == "forward"
    assert all(n["phase"] == "optimizer" for n in gd["nodes"] if n.get("module") == "optimizer")
    assert gd["summary"]["phases"]["forward"] + gd["summary"]["phases"]["backward"] + \
        gd["summary"]["phases"]["optimizer"] == len(g)


def test_modules_that_take_turns_make_one_group_each():
    gd = graph_data(interleaved_graph())
    assert [g["label"] for g in gd["groups"]] == ["a", "b"]
    top = gd["nodes"][-1]
    assert top["op"] == "topk" and [o["name"] for o in top["outputs"]] == ["%12", "%13"]
    assert gd["outputs"][1] == {"value": "%13", "type": "i64[4,2]", "node": 12, "output": 1,
                                "role": "output"}
    assert "group" not in gd["inputs"][1]  # the unused buffer sits at the top


def test_inference_graphs_have_no_phases():
    gd = graph_data(parse(BLOCKS_IR))
    assert not any("phase" in n for n in gd["nodes"]) and gd["summary"]["phases"] == {}


def test_layouts_collectives_and_graph_attrs():
    data = embedded(render_html(sharded_program()))
    assert [g["name"] for g in data["graphs"]] == ["stage0", "stage1"]
    stage1 = data["graphs"][1]
    assert stage1["attrs"] == {"stage": "1", "device": '"gpu1"'}
    assert stage1["inputs"][0]["layout"] == "{S(0),R}"
    assert [n["outputs"][0]["layout"] for n in stage1["nodes"]] == \
        ["{S(0),P}", "{S(0),R}", "{S(0),R}"]
    assert stage1["nodes"][1]["kind"] == "collective"
    assert stage1["summary"]["collectives"] == 1
    assert stage1["summary"]["collective_bytes"] == 8 * 64 * 4
    assert stage1["summary"]["layouts"] == {"{S(0),R}": 3, "{S(0),P}": 1, "{R,S(0)}": 1}
    assert data["totals"]["collectives"] == 2 and data["totals"]["nodes"] == 6


def test_node_info_adds_rows_for_later_passes():
    def estimate(node):
        return {"time (est.)": "0.21 ms"} if node.op == "linear" else {}

    gd = embedded(render_html(mlp_graph(), node_info=estimate))["graphs"][0]
    assert [n.get("info") for n in gd["nodes"]] == [
        {"time (est.)": "0.21 ms"}, None, {"time (est.)": "0.21 ms"}, None]


def test_page_is_self_contained():
    page = render_html(gpt_training_graph(layers=1))
    assert page.startswith("<!DOCTYPE html>")
    for needle in ("http://", "https://", "<link", " src=", "@import", "@font-face", "//cdn"):
        assert needle not in page, f"the page refers to an outside resource: {needle!r}"
    assert "Content-Security-Policy" in page and "default-src 'none'" in page
    assert "@CSS@" not in page and "@JS@" not in page and "@DATA@" not in page


class _Balance(HTMLParser):
    VOID = {"meta", "input", "br", "img", "link", "hr", "path", "rect"}

    def __init__(self):
        super().__init__()
        self.stack, self.ids, self.errors = [], [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids.append(attrs["id"])
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:]}")
        else:
            self.stack.pop()


def test_page_is_well_formed_html():
    checker = _Balance()
    checker.feed(render_html(sharded_program()))
    checker.close()
    assert checker.errors == [] and checker.stack == []
    assert len(checker.ids) == len(set(checker.ids)), "duplicate element ids"
    assert {"graph", "graphpar-data", "search", "details", "totals", "legend"} <= set(checker.ids)


def test_hostile_names_cannot_break_out_of_the_script_tag():
    g = Graph("evil")
    x = g.add_input("x", TensorType((2,), torch.float32))
    name = "</script><script>alert(1)</script>"
    n = g.create("relu", [x], module=name, loc="a.py:1 & <b>")
    g.add_output(n.output)
    page = render_html(g, title="<i>title</i>")
    assert name not in page and "<i>title</i>" not in page
    assert page.count("</script>") == 3  # the error hook, the data and the page script
    gd = embedded(page)["graphs"][0]
    assert gd["nodes"][0]["module"] == name and gd["nodes"][0]["loc"] == "a.py:1 & <b>"


def test_graph_without_nodes():
    g = Graph("empty")
    x = g.add_input("x", TensorType((3,), torch.float32), Role.BUFFER)
    g.add_output(x, OutputRole.OUTPUT)
    gd = embedded(render_html(g))["graphs"][0]
    assert gd["nodes"] == [] and gd["groups"] == []
    assert gd["outputs"] == [{"value": "%x", "type": "f32[3]", "input": 0, "role": "output"}]
    assert gd["summary"]["roles"] == {"buffer": {"count": 1, "numel": 3, "bytes": 12}}


def test_write_html_and_inputs_it_rejects(tmp_path):
    path = write_html(Program.of([mlp_graph()]), tmp_path / "g.html", title="mlp")
    assert path.read_text(encoding="utf-8") == render_html(mlp_graph(), title="mlp")
    with pytest.raises(TypeError, match="Graph or Program"):
        render_html("graph @main() {}")


def test_a_thousand_node_graph_stays_small_and_fast():
    g = gpt_training_graph(layers=8)
    assert 800 < len(g) < 1200
    start = time.perf_counter()
    page = render_html(g)
    seconds = time.perf_counter() - start
    assert len(page) < 1_000_000, f"{len(page)} bytes for {len(g)} nodes"
    assert seconds < 5, f"render_html took {seconds:.1f} s for {len(g)} nodes"
