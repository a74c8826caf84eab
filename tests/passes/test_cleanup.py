"""Each cleanup pass as IR text in, IR text out."""

import textwrap

import pytest

from graphpar.ir.parser import parse
from graphpar.ir.printer import print_graph
from graphpar.passes import run_pipeline


def run(pipeline: str, text: str) -> str:
    program = run_pipeline(parse(textwrap.dedent(text)), pipeline)
    return print_graph(next(iter(program)), show_cost=False)


def listing(text: str) -> str:
    return print_graph(parse(textwrap.dedent(text)), show_cost=False)


CASES = {
    "dce": ("""
        graph @g(
            %x: f32[4] input,
        ) {
          %0 = exp(%x) : f32[4]
          %1 = neg(%0) : f32[4]
          %2 = relu(%x) : f32[4]
          return %2 output
        }""", """
        graph @g(
            %x: f32[4] input,
        ) {
          %0 = relu(%x) : f32[4]
          return %0 output
        }"""),
    "cse": ("""
        graph @g(
            %x: f32[4] input,
        ) {
          %0 = mul(%x, 2.0) : f32[4]
          %1 = mul(%x, 2.0) : f32[4]
          %2 = mul(%x, 2) : f32[4]
          %3 = add(%0, %1) : f32[4]
          %4 = add(%3, %2) : f32[4]
          return %4 output
        }""", """
        graph @g(
            %x: f32[4] input,
        ) {
          %0 = mul(%x, 2.0) : f32[4]
          %1 = mul(%x, 2) : f32[4]
          %2 = add(%0, %0) : f32[4]
          %3 = add(%2, %1) : f32[4]
          return %3 output
        }"""),
    "canonicalize": ("""
        graph @g(
            %x: f32[4,6] input,
        ) {
          %0 = reshape(%x) {shape=[24]} : f32[24]
          %1 = reshape(%0) {shape=[6,4]} : f32[6,4]
          %2 = permute(%1) {dims=[1,0]} : f32[4,6]
          %3 = permute(%2) {dims=[1,0]} : f32[6,4]
          %4 = clone(%3) : f32[6,4]
          %5 = mul(%4, 1) : f32[6,4]
          %6 = add(0.0, %5) : f32[6,4]
          %7 = convert(%6) {dtype="f32"} : f32[6,4]
          %8 = expand(%7) {shape=[6,4]} : f32[6,4]
          return %8 output
        }""", """
        graph @g(
            %x: f32[4,6] input,
        ) {
          %0 = reshape(%x) {shape=[6, 4]} : f32[6,4]
          return %0 output
        }"""),
    "fold-constants": ("""
        graph @g(
            %x: f32[2,3] input,
        ) {
          %0 = full() {shape=[3], value=2.0, dtype="f32"} : f32[3]
          %1 = mul(%0, 3.0) : f32[3]
          %2 = expand(%1) {shape=[2,3]} : f32[2,3]
          %3 = lt(%2, 10) : bool[2,3]
          %4 = arange() {start=0, end=3, step=1, dtype="f32"} : f32[3]
          %5 = mul(%4, 2.0) : f32[3]
          %6 = where(%3, %x, %5) : f32[2,3]
          return %6 output
        }""", """
        graph @g(
            %x: f32[2,3] input,
        ) {
          %0 = full() {shape=[2, 3], value=true, dtype="bool"} : bool[2,3]
          %1 = arange() {start=0, end=3, step=1, dtype="f32"} : f32[3]
          %2 = mul(%1, 2.0) : f32[3]
          %3 = where(%0, %x, %2) : f32[2,3]
          return %3 output
        }"""),
}


@pytest.mark.parametrize("name", list(CASES))
def test_pass_rewrites_ir(name):
    before, after = CASES[name]
    assert run(name, before) == listing(after)


def test_mul_by_one_that_changes_dtype_stays():
    text = """
        graph @g(
            %x: i64[4] input,
        ) {
          %0 = mul(%x, 1.0) : f32[4]
          return %0 output
        }"""
    assert run("canonicalize", text) == listing(text)


def test_graph_outputs_and_duplicates_survive_cleanup():
    text = """
        graph @g(
            %x: f32[4] input,
        ) {
          %0 = exp(%x) : f32[4]
          %1 = exp(%x) : f32[4]
          return %0 output,
                 %1 loss
        }"""
    expected = """
        graph @g(
            %x: f32[4] input,
        ) {
          %0 = exp(%x) : f32[4]
          return %0 output,
                 %0 loss
        }"""
    assert run("cleanup", text) == listing(expected)


def test_dce_and_cse_keep_every_write_of_an_operand():
    """reshape_and_cache writes its cache operands in place: unused results do not make it dead,
    and two identical writes are two writes."""
    import torch

    from graphpar.ir.graph import Graph
    from graphpar.ir.types import TensorType
    from graphpar.passes.cleanup import CommonSubexpressionElimination, DeadCodeElimination
    from graphpar.passes.manager import PassContext

    graph = Graph("g")
    cache = TensorType((4, 2, 2, 8), torch.float32)
    kv = TensorType((3, 2, 8), torch.float32)
    k_cache, v_cache = graph.add_input("k_cache", cache), graph.add_input("v_cache", cache)
    key, value = graph.add_input("key", kv), graph.add_input("value", kv)
    slots = graph.add_input("slots", TensorType((3,), torch.int64))
    for _ in range(2):
        graph.create("reshape_and_cache", [k_cache, v_cache, key, value, slots])
    out = graph.create("neg", [key])
    graph.add_output(out.output)
    assert not CommonSubexpressionElimination().run_on_graph(graph, PassContext())
    assert not DeadCodeElimination().run_on_graph(graph, PassContext())
    assert [n.op for n in graph.nodes] == ["reshape_and_cache", "reshape_and_cache", "neg"]
