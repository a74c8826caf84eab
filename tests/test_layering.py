"""Layering of the graphpar package: the module import graph, read from the source with ast."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]

# the runners of IR graphs and their processes (one interpreter, one worker group)
RUNTIME_MODULES = {
    "graphpar.api",
    "graphpar.serve",
    "graphpar.backends",
    "graphpar.backends.interpreter",
    "graphpar.backends.reference",
    "graphpar.runtime.comm",
    "graphpar.runtime.executor",
    "graphpar.runtime.gloo",
    "graphpar.runtime.launch",
    "graphpar.runtime.model_rank",
    "graphpar.runtime.paged_model",
    "graphpar.runtime.program",
    "graphpar.runtime.spmd",
    "graphpar.runtime.tensor_parallel",
    "graphpar.runtime.workers",
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in (ROOT / "graphpar").rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _runtime_imports(tree: ast.AST):
    """The import statements that run (those under ``if TYPE_CHECKING:`` only name types)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph() -> nx.DiGraph:
    """module -> the graphpar modules it imports (anywhere in the file, lazy imports too).

    ``from package import submodule`` is an edge to the submodule; a package's own
    ``__init__`` counts only for names that are not submodules."""
    modules = _modules()
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _runtime_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                subs = [f"{base}.{alias.name}" for alias in node.names]
                targets = [s for s in subs if s in modules]
                if len(targets) < len(subs):
                    targets.append(base)
            graph.add_edges_from((name, t) for t in targets if t in modules and t != name)
    return graph


def test_the_import_graph_sees_imports():
    graph = import_graph()
    assert graph.has_edge("graphpar.runtime.spmd", "graphpar.backends.interpreter")
    assert graph.has_edge("graphpar.runtime.paged_model", "graphpar.runtime.tensor_parallel")


def test_no_import_cycle():
    graph = import_graph()
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_runtime_and_backends_do_not_import_each_other_backwards():
    graph = import_graph()
    backwards = [(a, b) for a, b in graph.edges
                 if a.startswith("graphpar.backends") and b.startswith("graphpar.runtime")]
    assert not backwards


def test_the_ir_imports_no_cost_model_backend_or_runtime():
    graph = import_graph()
    lower = ("graphpar.cost", "graphpar.backends", "graphpar.runtime")
    wrong = [(a, b) for a, b in graph.edges
             if a.startswith("graphpar.ir") and b.startswith(lower)]
    assert not wrong, f"graphpar.ir imports {wrong}"


def test_the_runtime_does_not_compile():
    """The runtime runs programs it is given: capture, passes and the compile drivers are the
    compile step's. (runtime.naive, the eager baseline generator, keeps its KV cache through the
    capture's attention hook; it compiles nothing.)"""
    graph = import_graph()
    compiler = ("graphpar.capture", "graphpar.passes", "graphpar.compiler", "graphpar.api",
                "graphpar.serving_compile", "graphpar.serve", "graphpar.cli", "graphpar.pipelined")
    wrong = [(a, b) for a, b in graph.edges
             if a.startswith("graphpar.runtime") and b.startswith(compiler)
             and (a, b) != ("graphpar.runtime.naive", "graphpar.capture.decoder")]
    assert not wrong, f"the runtime imports the compiler: {wrong}"


def test_layers_import_only_below_themselves():
    """The stack of docs/architecture.md: cost, capture and passes sit on the IR; backends
    below the runtime; nothing below the drivers imports them."""
    graph = import_graph()
    below = {
        "graphpar.cost": ("graphpar.capture", "graphpar.passes", "graphpar.backends",
                          "graphpar.runtime"),
        "graphpar.capture": ("graphpar.passes", "graphpar.runtime", "graphpar.models"),
        "graphpar.passes": ("graphpar.backends", "graphpar.runtime", "graphpar.capture"),
        "graphpar.backends": ("graphpar.runtime", "graphpar.passes", "graphpar.capture"),
    }
    drivers = ("graphpar.compiler", "graphpar.api", "graphpar.serving_compile",
               "graphpar.serve", "graphpar.cli", "graphpar.check", "graphpar.pipelined",
               "graphpar.placement", "graphpar.calibration", "graphpar.plan_runs")
    wrong = [(a, b) for a, b in graph.edges
             for layer, banned in below.items()
             if a.startswith(layer) and b.startswith(banned + drivers)]
    assert not wrong, f"imports that go up the stack: {wrong}"


def test_the_placement_simulator_and_workloads_use_no_compiler():
    """The simulator, workloads and queueing formulas are plain numpy/numba: they import only
    the errors (and each other), so benches and the runtime can use them without the compiler."""
    graph = import_graph()
    low = ("graphpar.placement.simulator", "graphpar.placement.workload",
           "graphpar.placement.queueing")
    wrong = [(a, b) for a in low for b in graph.successors(a)
             if b not in low and b != "graphpar.errors"]
    assert not wrong, f"the placement simulator imports {wrong}"
