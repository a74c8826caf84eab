"""Layering of the graphpar package: the module import graph, read from the source with ast."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]

# The floors and wings of docs/architecture.md: what each folder may import of graphpar. A
# folder's own modules are always allowed; "leaves" are errors, units and datafile.
LEAVES = ("graphpar.errors", "graphpar.units", "graphpar.datafile")
BELOW_THE_WINGS = ("graphpar.ir", "graphpar.cost", "graphpar.capture", "graphpar.passes",
                   "graphpar.backends", "graphpar.runtime", "graphpar.models")
MAY_IMPORT = {
    "graphpar.ir": (),
    "graphpar.cost": ("graphpar.ir",),
    "graphpar.backends": ("graphpar.ir", "graphpar.cost"),
    "graphpar.capture": ("graphpar.ir", "graphpar.cost", "graphpar.backends"),
    "graphpar.passes": ("graphpar.ir", "graphpar.cost"),
    # the runtime runs programs: it never captures or compiles, and knows no wing
    "graphpar.runtime": ("graphpar.ir", "graphpar.cost", "graphpar.backends"),
    "graphpar.models": (),
    "graphpar.viz": ("graphpar.ir", "graphpar.cost"),
    # the wings: the floors below, and of another wing only its public face
    "graphpar.compiler": BELOW_THE_WINGS,
    "graphpar.serving": BELOW_THE_WINGS,
    "graphpar.calibration": BELOW_THE_WINGS + ("graphpar.compiler.api",),
    "graphpar.placement": BELOW_THE_WINGS + ("graphpar.compiler.model_file",),
    # export writes what the compiler planned in PyTorch's terms; it takes plans as objects
    "graphpar.export": BELOW_THE_WINGS,
    # training runs the compiled step: the compiler's public face and its model files
    "graphpar.training": BELOW_THE_WINGS + ("graphpar.compiler.api",
                                            "graphpar.compiler.model_file"),
}
# modules of a wing that its engine-side code must not import: serving's engine, scheduler,
# KV cache manager and model ranks run programs the serving compile made
SERVING_COMPILE = ("graphpar.serving.compile", "graphpar.serving.llm",
                   "graphpar.serving.stage_split", "graphpar.capture", "graphpar.passes")
SERVING_ENGINE = ("graphpar.serving.engine", "graphpar.serving.scheduler",
                  "graphpar.serving.kv_cache_manager", "graphpar.serving.sampling",
                  "graphpar.serving.outputs", "graphpar.serving.paged_model",
                  "graphpar.serving.model_rank", "graphpar.serving.tensor_parallel",
                  "graphpar.serving.pipeline_parallel")


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
    assert graph.has_edge("graphpar.serving.paged_model", "graphpar.serving.tensor_parallel")
    assert graph.has_edge("graphpar.compiler.api", "graphpar.compiler.check.eager")  # lazy


def test_no_import_cycle():
    graph = import_graph()
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def _folder(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_every_folder_imports_only_what_its_floor_allows():
    """docs/architecture.md's table: each folder imports the leaves, itself and the folders
    listed in MAY_IMPORT (the CLI, the products' floor, imports anything)."""
    graph = import_graph()
    wrong = []
    for a, b in graph.edges:
        folder = _folder(a)
        if folder not in MAY_IMPORT or _folder(b) == folder or b.startswith(LEAVES):
            continue
        if not b.startswith(MAY_IMPORT[folder]):
            wrong.append((a, b))
    assert not wrong, f"imports that go up the stack or into another wing: {wrong}"


def test_the_root_holds_only_the_leaves_and_the_public_face():
    modules = [p.stem for p in (ROOT / "graphpar").glob("*.py")]
    assert len(modules) <= 6, sorted(modules)
    assert sorted(modules) == ["__init__", "__main__", "datafile", "errors", "units"], \
        sorted(modules)


def test_servings_engine_never_imports_its_compile():
    """vLLM v1's split: the engine, its scheduler and KV cache manager, and the model ranks run
    the programs the serving compile made; none of them captures or compiles."""
    graph = import_graph()
    wrong = [(a, b) for a, b in graph.edges
             if a.startswith(SERVING_ENGINE) and b.startswith(SERVING_COMPILE)]
    assert not wrong, f"serving's engine side imports its compile: {wrong}"


def test_only_the_scheduler_imports_the_kv_cache_manager():
    """vLLM v1's split: the scheduler owns the KV block manager and hands the engine each
    step's blocks; the engine (and anything else in graphpar) never imports the manager."""
    graph = import_graph()
    importers = set(graph.predecessors("graphpar.serving.kv_cache_manager"))
    assert "graphpar.serving.engine" not in importers
    assert importers == {"graphpar.serving.scheduler"}, \
        f"{sorted(importers)} import the KV cache manager: only the scheduler may"


def test_the_placement_simulator_and_workloads_use_no_compiler():
    """The simulator, workloads and queueing formulas are plain numpy/numba: they import only
    the leaves (the errors, the data-file reader) and each other, so benches and the runtime
    can use them without the compiler."""
    graph = import_graph()
    low = ("graphpar.placement.simulator", "graphpar.placement.workload",
           "graphpar.placement.queueing")
    wrong = [(a, b) for a in low for b in graph.successors(a)
             if b not in low and b not in ("graphpar.errors", "graphpar.datafile")]
    assert not wrong, f"the placement simulator imports {wrong}"
