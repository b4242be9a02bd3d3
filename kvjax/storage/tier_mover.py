"""The mover of the real tiers: it executes what the placement policy decides.

`TieredStore` (`kvjax/storage/tiers.py`) owns one (`TieredStore.mover`). Two kinds of moves run here, their
victims chosen by each tier's `kvjax.storage.eviction.PlacementPolicy` (the policy classes the
planner `kvjax.storage.placement.TierHierarchy` runs, with the same `eviction.leaf_first`):

  * demotions (write-back placement, CachedAttention, arXiv 2403.19708, section 3.3.2): a chunk
    the host tier evicted is written to the first persistent tier, as a task on the store's
    event loop, with at most `demotion_bytes_in_flight` bytes in flight; the host copy serves
    reads until the lower tier has published it;
  * capacity eviction of a persistent tier: orphans first (write-back: chunks whose prefix chain
    is broken in every tier can never hit), then the policy's victims (never a hinted chunk nor
    one a load is reading), each demoted to the next persistent tier (write-back) before it is
    deleted.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Sequence

from kvjax._typing import ChunkHash
from kvjax.storage.eviction import EntryInfo, PlacementPolicy
from kvjax.storage.host_tier import Evicted, HostMemoryTier, Tier
from kvjax.storage.tier_api import TierUsage
from kvjax.storage.tier_ledger import PersistentTier, TierLedger, record_nbytes
from kvjax.storage.types import ChunkHit, ChunkRecord, EncodedPayload

log = logging.getLogger(__name__)


class TierMover:
  """Demotions and capacity eviction of a `TieredStore`'s tiers.

  Owns: the demotions in flight (under its own lock) and the eviction passes. Runs on the
  store's event loop (a put or a promotion starts its work); `_pending_demotions` may be read
  from any thread. It records counts, recency and bytes in the store's `TierLedger` and asks
  the store where chunks are held only through `held` (`TieredStore.lookup`).

  Args:
    tiers: the store's tiers, top first.
    host: the host tier, or None.
    persistent: persistent tier name -> its capacity and policy.
    ledger: the store's books.
    held: `async (hashes) -> [tier name or None]`, where each chunk is held.
    placement: "write_through" or "write_back".
    demotion_bytes_in_flight: write-back: bytes of demotions being written at most.
  """

  def __init__(self, tiers: Sequence[Tier], host: HostMemoryTier | None,
               persistent: dict[str, PersistentTier], ledger: TierLedger,
               held: Callable[[Sequence[ChunkHash]], Awaitable[list[str | None]]], *,
               placement: str, demotion_bytes_in_flight: int):
    self._tiers = list(tiers)
    self._host = host
    self._persist = persistent
    self._ledger = ledger
    self._held = held
    self._placement = placement
    self._bytes_bound = int(demotion_bytes_in_flight)
    self._lock = threading.Lock()
    self._demotions: dict[asyncio.Task, int] = {}  # in flight -> its bytes

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

  def start_demotions(self) -> None:
    """Starts one demotion task per chunk the host tier evicted since the last call."""
    if self._host is None or not self._host.demote:
      return
    evicted = self._host.take_evicted()
    if not evicted:
      return
    loop = asyncio.get_running_loop()
    for ev in evicted:
      task = loop.create_task(self._demote_host_chunk(ev))
      with self._lock:
        self._demotions[task] = ev.nbytes
      task.add_done_callback(self._demotion_done)

  def _demotion_done(self, task: asyncio.Task) -> None:
    with self._lock:
      self._demotions.pop(task, None)

  async def drain(self) -> None:
    """Waits until every demotion started so far (on this event loop) is done."""
    loop = asyncio.get_running_loop()
    while True:
      mine, _ = self._pending_demotions(loop)
      if not mine:
        return
      await asyncio.gather(*mine, return_exceptions=True)

  def _below(self, tier_name: str) -> Tier | None:
    """The next persistent tier under `tier_name`, or None."""
    names = [t.name for t in self._tiers]
    return next((t for t in self._tiers[names.index(tier_name) + 1:]
                 if t.name in self._persist), None)

  async def _held_anywhere(self, hashes: Sequence[ChunkHash]) -> list[bool]:
    return [t is not None for t in await self._held(hashes)]

  async def _demote_host_chunk(self, ev: Evicted) -> None:
    """Writes one chunk the host evicted to the first persistent tier, then releases the host
    copy (which served reads meanwhile). Never raises: a failure is counted and the chunk lost."""
    rec, host = ev.record, self._host
    h = rec.chunk_hash
    try:
      lower = self._below(host.name)
      if lower is None:
        self._ledger.count(host.name, "demotion_drops")
        return
      if (await lower.contains([h]))[0]:
        self._ledger.count(host.name, "demotions_unneeded")
        self._ledger.touch(lower.name, h)
        return
      if not host.is_leaving(h):
        return  # deleted meanwhile (e.g. a bad copy being replaced): nothing to demote
      if rec.parent_hash != rec.namespace and not (await self._held_anywhere(
          [rec.parent_hash]))[0]:
        self._ledger.count(host.name, "orphans_dropped")
        return
      if await self._demote_into(host.name, lower, rec, ev.payloads, ev.nbytes):
        return
      if not (await lower.contains([h]))[0]:
        self._ledger.count(host.name, "demotion_drops")
    except Exception:  # noqa: BLE001  (a demotion is best effort; counted)
      log.warning("demotion of %s from %s failed", h, host.name, exc_info=True)
      self._ledger.count(host.name, "demotion_drops")
    finally:
      host.release(h)

  async def _demote_into(self, src: str, lower: Tier, rec: ChunkRecord,
                         payloads: Sequence[EncodedPayload], nbytes: int) -> bool:
    """Writes `payloads` of `rec` into persistent tier `lower` and counts the demotion; True if
    it published them (its capacity is enforced afterwards, which may demote further down)."""
    raw = next((q.arrays["values"] for q in payloads if q.codec == "raw"), None)
    coded = tuple(q for q in payloads if q.codec != "raw")
    try:
      ok = await lower.put(rec.chunk_hash, rec.parent_hash, rec.token_ids, rec.namespace, raw,
                           layout=rec.layout, payloads=coded, origin=rec.origin)
    except Exception:  # noqa: BLE001
      log.warning("demotion put failed on tier %s", lower.name, exc_info=True)
      self._ledger.count(lower.name, "put_errors")
      return False
    if not ok:
      return False
    self._ledger.count(src, "demotions_out")
    self._ledger.count(lower.name, "demotions_in")
    self._ledger.count(lower.name, "bytes_written", int(nbytes))
    self._ledger.touch(lower.name, rec.chunk_hash, new=True)
    self._ledger.wrote(lower.name, rec.chunk_hash, nbytes)
    await self.enforce(lower)
    return True

  async def _demote_persistent(self, t: Tier, lower: Tier, rec: ChunkRecord) -> None:
    """Copies one victim of persistent tier `t` (every encoding it can read) into `lower`
    before `t` deletes it; a chunk it cannot copy is counted as dropped."""
    h = rec.chunk_hash
    if (await lower.contains([h]))[0]:
      self._ledger.count(t.name, "demotions_unneeded")
      return
    payloads, nbytes = [], 0
    for e in rec.encodings:
      pick = lambda encs, e=e: next((x for x in encs if (x.codec, x.level) == (e.codec, e.level)),
                                    None)
      try:
        got = await t.get(h, rec.token_ids, rec.namespace, rec.layout, choose=pick,
                          origin=rec.origin)
      except Exception:  # noqa: BLE001
        log.warning("demotion read failed on tier %s", t.name, exc_info=True)
        continue
      if isinstance(got, ChunkHit):
        payloads.append(EncodedPayload(got.encoding.codec, got.encoding.level, got.payload))
        nbytes += int(got.encoding.nbytes)
    if not payloads or not await self._demote_into(t.name, lower, rec, payloads, nbytes):
      self._ledger.count(t.name, "demotion_drops")

  async def usage(self) -> list[TierUsage]:
    """What each persistent tier holds now, top first (lists every tier's records)."""
    out = []
    for t in self._tiers:
      p = self._persist.get(t.name)
      if p is None:
        continue
      recs = await t.records()
      out.append(TierUsage(t.name, len(recs), sum(record_nbytes(r) for r in recs),
                           p.capacity_bytes))
    return out

  async def enforce_capacity(self) -> None:
    """Brings every bounded persistent tier under its capacity (rescanning its records)."""
    for t in self._tiers:
      p = self._persist.get(t.name)
      if p is not None and p.capacity_bytes is not None:
        self._ledger.rescan(t.name)
        await self.enforce(t)

  async def enforce(self, t: Tier) -> None:
    """Evicts from persistent tier `t` by its policy until it fits its capacity.

    The byte count is a mirror of `records()` updated by our own puts; when it says the tier is
    over capacity (or it is unknown) the records are listed afresh before choosing victims, so
    other writers' chunks count too. One pass runs at a time per tier.
    """
    p, ledger = self._persist[t.name], self._ledger
    if not ledger.begin_eviction(t.name):
      return
    progress = again = False
    try:
      recs = await t.records()
      view = ledger.eviction_view(t.name, recs)
      if view is None:
        return
      need, infos, reading = view
      by_hash = {r.chunk_hash: r for r in recs}
      orphans: list[ChunkHash] = []
      write_back = self._placement == "write_back"
      if write_back:  # across the hierarchy: a chunk whose prefix is broken everywhere goes first
        dead_order = await self._orphans(t, recs, p.policy, infos, reading)
        sizes = {i.chunk_hash: i.nbytes for i in infos}
        freed = 0
        for h in dead_order:
          if freed >= need:
            break
          orphans.append(h)
          freed += sizes[h]
        dead = set(orphans)
        rest = [i for i in infos if i.chunk_hash not in dead]
        victims = orphans + p.policy.victims(rest, need - freed, keep=reading)
      else:
        victims = p.policy.victims(infos, need, keep=reading)
      lower = self._below(t.name) if write_back else None
      for v in victims:
        if ledger.is_reading(t.name, v):
          continue  # a load began reading it: not this pass
        if v in orphans:
          self._ledger.count(t.name, "orphans_dropped")
        elif lower is not None:
          await self._demote_persistent(t, lower, by_hash[v])
        try:
          gone = await t.delete(v)
        except Exception:  # noqa: BLE001
          log.warning("eviction delete failed on tier %s", t.name, exc_info=True)
          continue
        if gone:
          self._ledger.count(t.name, "evictions")
          progress = True
        ledger.forget(t.name, v)
    finally:
      again = ledger.end_eviction(t.name)
    if again and progress and self._placement == "write_back":  # demotions landed meanwhile
      await self.enforce(t)

  async def _orphans(self, t: Tier, recs: Sequence[ChunkRecord], policy: PlacementPolicy,
                     infos: Sequence[EntryInfo], reading: set[ChunkHash]) -> list[ChunkHash]:
    """Chunks of persistent tier `t` that can never hit: a parent that is not the namespace
    root and that no tier holds, or an orphan parent within `t`. In the policy's order; hinted
    chunks and chunks being read are left out."""
    parents = {r.chunk_hash: r.parent_hash for r in recs}
    roots = {r.chunk_hash: r.namespace for r in recs}
    outside = sorted({pa for h, pa in parents.items()
                      if pa not in parents and pa != roots[h]})
    held = dict(zip(outside, await self._held_anywhere(outside))) if outside else {}
    dead: dict[ChunkHash, bool] = {}

    def is_dead(h: ChunkHash) -> bool:
      path = []
      while h not in dead:
        pa = parents[h]
        if pa == roots[h] or (pa not in parents and held.get(pa, False)):
          dead[h] = False
          break
        if pa not in parents:
          dead[h] = True
          break
        if pa in path or pa == h:  # a cycle (not trusted never to happen): not dead
          dead[h] = False
          break
        path.append(h)
        h = pa
      for x in path:
        dead[x] = dead[h]
      return dead[h]

    skip = policy.hinted | reading
    order = sorted((i for i in infos if i.chunk_hash not in skip and is_dead(i.chunk_hash)),
                   key=policy.order_key)
    return [i.chunk_hash for i in order]
