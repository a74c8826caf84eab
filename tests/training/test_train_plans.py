"""graphpar train --plan: a hand plan (here DDP's) trains to the losses of auto-shard's plan and
of eager PyTorch on the same batches; a plan that does not exist or does not apply is one
line."""

import json

import pytest
from train_testutil import MODEL, corpus, eager_gpt_tiny

from graphpar.cli.main import main


def test_ddp_plan_trains_as_auto_and_as_eager(tmp_path, capsys):
    data = corpus(tmp_path)
    records = {}
    for plan in ("ddp", "auto"):
        log = tmp_path / f"{plan}.jsonl"
        assert main(["train", "--example", "gpt:tiny", "--data", data, "--mesh", "2",
                     "--steps", "3", "--optimizer", "sgd", "--lr", "0.1", "--plan", plan,
                     "--no-progress", "--log", str(log)]) == 0
        out = capsys.readouterr().out
        assert f"trained gpt_tiny on mesh 2 with plan {plan}: steps 1..3" in out
        assert f"on mesh 2, plan {plan}</h1>" in log.with_suffix(".html").read_text()
        records[plan] = [json.loads(line) for line in log.read_text().splitlines()]
        assert [r["plan"] for r in records[plan]] == [plan] * 3
    eager = eager_gpt_tiny(data, 3, 0.1)
    ddp, auto = ([r["loss"] for r in records[p]] for p in ("ddp", "auto"))
    assert ddp == pytest.approx(eager, rel=1e-4)
    assert ddp == pytest.approx(auto, rel=1e-4)
    assert eager[-1] < eager[0]  # it trains


TWO_LINEARS = '''
import torch


def build():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 4)), (torch.randn(4, 8),)


def loss(output, target):
    return torch.nn.functional.mse_loss(output, target)


def targets():
    return (torch.randn(4, 4),)


def batch(step):
    g = torch.Generator().manual_seed(step)
    return (torch.randn(4, 8, generator=g),), (torch.randn(4, 4, generator=g),)
'''


@pytest.mark.parametrize("args, code, message", [
    (("--plan", "dpp"), 2, "argument --plan: invalid choice: 'dpp' (choose from 'auto', "
                           "'data', 'ddp', 'zero', 'zero-3', 'megatron', 'data+megatron')"),
    (("--plan", "ddp", "--pipeline", "2"), 2, "--plan ddp with --pipeline: a pipelined plan's "
                                              "stages are auto-sharded"),
    (("--plan", "ddp", "--mesh", "1"), 1, "--plan ddp for tiny_causal_lm on mesh 1: mesh 1 has "
                                          "one device; choose another --plan"),
])
def test_a_plan_that_cannot_run_is_one_line(args, code, message, capsys):
    assert main(["train", str(MODEL), "--no-progress", "--mesh", "2", "--steps", "1",
                 *args]) == code
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_megatron_on_a_model_without_its_layer_names(tmp_path, capsys):
    model = tmp_path / "two_linears.py"
    model.write_text(TWO_LINEARS)
    assert main(["train", str(model), "--no-progress", "--mesh", "2", "--steps", "1",
                 "--plan", "megatron"]) == 1
    err = capsys.readouterr().err
    assert ("--plan megatron for two_linears on mesh 2: no row-parallel linears" in err
            and len(err.strip().splitlines()) == 1)
