"""IR graphs for the viz tests, built with the IR API: a tiny MLP, a GPT-shaped training step of
any depth (forward, backward and optimizer, with module paths), and a sharded two-stage program."""

from __future__ import annotations

import torch

from graphpar.capture.optim import SGD, append_optimizer
from graphpar.ir.graph import Graph, Node, OutputRole, Program, Role, Value
from graphpar.ir.layout import Layout
from graphpar.ir.registry import OpDef, OpKind, all_ops, register
from graphpar.ir.types import TensorType

F32 = torch.float32
COLLECTIVE_OP = "viz_test_all_reduce"  # registered here only: the core op set has no collective yet


def mlp_graph() -> Graph:
    g = Graph("tiny_mlp")
    x = g.add_input("x", TensorType((4, 16), F32))
    w1 = g.add_input("fc1.weight", TensorType((32, 16), F32), Role.PARAM)
    b1 = g.add_input("fc1.bias", TensorType((32,), F32), Role.PARAM)
    w2 = g.add_input("fc2.weight", TensorType((8, 32), F32), Role.PARAM)
    h = g.create("linear", [x, w1, b1], module="fc1", loc="mlp.py:12").output
    h = g.create("relu", [h], module="act", loc="mlp.py:13").output
    y = g.create("linear", [h, w2, None], module="fc2", loc="mlp.py:14").output
    s = g.create("sum", [y], {"dims": (1,), "keepdim": False}, loc="mlp.py:15").output
    g.add_output(y)
    g.add_output(s, OutputRole.LOSS)
    return g


def gpt_training_graph(layers: int = 2, dim: int = 64, heads: int = 4, seq: int = 16,
                       batch: int = 2, vocab: int = 128) -> Graph:
    """A GPT-shaped training step: real forward ops, a synthetic backward (right shapes and
    module paths, not the true gradient formulas) and SGD-with-momentum updates."""
    g = Graph(f"gpt{layers}_train")
    t = lambda *shape: TensorType(shape, F32)  # noqa: E731
    params: dict[str, Value] = {}

    def param(name: str, *shape: int) -> Value:
        params[name] = g.add_input(name, t(*shape), Role.PARAM)
        return params[name]

    idx = g.add_input("idx", TensorType((batch, seq), torch.int64))
    target = g.add_input("target", TensorType((batch, seq, vocab), F32))
    tok = param("tok_emb.weight", vocab, dim)
    h = g.create("embedding", [tok, idx], module="tok_emb", loc="gpt.py:87").output
    for i in range(layers):
        p = f"blocks.{i}"
        ln = lambda x, name, line: g.create(  # noqa: E731
            "layer_norm", [x, param(f"{name}.weight", dim), param(f"{name}.bias", dim)],
            {"shape": (dim,), "eps": 1e-5}, module=name, loc=f"layers.py:{line}").output
        a = ln(h, f"{p}.ln1", 53)
        qkv = g.create("linear", [a, param(f"{p}.attn.qkv.weight", 3 * dim, dim),
                                  param(f"{p}.attn.qkv.bias", 3 * dim)],
                       module=f"{p}.attn.qkv", loc="layers.py:22").output
        parts = []
        for j in range(3):
            s = g.create("slice", [qkv], {"dim": 2, "start": j * dim, "end": (j + 1) * dim,
                                          "step": 1}, module=f"{p}.attn", loc="layers.py:22")
            r = g.create("reshape", [s.output], {"shape": (batch, seq, heads, dim // heads)},
                         module=f"{p}.attn", loc="layers.py:24")
            parts.append(g.create("permute", [r.output], {"dims": (0, 2, 1, 3)},
                                  module=f"{p}.attn", loc="layers.py:24").output)
        o = g.create("attention", parts + [None], {"causal": True, "scale": None, "gqa": False},
                     module=f"{p}.attn", loc="layers.py:25").output
        o = g.create("permute", [o], {"dims": (0, 2, 1, 3)}, module=f"{p}.attn").output
        o = g.create("reshape", [o], {"shape": (batch, seq, dim)}, module=f"{p}.attn").output
        o = g.create("linear", [o, param(f"{p}.attn.proj.weight", dim, dim),
                                param(f"{p}.attn.proj.bias", dim)],
                     module=f"{p}.attn.proj", loc="layers.py:26").output
        h = g.create("add", [h, o], module=p, loc="layers.py:53").output
        m = ln(h, f"{p}.ln2", 54)
        m = g.create("linear", [m, param(f"{p}.mlp.up.weight", 4 * dim, dim),
                                param(f"{p}.mlp.up.bias", 4 * dim)],
                     module=f"{p}.mlp.up", loc="layers.py:39").output
        m = g.create("gelu", [m], module=f"{p}.mlp.act", loc="layers.py:39").output
        m = g.create("linear", [m, param(f"{p}.mlp.down.weight", dim, 4 * dim),
                                param(f"{p}.mlp.down.bias", dim)],
                     module=f"{p}.mlp.down", loc="layers.py:39").output
        h = g.create("add", [h, m], module=p, loc="layers.py:54").output
    h = g.create("layer_norm", [h, param("ln_f.weight", dim), param("ln_f.bias", dim)],
                 {"shape": (dim,), "eps": 1e-5}, module="ln_f", loc="gpt.py:90").output
    logits = g.create("linear", [h, param("lm_head.weight", vocab, dim), None],
                      module="lm_head", loc="gpt.py:91").output
    diff = g.create("sub", [logits, target], loc="train.py:8").output
    loss = g.create("mean", [g.create("mul", [diff, diff]).output],
                    {"dims": None, "keepdim": False}, loc="train.py:8").output
    g.add_output(loss, OutputRole.LOSS)

    # Backward: walk the forward nodes in reverse, giving every operand value a gradient of its
    # type; a second use of a value accumulates with `add`.
    grads: dict[Value, Value] = {}
    forward = list(g.nodes)
    seed = g.create("full", [], {"shape": (), "value": 1.0, "dtype": "f32"}).output
    grads[loss] = seed
    for node in reversed(forward):
        gout = grads.get(node.outputs[0])
        if gout is None:
            continue
        op = "matmul" if node.op == "linear" else "mul"
        for v in node.input_values:
            if v.type.dtype == torch.int64:  # token ids have no gradient
                continue
            new = g.add_node(Node(op, [gout, v], [v.type], module=node.module, loc=node.loc))
            value = new.output
            if v in grads:
                value = g.add_node(Node("add", [grads[v], value], [v.type],
                                        module=node.module, loc=node.loc)).output
            grads[v] = value
    for name, p in params.items():
        g.add_output(grads[p], OutputRole.GRAD, name)
    append_optimizer(g, SGD(momentum=0.9), {})
    return g


def interleaved_graph() -> Graph:
    """Modules that take turns (a, b, a, b): their groups form a cycle the layout must break;
    plus a two-result node and an unused input."""
    g = Graph("interleaved")
    x = g.add_input("x", TensorType((4, 8), F32))
    g.add_input("unused", TensorType((2,), F32), Role.BUFFER)
    h = x
    for i in range(6):
        module = "a" if i % 2 == 0 else "b"
        h = g.create("relu" if i % 3 else "tanh", [h], module=module, loc=f"m.py:{i}").output
        h = g.create("add", [h, x], module=module).output
    top = g.create("topk", [h], {"k": 2, "dim": 1}, module="head")
    g.add_output(top.outputs[0])
    g.add_output(top.outputs[1], OutputRole.OUTPUT)
    return g


def collective_op() -> str:
    """A test-only COLLECTIVE op, until the core op set has real ones."""
    if COLLECTIVE_OP not in all_ops():
        register(OpDef(COLLECTIVE_OP, OpKind.COLLECTIVE, lambda x, mesh_axis, op: x.clone(),
                       doc="test-only all-reduce"))
    return COLLECTIVE_OP


def sharded_program() -> Program:
    """Two pipeline stages with layouts and an all-reduce: what later passes will produce."""
    op = collective_op()
    stages = []
    for stage in range(2):
        g = Graph(f"stage{stage}", attrs={"stage": stage, "device": f"gpu{stage}"})
        x = g.add_input("x", TensorType((8, 64), F32))
        x.layout = Layout.parse("{S(0),R}")
        w = g.add_input(f"layers.{stage}.weight", TensorType((64, 64), F32), Role.PARAM)
        w.layout = Layout.parse("{R,S(0)}")
        n = g.create("linear", [x, w, None], module=f"layers.{stage}", loc="model.py:5")
        n.output.layout = Layout.parse("{S(0),P}")
        r = g.create(op, [n.output], {"mesh_axis": 1, "op": "sum"}, module=f"layers.{stage}")
        r.output.layout = Layout.parse("{S(0),R}")
        a = g.create("relu", [r.output], module=f"layers.{stage}.act", loc="model.py:6")
        a.output.layout = Layout.parse("{S(0),R}")
        g.add_output(a.output)
        stages.append(g)
    return Program.of(stages)
