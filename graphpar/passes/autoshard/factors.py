"""Sharding rules as factors: each op's loop dimensions, and which tensor dims each one indexes.

An op's iteration space is a set of factors (the loop dims of its einsum). Sharding a factor
over a mesh axis shards every operand and result dim it indexes; a result that does not index
it becomes a partial result (`reductions`) or, where no partial form exists, the factor cannot
be sharded (`blocked`). A strategy is then just a choice of factor per mesh axis, so the rule
for every op is one small `FactorSpec` and the strategies are enumerated in one place — the
factor formulation of OpenXLA Shardy and Meta's AutoParallel, linear in the number of dims.

Each rule lives on its op (`OpDef.sharding_rule`): `@rule("op", ...)` declares it here and
`register_sharding_rules()`, called once when graphpar.passes.autoshard loads, attaches it.
Elementwise ops without a rule of their own get `elementwise`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from graphpar.ir.graph import Node, Value
from graphpar.ir.registry import OpKind, all_ops, get_op

Dims = tuple  # per tensor dim: a factor index or None


@dataclass
class FactorSpec:
    sizes: list[int]
    operands: list[Dims | None]  # None for a scalar or absent operand
    results: list[Dims]
    reductions: list[dict[int, str]]  # per result: factor -> how partial results combine
    blocked: set[int] = field(default_factory=set)
    # Operands that must be partial sums where a factor is sharded (a bias added once).
    partial_operands: dict[int, set[int]] = field(default_factory=dict)


ShardingRule = Callable[[Node], "FactorSpec | None"]

# The rules declared below, in order, until register_sharding_rules attaches them to their ops.
_declared: list[tuple[tuple[str, ...], ShardingRule]] = []
_registered = False


def rule(*ops: str):
    """Declare `fn` as the sharding rule of `ops` (attached by `register_sharding_rules`)."""
    def declare(fn: ShardingRule) -> ShardingRule:
        _declared.append((ops, fn))
        return fn
    return declare


def register_sharding_rules() -> None:
    """Attach every declared rule to its op, and `elementwise` to each elementwise op without
    one. Raises for an op that is unknown or already has a rule; later calls do nothing."""
    global _registered
    if _registered:
        return
    _registered = True
    for ops, fn in _declared:
        for op in ops:
            get_op(op).attach_sharding_rule(fn)
    for op in all_ops().values():
        if op.kind is OpKind.ELEMENTWISE and op.sharding_rule is None:
            op.attach_sharding_rule(elementwise)


def factor_spec(node: Node) -> FactorSpec | None:
    """The node's factors, or None when it only runs replicated."""
    fn = get_op(node.op).sharding_rule
    return None if fn is None else fn(node)


def _shape(v) -> tuple[int, ...] | None:
    return v.type.shape if isinstance(v, Value) else None


def _result_shapes(node: Node) -> list[tuple[int, ...]]:
    return [o.type.shape for o in node.outputs]


def _aligned(shape, out_factors: Dims, out_shape) -> Dims:
    """Operand dims aligned to the right of the result's, broadcast dims unsharded."""
    offset = len(out_shape) - len(shape)
    return tuple(None if (size == 1 and out_shape[i + offset] != 1) else out_factors[i + offset]
                 for i, size in enumerate(shape))


def elementwise(node: Node) -> FactorSpec:
    out_shape = _result_shapes(node)[0]
    factors = tuple(range(len(out_shape)))
    operands = [None if _shape(v) is None else _aligned(_shape(v), factors, out_shape)
                for v in node.inputs]
    return FactorSpec(list(out_shape), operands, [factors] * len(node.outputs),
                      [{} for _ in node.outputs])


def _identity(node: Node, blocked_dims=()) -> FactorSpec:
    spec = elementwise(node)
    spec.blocked |= {d % max(1, len(spec.sizes)) for d in blocked_dims}
    return spec


@rule("clone", "convert")
def _same(node):
    return elementwise(node)


@rule("softmax", "log_softmax", "softmax_backward", "log_softmax_backward", "cumsum")
def _along_dim(node):
    return _identity(node, [node.attrs["dim"]])


@rule("tril", "triu")
def _tri(node):
    return _identity(node, [-1, -2])


@rule("flip")
def _flip(node):
    return _identity(node, node.attrs["dims"])


@rule("pad")
def _pad(node):
    pads = node.attrs["pad"]
    rank = node.output.type.rank
    return _identity(node, [rank - 1 - i // 2 for i, p in enumerate(pads) if p])


@rule("repeat")
def _repeat(node):
    spec = _identity(node, [i for i, r in enumerate(node.attrs["repeats"]) if r != 1])
    x = _shape(node.inputs[0])
    spec.operands[0] = tuple(range(len(spec.sizes) - len(x), len(spec.sizes)))
    return spec


@rule("slice", "slice_scatter")
def _slice(node):
    x, out = _shape(node.inputs[0]), _result_shapes(node)[0]
    factors = tuple(range(len(out)))
    spec = FactorSpec(list(out), [factors] + [factors] * (len(node.inputs) - 1), [factors], [{}],
                      blocked={node.attrs["dim"]})
    spec.sizes[node.attrs["dim"]] = max(x[node.attrs["dim"]], out[node.attrs["dim"]])
    return spec


@rule("select")
def _select(node):
    x = _shape(node.inputs[0])
    d = node.attrs["dim"]
    factors = tuple(range(len(x)))
    return FactorSpec(list(x), [factors], [factors[:d] + factors[d + 1:]], [{}], blocked={d})


@rule("select_scatter")
def _select_scatter(node):
    x = _shape(node.inputs[0])
    d = node.attrs["dim"]
    factors = tuple(range(len(x)))
    return FactorSpec(list(x), [factors, factors[:d] + factors[d + 1:]], [factors], [{}],
                      blocked={d})


@rule("cat")
def _cat(node):
    out = _result_shapes(node)[0]
    factors = tuple(range(len(out)))
    return FactorSpec(list(out), [factors] * len(node.inputs), [factors], [{}],
                      blocked={node.attrs["dim"]})


@rule("permute")
def _permute(node):
    x = _shape(node.inputs[0])
    factors = tuple(range(len(x)))
    return FactorSpec(list(x), [factors], [tuple(factors[d] for d in node.attrs["dims"])], [{}])


@rule("expand")
def _expand(node):
    out = _result_shapes(node)[0]
    factors = tuple(range(len(out)))
    return FactorSpec(list(out), [_aligned(_shape(node.inputs[0]), factors, out)], [factors], [{}])


@rule("reshape")
def _reshape(node):
    """Dims are matched in groups of equal product; only a group's major dim carries a factor."""
    x, out = _shape(node.inputs[0]), _result_shapes(node)[0]
    in_dims: list = [None] * len(x)
    out_dims: list = [None] * len(out)
    sizes: list[int] = []
    i = j = 0
    while i < len(x) or j < len(out):
        if i < len(x) and x[i] == 1:
            i += 1
            continue
        if j < len(out) and out[j] == 1:
            j += 1
            continue
        if i >= len(x) or j >= len(out):
            break
        start_i, start_j = i, j
        a, b = x[i], out[j]
        i, j = i + 1, j + 1
        while a != b:
            if a < b:
                a *= x[i]
                i += 1
            else:
                b *= out[j]
                j += 1
        # The group x[start_i:i] == out[start_j:j]: shard both through their major dims, when
        # the smaller major dim's chunks line up with the larger one's.
        factor = len(sizes)
        sizes.append(min(x[start_i], out[start_j]))
        in_dims[start_i] = factor
        out_dims[start_j] = factor
    return FactorSpec(sizes, [tuple(in_dims)], [tuple(out_dims)], [{}])


# --- reductions -------------------------------------------------------------------------------

_COMBINE = {"sum": "sum", "mean": "avg", "amax": "max", "amin": "min"}


def _reduced_dims(node, rank: int) -> set[int]:
    """The dims a reduction reduces: `dims` (None: all), or one `dim` (prod)."""
    dims = node.attrs["dim"] if "dim" in node.attrs else node.attrs.get("dims")
    if dims is None:
        return set(range(rank))
    return {dims % max(1, rank)} if isinstance(dims, int) else set(dims)


@rule("sum", "mean", "amax", "amin", "any", "all", "prod", "var")
def _reduction(node):
    x = _shape(node.inputs[0])
    dims = _reduced_dims(node, len(x))
    keepdim = node.attrs.get("keepdim", False)
    factors = tuple(range(len(x)))
    out = tuple(None if d in dims else f for d, f in enumerate(factors)
                if keepdim or d not in dims)
    combine = _COMBINE.get(node.op)
    if combine is None:
        return FactorSpec(list(x), [factors], [out], [{}], blocked=dims)
    return FactorSpec(list(x), [factors], [out], [{d: combine for d in dims}])


@rule("argmax", "argmin")
def _arg_reduction(node):
    x = _shape(node.inputs[0])
    d = node.attrs["dim"]
    factors = tuple(range(len(x)))
    out = factors if node.attrs.get("keepdim") else factors[:d] + factors[d + 1:]
    if node.attrs.get("keepdim"):
        out = out[:d] + (None,) + out[d + 1:]
    return FactorSpec(list(x), [factors], [out], [{}], blocked={d})


@rule("topk", "sort")
def _topk(node):
    x = _shape(node.inputs[0])
    factors = tuple(range(len(x)))
    return FactorSpec(list(x), [factors], [factors, factors], [{}, {}],
                      blocked={node.attrs.get("dim", -1) % len(x)})


# --- matmul -----------------------------------------------------------------------------------

@rule("matmul")
def _matmul(node):
    a, b = _shape(node.inputs[0]), _shape(node.inputs[1])
    out = _result_shapes(node)[0]
    batch = len(out) - 2
    factors = tuple(range(batch + 3))  # batch..., m, n, k
    m, n, k = batch, batch + 1, batch + 2
    out_dims = factors[:batch] + (m, n)
    a_dims = _aligned(a[:-2], factors[:batch], out[:-2]) + (m, k)
    b_dims = _aligned(b[:-2], factors[:batch], out[:-2]) + (k, n)
    sizes = list(out) + [a[-1]]
    return FactorSpec(sizes, [a_dims, b_dims], [out_dims], [{k: "sum"}])


@rule("linear")
def _linear(node):
    x, w = _shape(node.inputs[0]), _shape(node.inputs[1])
    batch = len(x) - 1
    factors = tuple(range(batch + 2))  # batch..., n, k
    n, k = batch, batch + 1
    operands = [factors[:batch] + (k,), (n, k), (n,) if node.inputs[2] is not None else None]
    spec = FactorSpec(list(x[:-1]) + [w[0], w[1]], operands, [factors[:batch] + (n,)],
                      [{k: "sum"}])
    if node.inputs[2] is not None:
        spec.partial_operands[2] = {k}  # the bias is added once: by one member of each group
    return spec


@rule("grouped_mm")
def _grouped_mm(node):
    """Experts shard: a device holding experts e0..e1 (their weights and bounds) computes
    their rows, zeros elsewhere, so the rows-grouped product is a partial sum over experts
    (expert parallelism); the weight-gradient form gives each device its experts' gradients
    whole. Within an expert, n and k shard as in a matmul. The grouped dim is blocked: the
    bounds are global row numbers."""
    a, b = _shape(node.inputs[0]), _shape(node.inputs[1])
    e, s, k, n = range(4)
    bounds = (e,)  # starts and ends: one per expert
    if len(b) == 3:  # a [S, K] rows grouped, b [E, K, N] -> [S, N]
        return FactorSpec([b[0], a[0], a[1], b[2]], [(s, k), (e, k, n), bounds, bounds],
                          [(s, n)], [{k: "sum", e: "sum"}], blocked={s})
    # a [K, S], b [S, N] contraction grouped -> [E, K, N]
    return FactorSpec([_shape(node.inputs[2])[0], a[1], a[0], b[1]],
                      [(k, s), (s, n), bounds, bounds], [(e, k, n)], [{}], blocked={s})


@rule("index_add")
def _index_add(node):
    """Dims other than `dim` shard freely; the added rows (index and src along `dim`) shard
    as a partial sum, x added by one member of each group, as a bias is."""
    x = _shape(node.inputs[0])
    d = node.attrs["dim"]
    factors = tuple(range(len(x)))
    i = len(x)  # the index's factor
    src = factors[:d] + (i,) + factors[d + 1:]
    spec = FactorSpec(list(x) + [_shape(node.inputs[1])[0]], [factors, (i,), src], [factors],
                      [{i: "sum"}], blocked={d})
    spec.partial_operands[0] = {i}
    return spec


# --- composites -------------------------------------------------------------------------------

def _attention_dims(node, q, k):
    """Factors batch, heads, q-seq, k-seq, head-dim, value-dim; only batch and heads shard."""
    b, h, s, sk, d, dv = range(6)
    q_dims = (b, h, s, d)
    kv_heads = h  # GQA: kv heads split with q heads; chunks keep each group together
    k_dims = (b, kv_heads, sk, d)
    v_dims = (b, kv_heads, sk, dv)
    return (b, h, s, sk, d, dv), q_dims, k_dims, v_dims


def _mask_dims(mask_shape, full):
    """A mask broadcast against [B, H, S, Sk]: size-1 dims stay whole."""
    if mask_shape is None:
        return None
    offset = 4 - len(mask_shape)
    return tuple(None if size == 1 else full[i + offset] for i, size in enumerate(mask_shape))


def _attention_sizes(q, k, v):
    return [q[0], q[1], q[2], k[2], q[3], v[3]]


@rule("attention", "attention_with_lse")
def _attention(node):
    q, k, v = (_shape(x) for x in node.inputs[:3])
    (b, h, s, sk, d, dv), qd, kd, vd = _attention_dims(node, q, k)
    mask = _shape(node.inputs[3]) if len(node.inputs) > 3 else None
    results = [(b, h, s, dv)] + ([(b, h, s)] if node.op == "attention_with_lse" else [])
    return FactorSpec(_attention_sizes(q, k, v),
                      [qd, kd, vd] + [_mask_dims(mask, (b, h, s, sk))] * (len(node.inputs) - 3),
                      results, [{} for _ in results], blocked={s, sk, d, dv})


@rule("attention_backward")
def _attention_backward(node):
    grad, q, k, v = (_shape(x) for x in node.inputs[:4])
    (b, h, s, sk, d, dv), qd, kd, vd = _attention_dims(node, q, k)
    mask = _shape(node.inputs[6]) if len(node.inputs) > 6 else None
    operands = [(b, h, s, dv), qd, kd, vd, (b, h, s, dv), (b, h, s),
                _mask_dims(mask, (b, h, s, sk))]
    return FactorSpec(_attention_sizes(q, k, v), operands[:len(node.inputs)], [qd, kd, vd],
                      [{}, {}, {}], blocked={s, sk, d, dv})


@rule("reshape_and_cache")
def _reshape_and_cache(node):
    """Only the kv-heads dim shards: each device writes its heads of every new token into its
    own slice of the caches (a token split would leave each device a cache of other tokens)."""
    cache, key = _shape(node.inputs[0]), _shape(node.inputs[2])
    blocks, slots, t, k, d = range(5)
    sizes = [cache[0], cache[1], key[0], key[1], key[2]]
    caches = (blocks, slots, k, d)
    return FactorSpec(sizes, [caches, caches, (t, k, d), (t, k, d), (t,)], [caches, caches],
                      [{}, {}], blocked={blocks, slots, t, d})


@rule("paged_attention")
def _paged_attention(node):
    """Heads shard, as in vLLM's tensor parallelism: query heads with their kv heads (GQA
    groups stay whole); with one kv head (MQA) every device reads the whole, replicated cache.
    Block tables and context lengths are read whole by every device."""
    q, cache, tables = _shape(node.inputs[0]), _shape(node.inputs[1]), _shape(node.inputs[3])
    t, h, d, blocks, slots, n, m = range(7)
    kv = (blocks, slots, None if cache[2] == 1 else h, d)
    operands = [(t, h, d), kv, kv, (n, m), (n,)] + [(None,)] * (len(node.inputs) - 5)
    return FactorSpec([q[0], q[1], q[2], cache[0], cache[1], tables[0], tables[1]], operands,
                      [(t, h, d)], [{}], blocked={t, d, blocks, slots, n, m})


def _norm(node, num_weights):
    """Norms over trailing `shape` dims: those are blocked, leading dims are free."""
    x = _shape(node.inputs[0])
    lead = len(x) - len(node.attrs["shape"])
    factors = tuple(range(len(x)))
    weight = factors[lead:]
    operands = [factors] + [weight if _shape(w) is not None else None
                            for w in node.inputs[1:1 + num_weights]]
    return x, lead, factors, operands


@rule("layer_norm", "rms_norm")
def _layer_norm(node):
    x, lead, factors, operands = _norm(node, len(node.inputs) - 1)
    return FactorSpec(list(x), operands, [factors], [{}], blocked=set(factors[lead:]))


@rule("layer_norm_with_stats")
def _layer_norm_with_stats(node):
    x, lead, factors, operands = _norm(node, 2)
    stats = factors[:lead] + (None,) * (len(x) - lead)
    return FactorSpec(list(x), operands, [factors, stats, stats], [{}, {}, {}],
                      blocked=set(factors[lead:]))


@rule("layer_norm_backward")
def _layer_norm_backward(node):
    g = _shape(node.inputs[0])
    lead = len(g) - len(node.attrs["shape"])
    factors = tuple(range(len(g)))
    stats = factors[:lead] + (None,) * (len(g) - lead)
    weight = factors[lead:]
    operands = [factors, factors, stats, stats] + [weight if _shape(w) is not None else None
                                                   for w in node.inputs[4:]]
    mask = node.attrs.get("mask", (True, True, True))
    results, reductions = [], []
    for want, dims in zip(mask, (factors, weight, weight)):
        if want:
            results.append(dims)
            reductions.append({} if dims is factors else {f: "sum" for f in factors[:lead]})
    return FactorSpec(list(g), operands, results, reductions, blocked=set(weight))


@rule("embedding")
def _embedding(node):
    w, idx = _shape(node.inputs[0]), _shape(node.inputs[1])
    batch = tuple(range(len(idx)))
    h, v = len(idx), len(idx) + 1
    return FactorSpec(list(idx) + [w[1], w[0]], [(v, h), batch], [batch + (h,)], [{}],
                      blocked={v})


@rule("embedding_backward")
def _embedding_backward(node):
    g, idx = _shape(node.inputs[0]), _shape(node.inputs[1])
    batch = tuple(range(len(idx)))
    h, v = len(idx), len(idx) + 1
    return FactorSpec(list(idx) + [g[-1], node.attrs["num_weights"]], [batch + (h,), batch],
                      [(v, h)], [{f: "sum" for f in batch}], blocked={v})


@dataclass
class _ConvFactors:
    sizes: list[int]
    n: int  # batch
    o: int  # output channels, or the group of a grouped convolution
    c: int | None  # input channels (summed); None when grouped: the group holds them
    whole: set[int]  # kernel and spatial factors, never split
    x: Dims
    w: Dims
    out: Dims


def _conv_factors(node, x, w, out) -> _ConvFactors:
    """The convolution's factors: batch n, output channels o, input channels c (summed), and
    kernel and spatial dims (kept whole: a split length would need a halo from its neighbour).

    Grouped (and depthwise) convolutions have one channel factor, the group (in o's place): a
    block of groups owns its block of input channels, of filters and of output channels, so
    sharding it splits all three with nothing to sum. A transposed convolution's weight is
    [C_in, C_out/groups, k...] instead of [C_out, C_in/groups, k...]."""
    spatial = len(x) - 2
    n, o, c = 0, 1, 2
    kernel = tuple(range(3, 3 + spatial))
    x_space = tuple(range(3 + spatial, 3 + 2 * spatial))
    out_space = tuple(range(3 + 2 * spatial, 3 + 3 * spatial))
    sizes = [x[0], out[1], x[1], *w[2:], *x[2:], *out[2:]]
    whole = {*kernel, *x_space, *out_space}
    groups = node.attrs.get("groups", 1)
    if groups != 1:
        sizes[o], sizes[c] = groups, 1  # c unused: size 1, blocked
        return _ConvFactors(sizes, n, o, None, whole | {c}, (n, o, *x_space),
                            (o, None, *kernel), (n, o, *out_space))
    w_dims = (c, o, *kernel) if node.attrs.get("transposed", False) else (o, c, *kernel)
    return _ConvFactors(sizes, n, o, c, whole, (n, c, *x_space), w_dims, (n, o, *out_space))


@rule("convolution")
def _convolution(node):
    x, w = _shape(node.inputs[0]), _shape(node.inputs[1])
    f = _conv_factors(node, x, w, _result_shapes(node)[0])
    has_bias = len(node.inputs) > 2 and node.inputs[2] is not None
    spec = FactorSpec(f.sizes, [f.x, f.w, (f.o,) if has_bias else None], [f.out],
                      [{} if f.c is None else {f.c: "sum"}], blocked=f.whole)
    if has_bias and f.c is not None:
        spec.partial_operands[2] = {f.c}  # the bias added once, on one input-channel shard
    return spec


@rule("convolution_backward")
def _convolution_backward(node):
    g, x, w = (_shape(v) for v in node.inputs[:3])
    f = _conv_factors(node, x, w, g)
    dx_sum = {} if f.c is None else {f.o: "sum"}  # grouped: a group's dx needs its filters only
    every = [(f.x, dx_sum), (f.w, {f.n: "sum"}), ((f.o,), {f.n: "sum"})]
    mask = node.attrs.get("mask", (True, True, True))
    chosen = [r for want, r in zip(mask, every) if want]
    return FactorSpec(f.sizes, [f.out, f.x, f.w], [r[0] for r in chosen],
                      [r[1] for r in chosen], blocked=f.whole)


@rule("batch_norm")
def _batch_norm(node):
    x = _shape(node.inputs[0])
    factors = tuple(range(len(x)))
    channel = (1,)
    return FactorSpec(list(x), [factors] + [channel] * 4, [factors], [{}])


@rule("batch_norm_train", "batch_norm_backward", "max_pool2d", "max_pool2d_backward")
def _per_channel(node):
    """Batch statistics (and pooling windows) need every sample and pixel: only N or C shard,
    and only C for batch norm."""
    x = _shape(node.inputs[0])
    n, c = 0, 1
    image = tuple(range(len(x)))
    blocked = set(range(2, len(x)))
    if node.op.startswith("batch_norm"):
        blocked.add(n)
    operands = [image if _shape(v) is not None and len(_shape(v)) == len(x)
                else ((c,) if _shape(v) is not None else None) for v in node.inputs]
    results = [image if len(o.type.shape) == len(x) else (c,) for o in node.outputs]
    return FactorSpec(list(x), operands, results, [{} for _ in results], blocked=blocked)


@rule("nll_loss")
def _nll_loss(node):
    logp = _shape(node.inputs[0])
    n, c = 0, 1
    if node.attrs.get("reduction", 1) != 2:  # only sums combine as partial results
        return None
    weight = (c,) if node.inputs[2] is not None else None
    return FactorSpec(list(logp), [(n, c), (n,), weight], [(), ()],
                      [{n: "sum"}, {n: "sum"}], blocked={c})


@rule("nll_loss_backward")
def _nll_loss_backward(node):
    logp = _shape(node.inputs[1])
    n, c = 0, 1
    weight = (c,) if len(node.inputs) > 4 and node.inputs[4] is not None else None
    grad = () if len(_shape(node.inputs[0])) == 0 else (n,)
    operands = [grad, (n, c), (n,), ()] + ([weight] if len(node.inputs) > 4 else [])
    return FactorSpec(list(logp), operands, [(n, c)], [{}], blocked={c})


@rule("full")
def _full(node):
    out = _result_shapes(node)[0]
    return FactorSpec(list(out), [], [tuple(range(len(out)))], [{}])
