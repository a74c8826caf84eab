"""`graphpar export --to mlir`: IR graphs rebuilt as fx.GraphModules of ATen ops (the inverse
of capture), imported by torch-mlir's FX importer, one func.func per graph, re-parsed."""

import re

import pytest
import torch
from export_testutil import MLP, load_model_file, run_cli

from graphpar.capture import capture_inference, capture_training
from graphpar.export.fx_graph import graph_module


def _func_names(text: str) -> list[str]:
    """The func.func symbols of MLIR text, read back by torch-mlir's own parser."""
    from torch_mlir import ir
    from torch_mlir.dialects import torch as torch_d

    with ir.Context() as context:
        torch_d.register_dialect(context)
        module = ir.Module.parse(text)
        assert module.operation.verify()
        return [op.attributes["sym_name"].value for op in module.body.operations
                if op.operation.name == "func.func"]


def test_a_captured_graph_rebuilt_as_an_fx_graph_module_computes_the_same():
    model = load_model_file(MLP)
    module, (x,) = model.build()
    (target,) = model.targets()
    for captured, args in ((capture_inference(module, (x,), name="mlp"), (x,)),
                           (capture_training(module, (x,), model.loss, (target,), name="mlp_train"),
                            (x, target))):
        gm = graph_module(captured.graph)
        assert "torch.ops.aten." in gm.code and "graphpar" not in gm.code  # ATen ops only
        bound = captured.bind(*args)
        rebuilt = gm(*[bound[v.name] for v in captured.graph.inputs])
        for a, b in zip(rebuilt, captured.run(*args), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_export_writes_one_func_per_graph_in_the_torch_dialect(tmp_path, capsys):
    pytest.importorskip("torch_mlir")
    out = tmp_path / "out"
    code, stdout, _ = run_cli(capsys, "export", MLP, "--mode", "train", "--optimizer", "sgd",
                              "--mesh", "2x2", "--cluster", "cpu", "--to", "mlir",
                              "--out", out)
    assert code == 0
    assert "func.func  @mlp_model_train (torch dialect)" in stdout
    text = (out / "stages.mlir").read_text()
    assert _func_names(text) == ["mlp_model_train"]
    assert re.search(r"torch\.aten\.mm .*!torch\.vtensor<\[64,128\],f32>", text)


def test_the_rebuilt_inference_graph_lowers_to_linalg():
    """torch-mlir's own pipeline takes the rebuilt graph down to linalg on tensors (running it
    needs torch-mlir's reference backend, which its wheel does not ship)."""
    fx = pytest.importorskip("torch_mlir.fx")
    module, (x,) = load_model_file(MLP).build()
    gm = graph_module(capture_inference(module, (x,), name="mlp").graph)
    text = str(fx.stateless_fx_import(gm, output_type="linalg-on-tensors"))
    assert "linalg.matmul" in text or "linalg.generic" in text
    assert "torch.aten" not in text


@pytest.mark.slow
def test_a_pipelines_stages_become_one_func_each(tmp_path, capsys):
    pytest.importorskip("torch_mlir")
    out = tmp_path / "out"
    code, _, _ = run_cli(capsys, "export", MLP, "--mode", "train", "--optimizer", "sgd",
                         "--mesh", "2x2", "--cluster", "cpu", "--pipeline", "2", "--to", "mlir",
                         "--out", out)
    assert code == 0
    assert _func_names((out / "stages.mlir").read_text()) == [
        "stage0_forward", "stage0_backward", "stage0_update",
        "stage1_forward", "stage1_backward", "stage1_update"]


def test_an_op_with_no_torch_form_is_named_with_its_graph():
    from graphpar.errors import UnsupportedOpError
    from graphpar.export.torch_program import graph_function
    from graphpar.ir.graph import Graph, Role
    from graphpar.ir.types import TensorType

    graph = Graph("experts")
    a = graph.add_input("a", TensorType((4, 8), torch.float32), Role.INPUT)
    b = graph.add_input("b", TensorType((2, 8, 3), torch.float32), Role.PARAM)
    starts = graph.add_input("starts", TensorType((2,), torch.int64), Role.INPUT)
    ends = graph.add_input("ends", TensorType((2,), torch.int64), Role.INPUT)
    node = graph.create("grouped_mm", [a, b, starts, ends], module="moe.experts")
    graph.add_output(node.output)
    with pytest.raises(UnsupportedOpError, match=r"graph @experts: op grouped_mm in module "
                                                 r"moe.experts has no plain torch form"):
        graph_function(graph, "step")
