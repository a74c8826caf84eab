"""Attention written out as ops, found in a graph: q @ k^T, scaled, soft-capped, with masks and
biases (ALiBi) added, a softmax over the keys (sink columns beside them), then @ v.

Hugging Face's "eager" attention (BLOOM, MPT, GPT-Neo, Gemma-2 for its soft-capping, GPT-OSS
for its sinks) and SDPA's math fallback under `torch.export` (Falcon) reach the IR so, without
an `attention` op. Passes that need to know where attention is and whether it is causal
(`slice-tokens`) read these sites beside the `attention` ops; whether a site is causal comes
from `attention_mask.scores_reach`, which bounds what is added to the product.

A site is a `softmax` over the last dimension whose operand is computed from a `matmul` of
[..., Sq, Sk] by the ops attention puts between them (scale, soft-cap, masks, biases, views),
and whose result (less any sink columns) is the left operand of a `matmul`. Softmaxes that are
not attention (a router's over its experts, the loss's) do not match.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from graphpar.ir.graph import Graph, Node, Value

__all__ = ["EagerAttention", "eager_attention"]

# Ops between the product q @ k^T and the softmax: scaling, soft-capping (div, tanh, mul),
# masks and biases added or selected, casts and views.
_SCORE_PATH = {"add", "sub", "mul", "div", "where", "tanh", "neg", "convert", "reshape",
               "expand", "permute", "slice"}
# Ops between the softmax and the product with v: views, casts, the sink columns sliced off,
# and SDPA's math fallback zeroing rows whose every key is masked (`where`).
_PROBS_PATH = {"reshape", "expand", "convert", "slice", "where"}
_SEARCH = 24  # nodes visited looking for the product: attention puts a handful between


@dataclass(frozen=True)
class EagerAttention:
    """One attention written out as ops. `scores` is q @ k^T [..., Sq, Sk] (heads may be folded
    into the batch), `logits` what the softmax reads over the keys (before sink columns are
    joined and the max is subtracted), `query` the product's left operand [..., Sq, D]."""

    softmax: Node
    scores: Value
    logits: Value
    query: Value

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(batch, heads, queries, head size): `logits` [B, H, Sq, Sk]; with fewer dims the
        leading ones count as the batch and heads as 1."""
        dims = self.logits.type.shape
        lead = dims[:-2]
        batch, heads = (lead[0], math.prod(lead[1:])) if len(lead) >= 2 else (
            math.prod(lead), 1)
        return batch, heads, dims[-2], self.query.type.shape[-1]


def eager_attention(graph: Graph) -> list[EagerAttention]:
    """Every attention of `graph` written out as ops, in graph order."""
    sites = []
    for node in graph.nodes:
        if node.op == "softmax" and (site := _site(node)) is not None:
            sites.append(site)
    return sites


def _site(softmax: Node) -> EagerAttention | None:
    x = softmax.inputs[0]
    rank = len(x.type.shape)
    if rank < 3 or softmax.attrs.get("dim") not in (-1, rank - 1):
        return None
    logits = _logits(x)
    sq, sk = logits.type.shape[-2:]
    scores = _product(logits, sq, sk)
    if scores is None or not _feeds_values(softmax, sk):
        return None
    return EagerAttention(softmax, scores, logits, scores.producer.inputs[0])


def _logits(x: Value) -> Value:
    """Back from the softmax's operand past what does not change the attention over the keys:
    casts, subtracting the row max (GPT-OSS), and sink columns joined after the keys."""
    while (node := x.producer) is not None:
        rank = len(x.type.shape)
        if node.op == "convert":
            x = node.inputs[0]
        elif (node.op == "sub" and isinstance(node.inputs[1], Value)
              and node.inputs[1].producer is not None
              and node.inputs[1].producer.op == "amax"
              and node.inputs[1].producer.inputs[0] is node.inputs[0]):
            x = node.inputs[0]
        elif node.op == "cat" and node.attrs.get("dim") in (-1, rank - 1):
            x = node.inputs[0]  # the keys' logits; the rest are sinks (no key, no value)
        else:
            return x


def _product(logits: Value, sq: int, sk: int) -> Value | None:
    """The matmul [..., Sq, Sk] that `logits` are computed from along the score path."""
    stack, seen = [logits], set()
    while stack and len(seen) < _SEARCH:
        v = stack.pop()
        node = v.producer
        if node is None or node in seen:
            continue
        seen.add(node)
        if node.op == "matmul":
            if tuple(v.type.shape[-2:]) == (sq, sk) and all(
                    isinstance(x, Value) and not x.is_input for x in node.inputs[:2]):
                return v
            continue
        if node.op in _SCORE_PATH:
            # the score operand has the logits' shape (up to views); masks and biases broadcast
            stack.extend(x for x in reversed(node.input_values)
                         if math.prod(x.type.shape) >= math.prod(logits.type.shape[-2:]))
    return None


def _feeds_values(softmax: Node, sk: int) -> bool:
    """Whether the softmax's result (as views, casts, less sink columns) is the left operand of
    a matmul contracting over the Sk keys."""
    stack, seen = [softmax.output], set()
    while stack and len(seen) < _SEARCH:
        v = stack.pop()
        for user in v.users:
            if user in seen:
                continue
            seen.add(user)
            if user.op == "matmul" and user.inputs[0] is v and v.type.shape[-1] == sk:
                return True
            if user.op in _PROBS_PATH:
                stack.extend(user.outputs)
    return False
