"""Per-request block tables over the device block pool, and the device prefix cache.

The scheduler owns one `KVCacheManager`; the engine only reads block tables and moves arrays
(vLLM v1 `vllm/v1/core/kv_cache_manager.py`). The device is the first tier every lookup tries
(CachedAttention, arXiv 2403.19708, section 3: device, host, disk, remote):

    admission      check_fits(prompt + max_tokens)        ValueError if it can never fit
                   get_computed_blocks(request, root) --> (hit blocks, hit tokens), device tier
                   allocate_slots(id, n, hits) --------> new block ids, or None: pool short,
                                                          preempt choose_victim(running), retry
    every step     allocate_slots(id, n)                 slots for this step's tokens
                   (engine writes KV into the request's non-shared, unindexed blocks)
                   cache_full_blocks(request, computed)  index blocks that are now full
    end            free(id)                              blocks stay cached at ref 0
                   preempt(id)                           the same, and the request is recomputed

    B = 4             block 0       block 1       block 2       block 3
    request A table   (0)           (1)           (2)           (3)             14 tokens
              holds   t0 .. t3      t4 .. t7      t8 .. t11     t12 t13 . .
              key     h0            h1            h2            -   (not full: unindexed)
    request B table   (0) ref 2     (1) ref 2     (4)                           10 tokens,
                      shared: read, never written  B writes only here           same first 8
    h0 = H(root, t0..t3), h1 = H(h0, t4..t7), ...  (`kvjax.block_hash`: the store's key scheme)

Hits are full blocks and never cover a sequence's last token: its logits must be computed to
sample the next one. A shared block (ref > 1) or an indexed block is never written: the engine
writes positions `>= num_computed_tokens`, which lie in blocks this manager allocated fresh.
`cache_salt` and the model namespace isolate hits through the per-request namespace root.

Not thread-safe: the scheduler calls it from one thread.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kvjax._typing import RequestId
from kvjax.block_hash import BlockHash, hash_block_tokens, loadable_units
from kvjax.scheduler.block_pool import BlockEvent, BlockId, BlockPool
from kvjax.scheduler.request import Request


@dataclasses.dataclass(frozen=True)
class KVCacheEvents:
  """The device prefix cache's index changes since the last drain (`drain_events`), plain data
  for whoever publishes them (the server's KV event publisher, in vLLM's schema).

  Attributes:
    namespace_root: the manager's default namespace root: a `BlockStoredEvent` whose
      `parent_hash` equals it is the first block of a sequence without `cache_salt`; a first
      block under another root is a salted (tenant-isolated) sequence.
    block_size: B, tokens per block.
    events: `BlockStoredEvent` / `BlockRemovedEvent` / `AllBlocksClearedEvent`, oldest first.
  """

  namespace_root: str
  block_size: int
  events: tuple[BlockEvent, ...]


@dataclasses.dataclass(frozen=True)
class KVCacheStats:
  """A snapshot of the pool and the device prefix cache (counts since construction).

  Attributes:
    num_blocks: usable blocks in the pool (the null block excluded).
    num_free_blocks: blocks allocatable now (free plus evictable cached ones).
    num_cached_blocks: indexed blocks, in use or not.
    usage: fraction of usable blocks in use, vLLM's `kv_cache_usage_perc`, in [0, 1].
    queries: prefix lookups (`get_computed_blocks` calls with caching on).
    query_tokens: tokens of the sequences looked up.
    hits: lookups that found at least one block.
    hit_tokens: tokens served from the device by those lookups.
    evictions: cached blocks evicted to make room.
    preemptions: requests preempted.
    peak_used_blocks: most blocks in use (held by a request) at once since construction.
    block_size: B, tokens per block (0: not given).
    enable_prefix_caching: whether full blocks are indexed and shared.
  """

  num_blocks: int
  num_free_blocks: int
  num_cached_blocks: int
  usage: float
  queries: int
  query_tokens: int
  hits: int
  hit_tokens: int
  evictions: int
  preemptions: int
  peak_used_blocks: int = 0
  block_size: int = 0
  enable_prefix_caching: bool = True

  @property
  def hit_rate(self) -> float:
    """hit_tokens / query_tokens (0 before any query)."""
    return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


@dataclasses.dataclass
class _RequestBlocks:
  namespace_root: str
  blocks: list[BlockId] = dataclasses.field(default_factory=list)
  hashes: list[BlockHash] = dataclasses.field(default_factory=list)  # full blocks seen so far
  num_indexed: int = 0  # leading blocks already offered to the index
  partial_hit: tuple[BlockId, int] | None = None  # the last lookup's parked block, its tokens
  indexing: bool = True  # False after a reset_prefix_cache while the request held blocks


def _tokens(request: Request, start: int, end: int) -> list[int]:
  """Token ids `[start, end)` of prompt + output, without concatenating the whole sequence."""
  prompt, n = request.prompt_token_ids, len(request.prompt_token_ids)
  if end <= n:
    return list(prompt[start:end])
  out = request.output_token_ids
  if start >= n:
    return list(out[start - n:end - n])
  return list(prompt[start:]) + list(out[:end - n])


def _check_count(name: str, value: int) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value < 0:
    raise ValueError(f"{name} must be an int >= 0, got {value!r}")


class KVCacheManager:
  """Block tables, prefix hits and preemption over one `BlockPool`.

  Args:
    num_blocks: blocks in the device pool.
    block_size: B, tokens per block.
    namespace_root: the default namespace root of block hashes (the store's
      `KeyNamespace.root_hash()` for the model, no salt); requests with a `cache_salt` pass their
      own to `get_computed_blocks`.
    enable_prefix_caching: index full blocks and serve hits; False makes every lookup miss.
    reserve_null_block: keep block 0 out of circulation (see `BlockPool`).

  Raises:
    ValueError: bad sizes (see `BlockPool`) or a root that is not a non-empty str.
  """

  def __init__(self, num_blocks: int, block_size: int, *, namespace_root: str,
               enable_prefix_caching: bool = True, reserve_null_block: bool = False):
    if not isinstance(namespace_root, str) or not namespace_root:
      raise ValueError(f"namespace_root must be a non-empty hex str, got {namespace_root!r}")
    self.pool = BlockPool(num_blocks, block_size, reserve_null_block=reserve_null_block)
    self.block_size = block_size
    self.namespace_root = namespace_root
    self.enable_prefix_caching = bool(enable_prefix_caching)
    self._requests: dict[RequestId, _RequestBlocks] = {}
    self._queries = self._query_tokens = self._hits = self._hit_tokens = 0
    self._preemptions = 0

  # -- admission ---------------------------------------------------------------------------------

  def check_fits(self, num_tokens: int) -> int:
    """Blocks a sequence of `num_tokens` tokens needs; call at admission with prompt + max_tokens.

    Raises:
      ValueError: `num_tokens` negative, or more blocks than the pool has (the request could
        never run, preemption or not).
    """
    _check_count("num_tokens", num_tokens)
    need = -(-num_tokens // self.block_size)
    if need > self.pool.num_usable_blocks:
      raise ValueError(
          f"a request of {num_tokens} tokens needs {need} KV blocks of {self.block_size} tokens, "
          f"but the pool has {self.pool.num_usable_blocks}: raise kv_cache_memory_bytes or "
          "lower max_tokens")
    return need

  def get_computed_blocks(self, request: Request, *, namespace_root: str | None = None,
                          record_stats: bool = True) -> tuple[list[BlockId], int]:
    """The longest device-resident prefix of full blocks of the request's tokens.

    Looks at prompt + output tokens (a preempted request resumes from both) and never covers the
    last one: a sequence of n tokens hits at most `floor((n - 1) / B)` blocks. Reference counts
    are not touched; pass the blocks to `allocate_slots` right away (before anything else
    allocates) so they are not evicted in between.

    Args:
      request: a request holding no blocks (waiting or preempted).
      namespace_root: its namespace root (salted with its `cache_salt`); default: the manager's.
      record_stats: count this lookup in `stats()` (False for a probe before admission).

    After the full blocks, a parked partial block (`BlockPool.park_partial`: the last block of
    a finished sequence with the same prefix) whose first tokens equal the request's next ones
    extends the hit by those tokens; `allocate_slots` then hands that block to this request (it
    writes the block's remaining slots), so a follow-up turn reuses every token whose KV exists,
    not only whole blocks (SGLang's token-granular radix cache gets the same by other means).

    Returns:
      (hit block ids in prefix order, hit tokens: len(full blocks) * B plus the partial block's
      matching tokens); ([], 0) with caching off.

    Raises:
      ValueError: the request already holds blocks.
    """
    state = self._requests.get(request.request_id)
    if state is not None and state.blocks:
      raise ValueError(f"request {request.request_id!r} already holds {len(state.blocks)} "
                       "blocks: free or preempt it before looking its prefix up again")
    if not self.enable_prefix_caching:
      return [], 0
    root = self.namespace_root if namespace_root is None else namespace_root
    if not isinstance(root, str) or not root:
      raise ValueError(f"namespace_root must be a non-empty hex str, got {root!r}")
    if state is None or state.namespace_root != root:
      state = self._requests[request.request_id] = _RequestBlocks(root)
    state.indexing = True
    hits: list[BlockId] = []
    b = self.block_size
    for i in range(loadable_units(request.num_tokens, b)):
      block = self.pool.lookup(self._hash(state, request, i))
      if block is None:
        break
      hits.append(block)
    hit_tokens = len(hits) * b
    state.partial_hit = None
    room = min(b - 1, request.num_tokens - 1 - hit_tokens)  # never the last token
    if room > 0:
      parent = state.hashes[len(hits) - 1] if hits else state.namespace_root
      found = self.pool.lookup_partial(parent, _tokens(request, hit_tokens, hit_tokens + room))
      if found is not None:
        state.partial_hit = found
        hits.append(found[0])
        hit_tokens += found[1]
    if record_stats:
      self._queries += 1
      self._query_tokens += request.num_tokens
      self._hits += bool(hits)
      self._hit_tokens += hit_tokens
    return hits, hit_tokens

  def _hash(self, state: _RequestBlocks, request: Request, i: int) -> BlockHash:
    """Hash of the request's block i, computing (and keeping) the chain up to it."""
    b = self.block_size
    while len(state.hashes) <= i:
      j = len(state.hashes)
      parent = state.hashes[-1] if state.hashes else state.namespace_root
      state.hashes.append(hash_block_tokens(parent, _tokens(request, j * b, (j + 1) * b)))
    return state.hashes[i]

  # -- slots -------------------------------------------------------------------------------------

  def allocate_slots(self, request_id: RequestId, num_new_tokens: int, *,
                     num_computed_tokens: int,
                     new_computed_blocks: Sequence[BlockId] = (),
                     num_lookahead_tokens: int = 0) -> list[BlockId] | None:
    """Gives a request the slots for its next tokens (vLLM's `allocate_slots` contract).

    Token positions of the request, B = block size:

      | num_computed_tokens | hits       | num_new_tokens | num_lookahead_tokens |
      | KV already in the   | new_comp-  | computed this  | slots only (draft    |
      | request's blocks    | uted_blocks| step           | tokens)              |
      |<--------------------------- total tokens needing a slot ------------------>|
      |<- blocks already held ->|<- hits ->|<---------- blocks to allocate --------->|

      total = num_computed_tokens + len(hits) * B + num_new_tokens + num_lookahead_tokens
      to allocate = ceil(total / B) - held - len(hits)     (0 if the held blocks suffice)

      B = 4, 6 computed, 3 new:   [0 1 2 3][4 5|6 7][8 . . .]   2 held, total 9 -> 1 new block
      B = 4, 2 hits, 5 new:       [hit    ][hit    ][8 9 a b][c . . .]   -> 2 new blocks

    Hits are touched before anything is allocated, so the allocation cannot evict them; the
    pool counts evictable hits as taken.

    Args:
      request_id: the request.
      num_new_tokens: tokens computed (or loaded from the store) this step, >= 0.
      num_computed_tokens: tokens whose KV is already in the request's blocks (not counting
        `new_computed_blocks`).
      new_computed_blocks: prefix hits from `get_computed_blocks`, only on the first allocation
        (no blocks held, `num_computed_tokens == 0`); a leading part of them may be passed
        (whole chunks); the parked partial block counts only as the lookup's last hit.
      num_lookahead_tokens: extra slots beyond the new tokens (speculative drafts), >= 0.

    Returns:
      The newly allocated block ids, in table order (also appended to `block_table`), or None
      when the pool is short (nothing changes then: preempt `choose_victim(...)` and retry).

    Raises:
      ValueError: negative counts, `num_computed_tokens` beyond the held slots, hits passed when
        blocks are held or tokens computed, or hits that are not this request's cached prefix
        (stale: evicted since the lookup, or from another namespace).
    """
    for name, v in (("num_new_tokens", num_new_tokens),
                    ("num_computed_tokens", num_computed_tokens),
                    ("num_lookahead_tokens", num_lookahead_tokens)):
      _check_count(name, v)
    b = self.block_size
    state = self._requests.get(request_id)
    if state is None:
      state = self._requests[request_id] = _RequestBlocks(self.namespace_root)
    hits = list(new_computed_blocks)
    if num_computed_tokens > len(state.blocks) * b:
      raise ValueError(f"request {request_id!r}: num_computed_tokens={num_computed_tokens} but "
                       f"it holds {len(state.blocks)} blocks of {b} tokens")
    if hits:
      if state.blocks or num_computed_tokens:
        raise ValueError(f"request {request_id!r}: prefix hits only on the first allocation "
                         f"(it holds {len(state.blocks)} blocks, {num_computed_tokens} computed)")
    partial = 0
    for i, block in enumerate(hits):
      if (i == len(hits) - 1 and state.partial_hit is not None
          and state.partial_hit[0] == block and self.pool.is_parked(block)):
        partial = state.partial_hit[1]
        continue
      if i >= len(state.hashes) or self.pool.block_hash(block) != state.hashes[i]:
        raise ValueError(f"request {request_id!r}: block {block} is not its cached prefix "
                         f"block {i} (stale lookup or another namespace)")
    full = len(hits) - bool(partial)
    total = num_computed_tokens + full * b + partial + num_new_tokens + num_lookahead_tokens
    need = max(0, -(-total // b) - len(state.blocks) - len(hits))
    evictable_hits = sum(self.pool.ref_count(block) == 0 for block in hits)
    if need + evictable_hits > self.pool.num_free:
      return None
    self.pool.touch(hits)  # a parked block is taken over: it is this request's alone now
    state.blocks.extend(hits)
    state.partial_hit = None
    state.num_indexed = max(state.num_indexed, full)
    new = self.pool.allocate(need)
    state.blocks.extend(new)
    return new

  def cache_full_blocks(self, request: Request, num_tokens: int) -> list[BlockId]:
    """Indexes the request's blocks that are full after its first `num_tokens` tokens' KV is
    written (prompt and generated tokens alike); call after the step that wrote them.

    Args:
      request: a request holding blocks; its prompt + output tokens give the hashes.
      num_tokens: leading tokens whose KV is in the request's blocks (`num_computed_tokens`).

    Returns:
      Blocks indexed by this call (a block whose prefix another block already holds is skipped).

    Raises:
      ValueError: unknown request, or `num_tokens` beyond its tokens or its slots.
    """
    _check_count("num_tokens", num_tokens)
    state = self._state(request.request_id)
    if num_tokens > request.num_tokens or num_tokens > len(state.blocks) * self.block_size:
      raise ValueError(f"request {request.request_id!r}: num_tokens={num_tokens} beyond its "
                       f"{request.num_tokens} tokens or {len(state.blocks)} blocks")
    if not self.enable_prefix_caching or not state.indexing:
      return []
    out = []
    for i in range(state.num_indexed, num_tokens // self.block_size):
      block = state.blocks[i]
      h = self._hash(state, request, i)
      if self.pool.block_hash(block) is not None:  # a hit block, indexed already
        continue
      parent = state.hashes[i - 1] if i else state.namespace_root
      tokens = (_tokens(request, i * self.block_size, (i + 1) * self.block_size)
                if self.pool.records_events else ())
      if self.pool.cache_block(block, h, parent, tokens):
        out.append(block)
    state.num_indexed = max(state.num_indexed, num_tokens // self.block_size)
    return out

  def fork(self, parent_id: RequestId, child_id: RequestId, num_tokens: int
           ) -> tuple[tuple[BlockId, BlockId], ...] | None:
    """Gives `child_id` the KV of `parent_id`'s first `num_tokens` tokens without computing it
    (`n` > 1: one prefill, n decodes): the parent's full blocks are shared (one more reference
    each: read, never written), and a partly filled last block gets a fresh block of the
    child's own, which the engine fills by copying the parent's (`Runner.copy_blocks`) once
    the step that writes it has run. B = 4, 10 prompt tokens:

        parent table   (0)      (1)      (2) t8 t9 . .     <- the parent decodes into (2)
        child table    (0) ref2 (1) ref2 (5) t8 t9 . .     <- a copy of (2); the child decodes
                                                              into (5)

    Args:
      parent_id: a request holding blocks that cover `num_tokens` (its prompt, planned).
      child_id: a request that holds no blocks (its prompt is the parent's).
      num_tokens: tokens to share, >= 1.

    Returns:
      The (source, destination) block pairs to copy (none when `num_tokens` is a whole number
      of blocks), or None when the pool is short (nothing changes then).

    Raises:
      ValueError: unknown parent, a child that holds blocks, or `num_tokens` beyond the
        parent's blocks.
    """
    _check_count("num_tokens", num_tokens)
    parent = self._state(parent_id)
    b = self.block_size
    known = self._requests.get(child_id)
    if known is not None and known.blocks:
      raise ValueError(f"request {child_id!r} already holds {len(known.blocks)} blocks")
    if not 1 <= num_tokens <= len(parent.blocks) * b:
      raise ValueError(f"request {parent_id!r} holds {len(parent.blocks)} blocks of {b} "
                       f"tokens: cannot fork {num_tokens} tokens")
    full, tail = divmod(num_tokens, b)
    if tail and not self.pool.num_free:
      return None
    shared = parent.blocks[:full]
    self.pool.touch(shared)
    own = self.pool.allocate(1) if tail else []
    self._requests[child_id] = _RequestBlocks(
        parent.namespace_root, blocks=shared + own, hashes=list(parent.hashes[:full]),
        num_indexed=full, indexing=parent.indexing)  # the parent indexes the shared blocks
    return ((parent.blocks[full], own[0]),) if tail else ()

  # -- queries -----------------------------------------------------------------------------------

  def _state(self, request_id: RequestId) -> _RequestBlocks:
    state = self._requests.get(request_id)
    if state is None:
      raise ValueError(f"unknown request {request_id!r}: no blocks allocated or looked up")
    return state

  def block_table(self, request_id: RequestId) -> tuple[BlockId, ...]:
    """The request's blocks in position order (block i holds tokens `[iB, (i+1)B)`).

    Raises:
      ValueError: unknown request.
    """
    return tuple(self._state(request_id).blocks)

  def is_shared(self, block: BlockId) -> bool:
    """Whether more than one request holds `block`: the engine must never write it."""
    return self.pool.is_shared(block)

  def stats(self) -> KVCacheStats:
    """A snapshot of counts; see `KVCacheStats`."""
    return KVCacheStats(
        num_blocks=self.pool.num_usable_blocks, num_free_blocks=self.pool.num_free,
        num_cached_blocks=self.pool.num_cached, usage=self.pool.usage, queries=self._queries,
        query_tokens=self._query_tokens, hits=self._hits, hit_tokens=self._hit_tokens,
        evictions=self.pool.num_evictions, preemptions=self._preemptions,
        peak_used_blocks=self.pool.peak_used_blocks, block_size=self.block_size,
        enable_prefix_caching=self.enable_prefix_caching)

  def set_record_events(self, on: bool) -> None:
    """Records (or stops recording) the index changes `drain_events` returns; off by default."""
    self.pool.set_record_events(on)

  def drain_events(self) -> KVCacheEvents:
    """The index changes since the last drain (blocks stored, evicted, all cleared), oldest
    first; empty `events` when not recording (`set_record_events`)."""
    return KVCacheEvents(self.namespace_root, self.block_size, tuple(self.pool.drain_events()))

  # -- release -----------------------------------------------------------------------------------

  def _release(self, state: _RequestBlocks, request: Request | None = None) -> int:
    # Tail first (vLLM's order): a sequence's last blocks are the first reused or evicted.
    n = len(state.blocks)
    blocks = list(state.blocks)
    b = self.block_size
    done = request.num_computed_tokens if request is not None else 0
    i, m = divmod(done, b)
    if (request is not None and self.enable_prefix_caching and state.indexing and m
        and done >= request.num_prefill_tokens and i < len(blocks)
        and self.pool.ref_count(blocks[i]) == 1 and not self.pool.is_cached(blocks[i])):
      # The last block holding KV is partly filled: park it for a follow-up turn.
      self.pool.free(reversed(blocks[i + 1:]))
      parent = self._hash(state, request, i - 1) if i else state.namespace_root
      self.pool.park_partial(blocks[i], parent, _tokens(request, i * b, done))
      self.pool.free(reversed(blocks[:i]))
      blocks = []
    self.pool.free(reversed(blocks))
    state.blocks = []
    state.num_indexed = 0
    state.indexing = True
    return n

  def free(self, request_id: RequestId, request: Request | None = None) -> int:
    """Releases a finished or aborted request's blocks; indexed ones stay cached at ref 0.

    Args:
      request_id: the request.
      request: the request itself (its tokens and `num_computed_tokens`): when given, its prefill
        is complete and its last block holding KV is partly filled and held only by it, that
        block is parked (`BlockPool.park_partial`) so a follow-up turn reuses its tokens.

    Returns:
      Blocks released (0 for a request this manager never saw, e.g. aborted while waiting).
    """
    state = self._requests.pop(request_id, None)
    return 0 if state is None else self._release(state, request)

  def preempt(self, request_id: RequestId) -> int:
    """Releases a running request's blocks so others can run (vLLM's recompute preemption).

    Its indexed blocks stay cached, so on re-admission `get_computed_blocks` finds them unless
    they were evicted meanwhile; the caller resets its `num_computed_tokens` to 0.

    Returns:
      Blocks released.

    Raises:
      ValueError: unknown request.
    """
    state = self._state(request_id)
    self._preemptions += 1
    return self._release(state)

  @staticmethod
  def choose_victim(running_ids_in_admission_order: Sequence[RequestId]) -> RequestId:
    """The request to preempt when the pool runs out: the newest running one (vLLM's policy).

    Raises:
      ValueError: nothing running.
    """
    if not running_ids_in_admission_order:
      raise ValueError("no running request to preempt")
    return running_ids_in_admission_order[-1]

  def reset_prefix_cache(self) -> int:
    """Empties the device prefix cache: nothing on the device before now is a hit again.

    Evictable blocks return to the free list; blocks of running requests stay theirs but are
    unindexed, and those requests index no more blocks until they are preempted or readmitted.

    Returns:
      Blocks unindexed.
    """
    for state in self._requests.values():
      if state.blocks:
        state.indexing = False
    return self.pool.reset_prefix_cache()
