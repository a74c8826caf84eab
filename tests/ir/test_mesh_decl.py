"""The mesh and cluster a graph is planned on are declared in the IR text and read back."""

import dataclasses

import pytest
import torch

from graphpar.cost.cluster import get_cluster, mesh_for
from graphpar.cost.communication import annotate_comm
from graphpar.errors import IRParseError
from graphpar.ir.graph import Graph, Program
from graphpar.ir.mesh import Mesh
from graphpar.ir.parser import parse, parse_program
from graphpar.ir.printer import print_graph, print_program
from graphpar.ir.types import TensorType


def relu_graph(name: str, mesh: Mesh | None) -> Graph:
    g = Graph(name, mesh=mesh)
    x = g.add_input("x", TensorType((4, 8), torch.float32))
    g.add_output(g.create("relu", [x]).output, "output")
    return g


def test_declared_mesh_prints_and_parses_back():
    mesh = mesh_for("2x4", "dgx-a100", axis_names=("dp", "tp"))
    text = print_graph(relu_graph("g", mesh))
    assert text.splitlines()[1] == (
        'mesh @mesh = <["dp"=2, "tp"=4]> on @dgx-a100 '
        "{bandwidth=[300000000000.0, 300000000000.0], latency=[1e-06, 1e-06]}")
    assert text.splitlines()[0].startswith('cluster @dgx-a100 = {name="dgx-a100", num_nodes=1,')
    assert ") on @mesh {" in text
    back = parse(text)
    assert back.mesh == mesh and back.mesh.cluster == get_cluster("dgx-a100")
    assert print_graph(back) == text
    assert "seconds_per_result_byte" not in text  # printed only where a calibration set it
    fresh = dataclasses.replace(mesh.cluster, seconds_per_result_byte=2e-11)
    text = print_graph(relu_graph("g", dataclasses.replace(mesh, cluster=fresh)))
    assert "seconds_per_result_byte=2e-11" in text.splitlines()[0]
    assert parse(text).mesh.cluster == fresh


def test_meshes_are_declared_once_per_program():
    big = mesh_for("2x8", "dgx-a100")  # two nodes: the cluster grows, axis 0 crosses nodes
    small = Mesh((2,), device_ids=(3, 5), bandwidth=1e9, latency=2e-6)
    program = Program.of([relu_graph("a", big), relu_graph("b", big), relu_graph("c", small)])
    text = print_program(program)
    lines = text.splitlines()
    assert [ln.split(" =")[0] for ln in lines[:3]] == ["cluster @dgx-a100", "mesh @mesh0",
                                                        "mesh @mesh1"]
    assert lines[2] == ("mesh @mesh1 = <[2]> {bandwidth=[1000000000.0], latency=[2e-06], "
                        "devices=[3, 5]}")
    back = parse_program(text)
    assert [g.mesh for g in back] == [big, big, small]
    assert back["a"].mesh.cluster.num_nodes == 2
    assert back == program


@pytest.mark.parametrize("text, where, message", [
    ("graph @g(\n  %x: f32[2] input,\n) on @m {\n  return %x output\n}\n", "3:6",
     "mesh @m is not declared before its use"),
    ("mesh @m = <[2]> on @nope\n", "1:20", "cluster @nope is not declared"),
    ("mesh @m = <[2]> {speed=[1.0]}\n", "1:1", "unknown mesh attribute(s) speed"),
    ("mesh @m = <[2, 0]>\n", "1:1", "bad mesh declaration"),
    ('mesh @m = <["a"=2, 2]>\n', "1:1", "name every mesh axis or none"),
    ("cluster @c = {name=\"c\", num_nodes=0}\n", "1:1", "bad cluster declaration"),
])
def test_bad_declarations_name_the_line(text, where, message):
    with pytest.raises(IRParseError) as info:
        parse_program(text)
    assert str(info.value).startswith(f"<string>:{where}: {message}"), str(info.value)


def test_collectives_print_their_estimated_bytes_and_time():
    mesh = Mesh((4,), bandwidth=1e9, latency=1e-5)
    g = Graph("g", mesh=mesh)
    x = g.add_input("x", TensorType((256, 1024), torch.float32))  # 1,048,576 bytes per device
    y = g.create("all_reduce", [x], {"axes": (0,), "n": 4, "op": "sum"}).output
    g.add_output(y, "output")
    text = print_graph(g, annotate=annotate_comm)
    # Ring all-reduce on 4: 2·3 steps of 10 us, and 2·(3/4)·1048576 bytes at 1 GB/s.
    seconds = 6 * 1e-5 + 1.5 * 1048576 / 1e9
    assert abs(seconds - 1.6329e-3) < 1e-6
    assert text.splitlines()[4].endswith("# 1.0 MB, 1.63 ms est"), text


def test_a_copy_keeps_the_mesh():
    mesh = dataclasses.replace(Mesh((2,)), axis_names=("tp",))
    assert relu_graph("g", mesh).copy().mesh == mesh


def test_reshards_of_a_global_graph_print_what_their_collectives_send():
    from graphpar.ir.layout import Layout

    mesh = Mesh((4,), bandwidth=1e9, latency=1e-5)
    g = Graph("g", mesh=mesh)
    x = g.add_input("x", TensorType((256, 1024), torch.float32))  # 1,048,576 bytes in all
    x.layout = Layout.parse("{S(0)}")
    r = g.create("reshard", [x], output_types=[x.type])
    r.output.layout = Layout.parse("{R}")
    g.add_output(r.output, "output")
    # S(0) -> R is one ring all-gather on 4: each device sends 3/4 of the gathered 1,048,576
    # bytes (786,432 B) in 3 steps of 10 us: 3e-5 + 786432 / 1e9 s = 0.82 ms.
    assert abs(3e-5 + 786432 / 1e9 - 816.432e-6) < 1e-12
    line = print_graph(g, annotate=annotate_comm).splitlines()[4]
    assert line.endswith("# 786.4 kB sent, 0.82 ms est"), line
