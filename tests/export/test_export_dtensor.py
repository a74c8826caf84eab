"""`graphpar export --to dtensor`: plan.json and graphpar.export.apply_plan on a real
DeviceMesh, against eager PyTorch; plans that do not fit the module or the mesh."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from export_testutil import HERE, MLP, load_model_file, run_cli

from graphpar.errors import ShardingError, UsageError
from graphpar.export import apply_plan
from graphpar.export.dtensor_plan import FORMAT

ROOT = HERE.parents[1]


def _export(tmp_path, capsys):
    out = tmp_path / "out"
    code, stdout, _ = run_cli(capsys, "export", MLP, "--mode", "train", "--optimizer", "sgd",
                              "--mesh", "2x2", "--cluster", "cpu", "--to", "dtensor",
                              "--out", out)
    assert code == 0
    plan = json.loads((out / "plan.json").read_text())
    assert plan["format"] == FORMAT and plan["mesh"]["shape"] == [2, 2]
    assert plan["parameters"].keys() == {"up.weight", "up.bias", "down.weight", "down.bias"}
    assert plan["parameters"]["up.weight"]["shape"] == [512, 128]
    assert [i["name"] for i in plan["inputs"]] == ["x"]  # the module's; not the loss target
    assert plan["collectives_planned"], "the plan shards: it communicates"
    assert f"planned    {', '.join(f'{k} {n}' for k, n in plan['collectives_planned'].items())}" \
        in stdout
    assert "apply_plan(model, \"plan.json\", mesh)" in (out / "README.md").read_text()
    return out, plan


def test_export_writes_each_parameters_placements_and_the_planned_collectives(tmp_path,
                                                                              capsys):
    _export(tmp_path, capsys)


@pytest.mark.slow
def test_a_plan_on_a_2x2_device_mesh_of_gloo_ranks_equals_eager(tmp_path, capsys):
    """apply_plan on a (2, 2) DeviceMesh of 4 gloo ranks under torchrun: parameters sharded
    as planned, forward and every gradient equal to eager; DTensor's collectives counted."""
    out, plan = _export(tmp_path, capsys)
    found = _run_check(tmp_path, out / "plan.json", MLP)
    assert found["backward_error"] is None
    assert set(found["sharded"]) == {n for n, e in plan["parameters"].items()
                                     if any(p.startswith("Shard") for p in e["placements"])}
    assert found["sharded"]
    assert max(found["errors"].values()) < 1e-5, found["errors"]
    assert found["errors"].keys() >= {f"grad {n}" for n in plan["parameters"]}
    assert found["counts"].get("all_gather", 0) > 0  # what DTensor issued, counted


def _run_check(tmp_path, plan, model_file) -> dict:
    """dtensor_check.py under torchrun on 4 gloo ranks: what rank 0 found."""
    result = tmp_path / "result.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore"}
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    done = subprocess.run([torchrun, "--nproc-per-node", "4", str(HERE / "dtensor_check.py"),
                           str(plan), str(model_file), str(result)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(result.read_text())


@pytest.fixture
def one_rank_mesh(tmp_path):
    """A real DeviceMesh of one gloo rank (this process)."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _plan(**change):
    module, _ = load_model_file(MLP).build()
    params = {n: {"placements": ["Shard(0)", "Replicate()"], "shape": list(p.shape)}
              for n, p in module.named_parameters()}
    plan = {"format": FORMAT, "mesh": {"dim_names": ["axis0", "axis1"], "shape": [2, 2]},
            "parameters": params, "buffers": {}, "inputs": [], "outputs": None}
    plan.update(change)
    return module, plan


def test_a_plan_for_another_models_parameters_is_refused(tmp_path, one_rank_mesh):
    module, plan = _plan()
    plan["parameters"]["fc1.weight"] = plan["parameters"].pop("up.weight")
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    with pytest.raises(ShardingError, match=r"plan.json: parameter 'fc1.weight' is not in the "
                                            r"module \(MLP; 1 unknown\)"):
        apply_plan(module, path, one_rank_mesh)
    del plan["parameters"]["fc1.weight"]
    with pytest.raises(ShardingError, match="the module's parameter 'up.weight' has no "
                                            "placements in the plan"):
        apply_plan(module, plan, one_rank_mesh)


def test_a_plan_with_other_shapes_or_another_mesh_is_refused(one_rank_mesh):
    module, plan = _plan()
    plan["parameters"]["down.bias"]["shape"] = [64]
    with pytest.raises(ShardingError, match=r"parameter 'down.bias' is \[128\] in the module "
                                            r"but \[64\] in the plan"):
        apply_plan(module, plan, one_rank_mesh)
    module, plan = _plan()
    with pytest.raises(ShardingError, match=r"the plan is for a 2x2 mesh, the DeviceMesh given "
                                            r"is 1: make the mesh init_device_mesh\(device, "
                                            r"\(2, 2\)\)"):
        apply_plan(module, plan, one_rank_mesh)
    assert not isinstance(module.up.weight, torch.distributed.tensor.DTensor)  # untouched


class _PositionEmbedding(torch.nn.Module):
    """Makes its position ids inside its forward as a plain tensor, as GPT-2 does."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.wpe = torch.nn.Embedding(8, 6)
        self.head = torch.nn.Linear(6, 4)

    def forward(self, x):
        positions = torch.arange(x.shape[1])
        return self.head(x + self.wpe(positions))


def test_a_plain_tensor_made_in_the_forward_meets_dtensor_parameters_in_the_backward(
        one_rank_mesh):
    """apply_plan makes the position ids a Replicate DTensor at the embedding's boundary, so
    the embedding's backward runs; without it DTensor refuses the mix there."""
    from torch.distributed.tensor import DTensor

    module, eager = _PositionEmbedding(), _PositionEmbedding()
    plan = {"format": FORMAT, "mesh": {"dim_names": ["axis0"], "shape": [1]},
            "parameters": {n: {"placements": ["Shard(0)"], "shape": list(p.shape)}
                           for n, p in module.named_parameters()},
            "buffers": {}, "inputs": [{"name": "x", "placements": ["Replicate()"]}],
            "outputs": None}
    apply_plan(module, plan, one_rank_mesh)
    x = torch.randn(2, 5, 6)
    out = module(x)
    out.square().sum().backward()
    expected = eager(x)
    expected.square().sum().backward()
    torch.testing.assert_close(out, expected)
    for (name, p), (_, q) in zip(module.named_parameters(), eager.named_parameters()):
        assert isinstance(p, DTensor), name
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=name)


def test_a_file_that_is_not_a_plan_is_refused(tmp_path):
    module, _ = _plan()
    path = tmp_path / "plan.json"
    path.write_text('{"parameters": {}}')
    with pytest.raises(UsageError, match="not a graphpar DTensor plan"):
        apply_plan(module, path, None)


@pytest.mark.slow
def test_a_hugging_face_causal_lms_plan_on_a_2x2_device_mesh_equals_eager(tmp_path, capsys,
                                                                           monkeypatch):
    """GPT-2's plan by apply_plan on a (2, 2) DeviceMesh of 4 gloo ranks: the output, the loss
    and every gradient equal to eager."""
    out = tmp_path / "out"
    hf_gpt2 = ROOT / "examples" / "hf_gpt2.py"
    code, _, _ = run_cli(capsys, "export", hf_gpt2, "--mode", "train", "--optimizer", "sgd",
                         "--mesh", "2x2", "--cluster", "cpu", "--to", "dtensor", "--out", out)
    assert code == 0
    monkeypatch.syspath_prepend(str(hf_gpt2.parent))  # hf_gpt2 imports its sibling hf_opt
    module, _ = load_model_file(hf_gpt2).build()
    found = _run_check(tmp_path, out / "plan.json", hf_gpt2)
    # GPT-2 makes its position ids inside its forward as a plain tensor: apply_plan's hooks
    # make them a Replicate DTensor at the position embedding, so its backward runs too
    assert found["backward_error"] is None
    assert found["sharded"]
    # every gradient, the tied embedding and LM head's once (as named_parameters names it)
    assert found["errors"].keys() == {"output", "loss"} | {f"grad {n}" for n, _
                                                           in module.named_parameters()}
    assert max(found["errors"].values()) < 1e-4, found["errors"]


@pytest.mark.slow
def test_a_pipelined_plan_runs_with_torch_distributed_pipelining_equal_to_eager(tmp_path,
                                                                               capsys):
    """--pipeline 2 --to dtensor: the stages in torchtitan's words, and apply_pipeline's
    stage and Schedule1F1B under torchrun on 4 gloo ranks (two pipelines of two stages): the
    loss and every gradient equal eager PyTorch."""
    out = tmp_path / "out"
    code, stdout, _ = run_cli(capsys, "export", MLP, "--mode", "train", "--optimizer", "sgd",
                              "--mesh", "2x2", "--cluster", "cpu", "--pipeline", "2",
                              "--to", "dtensor", "--out", out)
    assert code == 0
    assert "stage 1    ranks [2, 3], modules down" in stdout
    assert (out / "torchtitan.toml").read_text().splitlines()[1:] == [
        "[parallelism]", "pipeline_parallel_degree = 2",
        'pipeline_parallel_schedule = "1F1B"', "pipeline_parallel_microbatch_size = 16",
        'module_fqns_per_model_part = [["up"], ["down"]]', "tensor_parallel_degree = 2"]
    results = tmp_path / "results"
    results.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore"}
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    done = subprocess.run([torchrun, "--nproc-per-node", "4", str(HERE / "pipeline_check.py"),
                           str(out / "plan.json"), str(MLP), str(results)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    stages = [json.loads((results / f"stage{s}.json").read_text()) for s in range(2)]
    assert [s["parameters"] for s in stages] == [["up.bias", "up.weight"],
                                                 ["down.bias", "down.weight"]]
    errors = {**stages[0]["errors"], **stages[1]["errors"]}
    assert "loss" in errors and len(errors) == 5
    assert max(errors.values()) < 1e-6, errors
