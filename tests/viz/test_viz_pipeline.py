"""graphpar viz of pipelines: an MPMD program's stages as bands coloured by sub-mesh, matched
send/recv pairs as edges, and a sliced global training graph's nodes coloured by stage."""

import contextlib
import io
import re

import pytest
from test_viz_html import embedded

from graphpar.cli import main
from graphpar.ir.parser import load, parse_program
from graphpar.ir.printer import print_program
from graphpar.viz import pipeline_data, program_data, render_html
from graphpar.viz.stages import SUBMESH_PALETTE

BLUE, ORANGE, GREEN = SUBMESH_PALETTE[:3]

# Three stages joined by plain send/recv between the stages' lead devices (lower_mpmd writes
# tile sends where a sub-mesh has several devices: TILES below): stage 1 on a sub-mesh of two
# devices, a value relayed
# through stage 1, a gradient sent from the last stage's update to the first's (two bands
# apart), estimates in one graph's attrs, and one send nobody receives.
THREE_STAGES = """\
mesh @mesh0 = <[1]> {bandwidth=[1.0], latency=[0.0]}
mesh @mesh1 = <[2]> {bandwidth=[1.0], latency=[0.0], devices=[1, 2]}
mesh @mesh2 = <[1]> {bandwidth=[1.0], latency=[0.0], devices=[3]}
graph @stage0_forward(
    %x: f32[2,8] input,
    %w0: f32[8,8] param,
) on @mesh0 attrs {est_seconds=2.5e-05, mem_bytes=4096} {
  %0 = matmul(%x, %w0)                                  : f32[2,8]
  %1 = send(%0) {dst=1, tag=0}                          : f32[2,8]
  %2 = send(%x) {dst=1, tag=1}                          : f32[2,8]
  return %0 output
}

graph @stage0_update(
    %w0: f32[8,8] param,
) on @mesh0 {
  %0 = recv() {src=3, shape=[8, 8], dtype="f32", tag=0}  : f32[8,8]
  %1 = sub(%w0, %0)                                     : f32[8,8]
  return %1 update(%w0)
}

graph @stage1_forward(
    %w1: f32[8,8] param,
) on @mesh1 {
  %0 = recv() {src=0, shape=[2, 8], dtype="f32", tag=0}  : f32[2,8]
  %1 = recv() {src=0, shape=[2, 8], dtype="f32", tag=1}  : f32[2,8]
  %2 = matmul(%0, %w1)                                  : f32[2,8]
  %3 = send(%2) {dst=3, tag=0}                          : f32[2,8]
  %4 = send(%1) {dst=3, tag=1}                          : f32[2,8]
  return %2 output
}

graph @stage2_forward(
) on @mesh2 {
  %0 = recv() {src=1, shape=[2, 8], dtype="f32", tag=0}  : f32[2,8]
  %1 = recv() {src=1, shape=[2, 8], dtype="f32", tag=1}  : f32[2,8]
  %2 = add(%0, %1)                                      : f32[2,8]
  %3 = sum(%2) {dims=none, keepdim=false}               : f32[]
  %4 = send(%2) {dst=1, tag=5}                          : f32[2,8]
  return %3 loss
}

graph @stage2_update(
    %g: f32[8,8] input,
) on @mesh2 {
  %0 = send(%g) {dst=0, tag=0}                          : f32[8,8]
  return %0 output
}
"""


def transfer(phase, tag, type_, nbytes, src, dst):
    return {"phase": phase, "tag": tag, "type": type_, "bytes": nbytes,
            "src": dict(zip(("stage", "graph", "node"), src)),
            "dst": dict(zip(("stage", "graph", "node"), dst))}


def test_stages_are_bands_coloured_by_submesh_with_matched_transfers():
    data = program_data(parse_program(THREE_STAGES))["pipeline"]
    assert data["submeshes"] == [
        {"id": 0, "shape": "1", "devices": [0], "color": BLUE},
        {"id": 1, "shape": "2", "devices": [1, 2], "color": ORANGE},
        {"id": 2, "shape": "1", "devices": [3], "color": GREEN}]
    bands = data["stages"]
    assert [(b["stage"], b["submesh"], b["devices"], b["color"]) for b in bands] == [
        (0, 0, [0], BLUE), (1, 1, [1, 2], ORANGE), (2, 2, [3], GREEN)]
    assert bands[0]["graphs"] == [
        {"graph": 0, "name": "stage0_forward", "phase": "forward", "nodes": 3,
         "flops": 2 * 2 * 8 * 8},
        {"graph": 1, "name": "stage0_update", "phase": "update", "nodes": 2, "flops": 8 * 8}]
    assert [(b["nodes"], b["flops"]) for b in bands] == [(5, 320), (5, 256), (6, 16 + 16)]
    # estimates come from graph attrs when there are any, and only then
    assert (bands[0]["est_seconds"], bands[0]["mem_bytes"]) == (2.5e-05, 4096)
    assert "est_seconds" not in bands[1] and "mem_bytes" not in bands[2]
    assert data["transfers"] == [
        transfer("forward", 0, "f32[2,8]", 64, (0, 0, 1), (1, 2, 0)),
        transfer("forward", 1, "f32[2,8]", 64, (0, 0, 2), (1, 2, 1)),
        transfer("forward", 0, "f32[2,8]", 64, (1, 2, 3), (2, 3, 0)),  # the relay
        transfer("forward", 1, "f32[2,8]", 64, (1, 2, 4), (2, 3, 1)),
        transfer("update", 0, "f32[8,8]", 256, (2, 4, 0), (0, 1, 0))]
    assert data["unmatched"] == [
        {"op": "send", "stage": 2, "graph": 3, "node": 4, "to_stage": 1, "tag": 5}]


# Stage 0 on one device, stage 1 on two: the activation crosses as two tiles and is
# all-gathered, its gradient comes back from stage 1's first device, as lower_mpmd writes them.
TILES = """\
mesh @mesh0 = <[1]> {bandwidth=[1.0], latency=[0.0]}
mesh @mesh1 = <[2]> {bandwidth=[1.0], latency=[0.0], devices=[1, 2]}
graph @stage0_forward(
    %x: f32[2,8] input,
) on @mesh0 {
  %0 = send_tiles(%x) {src=[0, 0], dst=[1, 2], tag=0, dim=0} : f32[2,8]
  return %0 output
}

graph @stage1_forward(
) on @mesh1 {
  %0 = recv_tile() {src=[0, 0], dst=[1, 2], shape=[1, 8], dtype="f32", tag=0} : f32[1,8]
  %1 = all_gather(%0) {axes=[0], n=2, dim=0}            : f32[2,8]
  %2 = sum(%1) {dims=none, keepdim=false}               : f32[]
  return %2 loss
}

graph @stage1_backward(
    %g: f32[2,8] input,
) on @mesh1 {
  %0 = send_tiles(%g) {src=[1], dst=[0], tag=0}         : f32[2,8]
  return %0 output
}

graph @stage0_backward(
) on @mesh0 {
  %0 = recv_tile() {src=[1], dst=[0], shape=[2, 8], dtype="f32", tag=0} : f32[2,8]
  return %0 output
}
"""


def test_tile_sends_pair_with_their_tile_receives():
    data = program_data(parse_program(TILES))["pipeline"]
    assert data["transfers"] == [
        transfer("forward", 0, "f32[2,8]", 64, (0, 0, 0), (1, 1, 0)),
        transfer("backward", 0, "f32[2,8]", 64, (1, 2, 0), (0, 3, 0))]
    assert data["unmatched"] == []
    # a receiver expecting another tile shape does not take it
    wrong = TILES.replace("shape=[1, 8], dtype=\"f32\", tag=0} : f32[1,8]",
                          "shape=[2, 4], dtype=\"f32\", tag=0} : f32[2,4]")
    wrong = wrong.replace("n=2, dim=0}            : f32[2,8]", "n=2, dim=1}            : f32[2,8]")
    data = program_data(parse_program(wrong))["pipeline"]
    assert [t["phase"] for t in data["transfers"]] == ["backward"]
    assert [(u["op"], u["stage"]) for u in data["unmatched"]] == [("send", 0), ("recv", 1)]


def test_a_transfer_needs_the_same_phase_tag_and_type():
    text = THREE_STAGES.replace('src=0, shape=[2, 8], dtype="f32", tag=1}  : f32[2,8]',
                                'src=0, shape=[2, 4], dtype="f32", tag=1}  : f32[2,4]')
    text = text.replace("%2 = add(%0, %1)                                      : f32[2,8]",
                        "%2 = add(%0, %0)                                      : f32[2,8]")
    text = text.replace("%4 = send(%1) {dst=3, tag=1}", "%4 = send(%0) {dst=3, tag=1}")
    data = program_data(parse_program(text))["pipeline"]
    assert [(t["src"]["stage"], t["tag"]) for t in data["transfers"]] == [
        (0, 0), (1, 0), (1, 1), (2, 0)]
    assert data["unmatched"] == [
        {"op": "send", "stage": 0, "graph": 0, "node": 2, "to_stage": 1, "tag": 1},
        {"op": "send", "stage": 2, "graph": 3, "node": 4, "to_stage": 1, "tag": 5},
        {"op": "recv", "stage": 1, "graph": 2, "node": 1, "from_stage": 0, "tag": 1}]


def test_other_programs_have_no_pipeline_view():
    program = parse_program(THREE_STAGES)
    assert pipeline_data([], []) is None
    single = program["stage1_forward"].copy()
    single.name = "stage1_forward_v2"  # not an MPMD stage graph's name
    assert "pipeline" not in program_data(single)
    assert "stage" not in str(program_data(single)["graphs"][0]["nodes"])


def test_the_token_slicing_recorded_on_stage_graphs_is_in_the_pipeline_view():
    program = parse_program(THREE_STAGES)
    for graph in program:
        graph.attrs["token_slices"] = (24, 8)
        graph.attrs["batch_slices"] = (1, 1)
    data = program_data(program)["pipeline"]
    assert data["token_slices"] == [24, 8] and data["batch_slices"] == [1, 1]
    assert "token_slices" not in program_data(parse_program(THREE_STAGES))["pipeline"]


def viz(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    assert "Traceback" not in out.getvalue() + err.getvalue()
    return code, out.getvalue(), err.getvalue()


def test_viz_of_an_mpmd_file(tmp_path):
    path = tmp_path / "three_pipeline.gpir"
    path.write_text(THREE_STAGES)
    code, out, err = viz("viz", path, "-o", tmp_path / "p.html")
    assert code == 0, err
    data = embedded((tmp_path / "p.html").read_text())
    assert data["pipeline"] == program_data(load(path))["pipeline"]
    assert len(data["pipeline"]["stages"]) == 3


@pytest.fixture(scope="module")
def mlp_page(tmp_path_factory):
    """`graphpar viz --example mlp --mode train --mesh 2 --cluster cpu --pipeline 2
    --microbatches 2`: the data of the page it writes (a few seconds: one stage search)."""
    out = tmp_path_factory.mktemp("viz") / "p.html"
    code, stdout, err = viz("viz", "--example", "mlp", "--mode", "train", "--mesh", "2",
                            "--cluster", "cpu", "--pipeline", "2", "--microbatches", "2",
                            "-o", out)
    assert code == 0, err
    assert f"wrote {out}" in stdout
    return embedded(out.read_text())


def test_viz_pipeline_of_the_mlp_example(mlp_page):
    data = mlp_page
    assert data["title"] == "mlp_tiny: 2 stages, 2 microbatches, 1f1b"
    names = [g["name"] for g in data["graphs"]]
    assert names == ["stage0_forward", "stage0_backward", "stage0_update",
                     "stage1_forward", "stage1_backward", "stage1_update", "mlp_tiny_train"]
    pipe = data["pipeline"]
    assert pipe["submeshes"] == [{"id": 0, "shape": "1", "devices": [0], "color": BLUE},
                                 {"id": 1, "shape": "1", "devices": [1], "color": ORANGE}]
    bands = pipe["stages"]
    assert [[(g["graph"], g["phase"]) for g in b["graphs"]] for b in bands] == [
        [(0, "forward"), (1, "backward"), (2, "update")],
        [(3, "forward"), (4, "backward"), (5, "update")]]
    summaries = [g["summary"] for g in data["graphs"]]
    for b in bands:
        assert b["nodes"] == sum(summaries[g["graph"]]["nodes"] for g in b["graphs"])
        assert b["flops"] == sum(summaries[g["graph"]]["flops"] for g in b["graphs"])
        assert b["est_seconds"] > 0 and b["mem_bytes"] > 0  # the stage plan's estimates
    # The tiny MLP's ops cost their per-call overhead more than their FLOPs (the cpu preset's
    # roofline: 10 us an op), so the stages balance ops, not FLOPs: stage 0 runs layers.0 and
    # layers.2's matmul (x[1,64] @ w.T[64,64]), whose result goes down; the gradient of that
    # result and of its transposed view come back up.
    assert pipe["transfers"] == [
        transfer("forward", 0, "f32[1,64]", 256, (0, 0, 6), (1, 3, 0)),
        transfer("backward", 0, "f32[1,64]", 256, (1, 4, 12), (0, 1, 0)),
        transfer("backward", 1, "f32[64,1]", 256, (1, 4, 13), (0, 1, 1))]
    assert pipe["unmatched"] == []
    assert bands[0]["graphs"][0]["nodes"] == 7
    # matmul, bias, gelu (a transcendental: 10 FLOPs per element), matmul
    assert bands[0]["graphs"][0]["flops"] == 2 * 32 * 64 + 64 + 10 * 64 + 2 * 64 * 64


def test_the_global_graph_is_coloured_by_stage(mlp_page):
    graph = mlp_page["graphs"][-1]
    assert "pipeline" not in graph and all("stage" in n for n in graph["nodes"])
    assert sum(graph["summary"]["stages"].values()) == len(graph["nodes"])
    # layers.0's weight matmul runs on stage 0; the loss and every Adam update of the last
    # layer on stage 1
    nodes = graph["nodes"]
    first_matmul = next(n for n in nodes if n["op"] == "matmul")
    assert first_matmul["module"] == "layers.0" and first_matmul["stage"] == 0
    loss = next(o for o in graph["outputs"] if o["role"] == "loss")
    assert nodes[loss["node"]]["stage"] == 1
    updates = [o for o in graph["outputs"] if o["role"] == "update"]
    stage_of_update = {o["target"]: nodes[o["node"]]["stage"] for o in updates if "node" in o}
    assert stage_of_update["layers.0.weight"] == 0 and stage_of_update["layers.4.weight"] == 1


def test_viz_pipeline_refuses_what_it_cannot_draw(tmp_path):
    path = tmp_path / "x_pipeline.gpir"
    path.write_text(THREE_STAGES)
    code, _, err = viz("viz", path, "--pipeline", "2", "-o", tmp_path / "p.html")
    assert code != 0 and "give a model file (.py) or --example" in err
    code, _, err = viz("viz", "--example", "mlp", "--mesh", "2", "--pipeline", "2",
                       "-o", tmp_path / "p.html")
    assert code != 0 and "--mode train" in err
    assert not (tmp_path / "p.html").exists()


def test_stage_colours_without_an_mpmd_program():
    """A sliced global graph alone: nodes carry their stage and the page has no bands."""
    program = parse_program(THREE_STAGES)
    graph = program["stage1_forward"]
    stage_of = {n: (0 if n.op == "recv" else 1) for n in graph.nodes}
    page = render_html(graph, stage_of=stage_of)
    data = embedded(page)
    assert data["graphs"][0]["summary"]["stages"] == {"0": 2, "1": 3}
    assert [n["stage"] for n in data["graphs"][0]["nodes"]] == [0, 0, 1, 1, 1]
    assert re.search(r'<option value="stage">', page)


def test_print_and_parse_keep_the_pipeline_view():
    program = parse_program(THREE_STAGES)
    again = parse_program(print_program(program))
    assert program_data(again)["pipeline"] == program_data(program)["pipeline"]


def test_sends_and_receives_of_different_phases_do_not_pair():
    text = THREE_STAGES.replace("graph @stage0_update(", "graph @stage0_backward(")
    data = program_data(parse_program(text))["pipeline"]
    assert [t["phase"] for t in data["transfers"]] == ["forward"] * 4
    assert {(u["op"], u["stage"], u["tag"]) for u in data["unmatched"]} == {
        ("send", 2, 0), ("send", 2, 5), ("recv", 0, 0)}
