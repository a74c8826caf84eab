"""Serving never wedges: preempted multi-sequence groups (samples, beams) come back by swap and
by recompute, a prefix registered mid-flight cannot starve admitted work, generate() is all or
nothing, and the engine serves new requests after each of these (tokens equal eager)."""

import pytest
from serve_testutil import eager_beam_search, eager_greedy, prompts

from graphpar.errors import GenerationError
from graphpar.serving.kv_cache_manager import Pool, PreemptionMode
from graphpar.serving.llm import LLM, SamplingParams

GROUPS = {  # the second request of each situation: 3 samples or 3 beams of one prompt
    "samples": SamplingParams(max_tokens=4, n=3),
    "beams": SamplingParams(max_tokens=4, beam_width=3, n=3),
}


def expected_group(module, prompt, params):
    if params.use_beam_search:
        return eager_beam_search(module, prompt, params.beam_width, params.max_tokens)
    return [eager_greedy(module, prompt, params.max_tokens)] * params.n


def assert_served(module, llm, batch, params, outputs):
    """No error, every completion equal eager, every block back, and still serving."""
    assert [o.error for o in outputs] == [None] * len(batch)
    for prompt, p, out in zip(batch, params, outputs):
        got = [c.token_ids for c in out.outputs]
        if p.num_seqs > 1:
            assert got == expected_group(module, prompt, p)
        else:
            assert got == [eager_greedy(module, prompt, p.max_tokens)]
    bm = llm.engine.scheduler.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks() == bm.num_device_blocks
    assert bm.num_free_blocks(Pool.CPU) == bm.num_cpu_blocks
    assert llm.stats.stalled == 0
    (again,) = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3))
    assert again.error is None and again.outputs[0].token_ids == eager_greedy(module, [1, 2, 3], 3)


@pytest.mark.parametrize("kind", sorted(GROUPS))
def test_a_swapped_group_swaps_back_in(kind, models):
    """6 blocks of 4 tokens: the group of 3 is swapped out and needs 4 blocks to come back,
    which the swap-in check used to count as 7 (blocks + one per sequence)."""
    module = models("gpt")
    batch = [list(range(10, 16)), [1, 2, 3, 4]]
    params = [SamplingParams(max_tokens=10), GROUPS[kind]]
    llm = LLM(module, block_size=4, num_blocks=6, max_num_seqs=8)
    outputs = llm.generate(batch, params)
    assert llm.stats.preemptions > 0 and llm.stats.swapped_blocks > 0
    assert llm.stats.swap_preemptions > 0
    assert_served(module, llm, batch, params, outputs)


@pytest.mark.parametrize("kind", sorted(GROUPS))
def test_recompute_mode_never_swaps(kind, models, monkeypatch):
    """preemption_mode="recompute" holds for samples and beams too: the situation above, where
    auto mode swaps the group of 3 out, recomputes it instead (with swap space to spare)."""
    module = models("gpt")
    batch = [list(range(10, 16)), [1, 2, 3, 4]]
    params = [SamplingParams(max_tokens=10), GROUPS[kind]]
    llm = LLM(module, block_size=4, num_blocks=6, max_num_seqs=8, preemption_mode="recompute")
    bm = llm.engine.scheduler.block_manager
    preempted = []
    preempt = bm.preempt

    def spy(group, mode=None):
        preempted.append(preempt(group, mode))
        return preempted[-1]
    monkeypatch.setattr(bm, "preempt", spy)
    outputs = llm.generate(batch, params)
    assert any(len(p.recompute_tokens) == 3 for p in preempted)  # the group was preempted
    assert all(p.mode is PreemptionMode.RECOMPUTE for p in preempted)
    assert llm.stats.preemptions == len(preempted)
    assert llm.stats.swap_preemptions == 0 and llm.stats.swapped_blocks == 0
    assert_served(module, llm, batch, params, outputs)


@pytest.mark.parametrize("kind", sorted(GROUPS))
def test_a_recomputed_group_resumes_with_its_prompt_shared(kind, models):
    """A CPU pool of 1 block cannot hold the group, so it is recomputed: its 3 sequences
    re-prefill sharing the prompt's full blocks (unshared they would need 9 of 6 blocks)."""
    module = models("gpt")
    batch = [[7, 8, 9], list(range(20, 28))]
    params = [SamplingParams(max_tokens=18), GROUPS[kind]]
    llm = LLM(module, block_size=4, num_blocks=6, swap_blocks=1, max_num_seqs=8)
    outputs = llm.generate(batch, params)
    assert llm.stats.preemptions > 0
    assert_served(module, llm, batch, params, outputs)


def test_a_prefix_that_would_starve_admitted_work_is_refused(models):
    module = models("gpt")
    (prompt,) = prompts([10], seed=31)
    llm = LLM(module, block_size=4, num_blocks=6, max_num_seqs=4)
    engine = llm.engine
    engine.add_request(prompt, SamplingParams(max_tokens=12))  # up to 22 tokens: 6 blocks
    engine.step()
    with pytest.raises(GenerationError, match="in flight.*too little KV memory"):
        llm.register_prefix([5, 6, 7, 8, 9])
    assert engine.scheduler.block_manager.prefixes() == []
    (out,) = engine.run()
    assert out.error is None and out.outputs[0].token_ids == eager_greedy(module, prompt, 12)
    prefix = llm.register_prefix([5, 6, 7, 8, 9])  # nothing in flight: it fits now
    (out,) = llm.generate([[5, 6, 7, 8, 9, 10]], SamplingParams(max_tokens=3), prefix=prefix)
    assert out.outputs[0].token_ids == eager_greedy(module, [5, 6, 7, 8, 9, 10], 3)


def test_a_prefix_registered_mid_flight_keeps_serving(models):
    """A prefix that leaves room is registered between steps; running requests finish, waiting
    ones use it, and unregistering it while a request waits makes that one prefill it all."""
    module = models("gpt")
    system = [9, 8, 7, 6, 5]
    batch = prompts([4, 6], seed=32)
    llm = LLM(module, block_size=4, num_blocks=16, max_num_seqs=1)
    engine = llm.engine
    first = engine.add_request(batch[0], SamplingParams(max_tokens=6))
    engine.step()
    prefix = llm.register_prefix(system)
    on_prefix = [engine.add_request(system + b, SamplingParams(max_tokens=5), prefix=prefix)
                 for b in batch]
    engine.step()
    llm.engine.unregister_prefix(prefix)  # the second one still waits (one sequence a step)
    outputs = {o.request_id: o for o in engine.run()}
    assert outputs[first].outputs[0].token_ids == eager_greedy(module, batch[0], 6)
    for request_id, b in zip(on_prefix, batch):
        assert outputs[request_id].outputs[0].token_ids == eager_greedy(module, system + b, 5)
    assert engine.stats.stalled == 0
    assert engine.scheduler.block_manager.num_free_blocks() == 16


def test_generate_is_all_or_nothing(models):
    module = models("gpt")
    llm = LLM(module, block_size=4, num_blocks=16, max_num_seqs=4)
    with pytest.raises(GenerationError, match="prompt 1 is text"):
        llm.generate([[1, 2, 3], "hello"])
    with pytest.raises(GenerationError, match="prompt 0 holds 1.5"):
        llm.generate([[1, 1.5]])
    assert not llm.engine.has_unfinished_requests()
    (out,) = llm.generate([[4, 5]], SamplingParams(max_tokens=2))
    assert out.outputs[0].token_ids == eager_greedy(module, [4, 5], 2)
    assert [r for r in llm.engine.requests] == [out.request_id]  # no orphan was run


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(GROUPS))
def test_two_ranks_preempted_groups_come_back(kind, models):
    """The swap and recompute situations above on 2 CPU ranks (one engine, one block manager),
    with samples and with beams."""
    module = models("gpt")
    for swap_blocks, batch, first in ((None, [list(range(10, 16)), [1, 2, 3, 4]], 10),
                                      (1, [[7, 8, 9], list(range(20, 28))], 18)):
        params = [SamplingParams(max_tokens=first), GROUPS[kind]]
        with LLM(module, block_size=4, num_blocks=6, swap_blocks=swap_blocks, max_num_seqs=8,
                 tensor_parallel=2) as llm:
            outputs = llm.generate(batch, params)
            assert llm.stats.preemptions > 0
            assert_served(module, llm, batch, params, outputs)


def test_no_block_is_both_copied_from_and_into_in_one_step():
    """A partial block P shared by requests A and Z (a prefix since unregistered), and B's
    samples sharing their last block: A's append copies P; B needs a block, so Z is preempted,
    freeing its hold on P. Preempting before any append, A then writes P in place and B's copy
    goes elsewhere; appending first, B's copy-on-write would take P as its destination."""
    from graphpar.serving.kv_cache_manager import BlockManager
    from graphpar.serving.scheduler import (
        Request,
        RequestStatus,
        Scheduler,
        SchedulerConfig,
        SequenceState,
    )

    bm = BlockManager(num_device_blocks=3, block_size=4, preemption_mode="recompute")
    bm.register_prefix("p", 2)
    running = []
    for name, tokens, prefix, n in (("a", [1, 2], "p", 1), ("b", [3, 4, 5], None, 2),
                                    ("z", [1, 2], "p", 1)):
        request = Request(name, tokens, SamplingParams(n=n), arrival_time=len(running),
                          status=RequestStatus.RUNNING)
        bm.allocate(f"{name}.0", len(tokens), group=name, prefix=prefix)
        request.seqs.append(SequenceState(f"{name}.0", list(tokens), len(tokens)))
        for i in range(1, n):
            bm.fork(f"{name}.0", f"{name}.{i}")
            request.seqs.append(SequenceState(f"{name}.{i}", list(tokens), len(tokens)))
        running.append(request)
    bm.unregister_prefix("p")
    scheduler = Scheduler(SchedulerConfig(), bm)
    scheduler.running = running
    plan = scheduler.schedule()
    assert [r.request_id for r, _ in plan.preempted] == ["z"]
    assert [r.request_id for r in plan.decode] == ["a", "b"]
    sources, targets = {c.src for c in plan.copies}, {c.dst for c in plan.copies}
    assert not sources & targets
    bm.check_invariants()
