"""Pipeline-parallel serving: the decoder's programs cut into stages by layer (each stage its
blocks, their weights and caches; the hidden states cross), and generation on 2-3 CPU stage
processes over gloo with the same tokens as eager generation."""

import pytest
import torch
from serve_testutil import eager_greedy, prompts

from graphpar.errors import GenerationError
from graphpar.ir.graph import Role
from graphpar.ir.graph_template import GraphTemplate
from graphpar.ir.verify import verify
from graphpar.models import get_model
from graphpar.serving.compile import compile_decoder
from graphpar.serving.llm import LLM, SamplingParams
from graphpar.serving.stage_split import even_layers


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def params(graph):
    return {v.name for v in graph.inputs if v.role is Role.PARAM}


# --- the cut (no processes) ---------------------------------------------------------------------

def test_two_stages_hold_their_blocks_and_pass_the_hidden_state(models):
    programs = compile_decoder(models("gpt"), block_size=8, num_blocks=16, pipeline_stages=2)
    stages = programs.stages
    assert stages.layers == [(0, 1), (1, 2)]
    first, last = (stages.programs[s]["decode"][0] for s in (0, 1))
    assert params(first) == {"tok_emb.weight", "pos_emb.weight"} | {
        n for n in params(programs.graphs["decode"][0]) if n.startswith("blocks.0.")}
    assert params(last) == {"ln_f.weight", "ln_f.bias", "lm_head.weight"} | {
        n for n in params(programs.graphs["decode"][0]) if n.startswith("blocks.1.")}
    # each stage has its own block's cache, named as the first of its own
    for graph in (first, last):
        assert sorted(v.name for v in graph.inputs if "cache" in v.name) == [
            "key_cache.0", "value_cache.0"]
    # GPT's stages pass one tensor, the residual stream [N, 1, d], and nothing back
    assert len(stages.sends["decode"][0]) == 1 and stages.sends["decode"][1] == []
    sent = next(v for v in last.inputs if v.name == stages.sends["decode"][0][0])
    assert sent.type.shape == (2, 1, 64)
    assert last.outputs[0].value.type.shape[-1] == 256  # the logits
    for kind in ("prefill", "decode"):
        for s in (0, 1):
            base, sizes, variants = stages.programs[s][kind]
            verify(GraphTemplate.fit(base, sizes, variants).specialize(
                **{k: v + 9 for k, v in sizes.items()}))


@pytest.mark.slow
def test_values_for_later_stages_are_relayed():
    """LLaMA computes its rotary tables once: stage 0 makes them and every later stage reads
    them, so stage 1 passes them on beside the hidden state."""
    module = get_model("llama", "tiny", seq_len=64, n_layers=4).module.eval()
    stages = compile_decoder(module, block_size=8, num_blocks=16, pipeline_stages=3,
                             stage_layers=(1, 2, 1)).stages
    assert stages.layers == [(0, 1), (1, 3), (3, 4)]
    sends = stages.sends["decode"]
    assert len(sends[0]) == len(sends[1]) == 3 and sends[2] == []
    assert set(sends[0]) & set(sends[1]) == set(sends[0]) - {sends[0][-1]}  # relayed tables
    middle = stages.programs[1]["decode"][0]
    assert sorted(v.name for v in middle.inputs if v.name.startswith("key_cache")) == [
        "key_cache.0", "key_cache.1"]


def test_stage_layers_that_do_not_split_the_model_are_refused(models):
    with pytest.raises(GenerationError, match=r"stage layers \[1, 2\] do not split"):
        compile_decoder(models("gpt"), block_size=8, num_blocks=16, pipeline_stages=2,
                        stage_layers=(1, 2))
    with pytest.raises(GenerationError, match="cannot cut a decoder of 2 blocks into 3"):
        even_layers(2, 3)
    with pytest.raises(GenerationError, match="not both"):
        compile_decoder(models("gpt"), pipeline_stages=2, tensor_parallel=2)
    assert even_layers(5, 2) == [3, 2]


# --- generation on stage processes (gloo) -------------------------------------------------------

def test_two_stages_greedy_equals_eager(models):
    module = models("llama")
    batch = prompts([3, 9, 5, 1, 12, 7], seed=4)
    with LLM(module, max_num_seqs=4, block_size=8, num_blocks=64, pipeline_stages=2) as llm:
        outputs = llm.generate(batch, SamplingParams(max_tokens=10))
        assert tokens(outputs) == [eager_greedy(module, p, 10) for p in batch]
        assert llm.engine.model.ranks.summary() == "2 pipeline stages, decoder blocks 0-0, 1-1"


@pytest.mark.slow
def test_three_stages_with_swap_preemption_equal_eager():
    """Relayed values, uneven stages, and sequences swapped out and back in on every stage."""
    torch.manual_seed(0)
    module = get_model("llama", "tiny", seq_len=64, n_layers=4).module.eval()
    batch = prompts([5, 4, 11, 3], seed=2)
    with LLM(module, max_num_seqs=4, block_size=8, num_blocks=12, swap_blocks=24,
             preemption_mode="swap", pipeline_stages=3, stage_layers=(1, 2, 1)) as llm:
        outputs = llm.generate(batch, SamplingParams(max_tokens=16, ignore_eos=True))
        assert llm.stats.preemptions > 0
    assert tokens(outputs) == [eager_greedy(module, p, 16) for p in batch]


@pytest.mark.slow
def test_two_stages_greedy_equals_hugging_face_generate(models):
    module = models("hf-gpt2")
    batch = prompts([4, 11, 2, 6], seed=5)
    with LLM(module, max_num_seqs=4, block_size=8, num_blocks=64, pipeline_stages=2) as llm:
        outputs = llm.generate(batch, SamplingParams(max_tokens=12))
    for prompt, out in zip(batch, outputs):
        expected = module.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                   pad_token_id=0)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == expected
