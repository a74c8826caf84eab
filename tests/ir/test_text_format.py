"""The IR text format: exact listings, round trips, and parse errors with line and column."""

import math

import pytest
import torch

from graphpar.errors import IRParseError
from graphpar.ir.graph import Graph, OutputRole, Role
from graphpar.ir.parser import parse, parse_program
from graphpar.ir.printer import print_graph
from graphpar.ir.types import TensorType

F32 = torch.float32


def small_graph() -> Graph:
    g = Graph("mlp")
    x = g.add_input("x", TensorType((4, 16), F32))
    w = g.add_input("fc1.weight", TensorType((32, 16), F32), Role.PARAM)
    h = g.create("linear", [x, w, None], module="fc1", loc="model.py:7").output
    r = g.create("relu", [h], module="act").output
    top = g.create("topk", [r], {"k": 2, "dim": 1})
    g.add_output(top.outputs[0])
    g.add_output(top.outputs[1], OutputRole.LOSS)
    return g


EXPECTED = """\
graph @mlp(
    %x: f32[4,16] input,
    %fc1.weight: f32[32,16] param,
) {
  %0 = linear(%x, %fc1.weight, none)                    : f32[4,32]    # 4.1 KFLOP
  %1 = relu(%0)                                         : f32[4,32]    # 128 FLOP
  %2, %3 = topk(%1) {k=2, dim=1}                        : f32[4,2], i64[4,2]    # 128 FLOP
  return %2 output,
         %3 loss
}
"""


def test_listing_is_exact():
    assert print_graph(small_graph()) == EXPECTED


def test_round_trip_is_equal():
    g = small_graph()
    assert parse(print_graph(g)) == g
    assert print_graph(parse(EXPECTED)) == EXPECTED


def test_source_locations_round_trip_when_shown():
    text = print_graph(small_graph(), show_source=True)
    assert 'loc("model.py:7", "fc1")' in text
    g = parse(text)
    assert (g.nodes[0].loc, g.nodes[0].module) == ("model.py:7", "fc1")
    assert (g.nodes[1].loc, g.nodes[1].module) == (None, "act")


def test_literals_round_trip():
    g = Graph("lits", attrs={"note": 'a "quoted" name'})
    x = g.add_input("x", TensorType((3,), F32))
    values = [0.125, 1e-05, -2.5, 7, True, None, math.inf, -math.inf]
    outs = [g.create("add", [x, 1.0]).output]
    for v in values:
        outs.append(g.create("clamp", [x], {"min": v, "max": 100.0}).output)
    g.add_output(outs[-1])
    back = parse(print_graph(g))
    assert back == g
    assert [n.attrs.get("min") for n in back.nodes[1:]] == values


def test_nan_compares_equal_after_round_trip():
    g = Graph("n")
    x = g.add_input("x", TensorType((2,), F32))
    g.add_output(g.create("add", [x, math.nan]).output)
    assert parse(print_graph(g)) == g


def test_structural_equality_sees_differences():
    g = small_graph()
    other = parse(EXPECTED.replace("k=2", "k=3").replace("f32[4,2], i64[4,2]",
                                                         "f32[4,3], i64[4,3]"))
    assert other != g


def test_program_with_two_graphs():
    text = EXPECTED + "\n" + EXPECTED.replace("@mlp", "@mlp2")
    program = parse_program(text)
    assert list(program.graphs) == ["mlp", "mlp2"]
    assert parse_program(str(program)) == program


@pytest.mark.parametrize("bad, where, says", [
    (EXPECTED.replace("relu(%0)", "relu(%9)"), ":6:", "%9 is used before it is defined"),
    (EXPECTED.replace("relu", "rellu"), ":6:", "unknown op 'rellu'"),
    (EXPECTED.replace("f32[4,16] input", "f33[4,16] input"), ":2:", "unknown dtype 'f33'"),
    (EXPECTED.replace("param,", "weights,"), ":3:", "unknown input role 'weights'"),
    (EXPECTED.replace("%3 loss", "%3 lost"), ":9:", "unknown output role 'lost'"),
    (EXPECTED.replace("%2, %3 = topk", "%2 = topk").replace(": f32[4,2], i64[4,2]",
                                                           ": f32[4,2]"),
     ":7:", "topk has 2 result(s), not 1"),
    (EXPECTED.replace("}\n", ""), ":", "expected"),
    (EXPECTED.replace("relu(%0)", "relu(%0 $)"), ":6:", "unexpected character '$'"),
])
def test_parse_errors_name_line_and_column(bad, where, says):
    with pytest.raises(IRParseError) as err:
        parse(bad, "model.gpir")
    message = str(err.value)
    assert message.startswith("model.gpir" + where)
    assert says in message
    # below the message: the named line of the input, and a caret under the named column
    first, source, caret = message.split("\n")
    line, column = (int(n) for n in first.removeprefix("model.gpir:").split(":")[:2])
    lines = bad.splitlines()
    assert source == "    " + (lines[line - 1] if line <= len(lines) else "")
    assert caret == "    " + " " * (column - 1) + "^"


GRAPH_S = """\
graph @s(
    %x: f32[4,16] {S(0),R} input,
) on @mesh {
  %0 = relu(%x) : f32[4,16] {S(0),R}
  %1 = all_gather(%0) {axes=[0], n=2, dim=0} : f32[8,16] {R,R}
  return %1 output
}
"""
SHARDED = "mesh @mesh = <[2, 2]>\n" + GRAPH_S


@pytest.mark.parametrize("old, new, where, says", [
    ("dim=0}", 'dim=0, s="bad\\q"}', ":6:48:", "bad string literal"),
    ("dim=0}", "dim=0, s=" + "[" * 10_000 + "}", ":6:80:", "nested deeper than 32"),
    ("f32[4,16] {S(0),R} input", "f32[-2,16] input", ":3:13:", "dimension size -2"),
    ("f32[4,16] {S(0),R} input", "f32[" + "9" * 30 + ",16] input", ":3:13:",
     "dimension size 9999"),
    ("f32[4,16] {S(0),R} input", "f32[65536,65536,65536,2] input", ":3:9:",
     "more than 2**48 elements"),
    ("{S(0),R} input", "{S(5),R} input", ":3:5:", "layout {S(5),R} shards dim 5"),
    ("axes=[0]", "axes=[7]", ":6:3:", "mesh axis 7 does not exist"),
    ("output\n}\n", "output\n}\n" + GRAPH_S, ":9:7:", "graph @s is defined twice"),
])
def test_hostile_text_is_a_one_line_parse_error(old, new, where, says):
    with pytest.raises(IRParseError) as err:
        parse_program(SHARDED.replace(old, new, 1), "m.gpir")
    first = str(err.value).splitlines()[0]
    assert first.startswith("m.gpir" + where) and says in first


def test_an_early_error_in_a_long_text_is_found_without_reading_on():
    """Tokens are made as the parser reaches them: the rest is never tokenized (it holds a
    character that would be a lexing error)."""
    text = SHARDED.replace("relu(%x)", "relu(%nope)") + "$" * 1_000_000
    with pytest.raises(IRParseError, match=r"m.gpir:5:13: %nope is used before"):
        parse_program(text, "m.gpir")


def test_verifier_errors_name_the_line_of_the_text():
    from graphpar.errors import VerificationError

    text = SHARDED.replace("relu(%x) : f32[4,16]", "relu(%x) : f32[4,17]")
    parse_program(text, "m.gpir")  # types are the verifier's
    with pytest.raises(VerificationError, match=r"^m.gpir:5: graph @s, node 0 \(relu\): result "
                                                r"types f32\[4,17\]"):
        parse_program(text, "m.gpir", verify=True)
