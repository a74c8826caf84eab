"""The pass manager: pipeline strings, options, instrumentation, verification."""

from dataclasses import dataclass

import pytest

from graphpar.errors import PassError, UsageError
from graphpar.ir.parser import parse
from graphpar.passes import (
    GraphPass,
    PassContext,
    PassManager,
    available_passes,
    parse_pipeline,
    register_pass,
)

TEXT = """
graph @g(
    %x: f32[4] input,
) {
  %0 = exp(%x) : f32[4]
  %1 = exp(%x) : f32[4]
  %2 = add(%0, %1) : f32[4]
  %3 = neg(%x) : f32[4]
  return %2 output
}
"""


@register_pass("test-break-types")
@dataclass
class BreakTypes(GraphPass):
    """A deliberately wrong pass: the verifier must catch it."""

    def run_on_graph(self, graph, ctx):
        graph.nodes[0].op = "neg"
        graph.nodes[0].outputs[0].type = graph.nodes[0].outputs[0].type.__class__(
            (5,), graph.nodes[0].outputs[0].type.dtype)
        return True


@register_pass("test-options")
@dataclass
class WithOptions(GraphPass):
    """A pass with typed options."""

    mesh: str = "1"
    rounds: int = 1
    strict: bool = False
    ratio: float = 0.5

    def run_on_graph(self, graph, ctx):
        return False


def test_alias_expands_to_its_passes():
    assert [p.name for p in parse_pipeline("cleanup")] == [
        "canonicalize", "fold-constants", "cse", "dce"]


def test_options_are_typed():
    (p,) = parse_pipeline("test-options{mesh=2x4, rounds=3, strict=true, ratio=0.25}")
    assert (p.mesh, p.rounds, p.strict, p.ratio) == ("2x4", 3, True, 0.25)
    assert str(p) == "test-options{mesh=2x4,rounds=3,strict=True,ratio=0.25}"


@pytest.mark.parametrize("pipeline, says", [
    ("cse,nope", "unknown pass 'nope'; available passes: "),
    ("test-options{meshh=2}", "has no option 'meshh'; its options: mesh, rounds, strict, ratio"),
    ("test-options{rounds=many}", "option rounds='many' is not a int"),
    ("test-options{rounds}", "needs a value"),
    ("cse,,dce", "bad pipeline"),
    ("", "empty pipeline"),
])
def test_bad_pipelines_say_what_is_wrong(pipeline, says):
    with pytest.raises(UsageError, match=None) as err:
        parse_pipeline(pipeline)
    assert says in str(err.value)


def test_records_time_and_node_counts_and_dumps(tmp_path):
    dumps = {}
    pm = PassManager(parse_pipeline("cse,dce"), dump_after=["all"], dump_before=["cse"],
                     dump_dir=tmp_path, dump_fn=lambda label, text: dumps.update({label: text}))
    pm.run(parse(TEXT))
    assert [(r.name, r.nodes_before, r.nodes_after, r.changed) for r in pm.records] == [
        ("cse", 4, 3, True), ("dce", 3, 2, True)]
    assert all(r.seconds >= 0 for r in pm.records)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "00-after-cse.gpir", "00-before-cse.gpir", "01-after-dce.gpir"]
    assert "neg" not in dumps["01-after-dce"] and "neg" in dumps["00-after-cse"]


def test_verifier_names_the_pass_that_broke_the_graph():
    with pytest.raises(PassError, match="after pass 'test-break-types': graph @g, node 0"):
        PassManager(parse_pipeline("test-break-types")).run(parse(TEXT))


def test_analyses_are_cached_until_a_pass_changes_the_graph():
    calls = []
    ctx = PassContext()
    graph = parse(TEXT)

    def count_nodes(g):
        calls.append(1)
        return len(g)

    assert ctx.analysis(count_nodes, graph) == 4
    assert ctx.analysis(count_nodes, graph) == 4
    assert len(calls) == 1
    PassManager(parse_pipeline("dce")).run(graph, ctx)
    assert ctx.analysis(count_nodes, graph) == 3
    assert len(calls) == 2


def test_every_registered_pass_is_listed():
    assert {"dce", "cse", "canonicalize", "fold-constants", "cleanup"} <= set(available_passes())


@pytest.mark.parametrize("options, says", [
    ("mesh=abc", "mesh 'abc' is not a shape"),
    ("mesh=2,memory_limit=abc", "expected a size like"),
    ("mesh=2,cluster=nope", "unknown cluster preset 'nope'"),
    ("mesh=2,time_limit=-1", "time_limit=-1.0: give a positive number of seconds"),
    ("mesh=2,time_limit=nan", "option time_limit='nan' is not a float"),
    ("mesh=2,dtype=int8", "no peak FLOP/s for dtype 'int8'"),
])
def test_pass_options_are_checked_when_the_pipeline_is_parsed(options, says):
    """Before any model is captured: the pass itself refuses what it cannot use."""
    with pytest.raises(UsageError, match=r"^pass 'auto-shard': ") as err:
        parse_pipeline(f"cleanup,auto-shard{{{options}}}")
    assert says in str(err.value)
