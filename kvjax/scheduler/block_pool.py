"""The device KV block pool: reference counts, a free list, and the prefix-cache index.

The device holds one pool of `num_blocks` KV blocks of `block_size` tokens shared by every
sequence (vLLM's PagedAttention; the engine's `[L, num_blocks, block_size, K, H]` arrays). This
module only counts: which block ids are in use, by how many sequences, and which hold a full,
indexed prefix. The engine moves the arrays; the scheduler owns this object.

Every usable block is in exactly one of three states:

               allocate                         free: ref -> 0, uncached
    FREE ───────────────────> IN USE (ref >= 1) ───────────────────────> FREE (list tail)
     ^                          │          ^      cache_block: a full, written block in use
     │ allocate with FREE       │ free:    │      is indexed by its chained hash
     │ empty: evict (leaves     │ ref -> 0,│ touch: a prefix hit, ref + 1
     │ first, then LRU)         v cached   │
     └─────────────────────── EVICTABLE (ref 0, still indexed: a hit for the next request)

  * `allocate(n)` takes uncached free blocks first (oldest freed first), and only then evicts
    cached ones, so a finished request's prefix stays on the device until the pool needs room
    (the device is the top tier of CachedAttention's hierarchy, arXiv 2403.19708, section 3).
  * Eviction takes leaves first: a block whose hash is the parent of another indexed block goes
    after all its children (SGLang's radix-cache eviction, `mem_cache/radix_cache.py`, here over
    chained hashes instead of a tree). Among leaves, the least recently released goes first. If
    every evictable block still has an indexed child (a child in use by a request that computed
    its own copy of the parent), the least recently released evictable block goes.
  * A block is indexed by one hash and a hash by one block: a second block that computed the same
    prefix (two requests admitted together) stays unindexed and is freed to the free list.
  * `usage` is vLLM's `kv_cache_usage_perc`: 1 - free/usable, where free counts evictable blocks.

Design after vLLM v1 `vllm/v1/core/block_pool.py` (`get_new_blocks`, `touch`, `free_blocks`,
`cached_block_hash_to_block`); the leaf heap follows SGLang's lazy-deletion LRU heap.
Not thread-safe: the scheduler calls it from one thread.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
from collections.abc import Iterable, Sequence
from typing import NewType, Union

from kvjax.block_hash import BlockHash

#: Index of one block in the device KV pool, `[0, num_blocks)`.
BlockId = NewType("BlockId", int)


@dataclasses.dataclass(frozen=True)
class BlockStoredEvent:
  """A full block entered the prefix-cache index (`cache_block` indexed it).

  Attributes:
    block_hash: its chained hash (`kvjax.block_hash`, hex).
    parent_hash: the previous block's hash, or the namespace root for a sequence's first block.
    token_ids: the block's B token ids.
  """

  block_hash: BlockHash
  parent_hash: str
  token_ids: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class BlockRemovedEvent:
  """An indexed block was evicted to make room: its prefix is no longer on the device."""

  block_hash: BlockHash


@dataclasses.dataclass(frozen=True)
class AllBlocksClearedEvent:
  """`reset_prefix_cache`: no block indexed before is on the device any more."""


#: One prefix-cache index change, in the order it happened (vLLM's `BlockStored`,
#: `BlockRemoved`, `AllBlocksCleared` of `vllm/distributed/kv_events.py`, with kvjax's hashes).
BlockEvent = Union[BlockStoredEvent, BlockRemovedEvent, AllBlocksClearedEvent]


class BlockPool:
  """Reference-counted KV blocks with a free list and an LRU, leaves-first evictable index.

  Args:
    num_blocks: blocks in the device pool (>= 1, or >= 2 with a null block).
    block_size: tokens per block (>= 1).
    reserve_null_block: keep block 0 out of circulation (never allocated, freed or counted), for
      the engine to point padding entries of block tables and padded tokens' writes at (vLLM's
      `null_block`).

  Raises:
    ValueError: sizes that are not positive ints, or no usable block.
  """

  def __init__(self, num_blocks: int, block_size: int, *, reserve_null_block: bool = False):
    for name, v in (("num_blocks", num_blocks), ("block_size", block_size)):
      if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    first = 1 if reserve_null_block else 0
    if num_blocks - first <= 0:
      raise ValueError(f"num_blocks={num_blocks} leaves no usable block besides the null block")
    self.num_blocks = num_blocks
    self.block_size = block_size
    self.null_block: BlockId | None = BlockId(0) if reserve_null_block else None
    self._first = first
    self._ref = [0] * num_blocks
    self._hash: list[BlockHash | None] = [None] * num_blocks
    self._parent: list[BlockHash | None] = [None] * num_blocks
    self._free: collections.deque[BlockId] = collections.deque(
        BlockId(b) for b in range(first, num_blocks))
    # Cached blocks at ref 0, oldest release first (insertion order == tick order).
    self._evictable: collections.OrderedDict[BlockId, int] = collections.OrderedDict()
    # (release tick, block) of evictable leaves; stale entries are skipped when popped.
    self._leaf_heap: list[tuple[int, BlockId]] = []
    self._index: dict[BlockHash, BlockId] = {}
    # hash -> number of indexed blocks whose parent is that hash (indexed itself or not).
    self._children: collections.Counter[BlockHash] = collections.Counter()
    # Parked partial blocks: the last, partly filled block of a finished sequence, at ref 0,
    # keyed by the hash of the full block before it (or the root). A later sequence whose full
    # blocks end at that parent and whose next tokens begin with the parked ones takes the block
    # over (it is never shared: the taker writes the rest of it).
    self._partial: dict[BlockHash, tuple[BlockId, tuple[int, ...]]] = {}
    self._partial_of: dict[BlockId, BlockHash] = {}
    self._tick = 0
    self.num_evictions = 0
    self.peak_used_blocks = 0  # most blocks held (ref > 0) at once since construction
    self._events: list[BlockEvent] | None = None  # None: not recorded

  # -- index events ------------------------------------------------------------------------------

  def set_record_events(self, on: bool) -> None:
    """Starts (or stops, dropping what is pending) recording index events for `drain_events`:
    a `BlockStoredEvent` per indexed block, a `BlockRemovedEvent` per evicted indexed block, an
    `AllBlocksClearedEvent` per `reset_prefix_cache`. Off by default (nothing accumulates)."""
    self._events = ([] if self._events is None else self._events) if on else None

  @property
  def records_events(self) -> bool:
    return self._events is not None

  def drain_events(self) -> list[BlockEvent]:
    """The index events since the last drain, oldest first (empty when not recording)."""
    if not self._events:
      return []
    out, self._events = self._events, []
    return out

  # -- counters ----------------------------------------------------------------------------------

  @property
  def num_usable_blocks(self) -> int:
    """Blocks that can ever be allocated (the null block excluded)."""
    return self.num_blocks - self._first

  @property
  def num_free(self) -> int:
    """Blocks `allocate` can hand out now: uncached free blocks plus evictable cached ones."""
    return len(self._free) + len(self._evictable)

  @property
  def num_evictable(self) -> int:
    """Indexed blocks at reference count 0."""
    return len(self._evictable)

  @property
  def num_parked(self) -> int:
    """Parked partial blocks (see `park_partial`), all evictable."""
    return len(self._partial_of)

  @property
  def num_cached(self) -> int:
    """Indexed blocks, in use or not."""
    return len(self._index)

  @property
  def usage(self) -> float:
    """Fraction of usable blocks in use, in [0, 1] (vLLM's `kv_cache_usage_perc`)."""
    return 1.0 - self.num_free / self.num_usable_blocks

  # -- per-block queries -------------------------------------------------------------------------

  def _check_id(self, block: int) -> BlockId:
    if isinstance(block, bool) or not isinstance(block, int) or not (
        self._first <= block < self.num_blocks):
      raise ValueError(f"block {block!r} is not a usable block id in "
                       f"[{self._first}, {self.num_blocks})")
    return BlockId(block)

  def ref_count(self, block: BlockId) -> int:
    """Sequences holding `block`. Raises ValueError for a bad id."""
    return self._ref[self._check_id(block)]

  def block_hash(self, block: BlockId) -> BlockHash | None:
    """The chained hash `block` is indexed by, or None. Raises ValueError for a bad id."""
    return self._hash[self._check_id(block)]

  def is_cached(self, block: BlockId) -> bool:
    """Whether `block` is indexed (its content is a full, final prefix block: never written)."""
    return self.block_hash(block) is not None

  def is_shared(self, block: BlockId) -> bool:
    """Whether more than one sequence holds `block` (the engine must never write it)."""
    return self.ref_count(block) > 1

  def lookup(self, block_hash: BlockHash) -> BlockId | None:
    """The block indexed by `block_hash`, or None."""
    return self._index.get(block_hash)

  # -- allocation --------------------------------------------------------------------------------

  def allocate(self, n: int) -> list[BlockId]:
    """Hands out `n` blocks at reference count 1, uncached free blocks first, then evictions.

    Returns:
      The block ids in allocation order.

    Raises:
      ValueError: `n` negative or above `num_free` (nothing is allocated then).
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
      raise ValueError(f"n must be an int >= 0, got {n!r}")
    if n > self.num_free:
      raise ValueError(f"cannot allocate {n} blocks: only {self.num_free} free")
    out = []
    for _ in range(n):
      block = self._free.popleft() if self._free else self._evict_one()
      self._ref[block] = 1
      out.append(block)
    self._note_peak()
    return out

  def _note_peak(self) -> None:
    self.peak_used_blocks = max(self.peak_used_blocks, self.num_usable_blocks - self.num_free)

  def _evict_one(self) -> BlockId:
    """Unindexes and returns one evictable block: the least recently released leaf, else (every
    evictable block has an indexed child) the least recently released evictable block."""
    while self._leaf_heap:
      tick, block = heapq.heappop(self._leaf_heap)
      if self._evictable.get(block) == tick and self._is_leaf(block):
        break
    else:
      block = next(iter(self._evictable))
    del self._evictable[block]
    if block in self._partial_of:
      self._unpark(block)
    else:
      if self._events is not None:
        self._events.append(BlockRemovedEvent(self._hash[block]))
      self._uncache(block)
    self.num_evictions += 1
    return block

  def _is_leaf(self, block: BlockId) -> bool:
    if block in self._partial_of:
      return True
    h = self._hash[block]
    return h is not None and self._children[h] == 0

  def _push_leaf(self, block: BlockId) -> None:
    heapq.heappush(self._leaf_heap, (self._evictable[block], block))
    if len(self._leaf_heap) > 4 * self.num_blocks + 64:  # drop stale entries
      self._leaf_heap = [(t, b) for b, t in self._evictable.items() if self._is_leaf(b)]
      heapq.heapify(self._leaf_heap)

  def _uncache(self, block: BlockId) -> None:
    h, parent = self._hash[block], self._parent[block]
    assert h is not None
    del self._index[h]
    self._hash[block] = self._parent[block] = None
    self._drop_child(parent)

  def _unpark(self, block: BlockId) -> None:
    """Removes a parked partial block from the partial index (the caller owns it next)."""
    parent = self._partial_of.pop(block)
    del self._partial[parent]
    self._drop_child(parent)

  def _drop_child(self, parent: BlockHash) -> None:
    self._children[parent] -= 1
    if not self._children[parent]:
      del self._children[parent]
      up = self._index.get(parent)
      if up is not None and up in self._evictable:
        self._push_leaf(up)

  def touch(self, blocks: Iterable[BlockId]) -> None:
    """Adds one reference to each block (a prefix hit); an evictable block leaves the queue.

    Raises:
      ValueError: a bad id, or a block at reference count 0 that is not cached (free-list
        blocks hold no valid KV and must be allocated instead). Blocks before it stay touched.
    """
    for block in blocks:
      block = self._check_id(block)
      if self._ref[block] == 0:
        if block in self._partial_of:
          self._unpark(block)  # taken over: it leaves the partial index for good
        elif self._hash[block] is None:
          raise ValueError(f"block {block} is free and uncached: allocate it, do not touch it")
        del self._evictable[block]
      self._ref[block] += 1
    self._note_peak()

  def free(self, blocks: Iterable[BlockId]) -> None:
    """Drops one reference from each block, in the given order; a block reaching 0 joins the
    evictable queue (newest end) if cached, else the free-list tail.

    Raises:
      ValueError: a bad id or a block already at reference count 0 (blocks before it are freed).
    """
    for block in blocks:
      block = self._check_id(block)
      if self._ref[block] <= 0:
        raise ValueError(f"block {block} freed more often than allocated or touched")
      self._ref[block] -= 1
      if self._ref[block]:
        continue
      if self._hash[block] is None:
        self._free.append(block)
        continue
      self._tick += 1
      self._evictable[block] = self._tick
      if self._is_leaf(block):
        self._push_leaf(block)

  # -- the prefix-cache index --------------------------------------------------------------------

  def cache_block(self, block: BlockId, block_hash: BlockHash, parent_hash: str,
                  token_ids: Sequence[int] = ()) -> bool:
    """Indexes a full, written block under its chained hash.

    Args:
      block: a block in use (reference count >= 1), not yet indexed.
      block_hash: the chained hash of the prefix ending with this block.
      parent_hash: the previous block's hash, or the namespace root for a first block.
      token_ids: the block's tokens, for the `BlockStoredEvent` (when recording events).

    Returns:
      True if indexed; False if another block already holds `block_hash` (this block stays
      unindexed and goes to the free list when freed).

    Raises:
      ValueError: a bad id, a block at reference count 0, or one already indexed.
    """
    block = self._check_id(block)
    if self._ref[block] <= 0:
      raise ValueError(f"block {block} is not in use: only written blocks can be cached")
    if self._hash[block] is not None:
      raise ValueError(f"block {block} is already cached as {self._hash[block]}")
    if block_hash in self._index:
      return False
    self._index[block_hash] = block
    self._hash[block] = block_hash
    self._parent[block] = BlockHash(parent_hash)
    self._children[BlockHash(parent_hash)] += 1
    if self._events is not None:
      self._events.append(BlockStoredEvent(block_hash, parent_hash,
                                           tuple(int(t) for t in token_ids)))
    return True

  def park_partial(self, block: BlockId, parent_hash: str, token_ids: Sequence[int]) -> bool:
    """Releases a sequence's last, partly filled block into the partial index instead of the free
    list: at reference count 0 it is evictable (a leaf, LRU) like a cached block, and
    `lookup_partial` finds it under `parent_hash` until a sequence takes it (`touch`) or it is
    evicted. An entry already parked under the same parent is replaced (its block is freed).

    Args:
      block: a block held once (reference count 1), not indexed.
      parent_hash: hash of the full block before it, or the namespace root for a first block.
      token_ids: the tokens whose KV the block holds, 1 to B - 1 of them.

    Returns:
      True if parked; False (the block is freed instead) when `token_ids` is empty or full.

    Raises:
      ValueError: a bad id, a block not held exactly once, or an indexed block.
    """
    block = self._check_id(block)
    if self._ref[block] != 1 or self._hash[block] is not None:
      raise ValueError(f"block {block}: only an unindexed block held once can be parked "
                       f"(ref {self._ref[block]}, hash {self._hash[block]})")
    tokens = tuple(int(t) for t in token_ids)
    if not 0 < len(tokens) < self.block_size:
      self.free([block])
      return False
    parent = BlockHash(parent_hash)
    old = self._partial.get(parent)
    if old is not None:
      self._unpark(old[0])
      del self._evictable[old[0]]
      self._free.append(old[0])
    self._ref[block] = 0
    self._partial[parent] = (block, tokens)
    self._partial_of[block] = parent
    self._children[parent] += 1
    self._tick += 1
    self._evictable[block] = self._tick
    self._push_leaf(block)
    return True

  def lookup_partial(self, parent_hash: str, token_ids: Sequence[int]) -> tuple[BlockId, int] | None:
    """The parked block under `parent_hash` and how many of `token_ids` it holds: the length of
    the common prefix of its tokens and `token_ids` (KV of a token depends only on the tokens up
    to it, so that prefix of the block is exact). None when nothing is parked there or not even
    the first token matches. Nothing changes (take it with `touch`)."""
    entry = self._partial.get(BlockHash(parent_hash))
    if entry is None:
      return None
    block, parked = entry
    n = 0
    for a, b in zip(parked, token_ids):
      if a != b:
        break
      n += 1
    return (block, n) if n else None

  def is_parked(self, block: BlockId) -> bool:
    """Whether `block` is a parked partial block (see `park_partial`)."""
    return self._check_id(block) in self._partial_of

  def reset_prefix_cache(self) -> int:
    """Unindexes every block: evictable ones move to the free list (in release order), blocks in
    use become plain blocks of their requests.

    Returns:
      The number of blocks unindexed.
    """
    n = len(self._index)
    for block in self._index.values():
      self._hash[block] = self._parent[block] = None
    self._free.extend(self._evictable)
    self._evictable.clear()
    self._leaf_heap.clear()
    self._index.clear()
    self._children.clear()
    self._partial.clear()
    self._partial_of.clear()
    if self._events is not None:
      self._events.append(AllBlocksClearedEvent())
    return n

  def verify(self) -> None:
    """Checks the pool's invariants (for tests).

    Raises:
      RuntimeError: a block in two states or none, a negative count, or an index out of step.
    """
    free = set(self._free)
    evictable = set(self._evictable)
    problems = []
    if len(free) != len(self._free):
      problems.append("a block twice in the free list")
    children = collections.Counter(self._parent[b] for b in self._index.values())
    children.update(self._partial_of.values())
    if {b for b, _ in self._partial.values()} != set(self._partial_of) or any(
        self._partial[p][0] != b for b, p in self._partial_of.items()):
      problems.append("the partial index is out of step")
    if +children != +self._children:
      problems.append("child counts out of step with the index")
    for b in range(self._first, self.num_blocks):
      ref, h = self._ref[b], self._hash[b]
      states = (b in free) + (b in evictable) + (ref > 0)
      if ref < 0 or states != 1:
        problems.append(f"block {b}: ref {ref}, free {b in free}, evictable {b in evictable}")
      if b in free and h is not None:
        problems.append(f"block {b} is free but indexed")
      if b in evictable and h is None and b not in self._partial_of:
        problems.append(f"block {b} is evictable but neither indexed nor parked")
      if b in self._partial_of and (ref or h is not None or b not in evictable):
        problems.append(f"block {b} is parked but held, indexed or not evictable")
      if h is not None and self._index.get(h) != b:
        problems.append(f"block {b} has hash {h} that indexes {self._index.get(h)}")
    if problems:
      raise RuntimeError("block pool inconsistent: " + "; ".join(problems))
