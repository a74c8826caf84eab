"""Pipelined training steps: every schedule, in this process and on gloo ranks, gives the loss,
gradients, updated parameters and optimizer state of eager PyTorch + torch.optim on the full
batch (microbatch by microbatch for batch norm), and sends the bytes its programs predict."""

import copy

import pytest
import torch
from pipeline_check import assert_matches_eager

from graphpar.capture import Adam, capture_training
from graphpar.compiler.driver import ModelSpec
from graphpar.compiler.pipelined import compile_pipeline, pipeline_of
from graphpar.errors import GraphparError, ScheduleError, UsageError
from graphpar.ir.schedule import COMPUTE_KINDS, ActionKind
from graphpar.models import get_model
from graphpar.passes.pipeline.schedules import SCHEDULES
from graphpar.runtime import pipeline as runtime

MICROBATCHES = 4
BATCH = 8


def captured_pipeline(name: str, stages: int, schedule: str = "gpipe", **config):
    ex = get_model(name, "tiny", train=True, batch_size=BATCH, **config)
    spec = ModelSpec(name, ex.module, tuple(ex.inputs), ex.loss_fn, tuple(ex.targets))
    micro = [t[:BATCH // MICROBATCHES] for t in (*ex.inputs, *ex.targets)]
    captured = capture_training(copy.deepcopy(ex.module), micro[:len(ex.inputs)], ex.loss_fn,
                                micro[len(ex.inputs):], optimizer=Adam(), keep_grads=True)
    return pipeline_of(captured, stages, MICROBATCHES, schedule, spec=spec, optimizer=Adam())


@pytest.fixture(scope="module")
def gpt_two_stages():
    return captured_pipeline("gpt", 2)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_every_schedule_equals_eager(gpt_two_stages, schedule):
    pipe = gpt_two_stages.with_schedule(schedule)
    run = assert_matches_eager(pipe)
    assert run.tensors_left == 0  # every stash and received tensor was let go
    ran = {(s.stage, s.action.kind, s.action.microbatch) for s in run.spans}
    # in this process the computations are timed (transfers are a mailbox)
    assert ran == {(s, a.kind, a.microbatch) for s, actions in pipe.schedule.items()
                   for a in actions if a.kind in COMPUTE_KINDS | {ActionKind.UPDATE}}
    if schedule == "zb":  # the backward really is split: W runs apart from I
        assert any(s.action.kind is ActionKind.W for s in run.spans)


def test_a_lost_microbatch_gradient_is_caught(gpt_two_stages, monkeypatch):
    done = runtime.StageRunner._backward_done

    def forget_the_first(self, m):
        if m == 0:
            self.program = copy.copy(self.program)
            grads, self.program.grads = self.program.grads, ()
            done(self, m)
            self.program.grads = grads
        else:
            done(self, m)

    monkeypatch.setattr(runtime.StageRunner, "_backward_done", forget_the_first)
    check = gpt_two_stages.check()
    assert not check.within_tolerance
    assert check.errors["parameters"].tolerance_used > 1  # the update saw 3 of 4 gradients


def test_on_gloo_ranks(gpt_two_stages):
    pipe = gpt_two_stages.with_schedule("1f1b")
    # each boundary is several tensors, which cross as one message per microbatch
    stages = pipe.programs.stages
    assert len(stages[0].send_forward) > 1 and len(stages[1].send_backward) > 1
    run = assert_matches_eager(pipe, processes=True)
    # every tensor crossing is f32: the packed messages need no padding, so gloo carried
    # exactly each tensor's bytes
    crossing = {n for s in stages for n in (*s.send_forward, *s.send_backward)}
    assert {pipe.programs.types[n].dtype for n in crossing} == {torch.float32}
    assert run.bytes_counted == run.bytes_sent
    assert {s.rank for s in run.spans} == {0, 1}
    assert len(run.spans) == sum(len(actions) for actions in pipe.schedule.values())
    # a rank's actions are timed in order, one after the other
    for rank in (0, 1):
        spans = [s for s in run.spans if s.rank == rank]
        assert all(a.end_s <= b.start_s + 1e-6 for a, b in zip(spans, spans[1:]))


def test_bad_requests_are_named(gpt_two_stages):
    ex = get_model("mlp", "tiny", train=True, batch_size=6)
    with pytest.raises(GraphparError, match="multiple of 4"):
        compile_pipeline(ex.module, ex.inputs, loss_fn=ex.loss_fn, targets=ex.targets,
                         microbatches=4)
    with pytest.raises(UsageError, match="unknown pipeline schedule"):
        compile_pipeline(ex.module, ex.inputs, loss_fn=ex.loss_fn, targets=ex.targets,
                         microbatches=2, schedule="interleaved")
    with pytest.raises(ScheduleError, match="at least as many microbatches as stages"):
        pipeline_of(gpt_two_stages.captured, 2, 1, "1f1b")


def test_split_microbatches():
    x = torch.arange(12).reshape(6, 2)
    parts = runtime.split_microbatches({"x": x}, 3)
    assert [p["x"].tolist() for p in parts] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]],
                                                 [[8, 9], [10, 11]]]


# ------------------------------------------------------------------------------- slow: all

@pytest.mark.slow
@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("name", ["gpt", "llama", "bert", "moe", "wide_resnet"])
def test_bundled_models_every_schedule(name, stages):
    pipe = captured_pipeline(name, stages)
    for schedule in sorted(SCHEDULES):
        assert_matches_eager(pipe.with_schedule(schedule))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt", "wide_resnet"])
def test_four_gloo_ranks_every_schedule(name):
    pipe = captured_pipeline(name, 4)
    for schedule in sorted(SCHEDULES):
        assert_matches_eager(pipe.with_schedule(schedule), processes=True)


@pytest.fixture(scope="module")
def gpt_on_one_plus_two(gpt_two_stages):
    # stages of 1 and 2 devices: 3 ranks, stage 1's phases planned by the ILP on 1x2
    return gpt_two_stages.on_submeshes({1: "1x2"})


def test_a_stage_sharded_on_two_devices(gpt_on_one_plus_two):
    # stages of 1 and 2 devices (3 in all): stage 1's phases are planned by the auto-shard ILP
    # on its 1x2 sub-mesh and run as SPMD programs, each device on its own shards
    pipe = gpt_on_one_plus_two.with_schedule("1f1b")
    phases = pipe.sharded[1]
    assert set(phases) == {"F", "B", "I", "W", "U"}
    assert all(p.mesh.size == 2 for p in phases.values())
    # the update's device program holds slices of (some) parameters and optimizer state
    update = phases["U"]
    whole = update.global_graph.inputs_by_name()
    sliced = [v.name for v in update.device_program.inputs
              if v.type.numel < whole[v.name].type.numel]
    assert sliced, "the ILP sharded nothing: the test would not exercise a sharded stage"
    assert_matches_eager(pipe)


def cross_mesh_prediction(pipe):
    """Per stage, what the cost model says its received tensors cost inside it: Alpa's local
    all-gather of the tiles (`cross_mesh_cost(...).bytes_inside`), and that every tensor
    crosses once (`bytes_across` == its bytes)."""
    from graphpar.cost.communication import cross_mesh_cost
    from graphpar.passes.pipeline.lower_mpmd import transfers

    meshes = runtime.stage_meshes(pipe.stages, pipe.sharded)
    inside = [0] * pipe.stages
    for phase, _, dst, plan in transfers(pipe.programs, pipe.devices):
        if plan.dim is None and plan.tiles > 1:  # no dim divides: sent whole to each device
            assert plan.bytes_across == plan.tiles * plan.type.nbytes
            continue
        cost = cross_mesh_cost(plan.type.nbytes, meshes[dst], 1.0, 0.0)
        assert cost.bytes_across == plan.bytes_across == plan.type.nbytes
        inside[dst] += cost.bytes_inside * (1 if phase == "U" else pipe.microbatches)
    return inside


def assert_one_process_per_device(pipe):
    """One gloo process per device: equal to eager, every rank ran its stage's actions, the
    tiles crossed once (measured == predicted) and were all-gathered inside the receiving
    sub-mesh exactly as the cost model prices it."""
    run = assert_matches_eager(pipe, processes=True)
    ranks = {s.rank: s.stage for s in run.spans}
    assert ranks == {r: s for s, devices in enumerate(pipe.devices) for r in devices}
    for rank, stage in ranks.items():
        assert len([s for s in run.spans if s.rank == rank]) == len(pipe.schedule[stage])
    assert run.gathered_bytes == cross_mesh_prediction(pipe)
    # the stages' phases ran their collectives and boundary gathers on their own process
    # groups; a stage may send nothing but the tiles it gathers (wide_resnet's stage 1 on 4
    # stages only counts a batch norm's steps, and passes the activations on)
    assert all(run.intra_stage_bytes[s] >= run.gathered_bytes[s] for s in pipe.sharded)
    assert any(run.intra_stage_bytes[s] > run.gathered_bytes[s] for s in pipe.sharded)
    return run


def test_a_sharded_stage_on_three_gloo_ranks(gpt_on_one_plus_two):
    pipe = gpt_on_one_plus_two.with_schedule("1f1b")
    run = assert_one_process_per_device(pipe)
    # every tensor tiles evenly here: each byte crossed once
    assert sum(run.bytes_sent) == pipe.programs.step_bytes(pipe.microbatches)
    assert run.gathered_bytes[0] == 0 < run.gathered_bytes[1]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "zb"])
def test_a_sharded_stage_on_three_gloo_ranks_other_schedules(gpt_on_one_plus_two, schedule):
    assert_one_process_per_device(gpt_on_one_plus_two.with_schedule(schedule))


@pytest.mark.slow
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_unequal_sub_meshes_of_two_and_four_on_six_gloo_ranks(gpt_two_stages, schedule):
    pipe = gpt_two_stages.on_submeshes({0: "1x2", 1: "2x2"}).with_schedule(schedule)
    assert pipe.devices == [(0, 1), (2, 3, 4, 5)]
    assert_one_process_per_device(pipe)


@pytest.mark.slow
def test_gloo_ranks_time_repeated_steps_after_the_checked_one(gpt_two_stages):
    """`timed_steps`: the stage processes run more steps from the starting state (a sharded
    stage too) and time them; the checked step's outputs are the first step's."""
    pipe = gpt_two_stages.with_schedule("1f1b").on_submeshes({1: "1x2"})
    check = pipe.check(processes=True, timed_steps=2, warmup=1)
    assert check.within_tolerance, "\n".join(check.lines())
    run = pipe.last_run
    times = run.step_times
    # one process per device: stage 0 on rank 0, stage 1 sharded on ranks 1 and 2
    assert pipe.devices == [(0,), (1, 2)]
    assert times.steps == 2 and times.warmup == 1 and len(times.wall) == 3
    assert [len(s) for s in run.stage_compute_seconds] == [2, 2]
    for stage, seconds in enumerate(run.stage_compute_seconds):  # timed on the stage's first
        assert all(0 < c <= w for c, w in zip(seconds, times.wall[pipe.devices[stage][0]]))


def moved_update_plan(pipe):
    """A plan as slice-stages gives it (every node's stage, microbatches, logical meshes) in
    which lm_head's update sits on the other stage than its gradient."""
    from types import SimpleNamespace

    from graphpar.passes.pipeline.partition import forward_backward_optimizer

    graph = pipe.captured.graph
    _, _, optimizer = forward_backward_optimizer(graph)
    stage_of = dict(pipe.programs.stage_of)
    moved = [n for n in graph.nodes if n in optimizer and n.module == "optimizer.lm_head"]
    assert moved and {stage_of[n] for n in moved} == {1}
    stage_of.update({n: 0 for n in moved})
    return SimpleNamespace(stages=(SimpleNamespace(logical_mesh=(1,)),
                                   SimpleNamespace(logical_mesh=(1, 1))),
                           stage_of=stage_of, microbatches=MICROBATCHES)


@pytest.mark.slow
def test_a_stage_plan_with_a_gradient_updated_on_another_stage(gpt_two_stages):
    # the summed gradient crosses stages before the update
    from graphpar.compiler.pipelined import pipeline_of_plan

    pipe = gpt_two_stages
    planned = pipeline_of_plan(pipe.captured, moved_update_plan(pipe), "1f1b", spec=pipe.spec,
                               optimizer=pipe.optimizer)
    assert [(src, dst) for src, dst, _ in planned.programs.grad_transfers] == [(1, 0)]
    assert not planned.sharded
    assert_matches_eager(planned)  # the measured bytes include the gradient sent at UPDATE


@pytest.mark.slow
def test_a_gradient_updated_on_another_stage_on_gloo_ranks(gpt_two_stages):
    from graphpar.compiler.pipelined import pipeline_of_plan

    pipe = gpt_two_stages
    planned = pipeline_of_plan(pipe.captured, moved_update_plan(pipe), "zb", spec=pipe.spec,
                               optimizer=pipe.optimizer)
    assert_matches_eager(planned, processes=True)


def test_estimated_timeline_counts_every_flop_once_per_microbatch(gpt_two_stages, tmp_path):
    import dataclasses

    from graphpar.cost.cluster import get_cluster
    from graphpar.ir.printer import node_flops
    from graphpar.passes.pipeline.partition import forward_backward_optimizer

    pipe = gpt_two_stages.with_schedule("1f1b")
    # Without a compute table the roofline is FLOPs at peak: the FLOPs can be counted.
    flops_only = dataclasses.replace(get_cluster("cpu"), compute=())
    timeline = pipe.estimate(flops_only)
    graph = pipe.captured.graph
    fwd, bwd, opt = forward_backward_optimizer(graph)
    per_microbatch = sum(node_flops(n) for n in graph.nodes if n in fwd or n in bwd)
    once = sum(node_flops(n) for n in opt)
    peak = get_cluster("cpu").peak_flops("fp32")
    # recomputed scalars (Adam's bias corrections on each stage) add a few FLOPs at most
    assert sum(timeline.compute_seconds) * peak == pytest.approx(
        MICROBATCHES * per_microbatch + once, rel=1e-3)
    assert 0 < timeline.bubble_fraction < 1 and timeline.step_seconds > 0
    # The preset's roofline adds each op's memory traffic beyond its FLOPs and a call overhead.
    assert sum(pipe.estimate("cpu").compute_seconds) > sum(timeline.compute_seconds)
    pipe.run(*pipe.spec.inputs, *pipe.spec.targets)
    trace = pipe.trace(tmp_path / "pipeline.json")
    assert len([e for e in trace["traceEvents"] if e.get("ph") == "X"]) == len(
        pipe.last_run.spans)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt", "llama", "bert", "moe", "wide_resnet"])
def test_sharded_stages_every_schedule(name):
    # 4 stages on 6 devices: stages 1 and 3 each planned by the ILP on a sub-mesh of 2
    pipe = captured_pipeline(name, 4).on_submeshes({1: "1x2", 3: "2x1"})
    for schedule in sorted(SCHEDULES):
        assert_matches_eager(pipe.with_schedule(schedule))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt", "llama", "bert", "moe", "wide_resnet"])
def test_eight_devices_on_gloo_ranks_every_schedule(name):
    # 4 stages x sub-meshes of 2 devices: 8 devices, one gloo process each
    pipe = captured_pipeline(name, 4).on_submeshes({0: "1x2", 1: "2x1", 2: "1x2", 3: "2x1"})
    for schedule in sorted(SCHEDULES):
        assert_one_process_per_device(pipe.with_schedule(schedule))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt", "llama", "bert", "moe", "wide_resnet"])
def test_unequal_sub_meshes_on_eight_gloo_ranks_every_schedule(name):
    # 4 stages on 1 + 1 + 2 + 4 devices
    pipe = captured_pipeline(name, 4).on_submeshes({2: "1x2", 3: "2x2"})
    assert pipe.devices == [(0,), (1,), (2, 3), (4, 5, 6, 7)]
    for schedule in sorted(SCHEDULES):
        assert_one_process_per_device(pipe.with_schedule(schedule))


@pytest.mark.slow
def test_the_stage_dp_plan_on_eight_devices_runs_equal_to_eager():
    """graphpar.compile(pipeline="auto") on a 2x4 mesh: whatever stages and sub-meshes the DP
    picks, one step on gloo ranks equals eager."""
    import graphpar

    ex = get_model("gpt", "tiny", train=True, batch_size=BATCH)
    pipe = graphpar.compile(ex.module, ex.inputs, mesh="2x4", mode="train", loss_fn=ex.loss_fn,
                            targets=ex.targets, optimizer=Adam(), cluster="cpu",
                            keep_grads=True, pipeline="auto", microbatches=MICROBATCHES)
    assert sum(s.submesh[0] * s.submesh[1] for s in pipe.plan.stages) == 8
    assert_matches_eager(pipe, processes=True)


@pytest.mark.slow
def test_a_parameter_tied_across_stages():
    # GPT with its LM head tied to the token embedding: the weight is read by the first stage
    # (embedding) and the last (LM head); its update is the first stage's, and the last
    # stage's gradient contribution is sent back with the backward and summed there
    pipe = captured_pipeline("gpt", 2, tie_embeddings=True)
    assert pipe.captured.graph.attrs["tied"] == (("tok_emb.weight", "lm_head.weight"),)
    readers = {s.stage for s in pipe.programs.stages for phase in "FB"
               if "lm_head.weight" in (pipe.programs.stages[s.stage].program(phase)
                                       .inputs_by_name())}
    assert readers == {0, 1}
    for schedule in sorted(SCHEDULES):
        assert_matches_eager(pipe.with_schedule(schedule))
    assert_one_process_per_device(pipe.with_schedule("1f1b").on_submeshes({1: "1x2"}))
