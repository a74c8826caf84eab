"""Repeating a traced layer: the expanded IR is the IR of tracing every layer."""

import pytest
import torch

from graphpar.capture import capture_inference, capture_training, repeat
from graphpar.capture.repeat import (
    MIN_LAYERS,
    TRACED_LAYERS,
    LayerStack,
    expand_layers,
    find_layer_stack,
)
from graphpar.ir.graph import Graph, Node, OutputRole, Role
from graphpar.ir.printer import print_graph
from graphpar.ir.types import TensorType
from graphpar.models import example_batch, get_model
from graphpar.passes import run_pipeline


def in_data_order(graph: Graph) -> Graph:
    """A copy whose nodes are in depth-first order from the outputs: equal for two graphs that
    differ only in the order of independent nodes."""
    order: list[Node] = []
    seen: set[Node] = set()
    for out in graph.outputs:
        stack = [(out.value.producer, False)] if out.value.producer else []
        while stack:
            node, expanded = stack.pop()
            if expanded:
                order.append(node)
                continue
            if node in seen:
                continue
            seen.add(node)
            stack.append((node, True))
            for v in reversed(node.input_values):
                if v.producer is not None and v.producer not in seen:
                    stack.append((v.producer, False))
    assert len(order) == len(graph.nodes), "every node reaches an output"
    copy = graph.copy()
    position = {n: i for i, n in enumerate(graph.nodes)}
    nodes = list(copy.nodes)
    reordered = [nodes[position[n]] for n in order]
    for node in nodes:
        copy.nodes.remove(node)
    for node in reordered:
        copy.nodes.append(node)
    return copy


def same_graph(expanded: Graph, traced: Graph) -> None:
    """Equal up to the order of independent nodes, once both drop their dead nodes."""
    for graph in (expanded, traced):
        run_pipeline(graph, "dce")
    a, b = in_data_order(expanded), in_data_order(traced)
    assert print_graph(a, show_source=True) == print_graph(b, show_source=True)
    assert [n.module for n in a.nodes] == [n.module for n in b.nodes]


# --- on a hand-made stack: exact, fast ------------------------------------------------------

T = TensorType((4, 8), torch.float32)


def stack_graph(depth: int) -> Graph:
    """x -> depth layers of (matmul by the layer's weight, scaled by a constant every layer
    reads, plus the layer's input) -> sum."""
    g = Graph("stack")
    x = g.add_input("x", T)
    weights = [g.add_input(f"blocks.{i}.w", TensorType((8, 8), torch.float32), Role.PARAM)
               for i in range(depth)]
    scale = g.create("full", [], {"shape": (4, 8), "value": 0.5, "dtype": "f32"}).output
    h = x
    for i, w in enumerate(weights):
        y = g.create("matmul", [h, w], module=f"blocks.{i}.mlp").output
        y = g.create("mul", [y, scale], module=f"blocks.{i}.mlp").output
        h = g.create("add", [y, h], module=f"blocks.{i}").output
    g.add_output(g.create("sum", [h], {"dims": (0, 1), "keepdim": False}, module="head").output,
                 OutputRole.OUTPUT)
    return g


@pytest.mark.parametrize("depth", [TRACED_LAYERS, 6, 9])
def test_a_stack_expands_to_the_graph_of_all_its_layers(depth):
    expanded = expand_layers(stack_graph(TRACED_LAYERS), "blocks", depth)
    assert str(expanded) == str(stack_graph(depth))
    assert [n.module for n in expanded.nodes] == [n.module for n in stack_graph(depth).nodes]


def test_a_layer_reading_two_layers_back_is_not_repeated():
    g = stack_graph(TRACED_LAYERS)
    layer2 = [n for n in g.nodes if n.module == "blocks.2"][0]
    layer0 = [n for n in g.nodes if n.module == "blocks.0"][0]
    layer2.replace_input(layer2.inputs[1], layer0.output)  # a skip over layer 1
    assert expand_layers(g, "blocks", 9) is None


def test_the_stack_is_the_deepest_list_of_identical_layers():
    model = get_model("gpt", "tiny", device="meta", n_layers=MIN_LAYERS).module
    assert find_layer_stack(model) == LayerStack("blocks", MIN_LAYERS)
    shallow = get_model("gpt", "tiny", device="meta", n_layers=MIN_LAYERS - 1).module
    assert find_layer_stack(shallow) is None


# --- on bundled models: the expanded capture against tracing every layer ---------------------

def captures(name: str, mode: str, depth: int, monkeypatch, **config):
    """The capture with repeated layers (checked to have repeated them) and the one tracing
    every layer."""
    ex = get_model(name, "tiny", device="meta", train=mode == "train", n_layers=depth, **config)
    inputs, targets = example_batch(name, ex.config, 2)
    expanded = []

    def expand(*args):
        expanded.append(expand_layers(*args))
        return expanded[-1]

    monkeypatch.setattr(repeat, "expand_layers", expand)
    if mode == "infer":
        result = [capture_inference(ex.module, inputs, name=name, repeat_layers=r)
                  for r in (True, False)]
    else:
        result = [capture_training(ex.module, inputs, ex.loss_fn, targets, name=name,
                                   repeat_layers=r) for r in (True, False)]
    assert len(expanded) == 1 and expanded[0] is not None, "the layers were repeated"
    return result


@pytest.mark.slow
def test_gpt_inference_expands_to_the_traced_graph(monkeypatch):
    expanded, traced = captures("gpt", "infer", MIN_LAYERS, monkeypatch)
    assert str(expanded.graph) == str(traced.graph)  # the same order, too
    assert sorted(expanded.state) == sorted(traced.state)


@pytest.mark.slow
@pytest.mark.parametrize("name,mode,config", [
    ("gpt", "train", {}), ("llama", "infer", {}), ("llama", "train", {}),
    ("moe", "train", {"moe_every": 1}),  # every layer has experts: all alike
])
def test_expanded_capture_equals_the_traced_graph(name, mode, config, monkeypatch):
    expanded, traced = captures(name, mode, MIN_LAYERS + 1, monkeypatch, **config)
    same_graph(expanded.graph, traced.graph)
    assert sorted(expanded.state) == sorted(traced.state)


# --- on small modules: the real capture path, fast --------------------------------------------

class Residual(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return x + torch.relu(self.fc(x))


class Stack(torch.nn.Module):
    def __init__(self, depth: int, by_count: bool = False):
        super().__init__()
        self.depth, self.by_count = depth, by_count
        self.embed = torch.nn.Linear(4, 4)
        self.blocks = torch.nn.ModuleList(Residual() for _ in range(depth))
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        x = self.embed(x)
        if self.by_count:  # walks its layers by its own count, not the list
            for i in range(self.depth):
                x = self.blocks[i](x)
        else:
            for block in self.blocks:
                x = block(x)
        return self.head(x).sum()


def test_a_module_stack_captures_as_tracing_every_layer(monkeypatch):
    with torch.device("meta"):
        model = Stack(MIN_LAYERS)
    x = torch.empty(3, 4, device="meta")
    expanded = []
    monkeypatch.setattr(repeat, "expand_layers",
                        lambda *a: expanded.append(expand_layers(*a)) or expanded[-1])
    repeated = capture_inference(model, [x])
    assert expanded and expanded[0] is not None, "the layers were repeated"
    traced = capture_inference(model, [x], repeat_layers=False)
    assert str(repeated.graph) == str(traced.graph)
    assert sorted(repeated.state) == sorted(traced.state)
    assert all(t.is_meta for t in repeated.state.values())


@pytest.mark.slow
def test_a_module_stack_training_step_captures_as_tracing_every_layer():
    with torch.device("meta"):
        model = Stack(MIN_LAYERS)
    x = torch.empty(3, 4, device="meta")
    steps = [capture_training(model, [x], lambda out: out, repeat_layers=r)
             for r in (True, False)]
    same_graph(steps[0].graph, steps[1].graph)


def test_a_stack_that_cannot_be_shortened_is_traced_whole():
    with torch.device("meta"):
        model = Stack(MIN_LAYERS, by_count=True)
    x = torch.empty(3, 4, device="meta")
    graph = capture_inference(model, [x]).graph
    assert {n.module for n in graph.nodes if (n.module or "").startswith("blocks.")} == \
        {f"blocks.{i}{sub}" for i in range(MIN_LAYERS) for sub in ("", ".fc")}


def test_a_repeated_capture_runs_equal_to_eager_once_it_has_weights():
    from graphpar.compiler.driver import ModelSpec, capture

    def real():
        torch.manual_seed(0)
        return Stack(MIN_LAYERS)

    with torch.device("meta"):
        model = Stack(MIN_LAYERS)
    x = torch.randn(3, 4)
    spec = ModelSpec("stack", model, (x,), make_real=real)
    captured = capture(spec)
    [out] = captured.run(x)
    torch.testing.assert_close(out, real()(x), rtol=1e-5, atol=1e-5)


def test_a_list_inside_a_layer_is_not_the_stack():
    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(MIN_LAYERS))

    with torch.device("meta"):
        model = torch.nn.Module()
        model.layers = torch.nn.ModuleList(Experts() for _ in range(2))
    assert find_layer_stack(model) is None
    with torch.device("meta"):
        model.layers = torch.nn.ModuleList(Experts() for _ in range(MIN_LAYERS + 1))
    assert find_layer_stack(model) == LayerStack("layers", MIN_LAYERS + 1)
