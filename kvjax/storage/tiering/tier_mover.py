"""The mover of the real tiers: it executes the planner's moves, and decides nothing.

`TieredStore` (`kvjax/storage/tiering/tiers.py`) owns the planner (`kvjax.storage.tiering.placement.
TierHierarchy`, the one that drives the session simulator) and one mover
(`TieredStore.mover`). Every insert, promotion, demotion and drop the planner returns is carried
out here, as bytes copied between tiers and counts in the store's `TierLedger`:

    Insert(key, tier)          the put's bytes are written into `tier`          (awaited)
    Promote(key, src, dst)     the bytes a read got from `src` are written into `dst`; `src`
                               keeps its copy (the planner runs with copies)   (awaited)
    Demote(key, src, dst)      `src`'s copy (every encoding) is written into `dst`, then
                               deleted from `src`                        (a background task)
    Drop(key, tier)            deleted from `tier`                       (a background task)

Moves of one key run in the order the planner gave them (each waits for the key's previous
move); moves of different keys run concurrently. Demotions and drops are tasks on the store's
event loop, off the load path, with at most `demotion_bytes_in_flight` bytes of demotions in
flight (a put waits for room; a promotion is skipped when there is none). Races are closed by
order: a demoted copy is deleted from its source only after the tier below has published it
(a host copy leaves the host's capacity count at once and stays readable until then), and
reads go top down. A move that fails (a write raises or is declined) is reported to the store
(`lost(key, tier)`), which tells the planner; the chunk is then recomputed when needed.

When built with `record=True`, `planned` lists every move the store handed over, in the
planner's order (`note`), and `executed` every move carried out, in the order each finished:
the trace-replay test compares both with the planner's own moves.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Sequence

from kvjax.storage.tiering.host_tier import HostMemoryTier, Tier
from kvjax.storage.tiering.placement import Demote, Drop, Insert, Move, Promote
from kvjax.storage.tiering.tier_ledger import TierLedger
from kvjax.storage.format.types import ChunkHit, ChunkRecord, EncodedPayload

log = logging.getLogger(__name__)


class TierMover:
  """Carries out move records on the real tiers.

  Owns: the move tasks in flight per key and the demotions' bytes in flight (under its own
  lock; `demoting_bytes` may be read from any thread). Runs on the store's event loop. Knows
  nothing of placement: it is told which moves to run, and reports a lost copy through `lost`.

  Args:
    tiers: the store's tiers, top first.
    host: the host tier, or None.
    ledger: the store's books.
    lost: `(key, tier name) -> None`, called when a move could not leave a copy where the
      planner put it.
    demotion_bytes_in_flight: bytes of demotions being written at most.
    record: keep the moves handed over (`planned`) and carried out (`executed`).
  """

  def __init__(self, tiers: Sequence[Tier], host: HostMemoryTier | None, ledger: TierLedger,
               lost: Callable[[str, str], None], *, demotion_bytes_in_flight: int,
               record: bool = False):
    self._tiers = {t.name: t for t in tiers}
    self._host = host
    self._ledger = ledger
    self._lost = lost
    self._bytes_bound = int(demotion_bytes_in_flight)
    self._lock = threading.Lock()
    self._demotions: dict[asyncio.Task, int] = {}  # in flight -> its bytes
    self._background: set[asyncio.Task] = set()
    self._tails: dict[str, asyncio.Task] = {}  # key -> its last move's task (event loop only)
    self.planned: list[Move] | None = [] if record else None
    self.executed: list[Move] | None = [] if record else None

  def busy(self, key: str) -> bool:
    """Whether a move of `key` is still running (its copies are in transit)."""
    t = self._tails.get(key)
    return t is not None and not t.done()

  def note(self, moves: Sequence[Move]) -> None:
    """Records the moves of one planner call, in its order (with `record`)."""
    if self.planned is not None:
      self.planned.extend(moves)

  # -- bytes in flight --------------------------------------------------------------------------

  def _pending_demotions(self, loop: asyncio.AbstractEventLoop | None = None
                         ) -> tuple[list[asyncio.Task], int]:
    """(demotion tasks not done yet, their bytes), of `loop`'s tasks only if given."""
    with self._lock:
      tasks = [t for t in self._demotions
               if not t.done() and (loop is None or t.get_loop() is loop)]
      return tasks, sum(self._demotions[t] for t in tasks)

  def demoting_bytes(self) -> int:
    """Bytes of the demotions in flight."""
    return self._pending_demotions()[1]

  def has_room(self) -> bool:
    """Whether the demotions in flight leave room under the byte bound (a promotion is skipped
    when they do not: the load path never waits for demotions)."""
    return self.demoting_bytes() < self._bytes_bound

  async def demotion_room(self) -> None:
    """Waits (a put's caller: the saver) while the demotions in flight hold the byte bound."""
    loop = asyncio.get_running_loop()
    while True:
      mine, nbytes = self._pending_demotions(loop)
      if not mine or nbytes < self._bytes_bound:
        return
      await asyncio.wait(mine, return_when=asyncio.FIRST_COMPLETED)

  async def drain(self) -> None:
    """Waits until every move started so far (on this event loop) is done."""
    loop = asyncio.get_running_loop()
    while True:
      with self._lock:
        mine = [t for t in self._background if not t.done() and t.get_loop() is loop]
      if not mine:
        return
      await asyncio.gather(*mine, return_exceptions=True)

  # -- running moves ----------------------------------------------------------------------------

  async def _after(self, key: str, prev: asyncio.Task | None) -> None:
    if prev is not None and not prev.done():
      await asyncio.gather(prev, return_exceptions=True)

  def _chain(self, key: str, run: Callable[[], Awaitable[bool]], nbytes: int = 0,
             demotion: bool = False) -> asyncio.Task:
    """Starts `run` as a task after the key's previous move."""
    prev = self._tails.get(key)

    async def body() -> bool:
      await self._after(key, prev)
      return await run()

    task = asyncio.get_running_loop().create_task(body())
    self._tails[key] = task
    with self._lock:
      self._background.add(task)
      if demotion:
        self._demotions[task] = nbytes
    task.add_done_callback(lambda t, key=key: self._done(key, t))
    return task

  def _done(self, key: str, task: asyncio.Task) -> None:
    with self._lock:
      self._background.discard(task)
      self._demotions.pop(task, None)
    if self._tails.get(key) is task:
      del self._tails[key]

  def _log(self, move: Move) -> None:
    if self.executed is not None:
      self.executed.append(move)

  def start(self, moves: Sequence[Move]) -> None:
    """Starts the demotions and drops among `moves` as background tasks, in order per key
    (an `Insert` or `Promote` among them is the caller's to run: `insert`, `promote`)."""
    for m in moves:
      if isinstance(m, Demote):
        self._chain(m.key, lambda m=m: self._demote(m), m.nbytes, demotion=True)
      elif isinstance(m, Drop):
        self._chain(m.key, lambda m=m: self._drop(m))

  async def insert(self, move: Insert | Promote, write: Callable[[Tier], Awaitable[bool]]
                   ) -> bool:
    """Runs an `Insert` (or a `Promote` whose bytes the caller holds) now: `write(tier)`
    publishes the chunk into the destination tier, after the key's earlier moves. A write that
    raises is logged and counted (`put_errors`); False means the planner's copy is not there
    (reported through `lost`)."""
    dst = move.tier if isinstance(move, Insert) else move.dst
    prev = self._tails.get(move.key)
    if prev is not None:
      await self._after(move.key, prev)
    tier = self._tiers[dst]
    try:
      ok = bool(await write(tier))
    except Exception:  # noqa: BLE001  (saving is best effort; counted)
      log.warning("put failed on tier %s", dst, exc_info=True)
      self._ledger.count(dst, "put_errors")
      ok = False
    self._log(move)
    if not ok and not (await self._has(tier, move.key)):
      self._lost(move.key, dst)
    return ok

  async def _has(self, tier: Tier, key: str) -> bool:
    try:
      return bool((await tier.contains([key]))[0])
    except Exception:  # noqa: BLE001
      return False

  async def _drop(self, move: Drop) -> bool:
    tier = self._tiers[move.tier]
    self._log(move)
    try:
      gone = bool(await tier.delete(move.key))
    except Exception:  # noqa: BLE001
      log.warning("eviction delete failed on tier %s", move.tier, exc_info=True)
      return False
    if gone:
      self._ledger.count(move.tier, "evictions")
    return gone

  async def _demote(self, move: Demote) -> bool:
    """Writes `src`'s copy into `dst`, then deletes it from `src`. Never raises: a failure is
    counted (`demotion_drops`) and the chunk lost."""
    src, dst = self._tiers[move.src], self._tiers[move.dst]
    self._log(move)
    host = src if src is self._host else None
    try:
      if host is not None:
        ev = host.start_leaving(move.key)  # out of the capacity count, readable until release
        if ev is None:
          self._lost(move.key, move.dst)
          return False  # deleted meanwhile: nothing to demote
        rec, payloads = ev.record, list(ev.payloads)
      else:
        got = await self._read_all(src, move.key)
        if got is None:
          self._ledger.count(move.src, "demotion_drops")
          self._lost(move.key, move.dst)
          await self._delete(src, move.key)
          return False
        rec, payloads = got
      self._ledger.count(move.src, "evictions")
      if await self._has(dst, move.key):
        self._ledger.count(move.src, "demotions_unneeded")
        return True
      if host is not None and not host.is_leaving(move.key):
        self._lost(move.key, move.dst)
        return False  # deleted meanwhile (e.g. a bad copy being replaced)
      if await self._write(dst, rec, payloads, move.nbytes):
        self._ledger.count(move.src, "demotions_out")
        self._ledger.count(move.dst, "demotions_in")
        return True
      if not await self._has(dst, move.key):
        self._ledger.count(move.src, "demotion_drops")
        self._lost(move.key, move.dst)
      return False
    except Exception:  # noqa: BLE001  (a demotion is best effort; counted)
      log.warning("demotion of %s from %s failed", move.key, move.src, exc_info=True)
      self._ledger.count(move.src, "demotion_drops")
      self._lost(move.key, move.dst)
      return False
    finally:
      if host is not None:
        host.release(move.key)
      else:
        await self._delete(src, move.key)

  async def _delete(self, tier: Tier, key: str) -> None:
    try:
      await tier.delete(key)
    except Exception:  # noqa: BLE001
      log.warning("delete failed on tier %s", tier.name, exc_info=True)

  async def _read_all(self, tier: Tier, key: str
                      ) -> tuple[ChunkRecord, list[EncodedPayload]] | None:
    """Every encoding `tier` can read of `key` (its record and payloads), or None."""
    (rec,) = await tier.peek([key])
    if rec is None:
      return None
    payloads = []
    for e in rec.encodings:
      pick = lambda encs, e=e: next((x for x in encs if (x.codec, x.level) == (e.codec, e.level)),
                                    None)
      try:
        got = await tier.get(key, rec.token_ids, rec.namespace, rec.layout, choose=pick,
                             origin=rec.origin, layer_start=0)
      except Exception:  # noqa: BLE001
        log.warning("demotion read failed on tier %s", tier.name, exc_info=True)
        continue
      if isinstance(got, ChunkHit):
        arrays = {"values": got.kv} if got.encoding.codec == "raw" else got.payload
        payloads.append(EncodedPayload(got.encoding.codec, got.encoding.level, arrays))
    return (rec, payloads) if payloads else None

  async def _write(self, tier: Tier, rec: ChunkRecord, payloads: Sequence[EncodedPayload],
                   nbytes: int) -> bool:
    """Publishes `payloads` of `rec` into `tier`; True if it did."""
    raw = next((q.arrays["values"] for q in payloads if q.codec == "raw"), None)
    coded = tuple(q for q in payloads if q.codec != "raw")
    try:
      ok = await tier.put(rec.chunk_hash, rec.parent_hash, rec.token_ids, rec.namespace, raw,
                          layout=rec.layout, payloads=coded, origin=rec.origin)
    except Exception:  # noqa: BLE001
      log.warning("demotion put failed on tier %s", tier.name, exc_info=True)
      self._ledger.count(tier.name, "put_errors")
      return False
    if ok:
      self._ledger.count(tier.name, "bytes_written", int(nbytes))
    return bool(ok)
