"""The one IR interpreter: walks a graph's nodes, runs each op's torch reference, frees by last use.

Modelled on ``torch.fx.Interpreter``: an :class:`Interpreter` is prepared once for a graph (every
value gets a slot in a flat list, every node becomes its function, operand slots, attributes,
result slots and the slots to free after it), then runs it as often as wanted. Every executor
of IR graphs is this class:

- :func:`graphpar.backends.reference.run` prepares one and runs it once;
- the lockstep SPMD driver (``graphpar.runtime.spmd.run_spmd_in_process``) drives one
  :meth:`Interpreter.steps` generator per rank and answers their collectives group-wise;
- gloo worker processes and the serving ranks run device programs with a communicator, whose
  ``execute`` the :meth:`Interpreter.communicate` hook calls for each collective.

Nodes that communicate (collectives, send/recv: ``graphpar.ir.spmd_ops.COMM_OPS``) are the
hook; the free rank-local steps (``LOCAL_OPS``) go straight to the communicator. Without a
communicator every SPMD op runs its registry reference, which is the identity for a group of
one and raises ``BackendError`` otherwise.
"""

from __future__ import annotations

import operator
from collections.abc import Generator, Iterable, Mapping, Sequence
from typing import Any, Protocol

import torch

from graphpar.backends.codegen import Generated, generate, spread
from graphpar.backends.paged import KERNEL_OPS
from graphpar.errors import BackendError, GraphparError
from graphpar.ir.graph import Graph, Node, Value
from graphpar.ir.ops import get_op
from graphpar.ir.spmd_ops import COMM_OPS, LOCAL_OPS  # also registers the SPMD ops
from graphpar.ir.verify import describe

__all__ = ["Bucketed", "Communicating", "Interpreter", "Request", "node_error"]

Inputs = Mapping[str, torch.Tensor] | Sequence[torch.Tensor]
# what `steps` yields at a communicating node: (node index, node, operands)
Request = tuple[int, Node, list]


class Communicating(Protocol):
    """What the interpreter needs of a communicator (``graphpar.runtime.comm.Communicator``)."""

    def execute(self, node: Node, args: Sequence[Any], index: int | None = None
                ) -> torch.Tensor: ...


class Bucketed(Protocol):
    """All-reduce nodes run as one collective out of program order
    (``graphpar.runtime.overlap.Bucket``): launched after node `launch_after`, waited for
    before node `wait_before`."""

    members: tuple[int, ...]
    launch_after: int
    wait_before: int


class Interpreter:
    """``graph`` prepared for running, on its own or as one rank of a device program.

    Args:
        graph: the IR graph.
        comm: this rank's communicator for a device program with collectives.
        checked: names of the inputs whose shape and dtype are checked on every run; the others
            are checked on the first run only and trusted afterwards (for a serving step, whose
            weights and caches never change). ``None``: every input, every run.
        inference: run under ``torch.inference_mode`` (no autograd bookkeeping at all, cheaper
            than ``no_grad`` per op; its outputs cannot enter autograd later) instead of
            ``torch.no_grad``.
        buckets: all-reduces to run together and asynchronously (``plan_buckets`` of
            ``graphpar.runtime.overlap``): at each bucket's launch the communicator's
            ``launch_all_reduce(requests)`` gets every member's ``(index, node, operands)`` and
            returns what, called at the bucket's wait, gives their results in order. Needs a
            communicator; only :meth:`run` honours them (the lockstep driver's :meth:`steps`
            runs every node in program order).
    """

    def __init__(self, graph: Graph, comm: Communicating | None = None, *,
                 checked: Iterable[str] | None = None, inference: bool = False,
                 buckets: Sequence[Bucketed] = ()) -> None:
        self.graph = graph
        self.comm = comm
        self.checked = None if checked is None else frozenset(checked)
        self.inference = inference
        self.slot = slot = {v: i for i, v in enumerate(graph.values())}  # a value's place
        self.size = len(slot)
        self.inputs = [(v.name, slot[v], v.type) for v in graph.inputs]
        self.outputs = [slot[o.value] for o in graph.outputs]
        last_use: dict[Value, int] = {}
        for i, node in enumerate(graph.nodes):
            for v in node.input_values:
                last_use[v] = i
        keep = {o.value for o in graph.outputs}
        # one tuple per node: (index, node, function or None to yield, operands, attributes,
        # result slots, slots freed after it). Operands are an itemgetter over the value
        # slots when every operand is a value (the usual case: one C call fetches them all),
        # else (is value, slot or constant) pairs.
        self.plan = []
        for i, node in enumerate(graph.nodes):
            if node.inputs and all(isinstance(v, Value) for v in node.inputs):
                getter = operator.itemgetter(*(slot[v] for v in node.inputs))
                operands = (lambda env, g=getter: (g(env),)) if len(node.inputs) == 1 \
                    else getter
            else:
                operands = tuple((True, slot[v]) if isinstance(v, Value) else (False, v)
                                 for v in node.inputs)
            frees = tuple(slot[v] for v in set(node.input_values)
                          if last_use[v] == i and v not in keep and not v.is_input)
            fn, attrs = self._function(i, node)
            self.plan.append((i, node, fn, operands, attrs, tuple(slot[o] for o in node.outputs),
                              frees))
        self._first = True
        if self.checked is not None:  # bind's split: checked every run, trusted after the first
            self._checked_inputs = [i for i in self.inputs if i[0] in self.checked]
            self._trusted = [(n, index) for n, index, _ in self.inputs if n not in self.checked]
        # bucketed all-reduces: bucket k's requests and result slots; when to launch and
        # wait for which buckets (by node position; -1: before the first, len(plan): at the end)
        self._buckets: list[tuple[list, list[int]]] = []
        self._launches: dict[int, list[int]] = {}
        self._waits: dict[int, list[int]] = {}
        self._bucketed: frozenset[int] = frozenset()
        if buckets:
            self._plan_buckets(buckets)
        self._generated: Generated | None = None  # `run`'s function, made at its first call

    def _plan_buckets(self, buckets: Sequence[Bucketed]) -> None:
        if self.comm is None or not hasattr(self.comm, "launch_all_reduce"):
            raise BackendError("bucketed all-reduces need a communicator with "
                               "launch_all_reduce (a GlooCommunicator)")
        for k, b in enumerate(buckets):
            members = [self.plan[i] for i in b.members]
            if any(m[1].op != "all_reduce" for m in members) or not (
                    b.launch_after < min(b.members) < b.wait_before <= len(self.plan)):
                raise BackendError(f"graph @{self.graph.name}: {b} is not a bucket of "
                                   "all-reduces launched before them and waited for after")
            self._buckets.append(([(m[0], m[1], m[3]) for m in members],
                                  [m[5][0] for m in members]))
            self._launches.setdefault(b.launch_after, []).append(k)
            self._waits.setdefault(b.wait_before, []).append(k)
        self._bucketed = frozenset(i for b in buckets for i in b.members)

    def _function(self, index: int, node: Node):
        """The callable that runs `node` with its operands (None: yield it to the caller)."""
        if self.comm is not None and node.op in COMM_OPS:
            return None, {}
        if self.comm is not None and node.op in LOCAL_OPS:
            comm = self.comm

            def local_step(*args):
                return comm.execute(node, args, index=index)
            return local_step, {}
        return KERNEL_OPS.get(node.op, get_op(node.op).reference), dict(node.attrs)

    # --- running ----------------------------------------------------------------------------

    def run(self, inputs: Inputs) -> list[torch.Tensor]:
        """The graph's outputs in order: the plan run as one generated function
        (`graphpar.backends.codegen`), each communicating node through :meth:`communicate`,
        the buckets launched and waited for where planned."""
        generated = self._generate()
        env: list = [None] * self.size
        self.bind(inputs, env)
        with torch.inference_mode() if self.inference else torch.no_grad():
            try:
                return generated.function(env)
            except Exception as exc:
                node = generated.failing_node(exc)
                if node is None:
                    raise
                raise node_error(self.graph, node, exc) from exc

    @property
    def code(self) -> str:
        """The Python source :meth:`run` runs."""
        return self._generate().source

    def _generate(self) -> Generated:
        """:meth:`run`'s function, made once (again for a copy given another plan)."""
        if self._generated is None or self._generated.plan is not self.plan:
            self._generated = generate(self)
        return self._generated

    def communicate(self, index: int, node: Node, args: list) -> Any:
        """Run communicating node `node` (its graph position `index`) on operands `args`: the
        hook a subclass overrides; here, the communicator's ``execute``."""
        return self.comm.execute(node, args, index=index)  # type: ignore[union-attr]

    def steps(self, inputs: Inputs) -> Generator[Request, Any, list[torch.Tensor]]:
        """The interpreter loop as a generator: runs the local nodes itself and yields
        ``(node index, node, operands)`` for each communicating node, to be resumed with its
        result; returns the graph outputs.

        The lockstep SPMD driver runs one per rank. The caller sets the grad mode (a generator
        must not: interleaved generators would restore it out of order)."""
        env: list = [None] * self.size
        self.bind(inputs, env)
        for index, node, fn, operands, attrs, outs, frees in self.plan:
            args = _fetch(operands, env)
            if fn is None:
                result = yield index, node, list(args)
            else:
                try:
                    result = fn(*args, **attrs) if attrs else fn(*args)
                except Exception as exc:
                    raise node_error(self.graph, node, exc) from exc
            _store(env, outs, result)
            for f in frees:
                env[f] = None
        return [env[i] for i in self.outputs]

    def bind(self, inputs: Inputs, env: list) -> None:
        """Put the tensors for the graph inputs (by name, or all in order) in their slots,
        checking shapes and dtypes as ``checked`` says."""
        name = self.graph.name
        if not isinstance(inputs, Mapping):
            if len(inputs) != len(self.inputs):
                raise GraphparError(f"graph @{name} takes {len(self.inputs)} inputs, got "
                                    f"{len(inputs)}")
            inputs = {input_name: t for (input_name, _, _), t in zip(self.inputs, inputs)}
        if not (self._first or self.checked is None):  # trusted inputs: only fetched
            try:
                for input_name, index in self._trusted:
                    env[index] = inputs[input_name]
            except KeyError:
                pass  # named below
            else:
                self._bind(inputs, env, self._checked_inputs)
                return
        self._bind(inputs, env, self.inputs)
        self._first = False

    def _bind(self, inputs: Mapping[str, torch.Tensor], env: list, which) -> None:
        name = self.graph.name
        for input_name, index, ty in which:
            try:
                tensor = inputs[input_name]
            except KeyError:
                raise GraphparError(f"graph @{name}: no tensor given for input "
                                    f"%{input_name}") from None
            if tuple(tensor.shape) != ty.shape or tensor.dtype != ty.dtype:
                raise GraphparError(f"graph @{name}: input %{input_name} expects {ty}, got "
                                    f"{tuple(tensor.shape)} {tensor.dtype}")
            env[index] = tensor


def _store(env: list, outs: tuple, result) -> None:
    """A node's result into its output slots (`codegen.spread`)."""
    for o, r in zip(outs, spread(result, len(outs))):
        env[o] = r


def _fetch(operands, env: list):
    """A node's operands from the value slots: `operands` is the plan's itemgetter (every
    operand a value) or its (is value, slot or constant) pairs."""
    if type(operands) is tuple:
        return [env[x] if is_value else x for is_value, x in operands]
    return operands(env)


def node_error(graph: Graph, node: Node, exc: Exception) -> GraphparError:
    """The error for a node that failed: names the graph and node; a BackendError (an SPMD op
    without a communicator, a failed collective) stays one."""
    cls = BackendError if isinstance(exc, BackendError) else GraphparError
    return cls(f"graph @{graph.name}, {describe(node, graph)} failed to execute: {exc}")
