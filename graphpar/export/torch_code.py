"""Each IR op as one line of plain torch code: the expression a generated program runs.

`expression(node, args)` is the torch call that computes `node` from its operands' Python
expressions `args` (names or literals), as the op's reference in `graphpar.ir.ops` computes it.
The communicating ops become calls of the helpers every generated program defines
(`graphpar.export.torch_program`): `all_reduce(x, (1,), 'sum')`, `send(x, 3, 0)`, ...
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from graphpar.errors import UnsupportedOpError
from graphpar.ir.graph import Node
from graphpar.ir.registry import dtype as torch_dtype

__all__ = ["TUPLE_OPS", "expression", "literal"]

F = "torch.nn.functional"
A = "torch.ops.aten"


def literal(value: Any) -> str:
    """A Python literal for an attribute or inline scalar (dtypes by their torch name)."""
    if isinstance(value, float):
        if math.isnan(value):
            return "float('nan')"
        if math.isinf(value):
            return "float('inf')" if value > 0 else "(-float('inf'))"
        return f"({value!r})" if value < 0 else repr(value)
    if isinstance(value, int) and not isinstance(value, bool) and value < 0:
        return f"({value!r})"
    if isinstance(value, (tuple, list)):
        items = ", ".join(literal(v) for v in value)
        return f"[{items}]"
    return repr(value)


def _dtype(name: str | None) -> str:
    return "None" if name is None else str(torch_dtype(name))


Emit = Callable[[Node, list[str], dict[str, Any]], str]
_TABLE: dict[str, Emit] = {}
TUPLE_OPS: set[str] = set()
"""Ops whose expression returns a tuple even when the node has one result (unpacked)."""


def _on(*names: str, returns_tuple: bool = False):
    def register(fn: Emit) -> Emit:
        for name in names:
            _TABLE[name] = fn
            if returns_tuple:
                TUPLE_OPS.add(name)
        return fn
    return register


def expression(node: Node, args: list[str]) -> str:
    """The torch expression of `node` on operand expressions `args`."""
    emit = _TABLE.get(node.op)
    if emit is None:
        where = f" in module {node.module}" if node.module else ""
        raise UnsupportedOpError(
            f"op {node.op}{where} has no plain torch form in graphpar export: it runs only in "
            "graphpar's own runtime (serving's paged ops, MoE's grouped_mm)")
    return emit(node, args, dict(node.attrs))


# --- elementwise ------------------------------------------------------------------------------

_UNARY = ("neg", "abs", "exp", "log", "log1p", "expm1", "sqrt", "rsqrt", "sin", "cos", "tanh",
          "sigmoid", "relu", "erf", "reciprocal", "sign", "floor", "ceil", "trunc",
          "logical_not", "bitwise_not", "isnan")
for _name in _UNARY:
    _TABLE[_name] = (lambda name: lambda n, a, k: f"torch.{name}({a[0]})")(_name)
_on("silu")(lambda n, a, k: f"{F}.silu({a[0]})")
_on("gelu")(lambda n, a, k: f"{F}.gelu({a[0]}, approximate={k.get('approximate', 'none')!r})")

_OPERATORS = {"add": "+", "sub": "-", "mul": "*", "pow": "**", "eq": "==", "ne": "!=",
              "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "bitwise_and": "&",
              "bitwise_or": "|", "bitwise_xor": "^", "remainder": "%"}
for _name, _symbol in _OPERATORS.items():
    _TABLE[_name] = (lambda s: lambda n, a, k: f"{a[0]} {s} {a[1]}")(_symbol)
for _name in ("maximum", "minimum", "logical_and", "logical_or"):
    _TABLE[_name] = (lambda name: lambda n, a, k: f"torch.{name}({a[0]}, {a[1]})")(_name)


@_on("div")
def _div(n, a, k):
    mode = k.get("rounding_mode")
    if mode is None:
        return f"{a[0]} / {a[1]}"
    first = a[0] if hasattr(n.inputs[0], "type") else f"torch.full_like({a[1]}, {a[0]})"
    return f"torch.div({first}, {a[1]}, rounding_mode={mode!r})"


_on("where")(lambda n, a, k: f"torch.where({a[0]}, {a[1]}, {a[2]})")
_on("clamp")(lambda n, a, k: f"torch.clamp({a[0]}, {literal(k.get('min'))}, "
                             f"{literal(k.get('max'))})")
_on("convert")(lambda n, a, k: f"{a[0]}.to(dtype={_dtype(k['dtype'])})")
_on("gelu_backward")(lambda n, a, k: f"{A}.gelu_backward({a[0]}, {a[1]}, approximate="
                                     f"{k.get('approximate', 'none')!r})")
for _name in ("silu_backward", "sigmoid_backward", "tanh_backward"):
    _TABLE[_name] = (lambda name: lambda n, a, k: f"{A}.{name}({a[0]}, {a[1]})")(_name)
_on("threshold_backward")(lambda n, a, k: f"{A}.threshold_backward({a[0]}, {a[1]}, "
                                          f"{literal(k['threshold'])})")


# --- reductions -------------------------------------------------------------------------------

def _dims(n: Node, dims) -> str:
    return literal(list(dims) if dims is not None else list(range(n.inputs[0].type.rank)))


for _name in ("sum", "mean", "amax", "amin", "any", "all"):
    def _reduction(n, a, k, name=_name):
        dtype = f", dtype={_dtype(k['dtype'])}" if k.get("dtype") is not None else ""
        return f"torch.{name}({a[0]}, {_dims(n, k.get('dims'))}, {k.get('keepdim', False)}" \
               f"{dtype})"
    _TABLE[_name] = _reduction
_on("prod")(lambda n, a, k: f"torch.prod({a[0]}, {k['dim']}, {k.get('keepdim', False)})")
_on("var")(lambda n, a, k: f"torch.var({a[0]}, {literal(k['dims'])}, correction="
                           f"{k.get('correction', 1)}, keepdim={k.get('keepdim', False)})")
_on("argmax")(lambda n, a, k: f"torch.argmax({a[0]}, {k['dim']}, {k.get('keepdim', False)})")
_on("argmin")(lambda n, a, k: f"torch.argmin({a[0]}, {k['dim']}, {k.get('keepdim', False)})")
_on("cumsum")(lambda n, a, k: f"torch.cumsum({a[0]}, {k['dim']}, "
                              f"dtype={_dtype(k.get('dtype'))})")
_on("topk", returns_tuple=True)(
    lambda n, a, k: f"tuple(torch.topk({a[0]}, {k['k']}, {k.get('dim', -1)}, "
                    f"{k.get('largest', True)}, {k.get('sorted', True)}))")
_on("sort", returns_tuple=True)(
    lambda n, a, k: f"tuple(torch.sort({a[0]}, dim={k.get('dim', -1)}, "
                    f"descending={k.get('descending', False)}))")


# --- matmul, shapes, indexing -----------------------------------------------------------------

_on("matmul")(lambda n, a, k: f"torch.matmul({a[0]}, {a[1]})")
_on("linear")(lambda n, a, k: f"{F}.linear({', '.join(a)})")
_on("reshape")(lambda n, a, k: f"{a[0]}.reshape({literal(k['shape'])})")
_on("permute")(lambda n, a, k: f"{a[0]}.permute({literal(k['dims'])})")
_on("expand")(lambda n, a, k: f"{a[0]}.expand({literal(k['shape'])})")
_on("slice")(lambda n, a, k: f"{A}.slice.Tensor({a[0]}, {k['dim']}, {literal(k['start'])}, "
                             f"{literal(k['end'])}, {k.get('step', 1)})")
_on("select")(lambda n, a, k: f"{a[0]}.select({k['dim']}, {literal(k['index'])})")
_on("slice_scatter")(lambda n, a, k: f"torch.slice_scatter({a[0]}, {a[1]}, {k['dim']}, "
                                     f"{literal(k['start'])}, {literal(k['end'])}, "
                                     f"{k.get('step', 1)})")
_on("select_scatter")(lambda n, a, k: f"torch.select_scatter({a[0]}, {a[1]}, {k['dim']}, "
                                      f"{literal(k['index'])})")
_on("cat")(lambda n, a, k: f"torch.cat([{', '.join(a)}], {k['dim']})")
_on("pad")(lambda n, a, k: f"{F}.pad({a[0]}, {literal(k['pad'])}, "
                           f"value={literal(k.get('value', 0.0))})")
_on("flip")(lambda n, a, k: f"torch.flip({a[0]}, {literal(k['dims'])})")
_on("tril")(lambda n, a, k: f"torch.tril({a[0]}, {k.get('diagonal', 0)})")
_on("triu")(lambda n, a, k: f"torch.triu({a[0]}, {k.get('diagonal', 0)})")
_on("repeat")(lambda n, a, k: f"{a[0]}.repeat({literal(k['repeats'])})")
_on("clone")(lambda n, a, k: f"{a[0]}.clone()")
_on("reshard")(lambda n, a, k: a[0])


def _index_list(indices: list[str], dims) -> str:
    full = ["None"] * (max(dims) + 1)
    for d, i in zip(dims, indices):
        full[d] = i
    return f"[{', '.join(full)}]"


_on("index")(lambda n, a, k: f"{A}.index.Tensor({a[0]}, {_index_list(a[1:], k['dims'])})")
_on("index_put")(lambda n, a, k: f"{A}.index_put({a[0]}, {_index_list(a[2:], k['dims'])}, "
                                 f"{a[1]}, {k.get('accumulate', False)})")
_on("index_select")(lambda n, a, k: f"torch.index_select({a[0]}, {k['dim']}, {a[1]})")
_on("gather")(lambda n, a, k: f"torch.gather({a[0]}, {k['dim']}, {a[1]})")
_on("scatter_add")(lambda n, a, k: f"torch.scatter_add({a[0]}, {k['dim']}, {a[1]}, {a[2]})")
_on("scatter")(lambda n, a, k: f"torch.scatter({a[0]}, {k['dim']}, {a[1]}, {a[2]})")
_on("index_add")(lambda n, a, k: f"torch.index_add({a[0]}, {k['dim']}, {a[1]}, {a[2]})")
_on("histc")(lambda n, a, k: f"torch.histc({a[0]}, {k['bins']}, {literal(k['min'])}, "
                             f"{literal(k['max'])})")


# --- creation: on the program's device --------------------------------------------------------

_on("full")(lambda n, a, k: f"torch.full({literal(k['shape'])}, {literal(k['value'])}, "
                            f"dtype={_dtype(k['dtype'])}, device=DEVICE)")
_on("arange")(lambda n, a, k: f"torch.arange({literal(k['start'])}, {literal(k['end'])}, "
                              f"{literal(k['step'])}, dtype={_dtype(k['dtype'])}, "
                              "device=DEVICE)")


# --- composites -------------------------------------------------------------------------------

def _opt(a: list[str], i: int) -> str:
    return a[i] if len(a) > i else "None"


_on("attention")(lambda n, a, k: f"{F}.scaled_dot_product_attention({a[0]}, {a[1]}, {a[2]}, "
                                 f"attn_mask={_opt(a, 3)}, is_causal={k.get('causal', False)}, "
                                 f"scale={literal(k.get('scale'))}, "
                                 f"enable_gqa={k.get('gqa', False)})")
# training graphs keep the log-sum-exp for the backward: the CPU flash-attention kernel's form
_on("attention_with_lse", returns_tuple=True)(
    lambda n, a, k: f"tuple({A}._scaled_dot_product_flash_attention_for_cpu({a[0]}, {a[1]}, "
                    f"{a[2]}, 0.0, {k.get('causal', False)}, attn_mask={_opt(a, 3)}, "
                    f"scale={literal(k.get('scale'))}))")
_on("attention_backward", returns_tuple=True)(
    lambda n, a, k: f"tuple({A}._scaled_dot_product_flash_attention_for_cpu_backward("
                    f"{', '.join(a[:6])}, 0.0, {k.get('causal', False)}, "
                    f"attn_mask={_opt(a, 6)}, scale={literal(k.get('scale'))}))")
_on("layer_norm")(lambda n, a, k: f"{F}.layer_norm({a[0]}, {literal(k.get('shape'))}, "
                                  f"{_opt(a, 1)}, {_opt(a, 2)}, {literal(k.get('eps', 1e-5))})")
_on("layer_norm_with_stats", returns_tuple=True)(
    lambda n, a, k: f"tuple({A}.native_layer_norm({a[0]}, {literal(k.get('shape'))}, "
                    f"{_opt(a, 1)}, {_opt(a, 2)}, {literal(k.get('eps', 1e-5))}))")


def _not_none(call: str) -> str:
    return f"tuple(r for r in {call} if r is not None)"


_on("layer_norm_backward", returns_tuple=True)(
    lambda n, a, k: _not_none(f"{A}.native_layer_norm_backward({a[0]}, {a[1]}, "
                              f"{literal(k.get('shape'))}, {a[2]}, {a[3]}, {_opt(a, 4)}, "
                              f"{_opt(a, 5)}, {literal(k.get('mask', (True, True, True)))})"))
_on("rms_norm")(lambda n, a, k: f"{F}.rms_norm({a[0]}, {literal(k.get('shape'))}, {_opt(a, 1)}, "
                                f"{literal(k.get('eps'))})")
_on("softmax")(lambda n, a, k: f"torch.softmax({a[0]}, {k['dim']})")
_on("log_softmax")(lambda n, a, k: f"torch.log_softmax({a[0]}, {k['dim']})")
_on("softmax_backward")(lambda n, a, k: f"{A}._softmax_backward_data({a[0]}, {a[1]}, {k['dim']}, "
                                        f"{a[1]}.dtype)")
_on("log_softmax_backward")(lambda n, a, k: f"{A}._log_softmax_backward_data({a[0]}, {a[1]}, "
                                            f"{k['dim']}, {a[1]}.dtype)")
_on("embedding")(lambda n, a, k: f"{F}.embedding({a[1]}, {a[0]})")
_on("embedding_backward")(lambda n, a, k: f"{A}.embedding_dense_backward({a[0]}, {a[1]}, "
                                          f"{k['num_weights']}, {k.get('padding_idx', -1)}, "
                                          "False)")
_on("conv2d")(lambda n, a, k: f"{F}.conv2d({a[0]}, {a[1]}, {_opt(a, 2)}, "
                              f"{literal(k.get('stride', (1, 1)))}, "
                              f"{literal(k.get('padding', (0, 0)))}, "
                              f"{literal(k.get('dilation', (1, 1)))}, {k.get('groups', 1)})")
_on("conv2d_backward", returns_tuple=True)(
    lambda n, a, k: _not_none(
        f"{A}.convolution_backward({a[0]}, {a[1]}, {a[2]}, "
        f"{'[' + a[2] + '.shape[0]]' if k.get('bias', True) else 'None'}, "
        f"{literal(k.get('stride', (1, 1)))}, {literal(k.get('padding', (0, 0)))}, "
        f"{literal(k.get('dilation', (1, 1)))}, False, [0, 0], {k.get('groups', 1)}, "
        f"{literal(k.get('mask', (True, True, True)))})"))
_on("max_pool2d", returns_tuple=True)(
    lambda n, a, k: f"tuple({A}.max_pool2d_with_indices({a[0]}, {literal(k['kernel'])}, "
                    f"{literal(k['stride'])}, {literal(k['padding'])}, "
                    f"{literal(k['dilation'])}, {k.get('ceil_mode', False)}))")
_on("max_pool2d_backward")(
    lambda n, a, k: f"{A}.max_pool2d_with_indices_backward({a[0]}, {a[1]}, "
                    f"{literal(k['kernel'])}, {literal(k['stride'])}, {literal(k['padding'])}, "
                    f"{literal(k['dilation'])}, {k.get('ceil_mode', False)}, {a[2]})")
_on("batch_norm")(
    lambda n, a, k: f"{A}._native_batch_norm_legit_no_training({', '.join(a[:5])}, "
                    f"{literal(k.get('momentum', 0.1))}, {literal(k.get('eps', 1e-5))})[0]")
_on("batch_norm_train", returns_tuple=True)(
    lambda n, a, k: f"tuple({A}._native_batch_norm_legit_functional({', '.join(a[:5])}, True, "
                    f"{literal(k.get('momentum', 0.1))}, {literal(k.get('eps', 1e-5))}))")
_on("batch_norm_backward", returns_tuple=True)(
    lambda n, a, k: _not_none(f"{A}.native_batch_norm_backward({', '.join(a[:7])}, True, "
                              f"{literal(k.get('eps', 1e-5))}, "
                              f"{literal(k.get('mask', (True, True, True)))})"))
_on("nll_loss", returns_tuple=True)(
    lambda n, a, k: f"tuple({A}.nll_loss_forward({a[0]}, {a[1]}, {_opt(a, 2)}, "
                    f"{k.get('reduction', 1)}, {k.get('ignore_index', -100)}))")
_on("nll_loss_backward")(
    lambda n, a, k: f"{A}.nll_loss_backward({a[0]}, {a[1]}, {a[2]}, {_opt(a, 4)}, "
                    f"{k.get('reduction', 1)}, {k.get('ignore_index', -100)}, {a[3]})")


# --- communication: the generated program's helpers -------------------------------------------

def _axes(k) -> str:
    axes = k["axes"] if isinstance(k["axes"], (tuple, list)) else (k["axes"],)
    return f"({', '.join(map(str, axes))}{',' if len(axes) == 1 else ''})"


_on("all_reduce")(lambda n, a, k: f"all_reduce({a[0]}, {_axes(k)}, {k.get('op', 'sum')!r})")
_on("all_gather")(lambda n, a, k: f"all_gather({a[0]}, {_axes(k)}, {k['dim']})")
_on("reduce_scatter")(lambda n, a, k: f"reduce_scatter({a[0]}, {_axes(k)}, {k['dim']}, "
                                      f"{k.get('op', 'sum')!r})")
_on("all_to_all")(lambda n, a, k: f"all_to_all({a[0]}, {_axes(k)}, {k['split_dim']}, "
                                  f"{k['concat_dim']})")
_on("local_slice")(lambda n, a, k: f"local_slice({a[0]}, {_axes(k)}, {k['dim']})")
_on("local_zero")(lambda n, a, k: f"local_zero({a[0]}, {_axes(k)}, {k.get('op', 'sum')!r})")
_on("local_pad")(lambda n, a, k: f"local_pad({a[0]}, {_axes(k)}, {k['dim']})")
_on("send")(lambda n, a, k: f"send({a[0]}, {k['dst']})")
_on("recv")(lambda n, a, k: f"recv({k['src']}, {literal(k['shape'])}, {_dtype(k['dtype'])})")
_on("send_tiles")(lambda n, a, k: f"send_tiles({a[0]}, {literal(k['src'])}, {literal(k['dst'])}, "
                                  f"{literal(k.get('dim'))})")
_on("recv_tile")(lambda n, a, k: f"recv_tile({literal(k['src'])}, {literal(k['dst'])}, "
                                 f"{literal(k['shape'])}, {_dtype(k['dtype'])})")
