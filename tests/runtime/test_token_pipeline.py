"""Token-pipelined training steps (TeraPipe): a pipeline's stages run a causal LM's step token
slice by token slice, each stage keeping the keys and values of a sequence's earlier slices,
and the step equals eager PyTorch + torch.optim on the whole sequence (loss, gradients,
updated parameters, Adam state), in this process and on gloo ranks."""

import re

import pytest
import torch
from pipeline_check import assert_matches_eager

from graphpar.capture import Adam
from graphpar.compiler.pipelined import compile_pipeline
from graphpar.compiler.token_pipelined import parse_token_slices, token_pipeline
from graphpar.errors import ScheduleError, UsageError
from graphpar.ir.graph import OutputRole, Role
from graphpar.ir.schedule import Action, ActionKind, format_schedule, validate_token_order
from graphpar.models import get_model
from graphpar.models.common import lm_loss
from graphpar.passes.pipeline.partition import forward_backward_optimizer
from graphpar.passes.pipeline.schedules import token_schedule
from graphpar.runtime import token_pipeline as runtime

SEQ = 8
BATCH = 4
MICROBATCHES = 2


def layers_to_stages(graph, stages):
    """Forward nodes to stages by transformer block (block b of n on stage b * stages // n),
    so that every stage holds attention layers and their keys and values."""
    forward, _, _ = forward_backward_optimizer(graph)
    block = re.compile(r"(?:blocks|h)\.(\d+)\.")
    found = [int(m.group(1)) for n in forward if (m := block.search((n.module or "") + "."))]
    blocks = max(found) + 1
    assign, stage = {}, 0
    for node in graph.nodes:
        if node in forward:
            m = block.search((node.module or "") + ".")
            if m:
                stage = max(stage, int(m.group(1)) * stages // blocks)
            assign[node] = stage
    return assign


def whole_pipeline(module, inputs, targets, loss_fn, stages=2):
    return compile_pipeline(module, inputs, loss_fn=loss_fn, targets=targets, optimizer=Adam(),
                            stages=stages, microbatches=MICROBATCHES, schedule="gpipe",
                            forward_stage=layers_to_stages, keep_grads=True)


def bundled(name, token_slices, stages=2, **overrides):
    ex = get_model(name, "tiny", train=True, batch_size=BATCH, seq_len=SEQ, **overrides)
    pipe = whole_pipeline(ex.module, ex.inputs, ex.targets, ex.loss_fn, stages)
    return token_pipeline(pipe, token_slices, "gpipe")


@pytest.fixture(scope="module")
def gpt_sliced():
    return bundled("gpt", [5, 2, 1])


@pytest.fixture(scope="module")
def llama_sliced():
    return bundled("llama", [5, 3])  # 4 query heads share 2 key-value heads


# --- schedules ------------------------------------------------------------------------------

def test_token_gpipe_runs_slices_forward_in_order_and_backward_in_reverse():
    text = format_schedule(token_schedule("gpipe", 2, 1, 2))
    assert text == (
        "stage 0: F0 SEND_F0 F1 SEND_F1 RECV_B1 B1 RECV_B0 B0 UPDATE\n"
        "stage 1: RECV_F0 F0 RECV_F1 F1 B1 SEND_B1 B0 SEND_B0 UPDATE")


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages, microbatches, slices",
                         [(2, 1, 1), (2, 2, 3), (3, 1, 4), (4, 2, 4), (4, 4, 2)])
def test_token_schedules_are_valid(name, stages, microbatches, slices):
    schedule = token_schedule(name, stages, microbatches, slices)  # validates
    for actions in schedule.values():
        computed = [a for a in actions if a.kind in (ActionKind.F, ActionKind.B)]
        assert len(computed) == 2 * microbatches * slices


def test_token_1f1b_holds_fewer_items_than_gpipe():
    def peak(schedule):
        live = most = 0
        for a in schedule[0]:
            live += (a.kind is ActionKind.F) - (a.kind is ActionKind.B)
            most = max(most, live)
        return most

    # stage 0 of 2 stages, 3 slices: one item of warm-up beyond a whole sequence
    assert peak(token_schedule("1f1b", 2, 4, 3)) == 2 - 1 + 3 == 4
    assert peak(token_schedule("gpipe", 2, 4, 3)) == 12


def test_a_slice_out_of_order_is_named():
    schedule = token_schedule("gpipe", 2, 1, 2)
    order = schedule[0]
    order[0], order[2] = order[2], order[0]  # F1 before F0 on stage 0
    with pytest.raises(ScheduleError, match=r"stage 0: F1 \(microbatch 0, slice 1\) needs the "
                                            r"keys and values of slice 0"):
        validate_token_order(schedule, 2)
    backward = token_schedule("gpipe", 2, 1, 2)
    b = [i for i, a in enumerate(backward[1]) if a.kind is ActionKind.B]
    backward[1][b[0]], backward[1][b[1]] = backward[1][b[1]], backward[1][b[0]]
    with pytest.raises(ScheduleError, match="B0 .* needs the gradients into its keys and values "
                                            "from slice 1"):
        validate_token_order(backward, 2)
    with pytest.raises(ScheduleError, match="unknown token-sliced schedule 'zb'"):
        token_schedule("zb", 2, 2, 2)


def test_token_slices_option():
    assert parse_token_slices("3", 8) == [3, 3, 2]
    assert parse_token_slices("5,2,1", 8) == [5, 2, 1]
    assert parse_token_slices([8], 8) == [8]
    with pytest.raises(UsageError, match="sum to the sequence length 8 \\(they sum to 7\\)"):
        parse_token_slices("5,2", 8)
    with pytest.raises(UsageError, match="choose between 1 and 8 slices"):
        parse_token_slices("9", 8)
    with pytest.raises(UsageError, match="a number of slices or a comma list"):
        parse_token_slices("two", 8)


# --- the slice programs ---------------------------------------------------------------------

def test_a_middle_slice_reads_past_keys_and_returns_their_gradients(gpt_sliced):
    programs = gpt_sliced.programs
    assert [(s.offset, s.length) for s in programs.slices] == [(0, 5), (5, 2), (7, 1)]
    graph = programs.slices[1].programs.graph  # 2 tokens after 5, microbatch of 2 sequences
    user = {v.name: v.type.shape for v in graph.inputs if v.role is Role.INPUT}
    assert user == {"input_ids": (2, 2), "target": (2, 2),
                    **{f"past_{k}.{i}": (2, 4, 5, 16) for i in range(2) for k in ("key", "value")},
                    **{f"grad_{k}.{i}": (2, 4, 7, 16) for i in range(2) for k in ("key", "value")}}
    caches = {o.target: o.value.type.shape for o in graph.outputs if o.role is OutputRole.OUTPUT}
    assert caches == {f"{k}.{i}": (2, 4, 7, 16) for i in range(2) for k in ("key", "value")}
    into_past = {o.target for o in graph.outputs
                 if o.role is OutputRole.GRAD and o.target.startswith("past_")}
    assert into_past == {f"past_{k}.{i}" for i in range(2) for k in ("key", "value")}
    # each layer's keys and values live on the stage of that layer
    for s, stage in enumerate(programs.slices[1].programs.stages):
        reads = {v.name for v in stage.forward.inputs if v.name.startswith("past_")}
        assert reads == {f"past_key.{s}", f"past_value.{s}"}
    last = programs.slices[2].programs.graph
    assert not any(v.name.startswith("grad_") for v in last.inputs)  # nothing after it


# --- equal to eager -------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gpt_token_pipeline_equals_eager(gpt_sliced, schedule):
    run = assert_matches_eager(gpt_sliced.with_schedule(schedule))
    assert run.tensors_left == 0  # every stash, cache and cache gradient was let go
    items = {(s.stage, s.action.kind, s.action.microbatch) for s in run.spans
             if s.action.kind in (ActionKind.F, ActionKind.B)}
    assert len(items) == 2 * 2 * MICROBATCHES * 3  # stages x (F, B) x items


@pytest.mark.slow  # the ILP plans 7 phases
def test_a_stage_sharded_on_two_devices_equals_eager(gpt_sliced):
    sharded = gpt_sliced.with_schedule("1f1b").on_submeshes({1: "1x2"})  # 3 devices in all
    phases = sharded.sharded[1]
    assert [sorted(p) for p in phases["slices"]] == [["B", "F"]] * 3 and "U" in phases
    layouts = {str(v.layout) for n in phases["U"].global_graph.nodes for v in n.outputs}
    assert layouts - {"{R,R}"}, "the ILP shards some of the update on the sub-mesh"
    assert_matches_eager(sharded)


@pytest.mark.slow
def test_a_sharded_stage_on_gloo_ranks(gpt_sliced):
    sharded = gpt_sliced.with_schedule("1f1b").on_submeshes({1: "1x2"})
    run = assert_matches_eager(sharded, processes=True)
    assert {s.rank for s in run.spans} == {0, 1}  # the sub-mesh runs in its stage's process


def test_a_lost_key_value_gradient_is_caught(gpt_sliced, monkeypatch):
    compute = runtime.TokenStage.compute

    def forget(self, action: Action) -> None:  # later slices' gradients never reach slice j
        compute(self, action)
        for mb in (r.inputs for r in self.runners):
            for tensors in mb:
                for name in [n for n in tensors if n.startswith("grad_")]:
                    tensors[name] = torch.zeros_like(tensors[name])

    monkeypatch.setattr(runtime.TokenStage, "compute", forget)
    check = gpt_sliced.check()
    assert not check.within_tolerance
    assert check.errors["gradients"].tolerance_used > 100
    assert check.errors["loss"].max_abs_error < 1e-5  # the forward is still right


@pytest.mark.slow  # its captures take about 10 s of CPU
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_llama_gqa_token_pipeline_equals_eager(llama_sliced, schedule):
    graph = llama_sliced.programs.slices[1].programs.graph
    assert graph.input("past_key.0").type.shape == (2, 2, 5, 16)
    assert_matches_eager(llama_sliced.with_schedule(schedule))


# --- gloo ranks, more stages, Hugging Face ----------------------------------------------------

@pytest.mark.slow
def test_gpt_token_pipeline_on_two_gloo_ranks(gpt_sliced):
    run = assert_matches_eager(gpt_sliced.with_schedule("1f1b"), processes=True)
    assert {s.rank for s in run.spans} == {0, 1}


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_four_stages_on_four_gloo_ranks(schedule):
    tokens = bundled("gpt", [4, 2, 1, 1], stages=4, n_layers=4)
    run = assert_matches_eager(tokens.with_schedule(schedule), processes=True)
    assert {s.rank for s in run.spans} == {0, 1, 2, 3}


@pytest.mark.slow
def test_hf_gpt2_token_pipeline_equals_eager():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64,
                                     vocab_size=256, use_cache=False, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                     eos_token_id=0, pad_token_id=0)
    config._attn_implementation = "sdpa"
    model = transformers.GPT2LMHeadModel(config).train()  # tied: wte on stage 0, head on 1
    generator = torch.Generator().manual_seed(1)
    ids, target = (torch.randint(0, 256, (BATCH, SEQ), generator=generator) for _ in range(2))

    def loss(out, labels):  # the whole model returns its output, a slice's adapter the logits
        return lm_loss(getattr(out, "logits", out), labels)

    pipe = whole_pipeline(model, (ids,), (target,), loss)
    tokens = token_pipeline(pipe, [3, 4, 1], "1f1b")
    assert tokens.programs.grad_transfers  # the tied weight's gradient from both stages
    assert_matches_eager(tokens)
    assert_matches_eager(tokens, processes=True)
