"""The store side of the scheduler's requests: each stored prefix's merge, loads and inserts.

A request with stored chunks gets a `Prefix` record (its `CakeMerge`, its store lookup, the
chunks whose stored copy was rejected, the loads issued and not yet reported). The `Scheduler`
(`kvjax/scheduler/scheduler.py`) owns these records (one dict, request id -> `Prefix`) and calls
the functions here from `schedule` and `update`, on its one thread: they plan the step's inserts,
loads and releases from the merges, apply the executor's load reports to them, close a finished
request's merge, and answer the questions the step's policies ask about the store hits (which
hits are in reach, when their loads land, which requests to look ahead for).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from kvjax._typing import RequestId
from kvjax.scheduler.cake import (CakeMerge, ChunkState, LoadVerdict, MergeMode, MergeTrace,
                                  Writer)
from kvjax.scheduler.config import LoadConfig
from kvjax.scheduler.cost_model import CostModel
from kvjax.scheduler.output import InsertItem, LoadItem, LoadReport, StoredPrefix
from kvjax.scheduler.request import Request
from kvjax.scheduler.transfer_policy import (defer_bytes, largest_chunk_nbytes, loads_ahead,
                                             reads_at_once)

#: `LoadReport.reason` of a load the executor dropped, at the plan's request, before it started.
RELEASED = "released"


@dataclasses.dataclass
class Prefix:
  """Scheduler-side facts of a request's stored prefix (its merge and what to save)."""

  merge: CakeMerge
  stored: StoredPrefix
  rejected: set[int] = dataclasses.field(default_factory=set)
  outstanding: dict[int, int] = dataclasses.field(default_factory=dict)  # issued: planned bytes


def new_prefix(request: Request, stored: StoredPrefix, lc: LoadConfig,
               merge_mode: MergeMode | str | None,
               kv_ttft_target_s: float | None, resident: int,
               layer_split: bool = True) -> Prefix:
  """The record of a request whose lookup has stored chunks: a Cake merge of its prompt
  (`merge_mode` and `kv_ttft_target_s` override `lc`'s; `resident` leading chunks are on the
  device already; `layer_split` False plans it token-only whatever `lc.layer_split_points`)."""
  encodings = [c.candidates if c is not None else None for c in stored.chunks]
  merge = CakeMerge(
      request.num_prompt_tokens, stored.chunk_size, stored.hits,
      merge_mode if merge_mode is not None else lc.merge_mode,
      encodings=encodings, max_loads_in_flight=lc.max_loads_ahead or 2,
      kv_ttft_target_s=kv_ttft_target_s if kv_ttft_target_s is not None
      else lc.kv_ttft_target_s, arrival_s=request.arrival_s,
      check_writes=lc.check_writes, resident=resident,
      last_unit_tokens=stored.tail_tokens or None,
      num_layers=max(1, lc.num_layers),
      layer_split_points=lc.layer_split_points if layer_split else ())
  return Prefix(merge, stored)


def close(prefix: Prefix, now_s: float) -> MergeTrace:
  """Ends a finished (or aborted) request's merge: no chunk may be inserted any more, and its
  loads still outstanding count as waste (their planned bytes, at `now_s`). Returns a snapshot
  of its final trace."""
  m = prefix.merge
  m.cancel()
  for j, nbytes in sorted(prefix.outstanding.items()):
    m.load_done(j, False, nbytes, now_s)
  return snapshot(m)


def tokens_left(prefix: Prefix | None, r: Request) -> int:
  """Prefill tokens request `r` has left to compute (a merge's: past its frontier; without a
  merge, `prefix` None: all it has not computed)."""
  if prefix is None:
    return r.remaining_prefill_tokens
  return r.num_prompt_tokens - prefix.merge.frontier


def hits_in_reach(prefixes: Mapping[RequestId, Prefix], merges: Iterable[Request],
                  waiting: Iterable[Request], queued: int) -> list[Request]:
  """Store hits whose prefix is not all resident: among `merges` (running requests whose merge
  still prefills, oldest first), then among the first `queued` of `waiting` (the ones a step
  may admit)."""
  out = [r for r in merges if not prefixes[r.request_id].merge.is_prefix_done]
  out += [r for r in itertools.islice(waiting, queued) if r.request_id in prefixes]
  return out


def landing_hits(prefixes: Mapping[RequestId, Prefix], hits: Iterable[Request], now_s: float,
                 cost: CostModel) -> Iterator[tuple[RequestId, int, Callable[[], float | None]]]:
  """Per store hit of `hits`, in order: its id, its prefill tokens left once its loads are in,
  and a call predicting when they have landed (`CakeMerge.loads_land_s`, engine clock; made only
  when a policy needs it): what short first-token steps (rules b and c,
  `kvjax/scheduler/prefill_policy.py`) read of a hit."""
  for r in hits:
    m = prefixes[r.request_id].merge
    yield (r.request_id, m.tokens_left_after_loads(),
           functools.partial(m.loads_land_s, now_s, cost))


def lookahead(prefixes: Mapping[RequestId, Prefix], merges: Iterable[Request],
              waiting: Iterable[Request], window: int) -> tuple[RequestId, ...]:
  """The look-ahead window (`SchedulerOutput.lookahead`; CachedAttention, arXiv 2403.19708,
  section 3.3): `merges` (running requests whose merge still prefills), then the first `window`
  waiting requests with stored chunks; () when `window` is 0."""
  if not window:
    return ()
  out = [r.request_id for r in merges]
  out += [r.request_id for r in waiting if r.request_id in prefixes][:window]
  return tuple(out)


def snapshot(m: CakeMerge) -> MergeTrace:
  """A copy of `m`'s trace, with its writer letters when it keeps a writer map."""
  trace = copy.deepcopy(m.trace)
  if m.keeps_writers:
    trace.chunk_writers = m.chunk_writers()
    trace.unwritten_positions = m.writer_map().count(Writer.NONE)
  return trace


def plan_inserts(prefixes: Mapping[RequestId, Prefix], requests: Iterable[Request], held: int,
                 layerwise: bool, staging_bytes: int) -> tuple[list[InsertItem], int]:
  """Landed chunks of `requests` (holding slots): inserted this step (marked resident now).

  Args:
    prefixes: the scheduler's records.
    requests: running requests, in admission order.
    held: staged bytes the layer-wise deferring requests of this step hold already.
    layerwise: layer-wise pre-loading is on (`LoadConfig.layerwise_groups`): a
      request's landed chunks wait staged while its other loads are in flight, within
      `staging_bytes` in all (`transfer_policy.defer_bytes`).
    staging_bytes: `LoadConfig.staging_bytes`.

  Returns:
    The insert items, and `held` plus what the deferring ones among `requests` hold.
  """
  out = []
  for r in requests:
    prefix = prefixes.get(r.request_id)
    if prefix is None:
      continue
    m = prefix.merge
    if layerwise:
      need = defer_bytes(m, prefix.stored)
      if need is not None and held + need <= staging_bytes:
        held += need
        continue  # layer-wise: insert them with the step that computes after them
    for j, st in enumerate(m.states):
      if st is ChunkState.LANDED:
        m.inserted(j)
        n = m.unit_tokens(j)  # a stored tail's m rows, else the whole chunk
        out.append(InsertItem(r.request_id, j, r.slot, j * m.chunk_size,
                              n if n != m.chunk_size else None, m.split_layers(j)))
  return out, held


def plan_loads(prefixes: Mapping[RequestId, Prefix], requests: Sequence[Request],
               now_s: float | None, lc: LoadConfig, cost: CostModel, last_step_s: float,
               largest_size: int, link_free_s: Mapping[RequestId, float] | None = None
               ) -> tuple[LoadItem, ...]:
  """Each merge's next loads (last chunk first), in the order of `requests` (running ones
  first, then queued ones, or the joint plan's order); records them as outstanding. Loads
  ahead per request (`transfer_policy.loads_ahead`) take the longer of the last step
  (`last_step_s`) and one step of `largest_size` tokens as the delay, unless
  `lc.max_loads_ahead` fixes them. A request whose `link_free_s` (joint planning: when the
  link has moved the loads of the requests ahead of it) lies beyond that delay and the link's
  latency issues none yet: the link serves the requests in order."""
  out = []
  link_free_s = link_free_s or {}
  for r in requests:
    prefix = prefixes[r.request_id]
    m = prefix.merge
    nbytes = largest_chunk_nbytes(prefix.stored)
    delay_s = max(last_step_s, cost.predict_compute_s(r.num_computed_tokens, largest_size))
    if now_s is not None and link_free_s.get(r.request_id, now_s) > (
        now_s + delay_s + lc.link_latency_s):
      continue
    if lc.max_loads_ahead is None:
      m.max_loads_in_flight = loads_ahead(cost.bandwidth_bytes_per_s, delay_s,
                                          lc.link_latency_s, nbytes, lc.staging_bytes)
    reads = lc.max_loads_in_flight or reads_at_once(cost.bandwidth_bytes_per_s,
                                                    lc.link_latency_s, nbytes)
    while (j := m.next_load(now_s, cost)) is not None:
      enc = m.load_encoding(j)
      nbytes = m.load_nbytes(j) if enc is not None else 0
      prefix.outstanding[j] = nbytes
      out.append(LoadItem(r.request_id, j, enc.name if enc is not None else None, nbytes, reads,
                          m.load_layer_start(j)))
  return tuple(out)


def plan_releases(prefixes: Mapping[RequestId, Prefix], pending: list[tuple[RequestId, int]]
                  ) -> tuple[tuple[RequestId, int], ...]:
  """Outstanding loads of chunks compute has taken (not started: never start; landed: free),
  after `pending` (landed loads the merges dropped since the last plan), each once."""
  for rid, prefix in prefixes.items():
    states = prefix.merge.states
    for j in sorted(prefix.outstanding):
      if states[j] in (ChunkState.COMPUTING, ChunkState.COMPUTED):
        pending.append((rid, j))
  return tuple(dict.fromkeys(pending))


def apply_load_reports(prefixes: Mapping[RequestId, Prefix], reports: Iterable[LoadReport],
                       now_s: float, cost: CostModel) -> list[tuple[RequestId, int]]:
  """Hands each finished load to its merge (`CakeMerge.load_done`, or `load_dropped` for a
  load released before it started) and feeds the cost model; returns the landed loads the
  merges dropped (wasted), for the next plan's releases.

  The link is observed once per step, bytes over the step's link seconds (the reports' link
  times do not overlap): per-chunk samples of a fast link are milliseconds of jitter. A report
  of a request that ended meanwhile is ignored (the executor has dropped the load).
  """
  wasted = []
  link_bytes, link_s = 0, 0.0
  for rep in reports:
    prefix = prefixes.get(rep.request_id)
    if prefix is None or rep.index not in prefix.outstanding:
      continue
    del prefix.outstanding[rep.index]
    if not rep.ok and rep.reason == RELEASED:
      prefix.merge.load_dropped(rep.index, rep.done_s or now_s)
      continue
    if rep.ok:
      link_bytes += rep.nbytes
      link_s += rep.link_s
      cost.observe_decode(rep.nbytes, rep.decode_s)
    verdict = prefix.merge.load_done(rep.index, rep.ok, rep.nbytes, rep.done_s or now_s,
                                     level=rep.encoding)
    if verdict is LoadVerdict.REJECTED:
      prefix.rejected.add(rep.index)
    elif verdict is LoadVerdict.WASTED and rep.ok:
      wasted.append((rep.request_id, rep.index))
  if link_bytes > 0 and link_s > 0:
    cost.observe_load(link_bytes, link_s)
  return wasted
