"""Hugging Face causal LMs trained token-pipelined (TeraPipe) on 2 gloo ranks, family by
family, equal to eager PyTorch + torch.optim. Nothing in these models says is_causal=True:
Hugging Face builds each causal mask as a tensor, and `slice-tokens` reads causality (and a
sliding window) off it (`graphpar.passes.attention_mask`), for `attention` ops and for attention
written out as ops (`graphpar.passes.eager_attention`: BLOOM, MPT, GPT-Neo, Falcon, Gemma-2,
GPT-OSS). Each slice's step drives the model through the decoder adapter, or the model's own
cache, with explicit keys and values (`graphpar.capture.token_slice`).

Two families run in the default suite (DEFAULT), the rest are slow-marked; NOT_SLICED says
which do not token-pipeline yet and why."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F
from test_hf_families import FAMILIES, rows, token_ids

from graphpar.capture import Adam
from graphpar.compiler.pipelined import compile_pipeline
from graphpar.compiler.token_pipelined import token_pipeline
from graphpar.errors import PassError
from graphpar.passes import PassContext
from graphpar.passes.manager import PassManager, parse_pipeline
from graphpar.passes.pipeline.token_slicing import TokenSlicing

# Mistral: a sliding window of 6 tokens over the 16 (set below), so the later slices read past
# it. BLOOM: attention written out as ops (ALiBi, an additive mask), found by
# `passes.eager_attention`, each slice driven with the model's own cache. Qwen2 (grouped-query
# attention, biases on q, k, v) is slow-marked with the rest to keep the default suite's time;
# tests/passes/test_attention_mask.py reads its kind of mask, test_eager_attention.py the
# written-out kinds (soft-capping, sinks, a mask in a buffer).
DEFAULT = {"mistral", "bloom"}
WINDOWED = {"mistral": dict(sliding_window=6)}
# Families that do not token-pipeline yet, and why (each refused with a clear message).
NOT_SLICED: dict[str, str] = {}
BLOCK = re.compile(r"\.(?:layers|h|blocks)\.(\d+)\.")


def loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def slice_tokens(graph, constants=None) -> TokenSlicing:
    """3 equal slices by the slice-tokens pass, which first checks that attention is causal
    (`constants`: the model's buffers, as the compiler hands them to passes)."""
    ctx = PassContext({"constants": constants or {}})
    PassManager(parse_pipeline("slice-tokens{stages=1,slices=3,cluster=cpu}")).run(graph, ctx)
    return ctx.result(TokenSlicing)


def layers_to_stages(graph, stages):
    """Forward nodes to 2 stages by decoder layer: a layer, its keys and values on one."""
    from graphpar.passes.pipeline.partition import forward_backward_optimizer

    forward, _, _ = forward_backward_optimizer(graph)
    found = [int(m.group(1)) for n in forward if (m := BLOCK.search(f".{n.module or ''}."))]
    layers = max(found) + 1
    assign, stage = {}, 0
    for node in graph.nodes:
        if node in forward:
            if m := BLOCK.search(f".{node.module or ''}."):
                stage = max(stage, int(m.group(1)) * stages // layers)
            assign[node] = stage
    return assign


def family(name):
    """The family's tiny model with at least 2 layers (one per stage)."""
    fam = FAMILIES[name]
    kwargs = dict(fam.kwargs, **WINDOWED.get(name, {}))
    for key in ("num_hidden_layers", "n_layer", "n_layers"):
        if kwargs.get(key) == 1:
            kwargs[key] = 2
    return dataclasses.replace(fam, kwargs=kwargs).build()


@pytest.mark.parametrize("name", rows(FAMILIES, DEFAULT, skip=NOT_SLICED))
def test_family_token_pipeline_on_two_ranks_equals_eager(name):
    module = family(name)
    ids = token_ids()
    target = torch.roll(ids, -1, 1)
    pipe = compile_pipeline(module, (ids,), loss_fn=loss, targets=(target,), optimizer=Adam(),
                            stages=2, microbatches=2, schedule="1f1b",
                            forward_stage=layers_to_stages, keep_grads=True)
    # slice-tokens on the step as captured: causal from the masks alone
    assert all(not n.attrs["causal"] for n in pipe.captured.graph.find("attention_with_lse"))
    slices = slice_tokens(pipe.captured.graph.copy(), pipe.captured.state).slices
    assert slices == (6, 5, 5)
    tokens = token_pipeline(pipe, list(slices), "1f1b")
    check = tokens.check(processes=True)
    assert check.errors["loss"].max_abs_error < 1e-5
    assert check.within_tolerance, "\n".join(check.lines())
    run = tokens.last_run
    assert {s.rank for s in run.spans} == {0, 1}
    assert sum(run.bytes_sent) == tokens.predicted_bytes > 0


def test_a_bidirectional_hf_encoder_is_refused_with_its_reason():
    """BERT's mask (built from a padding mask) lets every token see every other: slice-tokens
    names the node and a query that sees a later key."""
    transformers = pytest.importorskip("transformers")
    from graphpar.capture import capture_training

    torch.manual_seed(0)
    config = transformers.BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=64, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    config._attn_implementation = "sdpa"
    bert = transformers.BertForMaskedLM(config).eval()
    ids = token_ids() % 64
    captured = capture_training(lambda_module(bert), [ids], loss, [ids])
    with pytest.raises(PassError, match=r"node \d+ \(attention_with_lse\) .* is not causal "
                                        r"\(query 0 may attend to the later key 1\)"):
        slice_tokens(captured.graph)


def lambda_module(model):
    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids):
            return self.model(input_ids=input_ids, attention_mask=input_ids != 0).logits
    return Logits()
