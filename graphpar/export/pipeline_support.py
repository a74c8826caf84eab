"""The part of every exported pipeline program that runs its schedule (imports torch only).

`graphpar export --to torch --pipeline ...` copies this text into `program.py` after
`program_support`'s (whose collectives, `shard` and `unshard` it uses) and before the stage
tables. A rank runs its stage's action list: F, B (or I and W), the sends and receives of the
tensors named by the stage programs, then the optimizer update on the mean gradients, as
graphpar's own pipeline runtime does. Every rank of a stage holds the phase boundaries whole:
a phase sharded on the stage's sub-mesh takes its shards of them and gathers its outputs whole.
Between stages a tensor crosses whole: receiving rank j of a stage takes it from rank j modulo
the sending stage's size.
"""

import torch
import torch.distributed as dist

# program.py defines these above this text; the import is for reading and linting it here
from graphpar.export.program_support import RANK, finish_sends, recv, send, shard, unshard

STAGES: list = []  # set by the generated program: each stage's tables
PHASE_FUNCTIONS: dict = {}  # (stage, phase) -> the function of that phase's program


class StageRun:
    """One stage's tensors through one step: per microbatch what it keeps, gradient sums,
    losses and updates."""

    def __init__(self, stage, state, inputs, microbatches):
        self.stage, self.spec = stage, STAGES[stage]
        self.state, self.inputs, self.microbatches = state, inputs, microbatches
        self.env = [{} for _ in range(microbatches)]
        self.grad_sums, self.losses, self.updates = {}, {}, {}
        self.backward_done, self.sent_back = set(), set()

    def lookup(self, name, m):
        for where in (self.env[m], self.inputs[m], self.state):
            if name in where:
                return where[name]
        raise RuntimeError(f"stage {self.stage}: microbatch {m} has no tensor {name!r}")

    def execute(self, phase, args):
        """Run a phase on whole tensors (sharded on the sub-mesh when planned so)."""
        tables = self.spec["phases"][phase]
        function = PHASE_FUNCTIONS[(self.stage, phase)]
        if tables["placements_in"] is None:
            return function(args)
        local = {n: shard(args[n], p) for n, p in tables["placements_in"].items()}
        return [unshard(t, p) for t, p in zip(function(local), tables["placements_out"])]

    def compute(self, phase, m):
        tables = self.spec["phases"].get(phase)
        env = self.env[m]
        if tables is not None:
            args = {n: self.lookup(n, m) for n in tables["inputs"]}
            for (role, target), t in zip(tables["outputs"], self.execute(phase, args)):
                if role == "output":
                    env[target] = t
                elif role == "loss":
                    self.losses[m] = t
                elif role == "update":  # a forward's update (batch norm) carries on
                    if target in self.state:
                        self.state[target] = t
                    self.updates[target] = t
        if phase == "F":  # keep what the backward (or a later send) reads
            keep = set(self.spec["keep_after_forward"]) | set(self.spec["send_forward"])
            for name in [n for n in env if n not in keep]:
                del env[name]
        elif phase in ("B", "W") or (phase == "I" and "W" not in self.spec["phases"]):
            self.finish_backward(m)

    def finish_backward(self, m):
        if m in self.backward_done:
            return
        self.backward_done.add(m)
        for name in self.spec["grads"]:
            t = self.env[m].get(name)
            if t is not None:
                self.grad_sums[name] = t.clone() if name not in self.grad_sums \
                    else self.grad_sums[name] + t
        env = self.env[m]  # only what is still to be sent back
        self.env[m] = {} if m in self.sent_back else \
            {n: env[n] for n in self.spec["send_backward"] if n in env}

    def outgoing(self, kind, m):
        names = self.spec["send_forward" if kind == "SEND_F" else "send_backward"]
        env = self.env[m]
        tensors = [self.lookup(n, m) for n in names]
        if kind == "SEND_B":
            self.sent_back.add(m)
        for n in names:  # sent: what the stage itself no longer reads is dropped
            if kind == "SEND_B" or n not in self.spec["keep_after_forward"]:
                if kind == "SEND_F" or m in self.backward_done:
                    env.pop(n, None)
        return tensors

    def update(self, received):
        """The optimizer step on the mean gradients (this stage's sums and those received)."""
        tables = self.spec["phases"].get("U")
        if tables is None:
            return
        grads = {n: t / self.microbatches for n, t in {**self.grad_sums, **received}.items()}
        args = {n: grads[n] if n in grads else self.state[n] for n in tables["inputs"]}
        for (role, target), t in zip(tables["outputs"], self.execute("U", args)):
            if role == "update":
                self.updates[target] = t


def send_whole(tensors, to_stage):
    """Send whole tensors to the ranks of `to_stage` this rank feeds (j modulo our size)."""
    mine, theirs = STAGES[STAGE]["ranks"], STAGES[to_stage]["ranks"]
    for j, dst in enumerate(theirs):
        if mine[j % len(mine)] == RANK:
            for t in tensors:
                send(t, dst)


def recv_whole(names, from_stage):
    mine, theirs = STAGES[STAGE]["ranks"], STAGES[from_stage]["ranks"]
    src = theirs[mine.index(RANK) % len(theirs)]
    return [recv(src, *TYPES[n]) for n in names]


STAGE = 0  # this rank's stage, set by `run_pipeline`
TYPES: dict = {}  # name -> (shape, dtype) of every tensor that crosses between stages


def run_pipeline(state, microbatch_inputs, microbatches):
    """This rank's action list for one step; its stage's run."""
    global STAGE
    STAGE = next(s for s, spec in enumerate(STAGES) if RANK in spec["ranks"])
    spec = STAGES[STAGE]
    run = StageRun(STAGE, state, microbatch_inputs, microbatches)
    for kind, m in spec["actions"]:
        if kind in ("SEND_F", "SEND_B"):
            send_whole(run.outgoing(kind, m), STAGE + 1 if kind == "SEND_F" else STAGE - 1)
        elif kind in ("RECV_F", "RECV_B"):
            peer = STAGE - 1 if kind == "RECV_F" else STAGE + 1
            names = STAGES[peer]["send_forward" if kind == "RECV_F" else "send_backward"]
            run.env[m].update(zip(names, recv_whole(names, peer)))
        elif kind == "UPDATE":
            for dst in dict.fromkeys(d for d, _ in spec["grads_out"]):
                send_whole([run.grad_sums[n] for d, n in spec["grads_out"] if d == dst], dst)
            received = {}
            for src in dict.fromkeys(s for s, _ in spec["grads_in"]):
                names = [n for s, n in spec["grads_in"] if s == src]
                received.update(zip(names, recv_whole(names, src)))
            run.update(received)
        else:
            run.compute(kind, m)
    finish_sends()
    return run


def gather_results(run):
    """Every stage's loss and updates, on every rank (each stage's first rank reports)."""
    mine = {}
    if STAGES[STAGE]["ranks"][0] == RANK:
        mine = {"updates": {k: t.cpu() for k, t in run.updates.items()}}
        if run.losses:
            mine["loss"] = torch.stack([run.losses[m] for m in sorted(run.losses)]).mean().cpu()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    loss, updates = None, {}
    for part in everyone:
        loss = part.get("loss", loss)
        updates.update(part.get("updates", {}))
    return loss, updates
