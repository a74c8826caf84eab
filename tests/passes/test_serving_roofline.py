"""The serving plan of a GPT's decode step on 2 CPU ranks (docs/autoshard.md, "Compute
cost"): priced by FLOPs the ILP keeps the MLP whole; priced by the roofline, whose decode
matmuls are bound by reading their weights, it splits the MLP as Megatron does, and its plan
is no dearer than Megatron's."""

import dataclasses

import pytest
import torch

from graphpar.cost.cluster import get_cluster, mesh_for
from graphpar.cost.compute import Roofline
from graphpar.ir.cluster import COMPUTE_CLASSES
from graphpar.models import get_model
from graphpar.passes.autoshard.ilp import Problem
from graphpar.passes.autoshard.serving import solve_serving
from graphpar.serving.compile import compile_decoder

# Two gloo processes on loopback, as tools/bench/gloo_cluster.py measured them (350 us per
# ring step, 1.25 GB/s), and one thread's compute: 90 GFLOP/s, 8 GB/s, 5 us per op.
GLOO = dataclasses.replace(
    get_cluster("cpu"), intra_node_latency=3.5e-4, intra_node_bandwidth=1.25e9,
    peak_flops_fp32=90e9,
    compute={"fp32": {c: {"flops": 90e9, "bandwidth": 8e9, "overhead": 5e-6}
                      for c in COMPUTE_CLASSES}})


@pytest.fixture(scope="module")
def decode():
    """One GPT-125M-wide block (hidden 768, MLP 3072), small vocabulary: its decode program."""
    torch.manual_seed(0)
    module = get_model("gpt", "tiny", d_model=768, n_heads=12, n_layers=1,
                       vocab_size=512).module.eval()
    base, _, variants = compile_decoder(module).graphs["decode"]
    return base, [g for _, g in variants.values()]


def _mlp_split(plan, base) -> bool:
    (up,) = [v for v in base.inputs if v.name.endswith("mlp.up.weight")]
    return not plan.input_layout[up].is_replicated


@pytest.mark.slow  # five captures of the decoder: ~25 s on 2 shared cores
def test_decode_on_two_cpu_ranks_splits_the_mlp_under_the_roofline(decode):
    base, others = decode
    mesh = mesh_for("2", GLOO)
    flops_only = Roofline.flops_only(GLOO.peak_flops("fp32"))
    roofline = Roofline.of(GLOO, "fp32")
    by_flops = solve_serving(base, others, mesh, "auto", roofline=flops_only)
    by_roofline = solve_serving(base, others, mesh, "auto", roofline=roofline)
    megatron = solve_serving(base, others, mesh, "megatron", roofline=roofline)
    assert not _mlp_split(by_flops, base)  # 19 MB of MLP weights read whole on each rank
    assert _mlp_split(by_roofline, base) and _mlp_split(megatron, base)
    priced = Problem(base, mesh, roofline)
    assert by_roofline.step_seconds < priced.recost(by_flops).step_seconds
    assert by_roofline.step_seconds <= priced.recost(megatron).step_seconds + 1e-12
