"""Unit tests of the paged KV block manager, with the PagedAttention paper's worked examples."""

from __future__ import annotations

import pytest

from graphpar.errors import KVCacheError
from graphpar.serving.kv_cache_manager import (
    BlockAllocator,
    BlockCopy,
    BlockManager,
    KVCacheStateError,
    NoFreeBlocksError,
    Pool,
    PreemptionMode,
    RequestStatus,
)


def test_allocator_refcounts_and_double_free():
    a = BlockAllocator(3)
    b0, b1 = a.allocate(), a.allocate()
    assert (b0, b1) == (0, 1) and a.num_free == 1 and a.num_used == 2
    assert a.incref(b0) == 2
    assert a.decref(b0) == 1 and a.num_free == 1
    assert a.decref(b0) == 0 and a.num_free == 2
    assert a.allocate() == b0  # freed blocks are reused first
    a.decref(b0)
    with pytest.raises(KVCacheStateError, match="double free"):
        a.decref(b0)
    a.allocate(), a.allocate()
    with pytest.raises(NoFreeBlocksError):
        a.allocate()


def test_fig6_prompt_of_7_tokens_block_size_4():
    """Fig. 6: 7 prompt tokens take 2 blocks (#filled 4 and 3); decode step 1 fills the last slot;
    step 2 allocates a third block."""
    m = BlockManager(num_device_blocks=9, block_size=4)
    alloc = m.allocate("A", 7)
    assert len(alloc.blocks) == 2 and alloc.copies == () and alloc.num_cached_tokens == 0
    b0, b1 = alloc.blocks
    assert m.get_block_table("A").entries() == [(b0, 4), (b1, 3)]
    assert m.slot_mapping("A") == [b0 * 4 + i for i in range(4)] + [b1 * 4 + i for i in range(3)]
    assert m.num_free_blocks() == 7

    step1 = m.append_slot("A")
    assert step1.slot.block == b1 and step1.slot.offset == 3 and not step1.new_block
    assert step1.slot_index == b1 * 4 + 3 and step1.copy is None
    assert m.get_block_table("A").entries() == [(b0, 4), (b1, 4)]
    assert m.num_free_blocks() == 7

    step2 = m.append_slot("A")
    assert step2.new_block and step2.slot.offset == 0 and step2.copy is None
    b2 = step2.slot.block
    assert b2 not in (b0, b1)
    assert m.get_block_table("A").entries() == [(b0, 4), (b1, 4), (b2, 1)]
    assert m.block_table("A", width=5, pad=-1) == [b0, b1, b2, -1, -1]
    assert m.slot_index("A", 8) == b2 * 4
    assert m.num_free_blocks() == 6
    m.free("A")
    assert m.num_free_blocks() == 9
    m.check_invariants()


def test_fig8_parallel_sampling_one_copy_on_write():
    """Fig. 8: two samples share the 7-token prompt (refcount 2). A1's write into the shared last
    block copies it once; A2 then writes in place."""
    m = BlockManager(num_device_blocks=9, block_size=4)
    b0, b1 = m.allocate("A1", 7, group="A").blocks
    m.fork("A1", "A2")
    assert m.seqs_in_group("A") == ["A1", "A2"]
    assert m.device_allocator.refcount(b0) == 2 and m.device_allocator.refcount(b1) == 2
    assert m.num_blocks_to_append("A") == 1  # exactly one copy-on-write block for the step

    r1 = m.append_slot("A1")
    assert r1.copy is not None and r1.copy.src == b1
    b3 = r1.copy.dst
    assert r1.slot.block == b3 and r1.slot.offset == 3
    assert m.device_allocator.refcount(b1) == 1 and m.device_allocator.refcount(b3) == 1

    r2 = m.append_slot("A2")
    assert r2.copy is None and r2.slot.block == b1 and r2.slot.offset == 3
    assert m.block_table("A1") == [b0, b3] and m.block_table("A2") == [b0, b1]
    assert m.device_allocator.refcount(b0) == 2
    assert m.num_free_blocks() == 9 - 3
    m.check_invariants()


def test_num_blocks_to_append_counts_cow_outside_group():
    m = BlockManager(num_device_blocks=8, block_size=4)
    m.register_prefix("p", 6)
    m.allocate("x", 6, prefix="p")  # shares both prefix blocks, the last one partial
    assert m.num_blocks_to_append("x") == 1  # the prefix keeps a reference: copy-on-write
    assert m.append_slot("x").copy is not None
    assert m.num_blocks_to_append("x") == 0
    m.check_invariants()


def test_beam_search_fork_tree_frees_blocks_at_refcount_zero():
    """Fig. 9 style: four beams share the prompt; when beams 2 and 3 die and 0/1 are forked, the
    blocks only the dead beams held return to the free list; shared blocks stay."""
    bs = 2
    m = BlockManager(num_device_blocks=32, block_size=bs)
    prompt = m.allocate("b0", 4, group="beam").blocks  # two full blocks
    for c in ("b1", "b2", "b3"):
        m.fork("b0", c)
    for b in prompt:
        assert m.device_allocator.refcount(b) == 4
    # Each beam appends 2 tokens: a new private block each (the shared blocks are full).
    own = {}
    for c in ("b0", "b1", "b2", "b3"):
        first = m.append_slot(c)
        assert first.new_block and first.copy is None
        m.append_slot(c)
        own[c] = first.slot.block
    free_before = m.num_free_blocks()
    # Beam selection: candidates 2 and 3 are dropped; 0 and 1 each get a second child.
    m.free("b2")
    m.free("b3")
    assert m.num_free_blocks() == free_before + 2  # own[b2], own[b3] hit refcount 0
    assert own["b2"] in m.device_allocator.free_blocks()
    m.fork("b0", "b0x")
    m.fork("b1", "b1x")
    for b in prompt:
        assert m.device_allocator.refcount(b) == 4
    assert m.device_allocator.refcount(own["b0"]) == 2
    # Next token: the last blocks are full, so every beam allocates; no copies.
    results = [m.append_slot(c) for c in ("b0", "b0x", "b1", "b1x")]
    assert all(r.new_block and r.copy is None for r in results)
    # A new beam forked mid-block: its first write copies exactly that one partial block.
    m.fork("b0", "b0y")
    copies = [m.append_slot(c).copy for c in ("b0y", "b0")]
    assert copies[0] == BlockCopy(results[0].slot.block, copies[0].dst) and copies[1] is None
    m.free("b0y")
    m.free("b0x")
    m.free("b1x")
    m.free("b0")
    m.free("b1")
    assert m.num_free_blocks() == 32 and m.groups() == []
    m.check_invariants()


def test_request_that_never_fits_raises_with_numbers_and_advice():
    m = BlockManager(num_device_blocks=10, block_size=16)
    with pytest.raises(KVCacheError) as err:
        m.check_request(prompt_len=100, max_new_tokens=100)
    msg = str(err.value)
    for needle in ("200 tokens", "13 blocks", "10 blocks", "16 tokens", "160 token slots"):
        assert needle in msg
    assert "KV cache more memory" in msg and "shorten" in msg
    with pytest.raises(KVCacheError):
        m.can_allocate(161)
    with pytest.raises(KVCacheError):
        m.allocate("s", 161)
    assert m.can_allocate(160) is True
    m.check_request(100, 60)  # exactly fits: no error


def test_out_of_blocks_now_is_reported_not_raised():
    m = BlockManager(num_device_blocks=4, block_size=4)
    m.allocate("a", 12)
    assert m.can_allocate(5) is False  # needs 2, only 1 free: queue the request
    assert m.can_allocate(4) is True
    with pytest.raises(NoFreeBlocksError):
        m.allocate("b", 5)
    m.allocate("b", 4)
    assert m.can_append("a") is False and m.can_append("b") is False
    with pytest.raises(NoFreeBlocksError):
        m.append_slot("a")
    m.check_invariants()  # the failed calls changed nothing


def test_watermark_applies_to_admission_only():
    m = BlockManager(num_device_blocks=4, block_size=4, watermark_blocks=1)
    assert m.can_allocate(12) is True and m.can_allocate(13) is False
    m.allocate("a", 12)
    assert m.can_append("a")  # decoding may use the watermark
    m.append_slot("a")


def test_swap_out_and_in_keeps_sharing_and_returns_mappings():
    m = BlockManager(num_device_blocks=8, num_cpu_blocks=8, block_size=4)
    b0, b1 = m.allocate("s1", 6, group="g").blocks
    m.fork("s1", "s2")
    cow = m.append_slot("s1").copy
    assert cow == BlockCopy(b1, cow.dst)
    assert m.blocks_to_swap_out("g") == 3
    mapping = m.swap_out("g")
    assert set(mapping) == {b0, b1, cow.dst}
    assert m.group_status("g") is RequestStatus.SWAPPED
    assert m.num_free_blocks(Pool.DEVICE) == 8 and m.num_free_blocks(Pool.CPU) == 5
    t1, t2 = m.get_block_table("s1"), m.get_block_table("s2")
    assert all(t1.on_cpu) and t1.blocks[0] == t2.blocks[0] == mapping[b0]
    assert m.cpu_allocator.refcount(mapping[b0]) == 2
    with pytest.raises(KVCacheStateError):
        m.slot_mapping("s1")
    m.check_invariants()

    back = m.swap_in("g")
    assert set(back) == set(mapping.values())
    assert m.group_status("g") is RequestStatus.RUNNING
    assert m.num_free_blocks(Pool.CPU) == 8 and m.num_free_blocks() == 5
    assert m.block_table("s1")[0] == m.block_table("s2")[0]
    m.check_invariants()


def test_swap_out_keeps_registered_prefix_blocks_on_device():
    m = BlockManager(num_device_blocks=8, num_cpu_blocks=8, block_size=4)
    pb = m.register_prefix("sys", 8)
    m.allocate("s", 10, prefix="sys")
    assert m.blocks_to_swap_out("s") == 1
    own = m.get_block_table("s").blocks[2]
    mapping = m.swap_out("s")
    assert list(mapping) == [own]
    t = m.get_block_table("s")
    assert t.blocks[:2] == pb and t.on_cpu == (False, False, True)
    m.unregister_prefix("sys")  # the swapped sequence still holds the prefix blocks
    assert m.device_allocator.refcount(pb[0]) == 1
    m.check_invariants()
    m.swap_in("s")
    assert m.block_table("s")[:2] == list(pb)
    m.free("s")
    assert m.num_free_blocks() == 8 and m.num_free_blocks(Pool.CPU) == 8


def test_shared_prefix_partial_last_block_is_copy_on_write():
    m = BlockManager(num_device_blocks=10, block_size=4)
    pb = m.register_prefix("sys", 6)  # blocks: full + 2 of 4 slots
    assert len(pb) == 2
    assert m.prefix_slot_mapping("sys") == [pb[0] * 4 + i for i in range(4)] + [
        pb[1] * 4,
        pb[1] * 4 + 1,
    ]
    assert m.blocks_to_allocate(9, prefix="sys") == 2  # copy of the partial block + one more
    a = m.allocate("u1", 9, prefix="sys")
    assert a.num_cached_tokens == 6 and a.copies == (BlockCopy(pb[1], a.blocks[1]),)
    assert a.blocks[0] == pb[0] and len(a.blocks) == 3
    b = m.allocate("u2", 6, prefix="sys")  # no suffix yet: shares the partial block too
    assert b.blocks == pb and b.copies == ()
    assert m.device_allocator.refcount(pb[0]) == 3 and m.device_allocator.refcount(pb[1]) == 2
    r = m.append_slot("u2")
    assert r.copy is not None and r.copy.src == pb[1]
    m.free("u1")
    m.free("u2")
    assert m.num_free_blocks() == 10 - 2  # the prefix stays reserved
    m.unregister_prefix("sys")
    assert m.num_free_blocks() == 10
    m.check_invariants()


def test_prefix_reservation_counts_against_never_fits():
    m = BlockManager(num_device_blocks=10, block_size=4)
    m.register_prefix("p", 16)  # 4 blocks reserved
    with pytest.raises(KVCacheError, match="reserved by registered prefixes"):
        m.check_request(20, 8)  # 7 blocks > 10 - 4
    m.check_request(20, 4, prefix="p")  # 6 blocks, 4 of them the prefix's own
    with pytest.raises(ValueError, match="shorter than prefix"):
        m.allocate("x", 3, prefix="p")


def test_preempt_recompute_then_resume_reprefills_all_tokens():
    m = BlockManager(num_device_blocks=6, block_size=4, preemption_mode="recompute")
    m.allocate("a", 5)
    for _ in range(4):
        m.append_slot("a")
    assert m.preemption_mode_for("a") is PreemptionMode.RECOMPUTE
    p = m.preempt("a")
    assert p.mode is PreemptionMode.RECOMPUTE and p.recompute_tokens == {"a": 9}
    assert m.group_status("a") is RequestStatus.RECOMPUTE and m.num_free_blocks() == 6
    assert m.blocks_to_resume("a") == 3 and m.can_resume("a")
    r = m.resume("a")
    (alloc,) = r.allocations
    assert alloc.num_tokens == 9 and alloc.num_cached_tokens == 0 and len(alloc.blocks) == 3
    assert m.num_tokens("a") == 9 and m.group_status("a") is RequestStatus.RUNNING
    m.check_invariants()


def test_auto_preemption_policy():
    m = BlockManager(num_device_blocks=8, num_cpu_blocks=2, block_size=4)
    m.allocate("solo", 4)
    m.allocate("s1", 8, group="pair")
    m.fork("s1", "s2")
    assert m.preemption_mode_for("solo") is PreemptionMode.RECOMPUTE
    assert m.preemption_mode_for("pair") is PreemptionMode.SWAP
    m.append_slot("s1")  # now 3 private blocks, CPU pool holds 2: swap is impossible
    assert m.preemption_mode_for("pair") is PreemptionMode.RECOMPUTE
    swap_only = BlockManager(num_device_blocks=8, num_cpu_blocks=8, preemption_mode="swap")
    swap_only.allocate("x", 3)
    assert swap_only.preempt("x").mode is PreemptionMode.SWAP


def test_recompute_mode_recomputes_groups_too():
    """The configured mode is the one policy: samples and beams are recomputed under
    "recompute" even with room to swap, keeping the prompt's full blocks shared on resume."""
    m = BlockManager(num_device_blocks=8, num_cpu_blocks=8, block_size=4,
                     preemption_mode="recompute")
    m.allocate("s1", 6, group="pair")
    m.fork("s1", "s2")
    m.append_slot("s1")  # copy-on-write of the shared last block
    m.append_slot("s2")
    assert m.can_swap_out("pair")
    assert m.preemption_mode_for("pair") is PreemptionMode.RECOMPUTE
    p = m.preempt("pair")
    assert p.mode is PreemptionMode.RECOMPUTE and p.mapping == {}
    assert p.recompute_tokens == {"s1": 7, "s2": 7}
    assert m.num_free_blocks(Pool.CPU) == 8 and m.num_free_blocks() == 8
    r = m.resume("pair", shared_tokens=6)
    assert [a.num_cached_tokens for a in r.allocations] == [0, 4]
    assert m.get_block_table("s1").blocks[0] == m.get_block_table("s2").blocks[0]
    m.check_invariants()


def test_group_is_preempted_and_resumed_all_or_nothing():
    m = BlockManager(num_device_blocks=8, num_cpu_blocks=8, block_size=2)
    m.allocate("r0", 3, group="req")
    m.fork("r0", "r1")
    m.fork("r0", "r2")
    m.preempt("req", PreemptionMode.SWAP)
    for s in ("r0", "r1", "r2"):
        assert all(m.get_block_table(s).on_cpu)
    with pytest.raises(KVCacheStateError):
        m.append_slot("r1")
    with pytest.raises(KVCacheStateError):
        m.fork("r1", "r3")
    m.resume("req")
    assert m.can_append("req") and m.num_blocks_to_append("req") == 2
    m.check_invariants()


def test_slot_mapping_and_padded_block_tables():
    m = BlockManager(num_device_blocks=16, block_size=4)
    m.allocate("x", 5)
    m.allocate("y", 9)
    bx, by = m.block_table("x"), m.block_table("y")
    assert m.block_tables(["x", "y"]) == [bx + [0], by]
    assert m.slot_mapping("y", 4, 9) == [m.slot_index("y", i) for i in range(4, 9)]
    assert m.slot_index("y", 8) == by[2] * 4
    with pytest.raises(IndexError):
        m.slot_index("x", 5)
    with pytest.raises(ValueError):
        m.block_table("y", width=2)


def test_misuse_raises_state_errors():
    m = BlockManager(num_device_blocks=4)
    m.allocate("a", 1)
    with pytest.raises(KVCacheStateError):
        m.allocate("a", 1)
    with pytest.raises(KVCacheStateError):
        m.free("nope")
    with pytest.raises(KVCacheStateError):
        m.fork("a", "a")
    with pytest.raises(KVCacheStateError):
        m.resume("a")  # running, not preempted
    with pytest.raises(ValueError):
        BlockManager(4, preemption_mode="evict")


def test_recompute_resume_after_prefix_unregistered_reprefills_the_prefix_too():
    m = BlockManager(num_device_blocks=8, block_size=4)
    m.register_prefix("sys", 8)
    m.allocate("s", 10, prefix="sys")
    m.preempt("s", PreemptionMode.RECOMPUTE)
    assert m.blocks_to_resume("s") == 1  # the prefix blocks are still there to share
    m.unregister_prefix("sys")
    assert m.num_free_blocks() == 8
    (alloc,) = m.resume("s").allocations
    assert alloc.num_cached_tokens == 0 and alloc.copies == () and len(alloc.blocks) == 3
    assert m.num_tokens("s") == 10
    m.check_invariants()


def test_a_prefix_id_registered_again_is_not_the_old_prefix():
    """Resume compares registrations, not ids: a new prefix under the old id holds other tokens."""
    m = BlockManager(num_device_blocks=8, block_size=4)
    m.register_prefix("sys", 8)
    m.allocate("s", 10, prefix="sys")
    m.preempt("s", PreemptionMode.RECOMPUTE)
    m.unregister_prefix("sys")
    m.register_prefix("sys", 8)  # same id, other tokens
    assert m.blocks_to_resume("s") == 3
    (alloc,) = m.resume("s").allocations
    assert alloc.num_cached_tokens == 0 and not set(alloc.blocks) & set(m.prefix_blocks("sys"))
    m.check_invariants()


def test_recompute_resume_keeps_the_prompt_shared():
    """3 samples of a 9-token prompt, 2 tokens each generated: re-prefilled, they share the
    prompt's 2 full blocks again (the first sequence writes them in the same step)."""
    m = BlockManager(num_device_blocks=16, block_size=4)
    m.allocate("a.0", 9, group="a")
    m.fork("a.0", "a.1")
    m.fork("a.0", "a.2")
    for _ in range(2):
        for seq in ("a.0", "a.1", "a.2"):
            m.append_slot(seq)
    m.preempt("a", PreemptionMode.RECOMPUTE)
    assert m.blocks_to_resume("a") == 9  # unshared: 3 blocks each
    assert m.blocks_to_resume("a", shared_tokens=9) == 3 + 1 + 1
    first, *others = m.resume("a", shared_tokens=9).allocations
    assert first.num_cached_tokens == 0 and len(first.blocks) == 3
    for alloc in others:
        assert alloc.blocks[:2] == first.blocks[:2] and alloc.blocks[2] != first.blocks[2]
        assert alloc.num_cached_tokens == 8 and alloc.num_tokens == 11
    assert m.device_allocator.refcount(first.blocks[0]) == 3
    assert m.num_free_blocks() == 16 - 5
    m.check_invariants()


def test_a_swapped_group_counts_the_blocks_of_its_first_step_back():
    """What swapping in and then decoding one token takes: 2 CPU blocks back, then one new block
    for each sample whose shared last block is copied on write (the last holder writes in place)."""
    m = BlockManager(num_device_blocks=6, num_cpu_blocks=6, block_size=4)
    m.allocate("g.0", 6, group="g")
    m.fork("g.0", "g.1")
    m.fork("g.0", "g.2")
    m.swap_out("g")
    assert m.blocks_to_swap_in("g") == 2
    assert m.num_blocks_to_append("g") == 2
    with pytest.raises(KVCacheStateError, match="not running"):
        m.can_append("g")
    m.swap_in("g")
    assert m.num_blocks_to_append("g") == 2
    m.check_invariants()
