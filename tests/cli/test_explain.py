"""`graphpar explain`: the plan's step as compile reports it, counterfactuals, clear errors."""

import json
from pathlib import Path

import pytest
from cli_run import run_cli

from graphpar.units import format_seconds

EXAMPLE = Path(__file__).parents[2] / "examples" / "tiny_mlp.py"


def test_the_explained_step_is_the_objective_compile_reports(tmp_path, capsys):
    code, _, _ = run_cli(capsys, "compile", EXAMPLE, "--mesh", "2", "--out", tmp_path / "out")
    assert code == 0
    plan = json.loads((tmp_path / "out" / "report.json").read_text())["plan"]
    code, out, _ = run_cli(capsys, "explain", EXAMPLE, "--mesh", "2", "--top", "2", "--tries",
                           "1", "--json", tmp_path / "why.json")
    assert code == 0
    why = json.loads((tmp_path / "why.json").read_text())
    assert why["step_seconds_estimated"] == plan["step_seconds_estimated"]
    assert why["objective_seconds_estimated"] == plan["solver"]["objective_seconds"]
    assert why["compute_seconds_estimated"] + why["communication_seconds_estimated"] == \
        pytest.approx(plan["solver"]["objective_seconds"], rel=1e-12)
    step = format_seconds(plan["step_seconds_estimated"])
    assert f"  step       {step} estimated = compute " in out
    assert f"(the ILP's objective: {format_seconds(plan['solver']['objective_seconds'])}; " \
        "OPTIMAL" in out
    assert [n["node"] for n in why["nodes"]] == ["fc1:linear", "gelu"]  # the costliest two
    for node in why["nodes"]:
        (tried,) = node["tried"]
        assert tried["delta_seconds_estimated"] >= 0
        assert tried["step_seconds_estimated"] == pytest.approx(
            why["step_seconds_estimated"] + tried["delta_seconds_estimated"])


def test_forcing_the_first_matmul_of_an_mlp_to_data_parallel(capsys):
    """tiny_mlp (batch 8, 16 -> 64 -> 4) on 2 A100s stays replicated: splitting anything adds
    a collective that costs more than the work it splits. Forced to split the batch, the first
    linear takes the rest of the MLP with it, and the output is gathered once at the end."""
    code, out, _ = run_cli(capsys, "explain", EXAMPLE, "--mesh", "2", "--node", "fc1:linear",
                           "--strategy", "({S(0)},{R},{R})->{S(0)}")
    assert code == 0
    lines = out.splitlines()
    assert lines[2] == "  node       fc1:linear (%0 linear, fc1, examples/tiny_mlp.py:15)"
    assert lines[3].startswith("    plan     ({R}, {R}, {R}) -> {R}: compute ")
    assert lines[4].startswith("  forced     ({S(0)}, {R}, {R}) -> {S(0)}: step ")
    assert "; OPTIMAL), 2 other nodes change:" in lines[4]
    assert lines[5:7] == ["    gelu: ({R}) -> {R} => ({S(0)}) -> {S(0)}",
                          "    fc2:linear: ({R}, {R}, {R}) -> {R} => ({S(0)}, {R}, {R}) -> {S(0)}"]


def test_unknown_node_names_the_closest(capsys):
    code, out, err = run_cli(capsys, "explain", EXAMPLE, "--mesh", "2", "--node", "fc3:linear",
                             "--strategy", "{S(0)}")
    assert code == 2 and out == ""
    assert err.splitlines()[-1] == (
        "graphpar: error: --node fc3:linear: no such node in graph @tiny_mlp (closest: "
        "fc2:linear, fc1:linear; or give a value number as printed, %N)")


def test_unknown_strategy_lists_the_nodes_strategies(capsys):
    code, out, err = run_cli(capsys, "explain", EXAMPLE, "--mesh", "2", "--node", "fc1:linear",
                             "--strategy", "{S(2)}")
    assert code == 2 and out == ""
    assert err.splitlines()[-1] == (
        "graphpar: error: --strategy {S(2)}: is not one of the strategies of node fc1:linear; "
        "they are: ({R}, {R}, {R}) -> {R}; ({S(0)}, {R}, {R}) -> {S(0)}; "
        "({R}, {S(0)}, {S(0)}) -> {S(1)}; ({S(1)}, {S(1)}, {P}) -> {P}")


@pytest.mark.parametrize("argv, says", [
    ([], "explain needs --mesh: the device mesh to plan on, e.g. --mesh 2x4"),
    (["--mesh", "2", "--strategy", "{R}"], "--strategy needs --node: the node to force"),
    (["--mesh", "2", "--top", "0"], "--top 0: give a number >= 1"),
    (["--mesh", "2", "--time-limit", "nan"], "--time-limit nan: give a positive number"),
    (["--mesh", "3x", "--cluster", "dgx-a100"], "--mesh 3x: "),
])
def test_bad_options_fail_before_the_model_loads(capsys, argv, says):
    code, out, err = run_cli(capsys, "explain", EXAMPLE, *argv)
    assert code == 2 and out == ""
    assert says in err and "loading the model" not in err
