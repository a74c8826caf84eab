"""Run by torchrun on 4 gloo ranks: a plan.json put on the model with apply_plan on a (2, 2)
DeviceMesh, one forward and backward against eager PyTorch; rank 0 writes what it found as
JSON (argv: plan.json, the model file, the result file)."""

import copy
import importlib.util
import json
import sys
from pathlib import Path

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.nn.attention import SDPBackend, sdpa_kernel

from graphpar.export import apply_plan, count_collectives

plan, model_file, result_file = sys.argv[1:4]
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2, 2))
sys.path.insert(0, str(Path(model_file).parent))  # hf_gpt2 imports its sibling hf_opt
spec = importlib.util.spec_from_file_location("model", model_file)
model = importlib.util.module_from_spec(spec)
spec.loader.exec_module(model)
module, inputs = model.build()
targets = model.targets()
eager = copy.deepcopy(module)
apply_plan(module, plan, mesh)
found = {}


def step():
    out = module(*inputs)
    found["output"] = out.detach()
    loss = model.loss(out, *targets)
    found["loss"] = loss.detach()
    try:
        loss.backward()
    except RuntimeError as exc:  # reported, for the test to judge
        found["backward_error"] = str(exc).splitlines()[0]


# DTensor has no sharding rule for the CPU flash-attention kernel SDPA picks on CPU ranks: the
# math backend's matmuls and softmax have rules. Plain tensors used outside any module (a
# causal mask) are taken as replicated; apply_plan makes those given to modules DTensors.
with sdpa_kernel(SDPBackend.MATH), implicit_replication():
    counts = count_collectives(step)
eager_out = eager(*inputs)
eager_loss = model.loss(eager_out, *targets)
eager_loss.backward()
errors = {"output": (found["output"] - eager_out.detach()).abs().max().item(),
          "loss": (found["loss"] - eager_loss.detach()).abs().max().item()}
sharded = []
for (name, p), (_, q) in zip(module.named_parameters(), eager.named_parameters()):
    assert isinstance(p, DTensor), name
    if any(pl.is_shard() for pl in p.placements):
        sharded.append(name)
    if "backward_error" not in found:
        errors[f"grad {name}"] = (p.grad.full_tensor() - q.grad).abs().max().item()
if dist.get_rank() == 0:
    with open(result_file, "w") as f:
        json.dump({"errors": errors, "sharded": sharded, "counts": counts,
                   "backward_error": found.get("backward_error")}, f)
dist.barrier()
dist.destroy_process_group()
