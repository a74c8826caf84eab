"""Shared prompt prefixes: prefilled once, mapped into every request's block table, and the
generated tokens are those of eager generation on the whole prompt."""

import pytest
from serve_testutil import eager_greedy, prompts

from graphpar.serving.kv_cache_manager import Pool
from graphpar.serving.llm import LLM, SamplingParams


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_requests_on_a_shared_prefix_equal_eager(name, models):
    module = models(name)
    system = prompts([20], seed=21)[0]  # 2 full blocks of 8 and 4 tokens of a third
    suffixes = prompts([3, 9, 1, 6], seed=22)
    with LLM(module, max_num_seqs=4, block_size=8, num_blocks=64) as llm:
        engine, bm = llm.engine, llm.engine.scheduler.block_manager
        prefix = llm.register_prefix(system)
        first_block = bm.prefix_blocks(prefix)[0]
        prompt_tokens = engine.stats.prompt_tokens
        outputs = llm.generate([system + s for s in suffixes], SamplingParams(max_tokens=8),
                               prefix=prefix)
        # only the suffixes were prefilled; the prefix's partly filled block was copied on write
        assert engine.stats.prompt_tokens - prompt_tokens == sum(len(s) for s in suffixes)
        assert engine.stats.cow_copies >= len(suffixes)
        # the requests are done; only the prefix holds its blocks
        assert bm.device_allocator.refcount(first_block) == 1
        llm.engine.unregister_prefix(prefix)
        bm.check_invariants()
        assert bm.num_free_blocks() == bm.num_device_blocks
        assert bm.num_free_blocks(Pool.CPU) == bm.num_cpu_blocks
    expected = [eager_greedy(module, system + s, 8) for s in suffixes]
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_blocks_are_shared_while_requests_run(models):
    system = prompts([16], seed=23)[0]  # exactly 2 full blocks: shared, never copied
    with LLM(models("gpt"), max_num_seqs=4, block_size=8, num_blocks=64) as llm:
        engine, bm = llm.engine, llm.engine.scheduler.block_manager
        prefix = llm.register_prefix(system)
        for suffix in prompts([2, 5, 3], seed=24):
            engine.add_request(system + suffix, SamplingParams(max_tokens=4), prefix=prefix)
        engine.step()  # the prefill step admits all three
        assert [bm.device_allocator.refcount(b) for b in bm.prefix_blocks(prefix)] == [4, 4]
        used = bm.num_device_blocks - bm.num_free_blocks()
        assert used == 2 + 3  # the prefix once, one block of its own per request
        engine.run()


def test_bad_prefix_use_fails_alone(models):
    with LLM(models("gpt"), max_num_seqs=4, block_size=8, num_blocks=64) as llm:
        prefix = llm.register_prefix([5, 6, 7])
        outputs = llm.generate([[5, 6, 7, 8], [1, 2, 3, 4], [5, 6, 7]],
                               SamplingParams(max_tokens=2), prefix=prefix)
        assert outputs[0].error is None and len(outputs[0].outputs[0].token_ids) == 2
        assert "does not start with prefix" in outputs[1].error
        assert "followed by at least one token" in outputs[2].error
        bad = llm.engine.add_request([1, 2], SamplingParams(max_tokens=2), prefix="nope")
        (out,) = [o for o in llm.engine.run() if o.request_id == bad]
        assert "unknown prefix 'nope'" in out.error
