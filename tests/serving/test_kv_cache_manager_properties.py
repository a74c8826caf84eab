"""Property tests of the KV block manager: random allocate/append/fork/free/swap/preempt programs
against a shadow memory that stores token ids in slots, checking invariants after every step."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from graphpar.errors import KVCacheError
from graphpar.serving.kv_cache_manager import (
    BlockManager,
    NoFreeBlocksError,
    Pool,
    PreemptionMode,
    RequestStatus,
)

POISON = -1  # what a free block's slots hold in the shadow memory


class KVCacheMachine(RuleBasedStateMachine):
    """Drives a BlockManager and a fake per-slot KV memory through the same operations.

    Every token written gets a fresh id; copy-on-write copies and swap mappings are applied to
    the fake memory exactly as the runtime would. Reading a sequence through its block table must
    give back exactly its tokens, in order.
    """

    def __init__(self) -> None:
        super().__init__()
        self.m: BlockManager | None = None
        self.tokens: dict[str, list[int]] = {}
        self.prefix_tokens: dict[str, list[int]] = {}
        self.counter = 0  # next token id
        self.names = 0  # next sequence / prefix number

    # -------------------------------------------------------------- helpers

    def name(self, kind: str) -> str:
        self.names += 1
        return f"{kind}{self.names}"

    def fresh(self, n: int) -> list[int]:
        out = list(range(self.counter, self.counter + n))
        self.counter += n
        return out

    def write(self, slot: int, token: int) -> None:
        self.mem[Pool.DEVICE][slot] = token

    def copy_block(self, src_pool: Pool, src: int, dst_pool: Pool, dst: int) -> None:
        b = self.B
        self.mem[dst_pool][dst * b : (dst + 1) * b] = self.mem[src_pool][src * b : (src + 1) * b]

    def apply_copies(self, copies) -> None:
        for c in copies:
            self.copy_block(Pool.DEVICE, c.src, Pool.DEVICE, c.dst)

    def prefill(self, alloc) -> None:
        self.apply_copies(alloc.copies)
        toks = self.tokens[alloc.seq]
        slots = self.m.slot_mapping(alloc.seq, alloc.num_cached_tokens, alloc.num_tokens)
        for pos, slot in zip(range(alloc.num_cached_tokens, alloc.num_tokens), slots):
            self.write(slot, toks[pos])

    def groups_in(self, status: RequestStatus) -> list:
        return [g for g in self.m.groups() if self.m.group_status(g) is status]

    def running_seqs(self) -> list[str]:
        return [q for g in self.groups_in(RequestStatus.RUNNING) for q in self.m.seqs_in_group(g)]

    def capacity(self) -> int:
        reserved = sum(len(self.m.prefix_blocks(p)) for p in self.m.prefixes())
        return self.m.num_device_blocks - reserved

    # ---------------------------------------------------------------- setup

    @initialize(
        block_size=st.integers(1, 4),
        num_device=st.integers(1, 16),
        num_cpu=st.integers(0, 10),
        watermark=st.integers(0, 1),
        mode=st.sampled_from([None, "swap", "recompute"]),
    )
    def setup(self, block_size, num_device, num_cpu, watermark, mode):
        self.B = block_size
        self.m = BlockManager(
            num_device, num_cpu, block_size, watermark_blocks=watermark, preemption_mode=mode
        )
        self.mem = {
            Pool.DEVICE: [POISON] * (num_device * block_size),
            Pool.CPU: [POISON] * (num_cpu * block_size),
        }

    # ---------------------------------------------------------------- rules

    @precondition(lambda self: self.m is not None and len(self.prefix_tokens) < 2)
    @rule(n=st.integers(1, 10))
    def register_prefix(self, n):
        name = self.name("p")
        try:
            ok = self.m.can_register_prefix(n)
        except KVCacheError:
            assert self.m.blocks_for_tokens(n) > self.capacity()
            return
        if not ok:
            return
        self.m.register_prefix(name, n)
        self.prefix_tokens[name] = toks = self.fresh(n)
        for slot, t in zip(self.m.prefix_slot_mapping(name), toks):
            self.write(slot, t)

    @precondition(lambda self: self.prefix_tokens)
    @rule(data=st.data())
    def unregister_prefix(self, data):
        name = data.draw(st.sampled_from(sorted(self.prefix_tokens)))
        self.m.unregister_prefix(name)
        del self.prefix_tokens[name]

    @precondition(lambda self: self.m is not None)
    @rule(data=st.data(), n=st.one_of(st.integers(0, 9), st.integers(10, 60)))
    def allocate(self, data, n):
        prefix = None
        if self.prefix_tokens and data.draw(st.booleans(), label="use_prefix"):
            prefix = data.draw(st.sampled_from(sorted(self.prefix_tokens)))
            n += len(self.prefix_tokens[prefix])
        group = None
        running = self.groups_in(RequestStatus.RUNNING)
        if running and data.draw(st.integers(0, 4), label="join") == 0:
            group = data.draw(st.sampled_from(running))
        seq = self.name("s")
        needed = self.m.blocks_to_allocate(n, prefix)
        try:
            ok = self.m.can_allocate(n, prefix)
        except KVCacheError as e:
            assert needed > self.capacity()
            assert f"{n} tokens" in str(e)
            return
        free = self.m.num_free_blocks()
        assert ok == (free - needed >= self.m.watermark_blocks)
        if needed > free:
            with pytest.raises(NoFreeBlocksError):
                self.m.allocate(seq, n, group=group, prefix=prefix)
            return
        alloc = self.m.allocate(seq, n, group=group, prefix=prefix)
        assert self.m.num_free_blocks() == free - needed
        ptoks = self.prefix_tokens[prefix] if prefix is not None else []
        assert alloc.num_cached_tokens == len(ptoks)
        self.tokens[seq] = ptoks + self.fresh(n - len(ptoks))
        self.prefill(alloc)

    @precondition(lambda self: self.m is not None and self.running_seqs())
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.running_seqs()))
        child = self.name("s")
        free = self.m.num_free_blocks()
        self.m.fork(parent, child)
        assert self.m.num_free_blocks() == free
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.m is not None and self.groups_in(RequestStatus.RUNNING))
    @rule(data=st.data())
    def decode_step(self, data):
        group = data.draw(st.sampled_from(self.groups_in(RequestStatus.RUNNING)))
        need = self.m.num_blocks_to_append(group)
        free = self.m.num_free_blocks()
        if not self.m.can_append(group):
            assert need > free
            return
        order = data.draw(st.permutations(self.m.seqs_in_group(group)))
        for seq in order:
            self.append(seq)
        assert self.m.num_free_blocks() == free - need

    @precondition(lambda self: self.m is not None and self.running_seqs())
    @rule(data=st.data())
    def append_one(self, data):
        seq = data.draw(st.sampled_from(self.running_seqs()))
        t = self.m.get_block_table(seq)
        needs_block = t.num_tokens == len(t.blocks) * self.B or (
            self.m.device_allocator.refcount(t.blocks[-1]) > 1
        )
        if needs_block and self.m.num_free_blocks() == 0:
            with pytest.raises(NoFreeBlocksError):
                self.m.append_slot(seq)
            return
        self.append(seq)

    def append(self, seq: str) -> None:
        r = self.m.append_slot(seq)
        if r.copy is not None:
            self.apply_copies([r.copy])
        assert r.slot_index == r.slot.index(self.B)
        assert r.slot.offset == (len(self.tokens[seq])) % self.B
        (tok,) = self.fresh(1)
        self.write(r.slot_index, tok)
        self.tokens[seq].append(tok)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.m.free(seq)
        del self.tokens[seq]

    @precondition(lambda self: self.m is not None and self.groups_in(RequestStatus.RUNNING))
    @rule(data=st.data())
    def swap_out(self, data):
        group = data.draw(st.sampled_from(self.groups_in(RequestStatus.RUNNING)))
        if not self.m.can_swap_out(group):
            assert self.m.blocks_to_swap_out(group) > self.m.num_free_blocks(Pool.CPU)
            with pytest.raises(NoFreeBlocksError):
                self.m.swap_out(group)
            return
        mapping = self.m.swap_out(group)
        for dev, cpu in mapping.items():
            self.copy_block(Pool.DEVICE, dev, Pool.CPU, cpu)

    @precondition(lambda self: self.m is not None and self.groups_in(RequestStatus.RUNNING))
    @rule(data=st.data(), mode=st.sampled_from([None, PreemptionMode.SWAP, "recompute"]))
    def preempt(self, data, mode):
        group = data.draw(st.sampled_from(self.groups_in(RequestStatus.RUNNING)))
        if mode is PreemptionMode.SWAP and not self.m.can_swap_out(group):
            return
        free = self.m.num_free_blocks()
        p = self.m.preempt(group, mode)
        for dev, cpu in p.mapping.items():
            self.copy_block(Pool.DEVICE, dev, Pool.CPU, cpu)
        if p.mode is PreemptionMode.RECOMPUTE:
            assert p.recompute_tokens == {q: len(self.tokens[q]) for q in p.recompute_tokens}
            assert self.m.group_status(group) is RequestStatus.RECOMPUTE
        assert self.m.num_free_blocks() >= free

    @precondition(
        lambda self: (
            self.m is not None
            and (self.groups_in(RequestStatus.SWAPPED) or self.groups_in(RequestStatus.RECOMPUTE))
        )
    )
    @rule(data=st.data())
    def resume(self, data):
        groups = self.groups_in(RequestStatus.SWAPPED) + self.groups_in(RequestStatus.RECOMPUTE)
        group = data.draw(st.sampled_from(groups))
        needed = self.m.blocks_to_resume(group)
        try:
            ok = self.m.can_resume(group)
        except KVCacheError:
            assert needed > self.capacity()
            return
        if needed > self.m.num_free_blocks():
            assert not ok
            with pytest.raises(NoFreeBlocksError):
                self.m.resume(group)
            return
        r = self.m.resume(group)
        for cpu, dev in r.mapping.items():
            self.copy_block(Pool.CPU, cpu, Pool.DEVICE, dev)
        for alloc in r.allocations:
            self.prefill(alloc)

    # ----------------------------------------------------------- invariants

    @invariant()
    def bookkeeping_is_consistent(self):
        if self.m is None:
            return
        self.m.check_invariants()
        expected = {Pool.DEVICE: Counter(), Pool.CPU: Counter()}
        for p in self.m.prefixes():
            expected[Pool.DEVICE].update(self.m.prefix_blocks(p))
        for seq in self.m.seqs():
            t = self.m.get_block_table(seq)
            for b, cpu in zip(t.blocks, t.on_cpu):
                expected[Pool.CPU if cpu else Pool.DEVICE][b] += 1
        for pool, alloc in (
            (Pool.DEVICE, self.m.device_allocator),
            (Pool.CPU, self.m.cpu_allocator),
        ):
            free = alloc.free_blocks()
            assert len(set(free)) == len(free)  # nothing freed twice
            assert alloc.num_free + len(expected[pool]) == alloc.num_blocks  # nothing leaked
            for b in range(alloc.num_blocks):
                assert alloc.refcount(b) == expected[pool][b]
                assert (b in free) == (alloc.refcount(b) == 0)

    @invariant()
    def every_sequence_reads_back_its_tokens(self):
        if self.m is None:
            return
        b = self.B
        for pool, alloc in (
            (Pool.DEVICE, self.m.device_allocator),
            (Pool.CPU, self.m.cpu_allocator),
        ):
            for blk in alloc.free_blocks():  # freed memory must not be read by anyone
                self.mem[pool][blk * b : (blk + 1) * b] = [POISON] * b
        assert set(self.m.seqs()) == set(self.tokens)
        for seq, toks in self.tokens.items():
            t = self.m.get_block_table(seq)
            assert t.num_tokens == len(toks)
            status = self.m.group_status(self.m.group_of(seq))
            if status is RequestStatus.RECOMPUTE:
                assert t.blocks == ()
                continue
            got = []
            for i in range(t.num_tokens):
                pool = Pool.CPU if t.on_cpu[i // b] else Pool.DEVICE
                got.append(self.mem[pool][t.blocks[i // b] * b + i % b])
            assert got == toks, f"sequence {seq} reads {got}, wrote {toks}"
            if status is RequestStatus.RUNNING:
                slots = self.m.slot_mapping(seq)
                assert [self.mem[Pool.DEVICE][s] for s in slots] == toks
        for name, toks in self.prefix_tokens.items():
            slots = self.m.prefix_slot_mapping(name)
            assert [self.mem[Pool.DEVICE][s] for s in slots] == toks


KVCacheMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVCacheMachine = KVCacheMachine.TestCase
