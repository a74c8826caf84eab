"""Automatic prefix caching and chunked prefill: full KV blocks kept by the key of their tokens
and everything before them, reused by later prompts, evicted least recently freed first and
only when free; long prompts prefilled in chunks beside running decodes. Tokens equal eager
PyTorch with and without either."""

import pytest
from serve_testutil import eager_greedy, prompts

from graphpar.serving.kv_cache_manager import BlockManager, block_key
from graphpar.serving.llm import LLM, SamplingParams

# --- the block manager ---------------------------------------------------------------------------


def manager(num_blocks=8, block_size=4):
    return BlockManager(num_blocks, 0, block_size, enable_prefix_caching=True)


def test_full_blocks_are_found_after_their_sequence_ends():
    m = manager()
    prompt = list(range(10))  # 2 full blocks of 4 and 2 tokens
    first = m.allocate("a", 10, tokens=prompt)
    assert first.num_cached_tokens == 0
    assert m.cache_blocks("a", prompt, 10) == 2  # the two full blocks get keys
    m.free("a")
    assert m.num_free_blocks() == 8  # cached blocks no one holds count as free
    assert m.blocks_to_allocate(10, tokens=prompt + [99]) == 3  # taking them back takes them
    again = m.allocate("b", 11, tokens=prompt + [99])
    assert again.num_cached_tokens == 8 and again.blocks[:2] == first.blocks[:2]
    held = m.allocate("c", 9, tokens=prompt[:9])  # held blocks: mapped, nothing taken
    assert held.blocks[:2] == first.blocks[:2] and held.num_cached_tokens == 8
    assert m.device_allocator.refcount(first.blocks[0]) == 2
    m.check_invariants()


def test_the_last_prompt_token_is_always_computed():
    m = manager()
    prompt = list(range(8))  # exactly 2 blocks
    m.allocate("a", 8, tokens=prompt)
    m.cache_blocks("a", prompt, 8)
    m.free("a")
    again = m.allocate("b", 8, tokens=prompt)
    assert again.num_cached_tokens == 4  # the second block is computed again (its last token)
    m.check_invariants()


def test_a_key_names_everything_before_the_block():
    m = manager()
    m.allocate("a", 9, tokens=[1, 2, 3, 4, 5, 6, 7, 8, 0])
    m.cache_blocks("a", [1, 2, 3, 4, 5, 6, 7, 8, 0], 9)
    other = m.allocate("b", 9, tokens=[9, 9, 9, 9, 5, 6, 7, 8, 0])  # same 2nd block, other 1st
    assert other.num_cached_tokens == 0
    assert block_key(None, [5, 6, 7, 8]) != block_key(block_key(None, [1, 2, 3, 4]), [5, 6, 7, 8])


def test_eviction_takes_plain_free_blocks_first_then_the_least_recently_freed():
    m = manager(num_blocks=4, block_size=2)
    for seq, prompt in (("a", [1, 2, 0]), ("b", [3, 4, 0])):
        m.allocate(seq, 3, tokens=prompt)
        m.cache_blocks(seq, prompt, 3)
    a_block, b_block = m.get_block_table("a").blocks[0], m.get_block_table("b").blocks[0]
    m.free("a")
    m.free("b")  # a's cached block is now the least recently freed
    assert m.device_allocator.num_evictable == 2
    m.allocate("c", 4, tokens=[7, 7, 7, 7])  # 2 blocks: the plain free ones, no eviction
    assert m.device_allocator.num_evictable == 2
    m.allocate("d", 1, tokens=[8])  # evicts a's block, keeps b's
    assert m.device_allocator.lookup(block_key(None, [1, 2])) is None
    assert m.device_allocator.lookup(block_key(None, [3, 4])) == b_block != a_block
    m.free("d")
    assert m.allocate("e", 3, tokens=[3, 4, 0]).num_cached_tokens == 2
    m.check_invariants()


def test_a_recomputed_sequence_maps_what_the_cache_still_holds():
    m = manager()
    prompt = list(range(10))
    blocks = m.allocate("a", 10, tokens=prompt).blocks
    m.cache_blocks("a", prompt, 10)
    m.preempt("a", "recompute")  # its blocks are free, the two full ones still cached
    assert m.blocks_to_resume("a") == 3  # the cached ones are taken back from the free ones
    resumed = m.resume("a").allocations[0]
    assert resumed.num_cached_tokens == 8 and resumed.blocks[:2] == blocks[:2]
    m.check_invariants()


def test_a_swapped_out_block_leaves_the_cache():
    """Issue 28: a swap-out moves a group's KV to the CPU pool; the device blocks it leaves
    must not be found by a later prompt (they are plain free blocks now)."""
    m = BlockManager(8, 4, 4, enable_prefix_caching=True)
    prompt = list(range(9))  # 2 full blocks of 4 and 1 token
    blocks = m.allocate("a.0", 9, group="a", tokens=prompt).blocks
    assert m.cache_blocks("a.0", prompt, 9) == 2
    m.fork("a.0", "a.1")  # two samples, as n=2 makes them
    mapping = m.swap_out("a")
    assert set(mapping) == set(blocks) and m.device_allocator.num_cached == 0
    assert m.device_allocator.lookup(block_key(None, prompt[:4])) is None
    again = m.allocate("b", 6, tokens=prompt[:5] + [99])  # its first block was a's first
    assert again.num_cached_tokens == 0
    m.check_invariants()
    swapped_in = m.swap_in("a")  # back in fresh blocks, keyed again as the sequence goes on
    assert len(swapped_in) == 3
    assert m.cache_blocks("a.0", prompt + [5], 10) == 2
    m.check_invariants()


def test_without_prefix_caching_nothing_is_kept():
    m = BlockManager(8, 0, 4)
    m.allocate("a", 9, tokens=list(range(9)))
    assert m.cache_blocks("a", list(range(9)), 9) == 0
    m.free("a")
    assert m.allocate("b", 9, tokens=list(range(9))).num_cached_tokens == 0


# --- the engine on real models -------------------------------------------------------------------

SYSTEM = prompts([27], seed=31)[0]  # 3 full blocks of 8 and 3 tokens
QUESTIONS = prompts([4, 11, 1, 7], seed=32)


def serve(llm, batch, max_tokens=6):
    outputs = llm.generate(batch, SamplingParams(max_tokens=max_tokens))
    assert all(o.error is None for o in outputs), [o.error for o in outputs]
    return outputs


@pytest.mark.parametrize("caching,chunk", [(True, None), (False, None), (True, 5), (False, 5)])
def test_tokens_equal_eager_with_and_without_caching_and_chunking(caching, chunk, models):
    module = models("gpt")
    first, second = [SYSTEM + q for q in QUESTIONS[:2]], [SYSTEM + q for q in QUESTIONS[2:]]
    with LLM(module, max_num_seqs=4, block_size=8, num_blocks=64,
             enable_prefix_caching=caching, max_num_batched_tokens=chunk) as llm:
        cold = serve(llm, first)
        warm = serve(llm, second + [first[0]])  # the first wave's blocks are free now
        stats = llm.stats
    batch = first + second + [first[0]]
    assert [o.outputs[0].token_ids for o in cold + warm] == \
        [eager_greedy(module, p, 6) for p in batch]
    if caching:  # the system prompt's 3 full blocks (the repeated prompt's 4th: its last token)
        # Chunked, the second prompt is admitted once the first's prompt is all computed.
        assert [o.num_cached_tokens for o in cold] == [0, 0 if chunk is None else 24]
        assert [o.num_cached_tokens for o in warm] == [24, 24, 24]
        assert stats.prefix_cache_hits == 72 + (0 if chunk is None else 24)
    else:
        assert [o.num_cached_tokens for o in cold + warm] == [0] * 5
        assert stats.prefix_cache_hits == 0
    assert stats.prefix_cache_queries == sum(len(p) for p in batch)
    assert stats.kv_blocks_used + stats.kv_blocks_free == 64


def test_chunked_prefill_runs_beside_decodes_within_the_budget(models):
    module = models("llama")
    short, long_ = prompts([3], seed=33)[0], prompts([40], seed=34)[0]
    with LLM(module, max_num_seqs=4, block_size=8, num_blocks=64,
             max_num_batched_tokens=8) as llm:
        engine = llm.engine
        plans = []
        schedule = engine.scheduler.schedule

        def spy():  # the real scheduler; the plans it made are kept to look at
            plans.append(schedule())
            return plans[-1]
        engine.scheduler.schedule = spy
        engine.add_request(short, SamplingParams(max_tokens=12))
        engine.step()  # the short prompt's prefill: it decodes from now on
        engine.add_request(long_, SamplingParams(max_tokens=4))
        outputs = {o.request_id: o for o in engine.run()}
    mixed = [p for p in plans if p.kind == "mixed"]
    assert len(mixed) >= 5  # 40 tokens in chunks of at most 8 - 1 beside one decode
    for plan in plans[1:]:
        assert len(plan.slots) + sum(i.end - i.start for i in plan.prefill) <= 8
    assert [o.outputs[0].token_ids for o in outputs.values()] == \
        [eager_greedy(module, short, 12), eager_greedy(module, long_, 4)]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_recompute_and_swap_stay_exact_with_cached_blocks(mode, models):
    """A pool too small for every sequence: cached blocks are taken back, sequences preempted
    (swapped out or dropped for a re-prefill) mid chunked prefill and after; tokens equal
    eager."""
    module = models("gpt")
    batch = [SYSTEM[:13] + q for q in QUESTIONS] * 2
    with LLM(module, max_num_seqs=4, block_size=4, num_blocks=14, swap_blocks=32,
             max_num_batched_tokens=6, preemption_mode=mode) as llm:
        outputs = serve(llm, batch, max_tokens=14)
        assert llm.stats.preemptions > 0 and llm.stats.prefix_cache_hits > 0
        bm = llm.engine.scheduler.block_manager
        bm.check_invariants()
        assert bm.num_free_blocks() == bm.num_device_blocks
    assert [o.outputs[0].token_ids for o in outputs] == [eager_greedy(module, p, 14) for p in batch]


def test_a_registered_prefix_is_found_by_prompts_that_do_not_name_it(models):
    """register_prefix (--system-prompt) is the pinned case of prefix caching."""
    module = models("gpt")
    with LLM(module, max_num_seqs=4, block_size=8, num_blocks=64) as llm:
        llm.register_prefix(SYSTEM)
        outputs = serve(llm, [SYSTEM + q for q in QUESTIONS])
    assert [o.num_cached_tokens for o in outputs] == [24] * 4
    assert [o.outputs[0].token_ids for o in outputs] == \
        [eager_greedy(module, SYSTEM + q, 6) for q in QUESTIONS]


@pytest.mark.slow
def test_two_ranks_with_caching_and_chunking_equal_eager(models):
    module = models("llama")
    batch = [SYSTEM + q for q in QUESTIONS]
    with LLM(module, max_num_seqs=4, block_size=8, num_blocks=64, tensor_parallel=2,
             max_num_batched_tokens=7) as llm:
        cold = serve(llm, batch[:2], max_tokens=8)
        warm = serve(llm, batch[2:], max_tokens=8)
    assert [o.num_cached_tokens for o in warm] == [24, 24]
    assert [o.outputs[0].token_ids for o in cold + warm] == \
        [eager_greedy(module, p, 8) for p in batch]
