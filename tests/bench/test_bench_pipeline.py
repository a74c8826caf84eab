"""The pipeline benchmark runs end to end on a tiny model and keeps its promise: the two-level
search with the hand plans as choices is never worse than any hand or one-level plan."""

import json

import pytest


@pytest.mark.slow
def test_pipeline_bench_writes_rows_and_two_level_is_never_worse(load_bench, tmp_path, capsys):
    bench = load_bench("pipeline")
    out = tmp_path / "pipeline.json"
    assert bench.main(["--models", "mlp:tiny", "--meshes", "1x2", "--batch", "8",
                       "--microbatches", "4", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    (entry,) = result["results"]
    best = entry["best"]
    assert {"two-level", "two-level+hand", "intra-op only", "inter-op only", "equal layer",
            "megatron"} <= set(best)
    for kind in ("two-level", "intra-op only", "inter-op only", "equal layer", "megatron"):
        assert best["two-level+hand"] <= best[kind] * (1 + 1e-12), kind
    # the ILP alone is never worse than the one-level plan and the equal slicing it contains
    for kind in ("intra-op only", "equal layer"):
        assert best["two-level"] <= best[kind] * (1 + 1e-12), kind
    assert entry["never_worse"] and entry["beaten_by"] == []
    assert bench.beaten_by({"two-level+hand": 2.0, "megatron": 1.0}) == ["megatron"]
    variants = {r["variant"] for r in entry["rows"]}
    assert {"megatron dp=2 tp=1 pp=1", "megatron dp=1 tp=2 pp=1", "megatron dp=1 tp=1 pp=2"
            } <= variants
    out = capsys.readouterr().out
    assert "estimated step milliseconds" in out and "never worse" in out
    row = next(line for line in out.splitlines() if line.startswith("mlp:tiny"))
    assert row.split()[-4] == "yes"  # the never-worse column


def test_two_level_plan_is_never_worse_on_a_small_case(load_bench):
    # Every variant of the benchmark on a 3-layer MLP, 2 devices, 4 microbatches: the
    # two-level search with the hand layouts as choices is at most each of them.
    from graphpar.capture import Adam, capture_training
    from graphpar.cost.cluster import get_cluster
    from graphpar.models import get_model

    bench = load_bench("pipeline")
    ex = get_model("mlp", "tiny", train=True, n_layers=3)
    graph = capture_training(ex.module, ex.inputs, ex.loss_fn, ex.targets,
                             optimizer=Adam(lr=1e-3), name="mlp").graph
    rows = bench.run_variants(graph, "1x2", 4, get_cluster("dgx-a100"))
    best = bench.summarize(rows)
    assert set(best) == set(bench.KINDS)
    assert bench.beaten_by(best) == []
    assert best["two-level+hand"] < best["intra-op only"]  # pipelining pays here


def test_markdown_table_shows_each_kind_best_row_and_why_not(load_bench):
    bench = load_bench("pipeline")
    rows = [{"variant": "two-level", "est_step_s": 1.5, "clustering": "eq6"},
            {"variant": "two-level+hand", "est_step_s": 1.5},
            {"variant": "equal layer S=2", "est_step_s": 2.0},
            {"variant": "equal layer S=4", "est_step_s": 1.75},
            {"variant": "megatron dp=2 tp=4 pp=2", "est_step_s": 0.0016},
            {"variant": "inter-op only", "error": "no pipeline ... fits"}]
    table = bench.markdown([{"model": "gpt:1.3B", "mesh": "2x8", "microbatch_size": 8,
                             "microbatches": 128, "rows": rows, "never_worse": False,
                             "beaten_by": ["megatron"], "two_level_ilp_solves": 70,
                             "two_level_cpu_s": 28.74}])
    assert table.splitlines()[2] == (
        "| gpt:1.3B | 2x8 | 8 x 128 | 1,500 | 1,500 | not run | does not fit | 1,750 (S=4) "
        "| not run | 1.600 (dp 2, tp 4, pp 2) | no: megatron | eq6 | 70 | 28.7 |")
