"""Tensor-parallel serving: the plans of the decoder programs (heads sharded, caches by kv heads,
step inputs replicated, one plan for every size), and generation on 2 CPU ranks over gloo with
the same tokens as eager generation."""

import pytest
import torch
from serve_testutil import eager_beam_search, eager_greedy, prompts

from graphpar.errors import GenerationError
from graphpar.ir.graph import Role
from graphpar.ir.graph_template import GraphTemplate
from graphpar.ir.layout import Layout
from graphpar.ir.verify import verify
from graphpar.models import get_model
from graphpar.passes.autoshard.serving import is_kv_cache, plan_serving
from graphpar.serving.compile import compile_decoder
from graphpar.serving.llm import LLM, SamplingParams

S0, S1, S2, R = (Layout.parse(t) for t in ("{S(0)}", "{S(1)}", "{S(2)}", "{R}"))


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def serving_programs(module, tp, plan):
    programs = compile_decoder(module, block_size=8, num_blocks=16)
    return plan_serving(programs.graphs, tp, plan)


def attention_heads(program):
    """Local query heads of every paged_attention in the base device program."""
    return {n.inputs[0].type.shape[1] for n in program.base.nodes if n.op == "paged_attention"}


# --- plans (no processes) -----------------------------------------------------------------------

def test_megatron_plan_shards_heads_and_mlp(models):
    programs = serving_programs(models("gpt"), 2, "megatron")
    layouts = programs["decode"].layouts
    assert {name: layouts[f"blocks.0.{name}"] for name in (
        "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight", "attn.proj.bias",
        "mlp.up.weight", "mlp.down.weight", "ln1.weight")} == {
        "attn.qkv.weight": S0, "attn.qkv.bias": S0, "attn.proj.weight": S1,
        "attn.proj.bias": R, "mlp.up.weight": S0, "mlp.down.weight": S1, "ln1.weight": R}
    assert attention_heads(programs["decode"]) == attention_heads(programs["prefill"]) == {2}
    # row-parallel outputs are summed across the ranks once per projection
    reductions = [n for n in programs["decode"].base.nodes
                  if n.op in ("all_reduce", "reduce_scatter")]
    assert len(reductions) == 2 * 2  # 2 layers x (attention proj, MLP down)


@pytest.mark.parametrize("plan", ["auto", "megatron"])
def test_serving_plan_constraints(models, plan):
    """Caches by kv heads, step inputs whole, one set of weight layouts for both programs, and
    the lowered templates specialize to fresh sizes."""
    programs = serving_programs(models("llama"), 2, plan)  # 4 heads, 2 kv heads
    decode, prefill = programs["decode"], programs["prefill"]
    for program in (decode, prefill):
        for v in program.base.inputs:
            if is_kv_cache(v.name):
                assert program.layouts[v.name] == S2 and v.type.shape[2] == 1
            elif v.role is Role.INPUT:
                assert program.layouts[v.name] == R, v.name
        assert attention_heads(program) == {2}
    shared = set(decode.layouts) & set(prefill.layouts)
    assert {n: decode.layouts[n] for n in shared} == {n: prefill.layouts[n] for n in shared}
    template = GraphTemplate.fit(prefill.base, prefill.base_sizes, prefill.variants)
    graph = template.specialize(T=37, N=5)
    verify(graph)
    assert next(v for v in graph.inputs if v.name == "input_ids").type.shape == (1, 37)


def test_one_kv_head_is_replicated_and_queries_still_split():
    module = get_model("llama", "tiny", seq_len=64, n_kv_heads=1).module.eval()
    programs = serving_programs(module, 2, "megatron")
    assert programs["decode"].layouts["key_cache.0"] == R
    assert attention_heads(programs["decode"]) == {2}


def test_ranks_that_do_not_divide_the_kv_heads_keep_the_cache_whole(models):
    programs = serving_programs(models("gpt"), 3, "auto")  # 4 heads on 3 ranks
    assert programs["decode"].layouts["key_cache.0"] == R
    assert attention_heads(programs["decode"]) == {4}


def test_unknown_plan(models):
    with pytest.raises(Exception, match="unknown serving plan 'zero'"):
        serving_programs(models("gpt"), 2, "zero")


# --- generation on 2 ranks (gloo processes) -----------------------------------------------------

@pytest.mark.parametrize("name,plan", [("gpt", "auto"), ("llama", "megatron")])
def test_two_ranks_greedy_equals_eager_bundled(name, plan, models):
    module = models(name)
    batch = prompts([3, 9, 5, 1, 12, 7], seed=4)
    with LLM(module, max_num_seqs=4, block_size=8, num_blocks=64, tensor_parallel=2,
             tp_plan=plan) as llm:
        outputs = llm.generate(batch, SamplingParams(max_tokens=10))
        assert tokens(outputs) == [eager_greedy(module, p, 10) for p in batch]
        if name == "gpt":  # forks and copy-on-write block copies on every rank
            prompt = prompts([6], seed=9)[0]
            before = llm.stats.cow_copies
            out = llm.generate([prompt], SamplingParams(max_tokens=6, beam_width=3, n=3))[0]
            assert [c.token_ids for c in out.outputs] == eager_beam_search(module, prompt, 3, 6)
            assert llm.stats.cow_copies > before


@pytest.mark.parametrize("name,plan", [("hf-gpt2", "megatron"), ("hf-llama", "auto")])
def test_two_ranks_greedy_equals_hugging_face_generate(name, plan, models):
    module = models(name)
    batch = prompts([4, 11, 2, 6, 8], seed=5)
    with LLM(module, max_num_seqs=4, block_size=8, num_blocks=64, tensor_parallel=2,
             tp_plan=plan) as llm:
        outputs = llm.generate(batch, SamplingParams(max_tokens=12))
    for prompt, out in zip(batch, outputs):
        expected = module.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                   pad_token_id=0)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == expected


def test_two_ranks_swap_preemption_keeps_tokens_exact(models):
    """Too few blocks for every sequence: sequences are swapped out and back in on both ranks."""
    module = models("gpt")
    batch = prompts([7, 5, 9, 6], seed=11)
    with LLM(module, max_num_seqs=4, block_size=4, num_blocks=12, swap_blocks=32,
             preemption_mode="swap", tensor_parallel=2) as llm:
        outputs = llm.generate(batch, SamplingParams(max_tokens=14))
        assert llm.stats.preemptions > 0 and llm.stats.swapped_blocks > 0
    assert tokens(outputs) == [eager_greedy(module, p, 14) for p in batch]


def test_a_worker_that_dies_gives_a_clear_error(models):
    llm = LLM(models("gpt"), max_num_seqs=2, block_size=8, num_blocks=16, tensor_parallel=2)
    try:
        worker = llm.engine.model.ranks.group.processes[1]
        worker.kill()
        worker.wait()
        with pytest.raises(GenerationError, match="tensor-parallel rank 1 exited"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
    finally:
        llm.close()
    assert not torch.distributed.is_initialized()
