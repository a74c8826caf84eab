"""Cleanup, the optimizer step's construction, the verifier and the printer do work linear in
the graph: counted in executed lines of graphpar code, not timed."""

import sys

import torch

import graphpar
from graphpar.capture import Adam
from graphpar.capture.optim import append_optimizer
from graphpar.ir.graph import Graph, OutputRole, Role
from graphpar.ir.printer import print_graph
from graphpar.ir.types import TensorType
from graphpar.ir.verify import verify
from graphpar.passes import PassContext, PassManager, parse_pipeline

T = TensorType((4, 8), torch.float32)
GRAPHPAR = graphpar.__path__[0]


def layered(depth: int) -> Graph:
    """Per layer: work CSE merges (a node computed twice), a chain canonicalize folds
    (reshape of reshape, a clone), a constant fold-constants folds, and one gradient-like
    output per layer (a training step returns one per parameter)."""
    g = Graph("layered")
    h = g.add_input("x", T)
    for i in range(depth):
        w = g.add_input(f"blocks.{i}.w", TensorType((8, 8), torch.float32), Role.PARAM)
        a = g.create("matmul", [h, w], module=f"blocks.{i}").output
        b = g.create("matmul", [h, w], module=f"blocks.{i}").output  # a duplicate
        r = g.create("reshape", [g.create("reshape", [a], {"shape": (32,)}).output],
                     {"shape": (4, 8)}).output
        c = g.create("clone", [b]).output
        one = g.create("full", [], {"shape": (4, 8), "value": 1.0, "dtype": "f32"}).output
        two = g.create("add", [one, one]).output  # folds to a constant
        h = g.create("add", [g.create("mul", [r, two]).output, c]).output
        g.add_output(g.create("permute", [w], {"dims": (1, 0)}).output, OutputRole.GRAD,
                     f"blocks.{i}.w")
    g.add_output(h)
    return g


def lines_run(work) -> int:
    """Lines of graphpar executed by `work()`."""
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        if not frame.f_code.co_filename.startswith(GRAPHPAR):
            return None
        if event == "line":
            count += 1
        return tracer

    sys.settrace(tracer)
    try:
        work()
    finally:
        sys.settrace(None)
    return count


def work_ratio(step, small: int = 25) -> float:
    """Lines run by `step` on a graph of 4x the layers, over those on the small one: 4 for
    linear work, 16 for quadratic."""
    graphs = [layered(small), layered(4 * small)]
    counts = [lines_run(lambda g=g: step(g)) for g in graphs]
    return counts[1] / counts[0]


def test_cleanup_is_linear_in_the_layers():
    def cleanup(graph):
        PassManager(parse_pipeline("cleanup"), verify=False).run(graph, PassContext())
        assert len(graph.find("clone")) == 0 and len(graph.find("matmul")) == len(
            graph.inputs_with_role(Role.PARAM))  # it did the work

    assert work_ratio(cleanup) < 4.4


def test_verify_and_print_are_linear_in_the_layers():
    assert work_ratio(verify) < 4.4
    assert work_ratio(lambda g: print_graph(g, show_source=True)) < 4.4


def test_appending_the_optimizer_is_linear_in_the_parameters():
    def adam(graph):
        state = {v.name: torch.empty(v.type.shape, device="meta")
                 for v in graph.inputs_with_role(Role.PARAM)}
        append_optimizer(graph, Adam(), state)
        assert len(graph.inputs_with_role(Role.OPTIM_STATE)) == 1 + 2 * len(
            graph.inputs_with_role(Role.PARAM))

    assert work_ratio(adam) < 4.4
