"""Paged KV-cache block manager (vLLM's design): block allocators, block tables, sharing, swap.

The manager hands out *block ids*; it never touches tensors. A KV block holds the keys and values
of ``block_size`` consecutive tokens of one sequence (for every layer and head: the runtime's
cache tensors are indexed by the same block id). In the serving engine the scheduler
(:mod:`graphpar.serving.scheduler`) owns the manager and is its only caller (vLLM v1's split);
the engine runs what the scheduler's step plan says, built from what the manager decided:

* :meth:`BlockManager.slot_mapping` / :meth:`BlockManager.slot_index`: where each new token's KV
  is written (flat slot ``block_id * block_size + offset``);
* :meth:`BlockManager.block_table`: the physical block ids the attention kernel reads, padded;
* :class:`BlockCopy` lists (copy-on-write) and swap mappings: block copies the runtime performs
  before the model runs.

Vocabulary (PagedAttention, SOSP'23, §4): a *sequence* is one token stream (one sample or beam);
a *sequence group* is the sequences of one request, allocated, preempted and resumed
all-or-nothing. ``fork`` shares every block (reference counts); writing into a shared block copies
it first (copy-on-write). A registered *prefix* reserves blocks once; sequences that start with it
map their first logical blocks to them.

Within one engine step the runtime performs the copies in this order, then runs the model:
swap-out copies (device -> CPU), swap-in copies (CPU -> device), copy-on-write copies (device ->
device, batched in one launch). A block freed by a swap-out may be the destination of a swap-in or
a copy of the same step, hence the order. Free finished sequences between steps, and make every
preemption of a step before any ``append_slot`` call of that step: then no block of one step's
copy-on-write batch is both a source and a destination. (Preempting only a group's own appends
is not enough: a partly filled prefix block two groups share can be one group's copy source
and, freed by the other's preemption, a destination of a third group's copy.)

Two kinds of failure are kept apart:

* a request that can never fit, even alone in an empty device pool, raises
  :class:`graphpar.errors.KVCacheError` (a user error: raise KV memory or shorten the request);
* running out of blocks *now* is normal: ``can_allocate`` / ``can_append`` / ``can_swap_in`` /
  ``can_resume`` answer ``False`` and the engine queues or preempts. Calling a mutating method
  anyway raises :class:`NoFreeBlocksError` (an engine bug, not a user error).
"""

from __future__ import annotations

import enum
from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from graphpar.errors import KVCacheError

__all__ = [
    "Allocation",
    "BlockAllocator",
    "BlockCopy",
    "BlockKey",
    "BlockManager",
    "BlockTable",
    "KVCacheStateError",
    "NoFreeBlocksError",
    "Pool",
    "Preemption",
    "PreemptionMode",
    "RequestStatus",
    "Resumption",
    "Slot",
    "AppendResult",
    "block_key",
]

DEFAULT_BLOCK_SIZE = 16

SeqId = Hashable
GroupId = Hashable
PrefixId = Hashable


class KVCacheStateError(RuntimeError):
    """The engine used the manager wrongly (unknown sequence, fork of a swapped sequence, ...)."""


class NoFreeBlocksError(KVCacheStateError):
    """A mutating call needed more free blocks than the pool has now; check ``can_*`` first."""


class Pool(enum.Enum):
    """Which physical block pool a block id belongs to."""

    DEVICE = "device"
    CPU = "cpu"


class PreemptionMode(enum.Enum):
    """How a preempted sequence group gives its device blocks back (PagedAttention §4.5)."""

    SWAP = "swap"  # copy its blocks to the CPU pool; swap them back in later
    RECOMPUTE = "recompute"  # drop its blocks; re-prefill prompt + generated tokens later


class RequestStatus(enum.Enum):
    """Where a request (a sequence group) is: the scheduler's queue and where its KV lives.

    One enum for the scheduler's requests and the block manager's groups. The manager holds a
    group only from its allocation to its last free, so its groups are RUNNING, SWAPPED or
    RECOMPUTE; WAITING and FINISHED are the scheduler's (no blocks before, none after).
    """

    WAITING = "waiting"  # queued, not admitted yet: no blocks
    RUNNING = "running"  # all blocks on the device; may be scheduled
    SWAPPED = "swapped"  # preempted by swap: private blocks in the CPU pool
    RECOMPUTE = "recompute"  # preempted by recompute: no blocks; needs a re-prefill
    FINISHED = "finished"  # done, failed or aborted: every block freed


@dataclass(frozen=True)
class Slot:
    """One token's place in the device cache: physical block id and offset inside the block."""

    block: int
    offset: int

    def index(self, block_size: int) -> int:
        """Flat slot index ``block * block_size + offset`` (what the cache-write kernel takes)."""
        return self.block * block_size + self.offset


@dataclass(frozen=True)
class BlockCopy:
    """Copy the whole of device block ``src`` into device block ``dst`` (copy-on-write)."""

    src: int
    dst: int


@dataclass(frozen=True)
class AppendResult:
    """What :meth:`BlockManager.append_slot` decided for one new token.

    The runtime performs ``copy`` (if any) before writing the token's KV at ``slot``.
    """

    slot: Slot
    slot_index: int
    copy: BlockCopy | None
    new_block: bool


@dataclass(frozen=True)
class Allocation:
    """Blocks given to a sequence for its prompt.

    The runtime performs ``copies`` (copy-on-write of a shared prefix's partial last block), then
    prefills token positions ``num_cached_tokens .. num_tokens - 1``; positions below
    ``num_cached_tokens`` are a registered prefix whose KV is already in the cache.
    """

    seq: SeqId
    blocks: tuple[int, ...]
    num_tokens: int
    num_cached_tokens: int
    copies: tuple[BlockCopy, ...]


@dataclass(frozen=True)
class BlockTable:
    """Snapshot of one sequence's block table (logical block i -> ``blocks[i]``)."""

    blocks: tuple[int, ...]
    on_cpu: tuple[bool, ...]
    num_tokens: int
    block_size: int

    @property
    def num_filled_last(self) -> int:
        """Filled slots of the last block (the paper's ``#filled``); 0 when there is no block."""
        if not self.blocks:
            return 0
        return self.num_tokens - (len(self.blocks) - 1) * self.block_size

    def entries(self) -> list[tuple[int, int]]:
        """``(physical block, #filled)`` per logical block, as drawn in the paper's Fig. 6."""
        out = []
        for i, b in enumerate(self.blocks):
            out.append((b, min(self.block_size, self.num_tokens - i * self.block_size)))
        return out


@dataclass(frozen=True)
class Preemption:
    """What :meth:`BlockManager.preempt` did.

    SWAP: ``mapping`` is device block -> CPU block; the runtime copies those blocks to host memory.
    RECOMPUTE: ``recompute_tokens`` is sequence -> token count (prompt + generated) to re-prefill.
    """

    group: GroupId
    mode: PreemptionMode
    mapping: dict[int, int]
    recompute_tokens: dict[SeqId, int]


@dataclass(frozen=True)
class Resumption:
    """What :meth:`BlockManager.resume` did.

    SWAP: ``mapping`` is CPU block -> device block; the runtime copies them back.
    RECOMPUTE: ``allocations`` give the fresh blocks; the runtime re-prefills each sequence.
    """

    group: GroupId
    mode: PreemptionMode
    mapping: dict[int, int]
    allocations: tuple[Allocation, ...]


class BlockAllocator:
    """A pool of ``num_blocks`` physical blocks with a free list and reference counts.

    ``allocate`` returns a block with reference count 1; ``decref`` returns it to the free list
    when the count reaches 0. Freeing a free block raises :class:`KVCacheStateError`.

    With ``caching`` (the device pool under prefix caching), a block may carry a *key*: the
    identity of the tokens whose KV it holds (:func:`block_key`). A keyed block whose count
    reaches 0 is not wiped: it waits, still findable by :meth:`lookup`, among the *evictable*
    blocks in least-recently-freed order. It counts as free; ``allocate`` takes a plain free
    block first and evicts the least recently freed keyed block only when none is left.
    """

    def __init__(self, num_blocks: int, pool: Pool = Pool.DEVICE, caching: bool = False) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.pool = pool
        self.num_blocks = num_blocks
        self.caching = caching
        self._refcount = [0] * num_blocks
        # A stack popped from the end: block 0 is handed out first, freed blocks are reused first.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._key_of: dict[int, BlockKey] = {}
        self._block_of: dict[BlockKey, int] = {}

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds (evictable cached blocks included)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks with a reference count above 0."""
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks with a key (held or evictable)."""
        return len(self._key_of)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def allocate(self) -> int:
        """Take a free block (evicting the least recently freed cached one if it must); its
        reference count becomes 1 and it has no key."""
        if self._free:
            block = self._free.pop()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._key_of.pop(block)]
        else:
            raise NoFreeBlocksError(f"the {self.pool.value} pool has no free block")
        self._refcount[block] = 1
        return block

    def incref(self, block: int, n: int = 1) -> int:
        """Add ``n`` references to an allocated block; returns the new count."""
        self._check_live(block)
        self._refcount[block] += n
        return self._refcount[block]

    def decref(self, block: int, n: int = 1) -> int:
        """Drop ``n`` references; at 0 the block goes back to the free list (a keyed block: to
        the evictable ones, most recent last). Returns the count."""
        self._check_live(block)
        if n > self._refcount[block]:
            raise KVCacheStateError(
                f"{self.pool.value} block {block} has {self._refcount[block]} references, "
                f"cannot drop {n}"
            )
        self._refcount[block] -= n
        if self._refcount[block] == 0:
            if block in self._key_of:
                self._evictable[block] = None
            else:
                self._free.append(block)
        return self._refcount[block]

    def refcount(self, block: int) -> int:
        """References to ``block`` (0 when free)."""
        return self._refcount[block]

    def free_blocks(self) -> list[int]:
        """The free blocks, a copy: the plain free list, then the evictable cached blocks."""
        return list(self._free) + list(self._evictable)

    # --- cached blocks (prefix caching) -------------------------------------------------------

    def lookup(self, key: BlockKey) -> int | None:
        """The block holding ``key``'s tokens, held or evictable, or None."""
        return self._block_of.get(key)

    def key_of(self, block: int) -> BlockKey | None:
        return self._key_of.get(block)

    def set_key(self, block: int, key: BlockKey) -> bool:
        """Record that held ``block`` now holds ``key``'s tokens. False (nothing recorded) when
        caching is off, the block has a key already, or another block holds the key."""
        self._check_live(block)
        if not self.caching or block in self._key_of or key in self._block_of:
            return False
        self._key_of[block] = key
        self._block_of[key] = block
        return True

    def drop_key(self, block: int) -> None:
        """Forget the key of held ``block`` (its KV is leaving the pool): no lookup finds it,
        and at reference count 0 it goes back to the plain free list."""
        self._check_live(block)
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._block_of[key]

    def take(self, block: int) -> None:
        """One more reference to a cached block: an evictable one is taken back (count 1)."""
        if self._refcount[block] == 0:
            if block not in self._evictable:
                raise KVCacheStateError(f"{self.pool.value} block {block} is free, not cached")
            del self._evictable[block]
            self._refcount[block] = 1
        else:
            self._refcount[block] += 1

    def check_cache(self) -> None:
        """Raise KVCacheStateError if the key maps or the evictable blocks are inconsistent."""
        if {b: k for k, b in self._block_of.items()} != self._key_of:
            raise KVCacheStateError(f"{self.pool.value} pool: block keys are not one-to-one")
        for block in self._evictable:
            if self._refcount[block] or block not in self._key_of:
                raise KVCacheStateError(f"{self.pool.value} block {block} is evictable but held "
                                        f"or has no key")
        if set(self._evictable) & set(self._free):
            raise KVCacheStateError(f"{self.pool.value} pool: a block is free and evictable")

    def _check_live(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise KVCacheStateError(f"{self.pool.value} block {block} is out of range")
        if self._refcount[block] == 0:
            raise KVCacheStateError(f"{self.pool.value} block {block} is free (double free?)")


BlockKey = tuple[int, tuple[int, ...]]  # (the previous block's key hash, this block's tokens)


def block_key(parent: BlockKey | None, tokens: Sequence[int]) -> BlockKey:
    """The identity of a full block: the hash of everything before it, and its own tokens.

    Two blocks have equal keys when their tokens are equal and the hashes of their prefixes
    are equal, so a key names the whole prefix up to a 64-bit hash collision of the part
    before the block (vLLM's design; its tokens are compared exactly).
    """
    return (0 if parent is None else hash(parent), tuple(tokens))


class _Seq:
    """Internal per-sequence state: its block table and bookkeeping."""

    __slots__ = ("group", "blocks", "on_cpu", "num_tokens", "prefix", "prefix_entry", "keys",
                 "num_keyed")

    def __init__(self, group: GroupId, num_tokens: int, prefix: PrefixId | None,
                 prefix_entry: _Prefix | None) -> None:
        self.group = group
        self.blocks: list[int] = []
        self.on_cpu: list[bool] = []
        self.num_tokens = num_tokens
        self.prefix = prefix
        # The registration the sequence started from: an id unregistered and registered again
        # names other tokens, so a resume compares registrations, not ids.
        self.prefix_entry = prefix_entry
        self.keys: list[BlockKey] = []  # keys of its first full blocks (tokens never change)
        self.num_keyed = 0  # leading blocks whose keys the device pool has been given


class _Group:
    __slots__ = ("seqs", "status")

    def __init__(self) -> None:
        self.seqs: list[SeqId] = []
        self.status = RequestStatus.RUNNING


class _Prefix:
    __slots__ = ("blocks", "num_tokens")

    def __init__(self, blocks: list[int], num_tokens: int) -> None:
        self.blocks = blocks
        self.num_tokens = num_tokens


class BlockManager:
    """Maps sequences' logical KV blocks to physical blocks in a device pool and a CPU swap pool.

    Args:
        num_device_blocks: blocks in the device (GPU) pool.
        num_cpu_blocks: blocks in the CPU pool used for swapping (0 disables swap).
        block_size: tokens per block (default 16, the paper's choice).
        watermark_blocks: device blocks ``can_allocate`` / ``can_resume`` keep free, so running
            sequences can grow a little before preemption is needed (vLLM keeps ~1%).
        preemption_mode: ``"swap"``, ``"recompute"`` or ``None``/``"auto"``; see
            :meth:`preemption_mode_for`.
        enable_prefix_caching: keep full device blocks, keyed by their tokens and everything
            before them (:func:`block_key`), after their last sequence lets them go; a new
            prompt (``allocate(..., tokens=)``) maps the cached blocks its tokens start with.

    Sequence, group and prefix ids are any hashable values chosen by the engine.
    """

    def __init__(
        self,
        num_device_blocks: int,
        num_cpu_blocks: int = 0,
        block_size: int = DEFAULT_BLOCK_SIZE,
        *,
        watermark_blocks: int = 0,
        preemption_mode: PreemptionMode | str | None = None,
        enable_prefix_caching: bool = False,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if watermark_blocks < 0:
            raise ValueError(f"watermark_blocks must be >= 0, got {watermark_blocks}")
        self.block_size = block_size
        self.watermark_blocks = watermark_blocks
        if preemption_mode in (None, "auto"):
            self.preemption_mode: PreemptionMode | None = None
        else:
            self.preemption_mode = PreemptionMode(preemption_mode)
        self._device = BlockAllocator(num_device_blocks, Pool.DEVICE, enable_prefix_caching)
        self._cpu = BlockAllocator(num_cpu_blocks, Pool.CPU)
        self._seqs: dict[SeqId, _Seq] = {}
        self._groups: dict[GroupId, _Group] = {}
        self._prefixes: dict[PrefixId, _Prefix] = {}

    # ------------------------------------------------------------------ queries

    @property
    def device_allocator(self) -> BlockAllocator:
        """The device pool (read its ``num_free`` / ``refcount``; do not mutate it)."""
        return self._device

    @property
    def cpu_allocator(self) -> BlockAllocator:
        """The CPU swap pool (read-only use, as for ``device_allocator``)."""
        return self._cpu

    @property
    def num_device_blocks(self) -> int:
        return self._device.num_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return self._cpu.num_blocks

    @property
    def prefix_caching(self) -> bool:
        return self._device.caching

    @property
    def num_reserved_blocks(self) -> int:
        """Device blocks registered prefixes reserve (no request can use them for itself)."""
        return sum(len(p.blocks) for p in self._prefixes.values())

    def num_free_blocks(self, pool: Pool = Pool.DEVICE) -> int:
        """Free blocks in ``pool``."""
        return self._allocator(pool).num_free

    def has_seq(self, seq: SeqId) -> bool:
        return seq in self._seqs

    def seqs(self) -> list[SeqId]:
        """All sequences the manager knows, in creation order."""
        return list(self._seqs)

    def groups(self) -> list[GroupId]:
        """All sequence groups, in creation order."""
        return list(self._groups)

    def group_of(self, seq: SeqId) -> GroupId:
        return self._seq(seq).group

    def seqs_in_group(self, group: GroupId) -> list[SeqId]:
        return list(self._group(group).seqs)

    def group_status(self, group: GroupId) -> RequestStatus:
        return self._group(group).status

    def num_tokens(self, seq: SeqId) -> int:
        """Tokens the sequence holds (or, after a recompute preemption, will re-prefill)."""
        return self._seq(seq).num_tokens

    def get_block_table(self, seq: SeqId) -> BlockTable:
        """A snapshot of the sequence's block table (in any status)."""
        s = self._seq(seq)
        return BlockTable(tuple(s.blocks), tuple(s.on_cpu), s.num_tokens, self.block_size)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------ prefix sharing

    def can_register_prefix(self, num_tokens: int) -> bool:
        """Whether a prefix of ``num_tokens`` tokens can be registered now.

        Raises KVCacheError if it could never fit beside the already registered prefixes.
        """
        needed = self.blocks_for_tokens(num_tokens)
        self._check_fits(num_tokens, needed, None, what="prefix")
        return needed <= self._device.num_free

    def register_prefix(self, prefix: PrefixId, num_tokens: int,
                        tokens: Sequence[int] | None = None) -> tuple[int, ...]:
        """Reserve device blocks for a shared prefix; returns them in logical order.

        The runtime fills them by prefilling the prefix at :meth:`prefix_slot_mapping`. The
        manager keeps one reference per block until :meth:`unregister_prefix`, so sequences that
        share the prefix never write into its blocks in place (the last one is copy-on-write).
        With prefix caching and the prefix's ``tokens``, its full blocks are also cached blocks:
        any prompt starting with those tokens finds them, named prefix or not (the caller
        prefills them before anything else reads them).
        """
        if prefix in self._prefixes:
            raise KVCacheStateError(f"prefix {prefix!r} is already registered")
        if num_tokens < 1:
            raise ValueError(f"a prefix needs at least 1 token, got {num_tokens}")
        if not self.can_register_prefix(num_tokens):
            raise NoFreeBlocksError(
                f"prefix {prefix!r} needs {self.blocks_for_tokens(num_tokens)} device blocks, "
                f"{self._device.num_free} are free"
            )
        blocks = [self._device.allocate() for _ in range(self.blocks_for_tokens(num_tokens))]
        self._prefixes[prefix] = _Prefix(blocks, num_tokens)
        if tokens is not None:
            self.cache_prefix(prefix, tokens)
        return tuple(blocks)

    def cache_prefix(self, prefix: PrefixId, tokens: Sequence[int]) -> int:
        """Key a registered prefix's full blocks by its ``tokens`` (prefix caching), so prompts
        that start with them find them; returns how many got a key. Call it only once the
        prefix is sure to stay and be prefilled: a prefix taken back unkeyed leaves nothing
        behind, a keyed one would leave unwritten blocks findable."""
        p = self._prefix(prefix)
        if not self.prefix_caching:
            return 0
        return sum(self._device.set_key(block, key) for block, key in
                   zip(p.blocks, self._block_keys(tokens[:p.num_tokens])))

    def unregister_prefix(self, prefix: PrefixId) -> None:
        """Drop the manager's reference to a prefix's blocks.

        Sequences still using them keep them alive; a sequence re-prefilled after a recompute
        preemption then recomputes the prefix as well.
        """
        p = self._prefix(prefix)
        for b in p.blocks:
            self._device.decref(b)
        del self._prefixes[prefix]

    def prefixes(self) -> list[PrefixId]:
        return list(self._prefixes)

    def prefix_blocks(self, prefix: PrefixId) -> tuple[int, ...]:
        return tuple(self._prefix(prefix).blocks)

    def prefix_num_tokens(self, prefix: PrefixId) -> int:
        return self._prefix(prefix).num_tokens

    def prefix_slot_mapping(self, prefix: PrefixId) -> list[int]:
        """Flat slot of each prefix token, for the prefill that fills the prefix's blocks."""
        p = self._prefix(prefix)
        return [self._flat(p.blocks, i) for i in range(p.num_tokens)]

    # ----------------------------------------------------------------- allocation

    def check_request(
        self, prompt_len: int, max_new_tokens: int = 0, prefix: PrefixId | None = None
    ) -> None:
        """Raise KVCacheError if a request of ``prompt_len + max_new_tokens`` tokens can never fit.

        "Never" means: not even alone in the device pool, beside the blocks that registered
        prefixes reserve. The engine calls this when a request arrives.
        """
        total = prompt_len + max_new_tokens
        if prefix is not None:
            self._check_prefix_use(prefix, total)
        self._check_fits(total, self._blocks_to_allocate(total, prefix), prefix, what="request")

    def can_allocate(self, prompt_len: int, prefix: PrefixId | None = None,
                     tokens: Sequence[int] | None = None) -> bool:
        """Whether a new sequence with a ``prompt_len``-token prompt can be allocated now.

        Keeps ``watermark_blocks`` free. Returns False when blocks are short *now* (queue the
        request or preempt); raises KVCacheError if the prompt could never fit. ``tokens``: the
        prompt, to count the cached blocks it would map (prefix caching).
        """
        if prefix is not None:
            self._check_prefix_use(prefix, prompt_len)
        needed = self._blocks_to_allocate(prompt_len, prefix, tokens)
        self._check_fits(prompt_len, needed, prefix, what="prompt")
        return self._device.num_free - needed >= self.watermark_blocks

    def blocks_to_allocate(self, prompt_len: int, prefix: PrefixId | None = None,
                           tokens: Sequence[int] | None = None) -> int:
        """Free device blocks :meth:`allocate` would take for this prompt (a cached block no
        one holds counts: taking it back takes it off the free ones)."""
        if prefix is not None:
            self._check_prefix_use(prefix, prompt_len)
        return self._blocks_to_allocate(prompt_len, prefix, tokens)

    def allocate(
        self,
        seq: SeqId,
        prompt_len: int,
        *,
        group: GroupId | None = None,
        prefix: PrefixId | None = None,
        tokens: Sequence[int] | None = None,
    ) -> Allocation:
        """Give a new sequence the blocks for its prompt (all-or-nothing).

        Args:
            seq: a new sequence id.
            prompt_len: prompt tokens (the prefill writes their KV).
            group: the sequence group to join or create; defaults to ``seq`` itself. For parallel
                sampling / beam search allocate one sequence and :meth:`fork` the others.
            prefix: a registered prefix the prompt starts with; its blocks are shared.
            tokens: the prompt's tokens. With prefix caching (and no ``prefix``), the cached
                full blocks its tokens start with are mapped instead of computed: the
                allocation's ``num_cached_tokens`` counts them. At least the last prompt token
                is always computed (the step samples from it).

        Raises KVCacheError if the prompt can never fit, NoFreeBlocksError if it does not fit now.
        """
        if seq in self._seqs:
            raise KVCacheStateError(f"sequence {seq!r} is already allocated")
        if prompt_len < 0:
            raise ValueError(f"prompt_len must be >= 0, got {prompt_len}")
        if prefix is not None:
            self._check_prefix_use(prefix, prompt_len)
        group = seq if group is None else group
        g = self._groups.get(group)
        if g is not None and g.status is not RequestStatus.RUNNING:
            raise KVCacheStateError(f"group {group!r} is {g.status.value}; cannot add {seq!r}")
        needed = self._blocks_to_allocate(prompt_len, prefix, tokens)
        self._check_fits(prompt_len, needed, prefix, what="prompt")
        if needed > self._device.num_free:
            raise NoFreeBlocksError(
                f"sequence {seq!r} needs {needed} device blocks, {self._device.num_free} are free"
            )
        s = _Seq(group, prompt_len, prefix, self._prefixes.get(prefix))
        if prefix is None and tokens is not None and self.prefix_caching:
            s.keys, hits = self._cache_hits(tokens, prompt_len)
            for block in hits:  # before any allocation, which could evict them
                self._device.take(block)
            s.num_keyed = len(hits)
            copies = self._fill_from(s, hits, taken=True)
            cached = len(hits) * self.block_size
        else:
            copies = self._fill_blocks(s, prefix)
            cached = self._prefixes[prefix].num_tokens if prefix is not None else 0
        if g is None:
            g = self._groups[group] = _Group()
        g.seqs.append(seq)
        self._seqs[seq] = s
        return Allocation(seq, tuple(s.blocks), prompt_len, cached, tuple(copies))

    def cache_blocks(self, seq: SeqId, tokens: Sequence[int], num_computed: int) -> int:
        """Give the device pool the keys of a running sequence's full blocks whose KV is
        written (its first ``num_computed`` positions, ``tokens`` its tokens), so later prompts
        find them. Returns how many blocks got a key now (0 without prefix caching). A block
        whose tokens another block holds already stays unkeyed (the first one is found)."""
        s = self._seq(seq)
        if not self.prefix_caching or self._groups[s.group].status is not RequestStatus.RUNNING:
            return 0
        full = min(num_computed, s.num_tokens, len(tokens)) // self.block_size
        if full <= s.num_keyed:
            return 0
        if len(s.keys) < full:
            s.keys.extend(self._block_keys(tokens, start=len(s.keys), end=full,
                                           parent=s.keys[-1] if s.keys else None))
        added = sum(self._device.set_key(s.blocks[i], s.keys[i])
                    for i in range(s.num_keyed, full))
        s.num_keyed = full
        return added

    def fork(self, parent: SeqId, child: SeqId) -> None:
        """Make ``child`` share all of ``parent``'s blocks (reference counts +1); same group.

        Used for parallel sampling and beam search. Takes no new block: the first write into a
        shared last block copies it (see :meth:`append_slot`).
        """
        p = self._seq(parent)
        if self._groups[p.group].status is not RequestStatus.RUNNING:
            raise KVCacheStateError(f"cannot fork {parent!r}: its group is not running")
        if child in self._seqs:
            raise KVCacheStateError(f"sequence {child!r} already exists")
        c = _Seq(p.group, p.num_tokens, p.prefix, p.prefix_entry)
        c.blocks = list(p.blocks)
        c.on_cpu = list(p.on_cpu)
        c.keys = list(p.keys)
        c.num_keyed = p.num_keyed
        for b in c.blocks:
            self._device.incref(b)
        self._seqs[child] = c
        self._groups[p.group].seqs.append(child)

    def free(self, seq: SeqId) -> None:
        """Drop a finished (or aborted) sequence's references, in any status; blocks at
        reference count 0 return to their pool. An emptied group disappears."""
        s = self._seq(seq)
        self._release(s)
        del self._seqs[seq]
        g = self._groups[s.group]
        g.seqs.remove(seq)
        if not g.seqs:
            del self._groups[s.group]

    def free_group(self, group: GroupId) -> None:
        """Free every sequence of a group."""
        for seq in list(self._group(group).seqs):
            self.free(seq)

    # ---------------------------------------------------------------- decoding

    def num_blocks_to_append(self, group: GroupId) -> int:
        """New device blocks one decode step (one token per sequence) of ``group`` takes.

        A sequence whose last block is full takes a block; one whose last block is shared takes a
        copy-on-write block, except the last holder inside the group, which then writes in place.
        The total is independent of the order of the appends; sums over groups are exact.
        For a swapped group: what the step right after :meth:`swap_in` takes (sharing inside
        the group survives the swap, so its CPU reference counts are the ones it will have).
        """
        g = self._group(group)
        if g.status is RequestStatus.RECOMPUTE:
            raise KVCacheStateError(f"group {group!r} is recompute, not running or swapped")
        if len(g.seqs) == 1:  # the common case, kept cheap for the scheduler's inner loop
            s = self._seqs[g.seqs[0]]
            if s.num_tokens == len(s.blocks) * self.block_size:
                return 1
            return 1 if self._refcount_of(s, -1) > 1 else 0
        need = 0
        departed: Counter[tuple[bool, int]] = Counter()
        for seq in g.seqs:
            s = self._seqs[seq]
            if s.num_tokens == len(s.blocks) * self.block_size:
                need += 1
                continue
            last = (s.on_cpu[-1], s.blocks[-1])
            if self._refcount_of(s, -1) - departed[last] > 1:
                need += 1
                departed[last] += 1
        return need

    def _refcount_of(self, s: _Seq, index: int) -> int:
        return (self._cpu if s.on_cpu[index] else self._device).refcount(s.blocks[index])

    def can_append(self, group: GroupId) -> bool:
        """Whether every sequence of ``group`` can take one more token now."""
        self._running(group)
        return self.num_blocks_to_append(group) <= self._device.num_free

    def append_slot(self, seq: SeqId) -> AppendResult:
        """Reserve the slot for the sequence's next token (the one whose KV the next step writes).

        Allocates a block when the last one is full. When the last block is shared (reference
        count > 1), copies it first: the result's ``copy`` says src -> dst, and the sequence's
        table now points at dst. Raises NoFreeBlocksError if a block is needed and none is free.
        """
        s = self._seq(seq)
        if self._groups[s.group].status is not RequestStatus.RUNNING:
            raise KVCacheStateError(f"sequence {seq!r} is not running (its group is preempted)")
        pos = s.num_tokens
        offset = pos % self.block_size
        copy = None
        new_block = False
        if pos == len(s.blocks) * self.block_size:
            block = self._device.allocate()
            s.blocks.append(block)
            s.on_cpu.append(False)
            new_block = True
        else:
            block = s.blocks[-1]
            if self._device.refcount(block) > 1:
                dst = self._device.allocate()
                self._device.decref(block)
                copy = BlockCopy(block, dst)
                s.blocks[-1] = block = dst
        s.num_tokens = pos + 1
        return AppendResult(Slot(block, offset), block * self.block_size + offset, copy, new_block)

    # ---------------------------------------------------------------- swapping

    def blocks_to_swap_out(self, group: GroupId) -> int:
        """CPU blocks :meth:`swap_out` would take (the group's private device blocks)."""
        return len(self._private_device_blocks(self._running(group)))

    def can_swap_out(self, group: GroupId) -> bool:
        return self.blocks_to_swap_out(group) <= self._cpu.num_free

    def swap_out(self, group: GroupId) -> dict[int, int]:
        """Move a running group's blocks to the CPU pool; returns device block -> CPU block.

        Blocks shared only within the group move once (sharing is kept). Blocks also referenced
        outside the group (a registered prefix) stay on the device and the group keeps its
        reference: they free no memory and need no copy. With prefix caching, the moved device
        blocks lose their keys: their KV now lives in the CPU pool (the runtime may treat the
        device copy as gone), so no later prompt may map them.
        """
        g = self._running(group)
        refs = self._private_device_blocks(g)
        if len(refs) > self._cpu.num_free:
            raise NoFreeBlocksError(
                f"swapping out group {group!r} needs {len(refs)} CPU blocks, "
                f"{self._cpu.num_free} are free"
            )
        mapping = self._move(g, refs, self._device, self._cpu, to_cpu=True)
        g.status = RequestStatus.SWAPPED
        return mapping

    def blocks_to_swap_in(self, group: GroupId) -> int:
        """Device blocks :meth:`swap_in` would take."""
        g = self._group(group)
        if g.status is not RequestStatus.SWAPPED:
            raise KVCacheStateError(f"group {group!r} is {g.status.value}, not swapped")
        return len(self._cpu_blocks(g))

    def can_swap_in(self, group: GroupId) -> bool:
        """Whether a swapped group fits back on the device now (keeping the watermark free)."""
        return self._device.num_free - self.blocks_to_swap_in(group) >= self.watermark_blocks

    def swap_in(self, group: GroupId) -> dict[int, int]:
        """Bring a swapped group back to the device; returns CPU block -> device block."""
        needed = self.blocks_to_swap_in(group)
        if needed > self._device.num_free:
            raise NoFreeBlocksError(
                f"swapping in group {group!r} needs {needed} device blocks, "
                f"{self._device.num_free} are free"
            )
        g = self._groups[group]
        mapping = self._move(g, self._cpu_blocks(g), self._cpu, self._device, to_cpu=False)
        g.status = RequestStatus.RUNNING
        return mapping

    # -------------------------------------------------------------- preemption

    def preemption_mode_for(self, group: GroupId) -> PreemptionMode:
        """The preemption policy: how :meth:`preempt` evicts ``group`` when no mode is given.

        This is the one place a mode is chosen (the scheduler calls :meth:`preempt` without
        one). With ``preemption_mode="swap"`` or ``"recompute"`` that mode is used, for every
        group: under ``"recompute"`` nothing is ever swapped, samples and beams included (their
        sequences re-prefill, the prompt's full blocks shared again; blocks they shared past the
        prompt come back unshared, a cost the scheduler's admission check already counts). In
        auto mode (vLLM's rule) a single-sequence group is recomputed (no PCIe traffic, one
        prefill) and a multi-sequence group is swapped (keeping all its sharing). Swap falls
        back to recompute when the CPU pool cannot hold the group. Override in a subclass for
        another policy; the scheduler decides *which* group to preempt (vLLM: the latest
        arrived).
        """
        g = self._running(group)
        mode = self.preemption_mode
        if mode is None:
            mode = PreemptionMode.RECOMPUTE if len(g.seqs) == 1 else PreemptionMode.SWAP
        if mode is PreemptionMode.SWAP and not self.can_swap_out(group):
            mode = PreemptionMode.RECOMPUTE
        return mode

    def preempt(self, group: GroupId, mode: PreemptionMode | str | None = None) -> Preemption:
        """Evict a running group all-or-nothing, by ``mode`` or by :meth:`preemption_mode_for`.

        SWAP moves its blocks to the CPU pool (status SWAPPED). RECOMPUTE drops every block and
        keeps each sequence's token count (status RECOMPUTE): :meth:`resume` re-allocates and the
        engine re-prefills prompt + generated tokens in one pass. Sequences of a recomputed
        group are re-allocated separately, so blocks they shared are no longer shared, except
        the leading tokens :meth:`resume` is told they share (``shared_tokens``). An explicit
        SWAP raises NoFreeBlocksError when the CPU pool cannot hold the group.
        """
        mode = self.preemption_mode_for(group) if mode is None else PreemptionMode(mode)
        if mode is PreemptionMode.SWAP:
            return Preemption(group, mode, self.swap_out(group), {})
        g = self._running(group)
        tokens = {}
        for seq in g.seqs:
            s = self._seqs[seq]
            self._release(s)
            tokens[seq] = s.num_tokens
        g.status = RequestStatus.RECOMPUTE
        return Preemption(group, mode, {}, tokens)

    def blocks_to_resume(self, group: GroupId, shared_tokens: int = 0) -> int:
        """Device blocks :meth:`resume` would take (``shared_tokens``: see :meth:`resume`)."""
        g = self._group(group)
        if g.status is RequestStatus.SWAPPED:
            return len(self._cpu_blocks(g))
        if g.status is RequestStatus.RECOMPUTE:
            return sum(self._recompute_blocks(g, shared_tokens))
        raise KVCacheStateError(f"group {group!r} is running, not preempted")

    def can_resume(self, group: GroupId, shared_tokens: int = 0) -> bool:
        """Whether a preempted group can be resumed now (keeping the watermark free).

        Raises KVCacheError if a recompute group could never fit again, even alone.
        """
        needed = self.blocks_to_resume(group, shared_tokens)
        g = self._groups[group]
        if g.status is RequestStatus.RECOMPUTE:
            tokens = sum(self._seqs[seq].num_tokens for seq in g.seqs)
            self._check_fits(
                tokens, needed, None, what=f"preempted group {group!r}", total_blocks=needed
            )
        return self._device.num_free - needed >= self.watermark_blocks

    def resume(self, group: GroupId, shared_tokens: int = 0) -> Resumption:
        """Bring a preempted group back: swap it in, or re-allocate it for a re-prefill.

        ``shared_tokens``: leading tokens every sequence of a recompute group has in common (its
        prompt). The first sequence re-prefills them; the others map its full blocks of them
        (their ``num_cached_tokens`` counts those positions, written by the first sequence's
        prefill in the same step), so the group keeps the sharing it had before preemption.
        """
        g = self._group(group)
        if g.status is RequestStatus.SWAPPED:
            return Resumption(group, PreemptionMode.SWAP, self.swap_in(group), ())
        needed = self.blocks_to_resume(group, shared_tokens)
        if needed > self._device.num_free:
            raise NoFreeBlocksError(
                f"resuming group {group!r} needs {needed} device blocks, "
                f"{self._device.num_free} are free"
            )
        allocations = []
        first = self._seqs[g.seqs[0]]
        for seq in g.seqs:
            s = self._seqs[seq]
            s.prefix = self._live_prefix(s)
            s.prefix_entry = self._prefixes.get(s.prefix)
        prefix_shared = self._shared_prefix_blocks(first.num_tokens, first.prefix)
        group_shared = self._group_shared_blocks(g, shared_tokens)
        hits = self._resume_hits(g)
        for i, seq in enumerate(g.seqs):
            s = self._seqs[seq]
            if hits:  # a lone sequence maps what the cache still holds of its blocks
                for block in hits:
                    self._device.take(block)
                copies = self._fill_from(s, hits, taken=True)
                s.num_keyed = len(hits)
                cached = len(hits) * self.block_size
            elif i and group_shared > prefix_shared:
                copies = self._fill_from(s, first.blocks[:group_shared])
                cached = group_shared * self.block_size
            else:
                copies = self._fill_blocks(s, s.prefix)
                cached = self._prefixes[s.prefix].num_tokens if s.prefix is not None else 0
            allocations.append(
                Allocation(seq, tuple(s.blocks), s.num_tokens, cached, tuple(copies))
            )
        g.status = RequestStatus.RUNNING
        return Resumption(group, PreemptionMode.RECOMPUTE, {}, tuple(allocations))

    # ------------------------------------------------------------ slot mapping

    def slot_index(self, seq: SeqId, position: int) -> int:
        """Flat device slot of token ``position``: ``table[position // B] * B + position % B``."""
        s = self._resident(seq)
        if not 0 <= position < s.num_tokens:
            raise IndexError(
                f"position {position} outside sequence {seq!r} of {s.num_tokens} tokens"
            )
        return self._flat(s.blocks, position)

    def slot_mapping(self, seq: SeqId, start: int = 0, end: int | None = None) -> list[int]:
        """Flat device slots of token positions ``start .. end - 1`` (default: all tokens)."""
        s = self._resident(seq)
        end = s.num_tokens if end is None else end
        if not 0 <= start <= end <= s.num_tokens:
            raise IndexError(f"positions {start}..{end} outside sequence {seq!r} of {s.num_tokens}")
        return [self._flat(s.blocks, i) for i in range(start, end)]

    def block_table(self, seq: SeqId, width: int | None = None, pad: int = 0) -> list[int]:
        """Physical block ids of a running sequence, padded with ``pad`` to ``width`` entries.

        The kernels read only ``ceil(context_len / B)`` entries, so any valid id is a safe pad.
        """
        s = self._resident(seq)
        if width is None:
            return list(s.blocks)
        if width < len(s.blocks):
            raise ValueError(f"width {width} < {len(s.blocks)} blocks of sequence {seq!r}")
        return s.blocks + [pad] * (width - len(s.blocks))

    def block_tables(
        self, seqs: Iterable[SeqId], width: int | None = None, pad: int = 0
    ) -> list[list[int]]:
        """Padded block tables of a batch; ``width`` defaults to the longest table."""
        seqs = list(seqs)
        if width is None:
            width = max((len(self._resident(q).blocks) for q in seqs), default=0)
        return [self.block_table(q, width, pad) for q in seqs]

    # -------------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        """Raise KVCacheStateError if the bookkeeping is inconsistent (for tests and debugging).

        Checks: free + referenced = pool size in both pools; each block's reference count equals
        the block-table (and prefix) entries pointing at it; table lengths match token counts.
        """
        expected = {Pool.DEVICE: Counter(), Pool.CPU: Counter()}
        for p in self._prefixes.values():
            expected[Pool.DEVICE].update(p.blocks)
            if len(p.blocks) != self.blocks_for_tokens(p.num_tokens):
                raise KVCacheStateError("prefix table length does not match its tokens")
        for seq, s in self._seqs.items():
            status = self._groups[s.group].status
            if seq not in self._groups[s.group].seqs:
                raise KVCacheStateError(f"sequence {seq!r} missing from its group")
            want = 0 if status is RequestStatus.RECOMPUTE else self.blocks_for_tokens(s.num_tokens)
            if len(s.blocks) != want or len(s.on_cpu) != want:
                raise KVCacheStateError(
                    f"sequence {seq!r}: {len(s.blocks)} blocks for {s.num_tokens} tokens "
                    f"({status.value})"
                )
            if status is RequestStatus.RUNNING and any(s.on_cpu):
                raise KVCacheStateError(f"running sequence {seq!r} has CPU blocks")
            for b, cpu in zip(s.blocks, s.on_cpu):
                expected[Pool.CPU if cpu else Pool.DEVICE][b] += 1
        for pool, counts in expected.items():
            alloc = self._allocator(pool)
            free = alloc.free_blocks()
            if len(set(free)) != len(free):
                raise KVCacheStateError(f"{pool.value} free list has duplicates")
            if len(free) + len(counts) != alloc.num_blocks:
                raise KVCacheStateError(
                    f"{pool.value} pool: {len(free)} free + {len(counts)} referenced "
                    f"!= {alloc.num_blocks} blocks"
                )
            for b in range(alloc.num_blocks):
                if alloc.refcount(b) != counts.get(b, 0):
                    raise KVCacheStateError(
                        f"{pool.value} block {b}: refcount {alloc.refcount(b)}, "
                        f"{counts.get(b, 0)} table entries"
                    )
        for group, g in self._groups.items():
            if not g.seqs or any(self._seqs[q].group != group for q in g.seqs):
                raise KVCacheStateError(f"group {group!r} membership is inconsistent")
        self._device.check_cache()
        for seq, s in self._seqs.items():
            if self._groups[s.group].status is RequestStatus.RUNNING:
                for i in range(s.num_keyed):
                    key = self._device.key_of(s.blocks[i])
                    if key is not None and key != s.keys[i]:
                        raise KVCacheStateError(f"sequence {seq!r}: block {s.blocks[i]} is "
                                                f"cached under other tokens")

    # ---------------------------------------------------------------- internals

    def _allocator(self, pool: Pool) -> BlockAllocator:
        return self._device if pool is Pool.DEVICE else self._cpu

    def _seq(self, seq: SeqId) -> _Seq:
        try:
            return self._seqs[seq]
        except KeyError:
            raise KVCacheStateError(f"unknown sequence {seq!r}") from None

    def _group(self, group: GroupId) -> _Group:
        try:
            return self._groups[group]
        except KeyError:
            raise KVCacheStateError(f"unknown sequence group {group!r}") from None

    def _prefix(self, prefix: PrefixId) -> _Prefix:
        try:
            return self._prefixes[prefix]
        except KeyError:
            raise KVCacheStateError(f"unknown prefix {prefix!r}") from None

    def _running(self, group: GroupId) -> _Group:
        g = self._group(group)
        if g.status is not RequestStatus.RUNNING:
            raise KVCacheStateError(f"group {group!r} is {g.status.value}, not running")
        return g

    def _resident(self, seq: SeqId) -> _Seq:
        s = self._seq(seq)
        if self._groups[s.group].status is not RequestStatus.RUNNING:
            raise KVCacheStateError(f"sequence {seq!r} is not on the device (group preempted)")
        return s

    def _flat(self, blocks: list[int], position: int) -> int:
        return blocks[position // self.block_size] * self.block_size + position % self.block_size

    def _check_prefix_use(self, prefix: PrefixId, prompt_len: int) -> None:
        p = self._prefix(prefix)
        if prompt_len < p.num_tokens:
            raise ValueError(
                f"prompt of {prompt_len} tokens is shorter than prefix {prefix!r} "
                f"({p.num_tokens} tokens)"
            )

    def _shared_prefix_blocks(self, num_tokens: int, prefix: PrefixId | None) -> int:
        """Prefix blocks a sequence of ``num_tokens`` maps in place (without copying)."""
        if prefix is None:
            return 0
        p = self._prefixes[prefix]
        if num_tokens == p.num_tokens:
            return len(p.blocks)  # no suffix: even a partial last block is shared until a write
        return p.num_tokens // self.block_size  # the partial last block is copied for the suffix

    def _blocks_to_allocate(self, num_tokens: int, prefix: PrefixId | None,
                            tokens: Sequence[int] | None = None) -> int:
        if prefix is None and tokens is not None and self.prefix_caching:
            _, hits = self._cache_hits(tokens, num_tokens)
            held = sum(self._device.refcount(b) > 0 for b in hits)
            return self.blocks_for_tokens(num_tokens) - held
        return self.blocks_for_tokens(num_tokens) - self._shared_prefix_blocks(num_tokens, prefix)

    def _block_keys(self, tokens: Sequence[int], start: int = 0, end: int | None = None,
                    parent: BlockKey | None = None) -> list[BlockKey]:
        """Keys of full blocks ``start .. end - 1`` of ``tokens`` (``parent``: block
        ``start - 1``'s key)."""
        b = self.block_size
        end = len(tokens) // b if end is None else end
        keys = []
        for i in range(start, end):
            parent = block_key(parent, tokens[i * b:(i + 1) * b])
            keys.append(parent)
        return keys

    def _cache_hits(self, tokens: Sequence[int], prompt_len: int
                    ) -> tuple[list[BlockKey], list[int]]:
        """The keys of a prompt's full blocks, and the cached blocks its first full blocks
        are found in (never the block of its last token: that one is computed)."""
        keys = self._block_keys(tokens[:prompt_len])
        hits = []
        for key in keys[:(prompt_len - 1) // self.block_size]:
            block = self._device.lookup(key)
            if block is None:
                break
            hits.append(block)
        return keys, hits

    def _live_prefix(self, s: _Seq) -> PrefixId | None:
        """The sequence's prefix if the registration it started from is still registered."""
        if s.prefix is not None and self._prefixes.get(s.prefix) is s.prefix_entry:
            return s.prefix
        return None

    def _recompute_blocks(self, g: _Group, shared_tokens: int) -> list[int]:
        """New device blocks each sequence of a recompute group takes on resume (as
        :meth:`resume` builds them): the first sequence maps its live prefix; the others map
        the first one's full blocks of ``shared_tokens`` when that shares more."""
        first = self._seqs[g.seqs[0]]
        hits = self._resume_hits(g)
        if hits:
            held = sum(self._device.refcount(b) > 0 for b in hits)
            return [self.blocks_for_tokens(first.num_tokens) - held]
        prefix_shared = self._shared_prefix_blocks(first.num_tokens, self._live_prefix(first))
        group_shared = self._group_shared_blocks(g, shared_tokens)
        needs = []
        for i, seq in enumerate(g.seqs):
            s = self._seqs[seq]
            if i and group_shared > prefix_shared:
                needs.append(self.blocks_for_tokens(s.num_tokens) - group_shared)
            else:
                needs.append(self._blocks_to_allocate(s.num_tokens, self._live_prefix(s)))
        return needs

    def _resume_hits(self, g: _Group) -> list[int]:
        """Cached blocks a recompute group of one sequence without a live prefix maps on
        resume: its leading full blocks the cache still holds (by the keys it had), never the
        block of its last token. Empty otherwise (groups re-share as :meth:`resume` says)."""
        if not self.prefix_caching or len(g.seqs) != 1:
            return []
        s = self._seqs[g.seqs[0]]
        if self._live_prefix(s) is not None:
            return []
        hits = []
        for key in s.keys[:(s.num_tokens - 1) // self.block_size]:
            block = self._device.lookup(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def _group_shared_blocks(self, g: _Group, shared_tokens: int) -> int:
        """Full blocks of the first ``shared_tokens`` tokens every sequence of ``g`` holds."""
        if len(g.seqs) < 2:
            return 0
        shortest = min(self._seqs[q].num_tokens for q in g.seqs)
        return min(shared_tokens, shortest) // self.block_size

    def _fill_blocks(self, s: _Seq, prefix: PrefixId | None) -> list[BlockCopy]:
        """Build the block table of ``s`` (holding ``s.num_tokens`` tokens) from scratch."""
        copies = []
        if prefix is not None:
            p = self._prefixes[prefix]
            shared = self._shared_prefix_blocks(s.num_tokens, prefix)
            for b in p.blocks[:shared]:
                self._device.incref(b)
            s.blocks = list(p.blocks[:shared])
            if shared < len(p.blocks):  # suffix tokens land in the prefix's partial last block
                dst = self._device.allocate()
                copies.append(BlockCopy(p.blocks[shared], dst))
                s.blocks.append(dst)
        else:
            s.blocks = []
        while len(s.blocks) < self.blocks_for_tokens(s.num_tokens):
            s.blocks.append(self._device.allocate())
        s.on_cpu = [False] * len(s.blocks)
        s.num_keyed = 0
        return copies

    def _fill_from(self, s: _Seq, shared: list[int], taken: bool = False) -> list[BlockCopy]:
        """Build the table of ``s`` mapping ``shared`` full blocks (``taken``: their
        references are taken already), then fresh ones."""
        if not taken:
            for b in shared:
                self._device.incref(b)
            s.num_keyed = 0
        s.blocks = list(shared)
        while len(s.blocks) < self.blocks_for_tokens(s.num_tokens):
            s.blocks.append(self._device.allocate())
        s.on_cpu = [False] * len(s.blocks)
        return []

    def _release(self, s: _Seq) -> None:
        # Last block first: a prompt's tail is evicted before its head, which more prompts share.
        for b, cpu in zip(reversed(s.blocks), reversed(s.on_cpu)):
            (self._cpu if cpu else self._device).decref(b)
        s.blocks = []
        s.on_cpu = []
        s.num_keyed = 0

    def _private_device_blocks(self, g: _Group) -> dict[int, int]:
        """Device blocks referenced only by ``g``'s tables -> number of references, in order."""
        refs: dict[int, int] = {}
        for seq in g.seqs:
            for b in self._seqs[seq].blocks:
                refs[b] = refs.get(b, 0) + 1
        return {b: n for b, n in refs.items() if self._device.refcount(b) == n}

    def _cpu_blocks(self, g: _Group) -> dict[int, int]:
        refs: dict[int, int] = {}
        for seq in g.seqs:
            s = self._seqs[seq]
            for b, cpu in zip(s.blocks, s.on_cpu):
                if cpu:
                    refs[b] = refs.get(b, 0) + 1
        return refs

    def _move(
        self,
        g: _Group,
        refs: dict[int, int],
        src: BlockAllocator,
        dst: BlockAllocator,
        to_cpu: bool,
    ) -> dict[int, int]:
        """Re-home blocks ``refs`` (block -> references by ``g``) from ``src`` to ``dst``."""
        mapping = {}
        for b, n in refs.items():
            new = dst.allocate()
            if n > 1:
                dst.incref(new, n - 1)
            mapping[b] = new
        for seq in g.seqs:
            s = self._seqs[seq]
            s.num_keyed = 0  # blocks come back as fresh device blocks, without keys
            for i, (b, cpu) in enumerate(zip(s.blocks, s.on_cpu)):
                if cpu != to_cpu and b in mapping:
                    s.blocks[i] = mapping[b]
                    s.on_cpu[i] = to_cpu
        for b, n in refs.items():
            if to_cpu:  # a swap-out is a move: the device copy is not a cached block any more
                src.drop_key(b)
            src.decref(b, n)
        return mapping

    def _check_fits(
        self,
        num_tokens: int,
        new_blocks: int,
        prefix: PrefixId | None,
        what: str,
        total_blocks: int | None = None,
    ) -> None:
        """Raise KVCacheError if ``new_blocks`` could never be free, even with nothing running."""
        reserved = self.num_reserved_blocks
        capacity = self._device.num_blocks - reserved
        if new_blocks <= capacity:
            return
        b = self.block_size
        if total_blocks is None:
            total_blocks = self.blocks_for_tokens(num_tokens)
        shared = total_blocks - new_blocks
        detail = f" ({shared} of them shared with prefix {prefix!r})" if prefix is not None else ""
        reserved_txt = (
            f", {reserved} of which are reserved by registered prefixes" if reserved else ""
        )
        raise KVCacheError(
            f"KV cache too small for a {what} of {num_tokens} tokens: it needs "
            f"{total_blocks} blocks of {b} tokens{detail}, but the device "
            f"pool has {self._device.num_blocks} blocks ({self._device.num_blocks * b} token "
            f"slots){reserved_txt}, so it can never be scheduled. Give the KV cache more memory "
            f"(a larger KV memory fraction, more devices, or a smaller model shard) or shorten the "
            f"request to at most {max(capacity, 0) * b} tokens (prompt + max new tokens)."
        )
