"""The load side of executing a plan: store hits become resident KV.

`KVLoads` is the part of `kvjax.engine.engine.Engine` that turns the store into device KV:
at admission it asks the store client which prefix chunks it holds (one batched lookup, no data)
and hands the scheduler the answer as plain data (`StoredPrefix`, with each chunk's decodable
encodings as level-policy candidates); per step it executes the plan's store side in field order:
the look-ahead window, releases, new loads (queued on the store client, which stages them as
they land) and inserts of staged chunks into the request's blocks (raw, or decoded on the
device: `PagedModelRunner.insert_payload`), whole before the step or, with layer-wise
pre-loading, layer group by layer group inside it (`step_layerwise`).

It owns only what executing loads needs across steps: the look-ahead window last handed over.
Request state stays
with the scheduler, per-request metrics with the engine: an insert is reported back as
`(InsertItem, tier)` for the engine to count.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Container, Sequence

from kvjax import codecs
from kvjax._typing import RequestId
from kvjax.connector import KVStoreClient
from kvjax.models.runner.runner_api import Runner, SeqChunk
from kvjax.scheduler.level_policy import Candidate
from kvjax.scheduler.output import (InsertItem, InsertTiming, LoadReport, SchedulerOutput,
                                    StoredChunk, StoredPrefix)

#: What an insert reports back for the engine's metrics: the item and the tier it came from.
Loaded = tuple[InsertItem, str]


def candidates(record, raw_nbytes: int) -> list[Candidate]:
  """The encodings of a stored chunk this engine can decode, as level-policy candidates.

  A chunk whose tier lists no record (a tier without `peek`) is taken as raw. Each candidate's
  name is its `codecs.EncodingId`. A record whose only encodings are codecs this engine knows at
  another byte-format version offers those: the load reads the record and the store refuses it
  (a CODEC_VERSION_MISMATCH miss, counted per tier like every rejected chunk; the stored-chunk
  guard), so the chunk is recomputed and its stored copy replaced, never decoded. Raw
  candidates are layer-sliceable (the layer axis of Cake may insert their layers `[k, L)`).
  """
  if record is None:
    raw = codecs.EncodingId(codecs.RAW, 0)
    return [Candidate(raw, raw_nbytes, codecs.ACCURACY_RANK[raw], layer_sliceable=True)]
  # Registered (codec, level) pairs, at this engine's byte-format version or another.
  decodable, other_version = [], []
  for e in record.encodings:
    info = codecs.CODECS.get(e.codec) if isinstance(e.codec, str) else None
    if info is None or e.level not in info.levels:
      continue
    eid = codecs.EncodingId(e.codec, e.level)
    (decodable if e.codec_version == info.version else other_version).append(
        Candidate(eid, int(e.nbytes), codecs.ACCURACY_RANK[eid],
                  layer_sliceable=e.codec == codecs.RAW))
  return decodable or other_version


def first_rows(kv_L2CKH, rows: int):
  """A staged chunk's first `rows` positions (a stored tail's, `KVLoads.insert_rows`); the
  chunk itself when that is all of it."""
  return kv_L2CKH if rows == kv_L2CKH.shape[2] else kv_L2CKH[:, :, :rows]


def chunk_blocks(table: Sequence[int], block_size: int, start: int, n: int) -> tuple[int, ...]:
  """The blocks of a block table holding positions `[start, start + n)` (whole blocks of
  `block_size` positions)."""
  return tuple(table[start // block_size:(start + n) // block_size])


class KVLoads:
  """Executes the load side of the scheduler's plans on the runner and the store client.

  Args:
    runner: the model runner (owns the device KV cache).
    kv_store: the store client (owns lookups, loads in flight and staged payloads).
    clock: the engine's clock, seconds (insert timings' start times).
    fixed_encoding: a consistent engine's one readable encoding (`codecs.EncodingId`), or None:
      lookups offer the level policy only that encoding.
  """

  def __init__(self, runner: Runner, kv_store: KVStoreClient,
               clock: Callable[[], float], fixed_encoding: codecs.EncodingId | None = None):
    self.runner = runner
    self.kv_store = kv_store
    self._clock = clock
    self._fixed_encoding = fixed_encoding
    self._window_ids: tuple[RequestId, ...] = ()  # the look-ahead window last handed over

  def open_request(self, rid: RequestId, ids: Sequence[int], cache_salt: str | None,
                   history_tokens: int) -> tuple[StoredPrefix, float]:
    """Looks a new request's prefix up in the store (one batched lookup, no data read; the
    client keeps the request's key chain until `KVStoreClient.close_request`). Returns what is
    stored as plain data for the scheduler's merge, and the lookup's seconds.

    `history_tokens` h > 0 also looks up the stored tail of a finished session turn covering
    the prompt's first h tokens; a tail with a decodable encoding becomes the merge's last unit
    (the chunks after it hold no hit).
    """
    kv = self.kv_store
    t0 = time.perf_counter()
    lookup = kv.open_request(rid, ids, cache_salt, history_tokens=history_tokens)
    lookup_s = time.perf_counter() - t0
    raw_nbytes = kv.layout.nbytes
    chunks = []
    for tier, record in zip(lookup.present, lookup.records or [None] * len(lookup.present)):
      cands = candidates(record, raw_nbytes) if tier is not None else []
      if self._fixed_encoding is not None:  # consistent: only the request's fixed encoding
        cands = [cand for cand in cands if cand.name == self._fixed_encoding]
      chunks.append(StoredChunk(tier, tuple(cands)) if cands else None)
    tail, tail_tokens = lookup.tail, 0
    if tail is not None:  # the merge's last unit: the chunks after it hold no hit
      cands = tuple(candidates(tail.record, raw_nbytes))
      if cands:
        chunks = chunks[:tail.index] + [StoredChunk(tail.tier, cands)]
        tail_tokens = tail.num_tokens
    return StoredPrefix(kv.chunk_size, tuple(chunks), tail_tokens), lookup_s

  def execute(self, plan: SchedulerOutput, tables: dict, live: Container[RequestId],
              insert_timings: list[InsertTiming], layered: list, timed: bool = False
              ) -> list[Loaded]:
    """The plan's store side, in field order: hands a changed look-ahead window to the client
    (before the loads: a load may wait on a prefetch; requests not in `live` are left out),
    releases, queues new loads (a layer-split load, `LoadItem.layer_start` k > 0, reads layers
    `[k, L)` alone from the store), and inserts staged chunks (a layer-split chunk's layers
    `[InsertItem.layer_start, L)` only, raw). With layer-wise pre-loading (the
    plan has `layer_groups > 1` and compute) raw staged chunks go to `layered` as
    `(InsertItem, ChunkHit, blocks)` for `step_layerwise`; the others are inserted now, each
    timed into `insert_timings` (`timed`: blocking on the cache after each, so the time
    includes the device work). Returns the inserted chunks, in order.

    Raises:
      ValueError: a stored tail staged in an encoding other than raw; a chunk staged with
        fewer layers than its insert writes.
    """
    kv = self.kv_store
    if plan.lookahead != self._window_ids:
      self._window_ids = plan.lookahead
      kv.set_lookahead(kv.lookahead_requests([rid for rid in plan.lookahead if rid in live]))
    for rid, index in plan.releases:
      kv.release(rid, index)
    for item in plan.loads:  # `item.encoding`: the level policy's pick, or None
      kv.start_request_load(item.request_id, item.index, encoding=item.encoding,
                            nbytes=item.nbytes, max_in_flight=item.max_in_flight,
                            layer_start=item.layer_start)
    layerwise = plan.layer_groups > 1 and bool(plan.decodes or plan.prefills)
    loaded: list[Loaded] = []
    for ins in plan.inserts:
      hit = kv.take(ins.request_id, ins.index)
      t0, t0_clock = time.perf_counter(), self._clock()
      rows = self.insert_rows(ins)
      where = chunk_blocks(tables[ins.request_id], self.runner.block_size, ins.start, rows)
      if hit.layer_start > ins.layer_start:  # a planner bug: it staged fewer layers
        raise ValueError(f"chunk {ins.index} of {ins.request_id} staged from layer "
                         f"{hit.layer_start}, inserted from {ins.layer_start}")
      if ins.layer_start:  # a layer-split chunk: its layers [k, L) only (raw)
        if hit.kv is None:
          raise ValueError(f"layer-split chunk {ins.index} of {ins.request_id} is not raw")
        high = hit.kv[ins.layer_start - hit.layer_start:]  # read as [k, L): all of it
        kv.charge_device(high.nbytes)
        self.runner.insert_chunks_layers([first_rows(high, rows)], [where], [ins.start],
                                         ins.layer_start)
      elif layerwise and hit.kv is not None:
        layered.append((ins, hit, where))  # inserted group by group inside the step
        continue
      else:
        kv.charge_device(hit.encoding.nbytes)  # the host -> device link, whole chunk
        if hit.kv is not None:
          self.runner.insert_chunk(first_rows(hit.kv, rows), where, ins.start)
        elif ins.num_tokens is None:
          self.runner.insert_payload(hit.encoding.codec, hit.payload, where, ins.start)
        else:  # a stored tail is raw (`KVStoreClient.stores_tails`): never here
          raise ValueError(f"stored tail {ins.index} of {ins.request_id} is not raw")
      if timed:
        self.runner.block_until_ready()
      insert_timings.append(InsertTiming(ins.request_id, ins.index, t0_clock,
                                         time.perf_counter() - t0))
      loaded.append((ins, hit.tier))
    return loaded

  def landed(self, wait_s: float | None = None) -> list[LoadReport]:
    """The store client's load reports since the last call (`KVStoreClient.landed`, blocking up
    to `wait_s` for one), their `started_s` and `done_s` moved from the loader's
    `time.perf_counter` onto the engine's clock (each stamp is its age subtracted from the
    engine's now), so the scheduler compares landings with the plan's times on one clock. A
    stamp of 0 (a released load that never ran) stays 0, unknown. Their `link_s` stays in wall
    seconds (it measures the link)."""
    reports = self.kv_store.landed(wait_s)
    if not reports:
      return reports
    now, wall = self._clock(), time.perf_counter()
    moved = lambda t: now - (wall - t) if t else 0.0  # noqa: E731
    return [dataclasses.replace(r, started_s=moved(r.started_s), done_s=moved(r.done_s))
            for r in reports]

  def insert_rows(self, ins: InsertItem) -> int:
    """Rows of a staged chunk an insert writes: the whole chunk, or a stored tail's m rows
    rounded up to whole blocks (the padding rows land in the request's own last block, past
    its tail, where compute writes next)."""
    c = self.kv_store.chunk_size
    if ins.num_tokens is None:
      return c
    b = self.runner.block_size
    return min(c, -(-ins.num_tokens // b) * b)

  def step_layerwise(self, seqs: Sequence[SeqChunk], groups: int, layered: Sequence,
                     insert_timings: list[InsertTiming], trace: list | None = None
                     ) -> tuple[Any, list[Loaded]]:
    """Layer-wise pre-loading (CachedAttention, arXiv 2403.19708, section 3.2.1): the step's
    raw inserted chunks move host -> device layer group by layer group on the store client's
    transfer thread (each group charged to the emulated link) while the step runs: for each
    group g, wait for group g of every chunk, insert them (`insert_chunks_layers`: one call for
    the whole chunks, one per stored tail, whose rows differ), run layer group g
    (`PagedModelRunner.step_layers`). So the step's compute overlaps the transfer: about
    max(transfer, compute) instead of their sum. `trace`, when a list, gets
    ("insert", request_id, chunk index, g) and ("layers", g) events in execution order.
    Returns the step's output (`PagedModelRunner.step_finish`) and the inserted chunks."""
    runner, kv = self.runner, self.kv_store
    st = runner.step_begin(seqs, groups)
    transfers = kv.transfer([hit.kv for _, hit, _ in layered], st.groups)
    rows = [self.insert_rows(ins) for ins, _, _ in layered]
    whole = [i for i, r in enumerate(rows) if r == kv.chunk_size]
    tails = [[i] for i, r in enumerate(rows) if r != kv.chunk_size]  # each alone: rows differ
    batches = sorted(([whole] if whole else []) + tails)  # in chunk order
    spent = [0.0] * len(layered)
    started = self._clock()
    for g, (l0, _) in enumerate(st.groups):
      arrs = [tr.wait(g, timeout_s=60.0) for tr in transfers]
      for idx in batches:
        t0 = time.perf_counter()
        runner.insert_chunks_layers([first_rows(arrs[i], rows[i]) for i in idx],
                                    [layered[i][2] for i in idx],
                                    [layered[i][0].start for i in idx], l0)
        share = (time.perf_counter() - t0) / len(idx)
        for i in idx:
          spent[i] += share
          if trace is not None:
            ins = layered[i][0]
            trace.append(("insert", ins.request_id, ins.index, g))
      runner.step_layers(st)
      if trace is not None:
        trace.append(("layers", g))
    loaded: list[Loaded] = []
    for (ins, hit, _), sec in zip(layered, spent):
      insert_timings.append(InsertTiming(ins.request_id, ins.index, started, sec))
      loaded.append((ins, hit.tier))
    return runner.step_finish(st), loaded
