"""Hand-written parallel plans, costed like the ILP's: data parallel (and DDP's pure form of
it), ZeRO, Megatron-LM tensor parallel, and data x tensor parallel.

Each plan is a rule per mesh axis, applied as a filter on the choices of the same reduced ILP
the auto-sharder solves (`Reduced.solve(allow=...)`):

- a *data* axis shards a batch factor of every heavy op (matmul, attention, conv, embedding)
  and replicates parameters and optimizer state — or, for ZeRO, shards the optimizer state
  (`zero`) or parameters and optimizer state (`zero-3`) over it;
- a *tensor* axis shards parameters as Megatron-LM does (QKV and MLP-up column-parallel, the
  attention and MLP-down projections row-parallel, the LM head by vocabulary, the rest
  replicated; optimizer state like its parameter) and shards a non-batch factor of every heavy
  op (attention: its heads), reading each weight it shards where it lies (a weight is never
  gathered or moved to run a linear another way).

`ddp` is data parallelism as PyTorch's DistributedDataParallel runs it: the data rule on every
node, the cheap ones too, and every input sliced by the batch (dim 0), so each rank runs the
whole step on its rows and the only collectives are the gradients' (and the loss's)
all-reduces. The other plans leave the cheap nodes to the solver, which may gather
activations to run norms and additions replicated where collectives are priced cheap.

Everything else — elementwise ops, reshapes, norms, where to all-reduce or reduce-scatter — is
left to the solver, so a hand plan is the best plan of its family under the cost model, and it
is always valid. The ILP's own choices include every hand plan's, so its plan is never worse.
"""

from __future__ import annotations

from dataclasses import dataclass

from graphpar.errors import MemoryLimitError, ShardingError
from graphpar.ir.graph import PERSISTENT_ROLES, Graph, Node, Role, Value
from graphpar.ir.layout import Layout, Replicate, Shard
from graphpar.ir.ops import OpKind, get_op
from graphpar.passes.autoshard.factors import factor_spec
from graphpar.passes.autoshard.ilp import DEFAULT_SOLVER, Plan, Reduced
from graphpar.passes.autoshard.strategies import Strategy, is_follower

HAND_PLANS = ("data", "ddp", "zero", "zero-3", "megatron", "data+megatron")

# Megatron-LM's layouts by module name: column-parallel linears split their output features
# (weight dim 0 of nn.Linear's [out, in], dim 1 of GPT-2's Conv1D [in, out]; bias too),
# row-parallel ones their input features. Fused projections (query_key_value, qkv_proj, Wqkv,
# gate_up_proj) are split in halves of their output, which need not fall between heads.
_COLUMN = {"qkv", "wq", "wk", "wv", "q_proj", "k_proj", "v_proj", "query", "key", "value",
           "c_attn", "query_key_value", "qkv_proj", "Wqkv", "up", "up_proj", "gate",
           "gate_proj", "gate_up_proj", "fc1", "fc_in", "c_fc", "dense_h_to_4h", "w1", "w3",
           "lm_head"}
_ROW = {"proj", "wo", "o_proj", "out_proj", "c_proj", "down", "down_proj", "fc2", "fc_out",
        "dense_4h_to_h", "w2", "dense"}
# Batched expert weights [E, in, out] (graphpar.models.moe): w_in is column-, w_out row-parallel.
_EXPERT = {"w_in": -1, "w_out": -2}
_STATE_SUFFIXES = ("exp_avg", "exp_avg_sq", "momentum_buffer")


class NotApplicable(ShardingError):
    """The hand plan does not exist for this graph or mesh (say why)."""


@dataclass(frozen=True)
class _Rules:
    data_axes: tuple[int, ...]
    tensor_axes: tuple[int, ...]
    shard_state: bool = False  # ZeRO: optimizer state sharded over the data axes
    shard_params: bool = False  # ZeRO-3: parameters too
    every_node: bool = False  # DDP: the rules on the cheap nodes and the inputs too


def param_name(name: str) -> str:
    """The parameter an optimizer-state tensor belongs to (`name` itself for a parameter)."""
    parts = name.split(".")
    while parts and parts[-1] in _STATE_SUFFIXES:
        parts = parts[:-1]
    return ".".join(parts)


def megatron_dim(name: str, rank: int, in_out: bool = False) -> int | None:
    """The dim Megatron-LM shards a parameter (or its optimizer state) along, None to
    replicate it. `in_out`: a weight stored [in, out] (GPT-2's Conv1D), not [out, in]."""
    parts = param_name(name).split(".") if name else []
    if not parts:
        return None
    if parts[-1] in _EXPERT:
        return _EXPERT[parts[-1]] % rank
    if len(parts) < 2 or parts[-1] not in ("weight", "bias"):
        return None
    module = parts[-2]
    weight = parts[-1] == "weight" and rank == 2
    if module in _COLUMN:
        return 1 if weight and in_out else 0
    if module in _ROW and weight:
        return 0 if in_out else 1
    return None


def weights_stored_in_out(graph: Graph) -> set[str]:
    """The 2-D parameters stored [in, out], as GPT-2's Conv1D stores them: the first op that
    reads one is a `matmul` taking it on the right (nn.Linear's [out, in] weights go to
    `linear` first; a training step's backward matmuls come after it)."""
    found: set[str] = set()
    seen: set[Value] = set()
    for node in graph.nodes:
        for k, v in enumerate(node.inputs):
            if isinstance(v, Value) and v.role is Role.PARAM and v.type.rank == 2 \
                    and v not in seen:
                seen.add(v)
                if node.op == "matmul" and k == 1:
                    found.add(v.name)
    return found


def batch_factors(problem) -> dict[Node, set[int]]:
    """Per node, the factors that index the batch: tensor dims derived from dim 0 of the
    graph's activation inputs, followed through every op's factors."""
    graph = problem.graph
    dims: dict[Value, set[int]] = {v: ({0} if v.role is Role.INPUT and v.type.rank else set())
                                   for v in graph.inputs}
    found: dict[Node, set[int]] = {}
    for node in graph.nodes:
        spec = factor_spec(node)
        factors: set[int] = set()
        if spec is not None:
            for k, v in enumerate(node.inputs):
                if isinstance(v, Value) and k < len(spec.operands) and spec.operands[k]:
                    factors |= {spec.operands[k][d] for d in dims.get(v, ())
                                if spec.operands[k][d] is not None}
        found[node] = factors
        for r, out in enumerate(node.outputs):
            dims[out] = ({d for d, f in enumerate(spec.results[r]) if f in factors}
                         if spec is not None else set())
    return found


def _axis_roles(name: str, mesh) -> _Rules:
    axes = tuple(a for a, n in enumerate(mesh.shape) if n > 1)
    if not axes:
        raise NotApplicable(f"mesh {mesh} has one device")
    if name == "data":
        return _Rules(axes, ())
    if name == "ddp":
        return _Rules(axes, (), every_node=True)
    if name == "zero":
        return _Rules(axes, (), shard_state=True)
    if name == "zero-3":
        return _Rules(axes, (), shard_state=True, shard_params=True)
    if name == "megatron":
        return _Rules((), axes)
    if name == "data+megatron":
        if len(mesh.shape) != 2 or mesh.shape[0] == 1 or mesh.shape[1] == 1:
            raise NotApplicable(f"data x tensor parallelism needs a 2-D mesh, got {mesh}")
        return _Rules((0,), (1,))
    raise ShardingError(f"unknown hand plan {name!r}; choose one of {', '.join(HAND_PLANS)}")


class _Filter:
    """The `allow` filter of one hand plan: which choices each item may take."""

    def __init__(self, reduced: Reduced, rules: _Rules):
        self.problem, self.rules = reduced.problem, rules
        self.batch = batch_factors(self.problem)
        self._required: dict[tuple, dict] = {}
        # Megatron's vocab-parallel embedding needs a masked lookup the IR's `embedding` does
        # not express; on a tensor axis the solver picks the embedding tables' layout.
        tables = {n.inputs[0].name for n in self.problem.graph.nodes
                  if n.op == "embedding" and isinstance(n.inputs[0], Value)}
        self.tables = {v for v in self.problem.graph.inputs if v.name in tables or any(
            (v.name or "").startswith(t + ".") for t in tables)}
        self.in_out = weights_stored_in_out(self.problem.graph)

    def __call__(self, item, choice) -> bool | None:
        every = self.rules.every_node
        if isinstance(item, Value):
            if item.role in PERSISTENT_ROLES:
                return self._input(item, choice)
            return self._batch_input(item, choice) if every and item.role is Role.INPUT \
                else None
        if (is_follower(item) and not every) or get_op(item.op).kind is OpKind.CREATION:
            return None
        return self._heavy(item, choice)

    def _batch_input(self, value: Value, layout: Layout) -> bool:
        """DDP's inputs: sliced by the batch (dim 0) over the data axes where some layout of
        `value` is, else replicated."""
        key = ("batch-input", value.type.shape, value.name)
        if key not in self._required:
            choices = self.problem.choices[self.problem.index[value]]
            self._required[key] = {a: any(lay[a] == Shard(0) for lay in choices)
                                   for a in self.rules.data_axes}
        return all(layout[a] == (Shard(0) if sliced else Replicate())
                   for a, sliced in self._required[key].items())

    def _input(self, value: Value, layout: Layout) -> bool:
        rules = self.rules
        sharded = self._shardable(value)
        for a in rules.data_axes:
            shard = (rules.shard_params if value.role is Role.PARAM else
                     rules.shard_state and value.role is Role.OPTIM_STATE)
            if shard and sharded.get(a):
                if not layout[a].is_shard():
                    return False
            elif not layout[a].is_replicate():
                return False
        for a in rules.tensor_axes:
            if value in self.tables:
                continue
            name = value.name or ""
            dim = megatron_dim(name, value.type.rank, param_name(name) in self.in_out)
            want = Replicate() if dim is None else Shard(dim)
            if layout[a] != want:
                return False
        return True

    def _shardable(self, value: Value) -> dict[int, bool]:
        """Per data axis, whether some candidate layout of `value` shards it there (a scalar or
        an indivisible vector stays replicated under ZeRO)."""
        key = ("input", value.type.shape, value.name)
        if key not in self._required:
            choices = self.problem.choices[self.problem.index[value]]
            self._required[key] = {a: any(lay[a].is_shard() for lay in choices)
                                   for a in self.rules.data_axes}
        return self._required[key]

    def _heavy(self, node: Node, strategy: Strategy) -> bool:
        batch = self.batch.get(node, set())
        possible = self._possible(node, batch)
        for a in self.rules.data_axes:
            f = strategy.axis_factors[a]
            if (f not in batch) if possible[a] else (f is not None):
                return False
        for a in self.rules.tensor_axes:
            f = strategy.axis_factors[a]
            if f in batch or (f is None and possible[a]):
                return False
        if self.rules.tensor_axes and self._keeps_weights(node, None) \
                and not self._keeps_weights(node, strategy):
            return False
        return True

    def _keeps_weights(self, node: Node, strategy: Strategy | None) -> bool:
        """Whether `strategy` reads each parameter operand Megatron shards in its Megatron
        layout on the tensor axes, so that weights stay where they are (column- and
        row-parallel linears, not weights gathered each step); for `strategy` None, whether
        some strategy of `node` does (else the rule is relaxed)."""
        if strategy is None:
            choices = self.problem.choices[self.problem.index[node]]
            key = ("keeps", id(choices), *map(id, node.inputs))
            if key not in self._required:
                self._required[key] = any(self._keeps_weights(node, s) for s in choices)
            return self._required[key]
        for k, v in enumerate(node.inputs):
            if not isinstance(v, Value) or v.role is not Role.PARAM or v in self.tables:
                continue
            name = v.name or ""
            dim = megatron_dim(name, v.type.rank, param_name(name) in self.in_out)
            if dim is None:
                continue
            layout = strategy.inputs[k] if k < len(strategy.inputs) else None
            if layout is None or any(layout[a] != Shard(dim) for a in self.rules.tensor_axes):
                return False
        return True

    def _possible(self, node: Node, batch: set[int]) -> dict[int, bool]:
        """Per axis, whether some strategy of `node` meets the axis' rule (else the rule is
        relaxed to replicating there)."""
        choices = self.problem.choices[self.problem.index[node]]
        key = (id(choices), frozenset(batch))
        if key not in self._required:
            rules = self.rules
            need = {a: any(s.axis_factors[a] in batch for s in choices) for a in rules.data_axes}
            need.update({a: any(s.axis_factors[a] is not None and s.axis_factors[a] not in batch
                                for s in choices) for a in rules.tensor_axes})
            self._required[key] = need
        return self._required[key]


def _check_megatron(reduced: Reduced, rules: _Rules) -> None:
    if not rules.tensor_axes:
        return
    # read as nn.Linear's [out, in]: dim 1 is a row-parallel weight whichever way it is stored
    dims = {megatron_dim(v.name or "", v.type.rank) for v in reduced.problem.graph.inputs
            if v.role is Role.PARAM}
    if dims <= {None, 0}:
        raise NotApplicable("no row-parallel linears (attention/MLP output projections) in "
                            "the graph: Megatron-LM's layout does not apply")


def hand_plan(reduced: Reduced, name: str, memory_limit: float | None = None,
              time_limit: float = 30.0, solver: str = DEFAULT_SOLVER) -> Plan:
    """The hand plan `name` (one of HAND_PLANS) as the best plan its rules allow. Raises
    NotApplicable when it does not exist for this graph or mesh, MemoryLimitError when it
    does not fit."""
    rules = _axis_roles(name, reduced.problem.mesh)
    _check_megatron(reduced, rules)
    try:
        return reduced.solve(memory_limit, time_limit, solver, allow=_Filter(reduced, rules),
                             name=name)
    except MemoryLimitError:
        raise
    except ShardingError as e:
        raise NotApplicable(str(e)) from None


def hand_plans(reduced: Reduced, memory_limit: float | None = None, time_limit: float = 30.0,
               solver: str = DEFAULT_SOLVER) -> dict[str, Plan | str]:
    """Every hand plan, or for those that do not apply or fit, why not."""
    result: dict[str, Plan | str] = {}
    for name in HAND_PLANS:
        try:
            result[name] = hand_plan(reduced, name, memory_limit, time_limit, solver)
        except NotApplicable as e:
            result[name] = f"n/a: {e}"
        except MemoryLimitError:
            result[name] = "does not fit in memory"
    return result
