"""Run by torchrun on 4 gloo ranks: a pipelined plan.json built into stages and a schedule with
graphpar.export.apply_pipeline, one step of torch.distributed.pipelining against eager
PyTorch; each stage's first rank writes what it found as JSON (argv: plan.json, the model
file, a results folder)."""

import copy
import importlib.util
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from graphpar.export import apply_pipeline

plan_file, model_file, results = sys.argv[1:4]
dist.init_process_group("gloo")
sys.path.insert(0, str(Path(model_file).parent))
spec = importlib.util.spec_from_file_location("model", model_file)
model = importlib.util.module_from_spec(spec)
spec.loader.exec_module(model)
module, (x,) = model.build()
(target,) = model.targets()
plan = json.loads(Path(plan_file).read_text())
microbatches = plan["pipeline"]["microbatches"]
eager = copy.deepcopy(module)
stage, schedule = apply_pipeline(module, plan, (x.chunk(microbatches)[0],), loss_fn=model.loss)
losses = []
if stage.is_first:
    schedule.step(x)
elif stage.is_last:
    schedule.step(target=target, losses=losses)
else:
    schedule.step()
eager_loss = model.loss(eager(x), target)
eager_loss.backward()
grads = dict(eager.named_parameters())
errors = {}
for name, p in stage.submod.named_parameters():
    # the schedule divides the microbatches' summed gradients by their number (scale_grads):
    # each microbatch's loss is a mean over its rows, so that is the whole batch's gradient
    errors[f"grad {name}"] = (p.grad - grads[name].grad).abs().max().item()
if losses:
    errors["loss"] = (torch.stack(losses).mean() - eager_loss.detach()).abs().item()
if plan["pipeline"]["stages"][stage.stage_index]["ranks"][0] == dist.get_rank():
    Path(results, f"stage{stage.stage_index}.json").write_text(json.dumps(
        {"errors": errors, "parameters": sorted(n for n, _ in stage.submod.named_parameters())}))
dist.barrier()
dist.destroy_process_group()
