"""The scheduler: the one owner of request state. Plain data in, plain data out.

Ownership. The scheduler holds every live `Request` (queued or running), its slot, its token
counts, its Cake merge (`kvjax.scheduler.cake.CakeMerge`: chunk states, loads in flight, trace)
and the cost model the merges plan with. Nothing outside this room holds a reference to them.
Each step (vLLM v1's `schedule()` then `update_from_output()`):

    schedule(now_s) ──> SchedulerOutput      what the executor does this step (plain records)
    update(result)  <── StepResult           what it did: tokens, finishes, loads, timings

`schedule` spends the step's token budget in this order (Cake, arXiv 2410.03065, section 4
Part 3, adaptive mode):

  1. every decoding request takes one token;
  2. staged chunks of requests holding a slot are inserted (free of budget: loads are the other
     resource, Cake section 3);
  3. prefills already under way continue (`SchedulerConfig.prefill_order`): "shortest_first"
     (default), fewest tokens left first, among ordinary prefills, merges whose stored chunks
     are all resident (a hit with only its new tokens left), and the queue's first ordinary
     requests with fewer tokens left than the longest of those, counted past their
     device-resident prefix (a device prefix-cache hit's new tokens), admitted at their turn
     when a slot, the pool and the budget allow (queued requests never pass each other);
     "fcfs", ordinary prefills oldest first;
  4. waiting requests are admitted into free decode slots, first come first served (a request
     with a Cake merge is admitted whenever a slot is free, budget or not: its loads need none);
     their staged chunks are inserted, and every merge issues its next loads, last chunk first,
     queued requests included (loads need no slot);
  5. the compute side of each merge takes what is left, oldest first: compiled chunk sizes
     aligned to store chunks, possibly several pieces (skipping resident chunks), none when loads
     are predicted to finish the next chunk first.

Short first-token steps (`SchedulerConfig.short_first_token_steps`, with "shortest_first"): a
request's first token comes at the end of the step that computes its prompt's last token, so
that step's length is part of its TTFT, and so is the length of every step its loads wait out.
Three rules keep those steps short:

  a. once a prefill planned in 3 ends its prompt, the rest of the step (3, 4 and 5) takes at most
     as many tokens again as the step holds so far (its decodes and prefill tokens, the ended
     prompt's included), at least the smallest chunk size: a hit's 46-token tail rides with 32
     tokens of a cold prompt, not with 466 (on the 2-core CPU at a 1.8K-token context, a step
     of 0.7 s instead of 2.2 s). The same for the queue: a long prompt admitted in 4 (it does
     not end within the step) leaves room for the short prompts queued right behind it that
     end within the step (`_room_behind`; at least the smallest chunk size its own), so they
     are admitted in the same step, in queue order, with their first tokens;
  b. while a merge with fewer tokens left once its loads are in than the longest prefill in 3
     has loads to come (holding a slot, or queued within the free slots' reach), the step takes
     only what the cost model says computes before those loads are predicted to land
     (`CakeMerge.loads_land_s`; at least the smallest chunk size), so the hit is inserted the
     moment they do. A load past its predicted landing turns this off (the model is off for it);
  c. when a merge (holding a slot with loads to come, or heading the queue with a slot free) has at
     most the token budget left once its loads are in, and they are predicted to land within half
     the last computing step, the step computes nothing: it admits the hit, issues its loads, and
     the executor blocks until a load lands (`wait_s`); the steps after insert what landed and wait
     again, until the hit's loads are all in or half that step has passed since the first waiting
     step (`_landing_wait`). The hit's tail then computes in the next step instead of the one after
     it, and the decodes and prefills under way lose at most half a step (on the 2-core CPU, a
     host-tier hit of 28 chunks landed in about 10 ms beside 0.1 s decode steps).

Rules a and b cut only the longer prefills, in 3 and among the admissions in 4 alike: a prefill
that ends its prompt within what the step has left is short (its first token comes with the same
step; cutting it would cost it a whole step to save the others its compute), and so is one with
at most twice the tokens left of the hit a rule serves (the hit's tokens left once its loads are
in; for a, the step so far or the smallest chunk size, the larger), so two hits' tails in one
step do not split each other; short prefills are planned whole. Many short prompts at once are
thus admitted as the budget allows, not one a step (64 prompts of 40 tokens: 12 a step, as with
the rules off; `tests/scheduler/admission_test.py`). A long prompt beside hits pays a few more,
smaller steps (a step's fixed cost each); a step with no hit near its first token is whole. Both
rules are bounded: the longer prefills together still advance at least the smallest chunk size
a step.
Rule c is bounded by half a step per hit (a stuck or slow load cannot hold the others longer);
it uses the one link estimate the cost model has for every tier, so a disk-tier hit predicted
as fast as a host hit may cost the others that half step for nothing.

Why "shortest_first": a store hit is mostly loads; once they are in, what it has left is its new
tokens, often a few dozen. First come first served puts them behind a long cold prompt's chunked
prefill, so the hit's first token waits for that whole prompt (on the 2-core CPU replay of
`scripts/bench_sessions.py`, hits beside a cold prefill waited 7.6 s at the median against
0.94 s for the others). Fewest tokens left first is shortest-remaining-time-first, which
minimises the mean time to first token; a merge still loading keeps Cake's leftover budget, so
the meeting point still moves by itself.

A prefill chunk is the largest compiled chunk size that fits the budget and the prompt's remaining
tokens, so only a prompt's last chunk is ever padded:

    prompt of 300 tokens, sizes (16, 32, ..., 512):  [0 --256--)[256 -32-)[288 12+pad)

Long prefills share the step (vLLM's `long_prefill_token_threshold`, `SchedulerConfig`): with a
threshold T > 0, each request's prefill takes at most T tokens of a step (in 2, 3 and 5 alike),
so one long prompt leaves the rest of the budget to the prefills and merges after it in the
order above. A request whose remaining prefill is at most T is not limited by it. T = 0: off.
A Cake merge's compute side is capped the same way (its chunk planner sees the capped budget,
so its predictions of where compute meets the loads assume the capped step); in consistent mode
(whole store chunks per prefill piece) the cap is at least one store chunk.

A plan is a promise the executor keeps in order: the scheduler advances `num_computed_tokens` and
marks inserted chunks resident when it plans them. `update` learns the rest: sampled tokens are
appended, finished requests free their slots (their ids reach the executor in the next plan),
each landed load goes to its merge (`load_done`), and measured times feed the cost model.

Loads are issued ahead, as a queue: the executor runs each request's reads a few at a time and
starts the next the moment one lands, so a long step never idles the link. How far ahead is the
link's bandwidth-delay product, where the delay is the time until the next chance to issue (one
step) plus the link's latency (`loads_ahead`).
"""

from __future__ import annotations

import bisect
import collections
import copy
import dataclasses
import itertools
import math

from kvjax._typing import RequestId
from kvjax.scheduler.cake import CakeMerge, ChunkState, LoadVerdict, MergeMode, MergeTrace, Writer
from kvjax.scheduler.cost_model import CostModel
from kvjax.scheduler.kv_cache_manager import KVCacheManager
from kvjax.scheduler.output import (DecodeItem, InsertItem, LoadItem, PrefillChunk, SaveItem,
                                    SchedulerOutput, StepResult, StoredPrefix)
from kvjax.scheduler.request import Request, RequestStatus

#: `LoadReport.reason` of a load the executor dropped, at the plan's request, before it started.
RELEASED = "released"

#: `SchedulerConfig.prefill_order` values.
FCFS = "fcfs"
SHORTEST_FIRST = "shortest_first"
PREFILL_ORDERS = (FCFS, SHORTEST_FIRST)

#: Longest single wait for a load to land, seconds (the executor asks for a new plan after it).
MAX_LOAD_WAIT_S = 1.0


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
  """Attributes:
    num_slots: decode slots (maximum running requests).
    token_budget: tokens computed per step at most (decodes count one each).
    chunk_sizes: compiled prefill chunk sizes, ascending.
    long_prefill_token_threshold: vLLM's option of that name: a request's prefill (ordinary,
      or a Cake merge's compute side) takes at most this many tokens of one step, so a long
      prompt shares the budget with other requests' prefills; 0 (default): off. When > 0 it
      must be at least the smallest chunk size (a long prompt could not advance otherwise).
    prefill_order: the order prefills under way take the budget (the module note):
      "shortest_first" (default) or "fcfs".
    short_first_token_steps: with "shortest_first", keep a step short when it carries a
      prefill's first token or a store hit's last loads (cutting the longer prefills; those
      that end within the step go whole), or let it wait for a hit's loads that land within
      half a step (the module note): True (default).

  Raises:
    ValueError: non-positive slots or budget, unsorted sizes, a budget or threshold below the
      smallest size, or an unknown `prefill_order`.
  """

  num_slots: int = 4
  token_budget: int = 512
  chunk_sizes: tuple[int, ...] = (16, 32, 64, 128, 256, 512)
  long_prefill_token_threshold: int = 0
  prefill_order: str = SHORTEST_FIRST
  short_first_token_steps: bool = True

  def __post_init__(self):
    if not isinstance(self.short_first_token_steps, bool):
      raise ValueError(f"short_first_token_steps={self.short_first_token_steps!r} must be a bool")
    if self.prefill_order not in PREFILL_ORDERS:
      raise ValueError(f"prefill_order={self.prefill_order!r}; use one of {PREFILL_ORDERS}")
    if self.num_slots <= 0 or self.token_budget <= 0:
      raise ValueError(f"num_slots={self.num_slots} and token_budget={self.token_budget} must be "
                       "positive")
    if not self.chunk_sizes or list(self.chunk_sizes) != sorted(set(self.chunk_sizes)):
      raise ValueError(f"chunk_sizes must be ascending and distinct, got {self.chunk_sizes}")
    if self.token_budget < self.chunk_sizes[0]:
      raise ValueError(f"token_budget={self.token_budget} is below the smallest chunk size "
                       f"{self.chunk_sizes[0]}: long prompts could never be scheduled")
    t = self.long_prefill_token_threshold
    if isinstance(t, bool) or not isinstance(t, int) or t < 0:
      raise ValueError(f"long_prefill_token_threshold={t!r} must be an int >= 0 (0: off)")
    if 0 < t < self.chunk_sizes[0]:
      raise ValueError(f"long_prefill_token_threshold={t} is below the smallest chunk size "
                       f"{self.chunk_sizes[0]}: long prompts could never be scheduled")


@dataclasses.dataclass(frozen=True)
class LoadConfig:
  """How stored prefixes become resident.

  Attributes:
    merge_mode: "cake" (compute from the front, load from the back), "compute_only" (ignore
      hits) or "load_only" (wait for every stored chunk): the baselines share the machinery.
    max_loads_in_flight: reads at once per request (the executor's concurrency); None derives
      it from the link's bandwidth and latency (`reads_at_once`).
    max_loads_ahead: loads issued ahead per request (queued or reading); None derives it from
      the link's bandwidth-delay product over one step (`loads_ahead`).
    link_latency_s: the store link's latency prior, seconds (a read's fixed cost), for the
      bandwidth-delay product.
    staging_bytes: stored bytes a request may have issued and not yet inserted, at most.
    kv_ttft_target_s: pick encodings for this TTFT target instead of for the time compute would
      finish each chunk (CacheGen, arXiv 2310.07240, section 5.3).
    check_writes: keep each merge's per-position writer map (raises on a double write).
    layerwise_groups: layer-wise pre-loading (CachedAttention, arXiv 2403.19708, section
      3.2.1): a step that inserts stored chunks and computes runs as this many layer groups,
      each chunk's group g inserted just before group g runs, so the host -> device transfer
      overlaps the step's compute; a request's landed chunks wait staged while its other loads
      are in flight (when the staging budget holds them), so they go in with the step that
      computes after them. 1 (default): off.
    lookahead_window: waiting requests with stored chunks whose chunks the executor hints
      (never evicted) and prefetches toward the host tier (CachedAttention, arXiv 2403.19708,
      section 3.3; `SchedulerOutput.lookahead`); 0: off (plain LRU, no prefetch).
  """

  merge_mode: str = "cake"
  max_loads_in_flight: int | None = None
  max_loads_ahead: int | None = None
  link_latency_s: float = 1e-3
  staging_bytes: int = 1 << 30
  kv_ttft_target_s: float | None = None
  check_writes: bool = False
  layerwise_groups: int = 1
  lookahead_window: int = 0

  def __post_init__(self):
    w = self.lookahead_window
    if isinstance(w, bool) or not isinstance(w, int) or w < 0:
      raise ValueError(f"lookahead_window={w!r} must be an int >= 0")
    g = self.layerwise_groups
    if isinstance(g, bool) or not isinstance(g, int) or g < 1:
      raise ValueError(f"layerwise_groups={g!r} must be an int >= 1")
    try:
      MergeMode(self.merge_mode)
    except ValueError:
      raise ValueError(f"merge_mode={self.merge_mode!r}; use one of "
                       f"{[m.value for m in MergeMode]}") from None
    for name in ("max_loads_in_flight", "max_loads_ahead"):
      v = getattr(self, name)
      if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise ValueError(f"{name}={v!r} must be None or an int >= 1")
    if not self.link_latency_s >= 0 or not self.staging_bytes > 0:
      raise ValueError(f"link_latency_s={self.link_latency_s} must be >= 0 and staging_bytes="
                       f"{self.staging_bytes} > 0")


def loads_ahead(bandwidth_bytes_per_s: float, step_s: float, latency_s: float,
                chunk_nbytes: int, staging_bytes: int) -> int:
  """Loads to keep issued per request: the link's bandwidth-delay product in chunks.

  The delay is how long the link must stay busy without the scheduler: one step (the scheduler
  issues between steps) plus the link's latency. At least 2 (one moving, one queued), at most
  what the staging budget holds.
  """
  if chunk_nbytes <= 0 or not math.isfinite(bandwidth_bytes_per_s):
    return max(2, staging_bytes // max(1, chunk_nbytes))
  bdp = bandwidth_bytes_per_s * (step_s + latency_s) / chunk_nbytes
  return int(max(2, min(math.ceil(bdp) + 1, staging_bytes // chunk_nbytes)))


def reads_at_once(bandwidth_bytes_per_s: float, latency_s: float, chunk_nbytes: int) -> int:
  """Concurrent reads that cover the link's latency: ceil(bandwidth x latency / chunk) + 1, in
  [2, 16]."""
  if chunk_nbytes <= 0 or not math.isfinite(bandwidth_bytes_per_s):
    return 2
  return int(min(16, max(2, math.ceil(bandwidth_bytes_per_s * latency_s / chunk_nbytes) + 1)))


def chunk_tokens(remaining: int, budget: int, chunk_sizes: tuple[int, ...]) -> int:
  """Tokens of the next prefill chunk: the largest compiled size that fits, or a short tail.

  Returns 0 when nothing fits. A prompt tail shorter than the smallest size is taken whole (the
  runner pads it).
  """
  limit = min(remaining, budget, chunk_sizes[-1])
  if limit <= 0:
    return 0
  i = bisect.bisect_right(chunk_sizes, limit)
  if i == 0:
    return remaining if remaining == limit else 0
  return chunk_sizes[i - 1]


@dataclasses.dataclass
class _Prefix:
  """Scheduler-side facts of a request's stored prefix (its merge and what to save)."""

  merge: CakeMerge
  stored: StoredPrefix
  rejected: set[int] = dataclasses.field(default_factory=set)
  outstanding: dict[int, int] = dataclasses.field(default_factory=dict)  # issued: planned bytes


class Scheduler:
  """Admits requests into decode slots and plans each step within the token budget.

  Args:
    config: slots, token budget, chunk sizes.
    cost_model: the cost model merges plan with (fed by `update`); a fresh `CostModel()` when
      None.
    load_config: how stored prefixes load (merge mode, loads ahead, TTFT target).
    save_chunk_size: tokens per store chunk when requests' chunks are saved (None: no store;
      requests then get no `saves`).
    consistent: outputs must not depend on which chunks were loaded (lossy codecs): every prefill
      step inside a full store chunk is exactly one chunk, and each completed chunk is listed in
      `PrefillChunk.roundtrip` (it passes through the stored encoding), so a computed chunk
      equals a loaded one bit for bit and the meeting point cannot change the answer. A
      `long_prefill_token_threshold` below the store chunk size is then raised to it (a request
      still advances one whole chunk a step).
    kv_cache: the KV pool's block manager (issue 11); None plans without one (slots only, no
      blocks: plan tests). With
      it the scheduler allocates blocks before planning a request's tokens (a request with a
      Cake merge gets its whole prompt's blocks at admission, so loads can land anywhere),
      lists every running request's block table in the plan, frees a finished request's
      blocks (indexed ones stay cached), preempts the newest running request when the pool is
      short (it recomputes prompt + output later, `Request.prefill_len`), and admits a request
      with the longest device-resident prefix of whole blocks (`KVCacheManager`), shared
      without a copy. `config.num_slots` then only caps running requests.

  Raises:
    ValueError: `consistent` without a `save_chunk_size` among the compiled chunk sizes, or a
      token budget below it.
  """

  def __init__(self, config: SchedulerConfig, cost_model: CostModel | None = None, *,
               load_config: LoadConfig | None = None, save_chunk_size: int | None = None,
               consistent: bool = False, kv_cache: KVCacheManager | None = None):
    if kv_cache is not None and save_chunk_size is not None and (
        save_chunk_size % kv_cache.block_size):
      raise ValueError(f"kv_chunk_size={save_chunk_size} must be a whole number of blocks of "
                       f"block_size={kv_cache.block_size}")
    self.kv_cache = kv_cache
    self._roots: dict[RequestId, str | None] = {}  # per-request namespace root (paged)
    self._device_hit_tokens: dict[RequestId, int] = {}
    self._preempted: list[RequestId] = []
    self._device_hits: list[tuple[RequestId, int]] = []
    if consistent and (save_chunk_size not in config.chunk_sizes
                       or config.token_budget < save_chunk_size):
      raise ValueError(f"consistent codec outputs need the store chunk size {save_chunk_size} "
                       f"among the compiled chunk sizes {config.chunk_sizes} and a token budget "
                       f">= it (got {config.token_budget})")
    self.consistent = consistent
    # Consistent mode computes store chunks whole, one per step: the only compiled size used.
    self._plan_sizes = (save_chunk_size,) if consistent else config.chunk_sizes
    # One request's prefill tokens per step at most (None: the budget's): see the module note.
    # Consistent mode: exactly one store chunk. A step runs all its tokens in one ragged call,
    # where a request's later chunk would attend to its earlier chunk's computed KV, not to the
    # round-tripped KV a load (or a later step) gives it.
    cap = config.long_prefill_token_threshold
    self._prefill_cap = save_chunk_size if consistent else (cap or None)
    self.config = config
    self.cost_model = cost_model if cost_model is not None else CostModel()
    self.load_config = load_config or LoadConfig()
    self.save_chunk_size = save_chunk_size
    self.waiting: collections.deque[Request] = collections.deque()
    self.running: dict[RequestId, Request] = {}  # insertion order = admission order
    self._free_slots = list(range(config.num_slots))
    self._prefix: dict[RequestId, _Prefix] = {}
    self._finished_ids: list[RequestId] = []
    self._releases: list[tuple[RequestId, int]] = []
    self._last_step_s = 0.0
    self._last_now_s: float | None = None
    # Rule c of short first-token steps: the last step that computed, seconds (0: none yet);
    # whether the last plan computed; the hit a run of waiting steps waits for, and when the
    # run began.
    self._last_compute_step_s = 0.0
    self._computed_last = False
    self._waiting_for: RequestId | None = None
    self._waiting_since_s = 0.0
    self._final_traces: dict[RequestId, MergeTrace] = {}

  # ----------------------------------------------------------------------------- requests
  def add_request(self, request: Request, stored: StoredPrefix | None = None, *,
                  merge_mode: MergeMode | str | None = None,
                  kv_ttft_target_s: float | None = None,
                  namespace_root: str | None = None) -> None:
    """Takes ownership of a new request (the caller keeps no reference to it).

    Args:
      request: the request, status WAITING.
      stored: the store lookup of its prefix; a Cake merge plans it when any chunk is stored
        (and the mode uses hits).
      merge_mode: this request's merge mode instead of `load_config.merge_mode`.
      kv_ttft_target_s: this request's TTFT target instead of `load_config.kv_ttft_target_s`.
      namespace_root: the root of its block hashes (the store's namespace with
        its `cache_salt`); None: the manager's default.

    Raises:
      ValueError: a duplicate id, a lookup that does not fit the prompt, or (paged) a request
        whose prompt + max_tokens can never fit the pool.
    """
    rid = request.request_id
    if rid in self.running or rid in self._prefix or any(
        r.request_id == rid for r in self.waiting):
      raise ValueError(f"request id {rid!r} is already scheduled")
    self.check_fits(request.num_prompt_tokens + request.sampling_params.max_tokens)
    self._roots[rid] = namespace_root
    if stored is not None and any(stored.hits) and self._device_covers(request, stored,
                                                                       namespace_root):
      stored = None  # the device holds every stored chunk: its blocks (and parked block) serve
    if stored is not None and any(stored.hits):
      lc = self.load_config
      encodings = [c.candidates if c is not None else None for c in stored.chunks]
      resident = self._hold_device_prefix(request, stored.chunk_size, namespace_root)
      merge = CakeMerge(
          request.num_prompt_tokens, stored.chunk_size, stored.hits,
          merge_mode if merge_mode is not None else lc.merge_mode,
          encodings=encodings, max_loads_in_flight=lc.max_loads_ahead or 2,
          kv_ttft_target_s=kv_ttft_target_s if kv_ttft_target_s is not None
          else lc.kv_ttft_target_s, arrival_s=request.arrival_s,
          check_writes=lc.check_writes, resident=resident,
          last_unit_tokens=stored.tail_tokens or None)
      self._prefix[rid] = _Prefix(merge, stored)
    request.status = RequestStatus.WAITING
    self.waiting.append(request)

  def _device_covers(self, r: Request, stored: StoredPrefix, root: str | None) -> bool:
    """whether the device-resident prefix reaches past the last stored hit, so
    the store has nothing the device lacks; the request then takes the device path (whole
    blocks and a parked partial block, token-granular) instead of a Cake merge (whole chunks)."""
    if self.kv_cache is None:
      return False
    _, hit_tokens = self.kv_cache.get_computed_blocks(r, namespace_root=root, record_stats=False)
    return stored.end <= hit_tokens

  def _hold_device_prefix(self, r: Request, chunk_size: int, root: str | None) -> int:
    """A request with a Cake merge: takes its device-resident whole store chunks
    now (hit blocks shared, the rest of the prompt's blocks allocated), so the merge treats
    them as resident from the start; returns how many chunks (0 when none, or the pool is
    short: the blocks are then allocated at admission)."""
    kvm = self.kv_cache
    if kvm is None:
      return 0
    hits, hit_tokens = kvm.get_computed_blocks(r, namespace_root=root)
    per_chunk = chunk_size // kvm.block_size
    chunks = hit_tokens // chunk_size  # whole chunks (a parked partial block is not one)
    if not chunks:
      return 0
    hits = hits[:chunks * per_chunk]
    tokens = chunks * chunk_size
    if kvm.allocate_slots(r.request_id, r.num_prompt_tokens - tokens, num_computed_tokens=0,
                          new_computed_blocks=hits) is None:
      return 0
    self._device_hit_tokens[r.request_id] = tokens
    self._device_hits.append((r.request_id, tokens))
    return chunks

  def check_fits(self, num_tokens: int) -> None:
    """Raises ValueError when a sequence of `num_tokens` tokens can never fit the pool (a no-op
    without a block manager)."""
    if self.kv_cache is not None:
      self.kv_cache.check_fits(num_tokens)

  def reset_prefix_cache(self) -> int:
    """Empties the device prefix cache; returns blocks unindexed (0 without a block manager)."""
    return self.kv_cache.reset_prefix_cache() if self.kv_cache is not None else 0

  def set_check_writes(self, on: bool) -> None:
    """Keep (or stop keeping) a writer map in the merges of requests added from now on."""
    self.load_config = dataclasses.replace(self.load_config, check_writes=bool(on))

  def has_unfinished(self) -> bool:
    return bool(self.waiting or self.running)

  def num_waiting(self) -> int:
    return len(self.waiting)

  def num_running(self) -> int:
    return len(self.running)

  def merge(self, request_id: RequestId) -> CakeMerge | None:
    """The request's merge (read-only use: tests and traces), or None."""
    p = self._prefix.get(request_id)
    return p.merge if p is not None else None

  def merge_trace(self, request_id: RequestId) -> MergeTrace | None:
    """A snapshot (a copy) of the request's merge trace, or None without a merge."""
    p = self._prefix.get(request_id)
    return self._snapshot(p.merge) if p is not None else None

  @staticmethod
  def _snapshot(m: CakeMerge) -> MergeTrace:
    trace = copy.deepcopy(m.trace)
    if m.keeps_writers:
      trace.chunk_writers = m.chunk_writers()
      trace.unwritten_positions = m.writer_map().count(Writer.NONE)
    return trace

  def cake_requests(self, include_waiting: bool = False) -> list[Request]:
    """Requests whose merge still prefills: running ones oldest first, then (with
    `include_waiting`) queued ones in queue order."""
    out = [r for r in self.running.values()
           if r.request_id in self._prefix and r.status is RequestStatus.PREFILLING]
    if include_waiting:
      out += [r for r in self.waiting if r.request_id in self._prefix]
    return out

  def finish_request(self, request_id: RequestId, reason: str) -> Request | None:
    """Ends a request (stop, length, abort, error) and frees its slot; returns it, or None if
    unknown. Its id reaches the executor in the next plan (`finished_request_ids`)."""
    r = self.running.pop(request_id, None)
    if r is None:
      for i, w in enumerate(self.waiting):
        if w.request_id == request_id:
          r = w
          del self.waiting[i]
          break
      else:
        return None
    prefix = self._prefix.pop(request_id, None)
    if prefix is not None:
      m = prefix.merge
      m.cancel()  # no chunk of a freed slot may be inserted any more
      now = self._last_now_s if self._last_now_s is not None else 0.0
      for j, nbytes in sorted(prefix.outstanding.items()):
        m.load_done(j, False, nbytes, now)  # abandoned loads count as waste (planned bytes)
      self._final_traces[request_id] = self._snapshot(m)
    if r.slot is not None:
      bisect.insort(self._free_slots, r.slot)
      r.slot = None
    if self.kv_cache is not None:
      # A failed step may not have written its KV: only a clean finish parks its last block.
      self.kv_cache.free(request_id, r if reason != "error" else None)
    self._roots.pop(request_id, None)
    self._device_hit_tokens.pop(request_id, None)
    r.status = RequestStatus.FINISHED
    r.finish_reason = reason
    self._finished_ids.append(request_id)
    return r

  # ----------------------------------------------------------------------------- schedule
  def schedule(self, now_s: float | None = None, token_budget: int | None = None
               ) -> SchedulerOutput:
    """Plans one step; see the module docstring for the order.

    Args:
      now_s: the clock at the step's start, seconds, increasing from step to step; needed when
        any request has a Cake merge (a merge tells steps apart by it).
      token_budget: this step's budget instead of `config.token_budget` (e.g. throttled under
        competing load), >= 0.

    Raises:
      ValueError: on a negative `token_budget`, or no `now_s` with a Cake merge to plan.
    """
    budget = self.config.token_budget if token_budget is None else token_budget
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
      raise ValueError(f"token_budget={token_budget!r} must be an int >= 0")
    if now_s is None and self._prefix:
      raise ValueError("schedule() needs now_s (the engine clock) to plan Cake merges")
    if now_s is not None:
      if self._last_now_s is not None and now_s > self._last_now_s:
        self._last_step_s = now_s - self._last_now_s
        if self._computed_last:
          self._last_compute_step_s = self._last_step_s
      self._last_now_s = now_s
    short = (self.config.short_first_token_steps
             and self.config.prefill_order == SHORTEST_FIRST)
    land_at = self._landing_wait(now_s) if short else None
    if land_at is not None:
      budget = 0  # rule c: this step waits for a hit's loads; nothing computes
    step_budget = budget  # what the step holds so far is what it has spent of this
    decodes: list[DecodeItem] = []
    prefills: list[PrefillChunk] = []
    inserts: list[InsertItem] = []
    self._planned = (decodes, prefills, inserts)
    for r in list(self.running.values()):
      if (r.request_id in self.running and r.status is RequestStatus.DECODING and budget > 0
          and self._grow(r, 1)):
        r.num_computed_tokens += 1
        decodes.append(DecodeItem(r.request_id, r.slot, r.num_computed_tokens - 1,
                                  r.output_token_ids[-1], self._decode_saves(r)))
        budget -= 1
    # Inserts of requests already holding a slot first: a merge they complete computes its
    # suffix with the prefills under way (`prefill_order`).
    planned, held = self._plan_inserts(list(self.running.values()), 0)
    inserts += planned
    admitted: list[RequestId] = []
    admitting = True  # until an admission fails (then nobody behind it is admitted this step)
    order = self._prefills_first()
    # Short first-token steps (the module note): `cap` is what the prefills with more than
    # `exempt` tokens left may still take this step (None: no cap).
    cap, exempt = None, 0
    rule_a = short  # until the first prefill of the order ends its prompt
    if short and order:
      landing = self._landing_cap(order, now_s)
      if landing is not None:
        cap, hit_left = landing
        exempt = 2 * hit_left
    for r in order:
      capped = cap is not None and self._cut(self._tokens_left(r), exempt, budget)
      offer = min(budget, cap) if capped else budget
      left = offer
      if r.status is RequestStatus.WAITING:  # "shortest_first": a queued one, admitted early
        if admitting:
          left, admitting = self._admit(r, offer, prefills, admitted)
      elif r.request_id in self.running and r.status is RequestStatus.PREFILLING:
        if r.request_id in self._prefix:
          left = self._plan_cake(r, offer, now_s, prefills)
        else:
          left = self._plan_chunks(r, offer, prefills)
      took = offer - left
      budget -= took
      if capped:
        cap -= took
      if rule_a and r.status is RequestStatus.DECODING:
        # Its first token comes with this step (the first to end sets the rule): the longer
        # prefills after it take at most as many tokens again as the step holds so far (its
        # decodes and prefill tokens, this one's included); one with at most twice that left
        # is short too and goes whole.
        rule_a = False
        n = max(step_budget - budget, self._plan_sizes[0])
        cap = n if cap is None else min(cap, n)
        exempt = max(exempt, 2 * n)
    # Admissions (first come first served) are the step's rest: under a cap, a queued request
    # that is short (`_cut`) goes whole, as it would in the order above; a longer one takes
    # what the cap leaves.
    while admitting and self.waiting:
      r = self.waiting[0]
      capped = cap is not None and self._cut(self._queued_left(r), exempt, budget)
      offer = min(budget, cap) if capped else budget
      if short:  # rule a for the queue (`_room_behind`)
        offer = min(offer, budget - self._room_behind(budget))
      left, admitting = self._admit(r, offer, prefills, admitted)
      budget -= offer - left
      if capped:
        cap -= offer - left
    if cap is not None:
      budget = min(budget, cap)  # merges' compute is the step's rest
    # One admitted early may have been preempted by a later prefill's blocks (the newest goes
    # first): it is queued again, at the front.
    admitted = [rid for rid in admitted if rid in self.running]
    late, _ = self._plan_inserts([self.running[rid] for rid in admitted], held)
    inserts += late
    loads = self._plan_loads(now_s)
    for r in self.cake_requests():
      budget = self._plan_cake(r, budget, now_s, prefills)
    releases = self._plan_releases()
    block_tables: tuple = ()
    preempted: tuple = ()
    device_hits: tuple = ()
    if self.kv_cache is not None:
      kvm = self.kv_cache
      for r in self.running.values():
        # Index the blocks this plan fills (after admissions: a lookup never hits a block
        # whose KV this very plan writes). Consistent mode: the prefill's whole store chunks
        # only (their KV passed through the codec, `PrefillChunk.roundtrip`), never a block
        # of decode KV.
        kvm.cache_full_blocks(r, min(r.num_computed_tokens, r.num_tokens,
                                     r.num_prefill_tokens // self.save_chunk_size
                                     * self.save_chunk_size if self.consistent
                                     else r.num_tokens))
      block_tables = tuple((rid, kvm.block_table(rid)) for rid in self.running)
      preempted, self._preempted = tuple(self._preempted), []
      device_hits, self._device_hits = tuple(self._device_hits), []
    wait_s = None
    self._computed_last = bool(decodes or prefills)
    if land_at is not None:
      wait_s = min(MAX_LOAD_WAIT_S, max(0.0, land_at - now_s))
    if land_at is None and not inserts and not decodes and not prefills and any(
        p.outstanding for p in self._prefix.values()):
      wait_s = MAX_LOAD_WAIT_S
      for r in self.cake_requests():
        t = self._prefix[r.request_id].merge.recheck_s(now_s, self.cost_model)
        if t is not None:
          wait_s = min(wait_s, max(0.0, t - now_s))
    finished, self._finished_ids = tuple(self._finished_ids), []
    layer_groups = (self.load_config.layerwise_groups
                    if inserts and (decodes or prefills) and self.kv_cache is not None else 1)
    return SchedulerOutput(finished_request_ids=finished, releases=releases, loads=loads,
                           inserts=tuple(inserts), decodes=tuple(decodes), prefills=tuple(prefills),
                           wait_s=wait_s, block_tables=block_tables, preempted=preempted,
                           device_hits=device_hits, layer_groups=layer_groups,
                           lookahead=self._lookahead(), admitted=tuple(admitted))

  def _lookahead(self) -> tuple[RequestId, ...]:
    """The look-ahead window (`SchedulerOutput.lookahead`): running requests whose merge still
    prefills, then the first `lookahead_window` waiting requests with stored chunks."""
    w = self.load_config.lookahead_window
    if not w:
      return ()
    out = [r.request_id for r in self.cake_requests()]
    out += [r.request_id for r in self.waiting if r.request_id in self._prefix][:w]
    return tuple(out)

  # ----------------------------------------------------------------------------- blocks
  def _prefill_share(self, budget: int) -> int:
    """The tokens one request's prefill may take of `budget` left in this step: at most the
    long-prefill threshold (vLLM caps a request whose remaining prefill exceeds it; capping
    every request is the same, since none takes more than it has left)."""
    return budget if self._prefill_cap is None else min(budget, self._prefill_cap)

  def _admit_blocks(self, r: Request, budget: int) -> bool:
    """looks up `r`'s device-resident prefix and allocates the blocks of its first
    chunk (its whole prompt with a Cake merge); False when the pool is short (admission waits;
    a new request never preempts a running one). True without a block manager."""
    kvm = self.kv_cache
    if kvm is None:
      return True
    rid = r.request_id
    merge = rid in self._prefix
    if merge and rid in self._device_hit_tokens:
      return True  # its blocks were taken at `add_request` (`_hold_device_prefix`)
    hits, hit_tokens = ([], 0) if merge else self._device_prefix(r)
    if merge:
      want = r.num_prefill_tokens
    else:
      want = chunk_tokens(r.num_prefill_tokens - hit_tokens, self._prefill_share(budget),
                          self._plan_sizes)
      if want == 0:
        return False
    if kvm.allocate_slots(rid, want, num_computed_tokens=0, new_computed_blocks=hits) is None:
      return False
    r.num_computed_tokens = hit_tokens
    if hit_tokens:
      self._device_hit_tokens[rid] = hit_tokens
      self._device_hits.append((rid, hit_tokens))
    return True

  def _device_prefix(self, r: Request, record_stats: bool = True) -> tuple[list, int]:
    """A queued ordinary request's device-resident prefix: (hit blocks, hit tokens); whole
    store chunks only in consistent mode; ([], 0) without a block manager. `record_stats=False`
    peeks (the manager's hit-rate counters stay as they are)."""
    kvm = self.kv_cache
    if kvm is None:
      return [], 0
    hits, hit_tokens = kvm.get_computed_blocks(r, namespace_root=self._roots.get(r.request_id),
                                               record_stats=record_stats)
    if self.consistent and self.save_chunk_size and hit_tokens % self.save_chunk_size:
      keep = hit_tokens // self.save_chunk_size * self.save_chunk_size // kvm.block_size
      hits, hit_tokens = hits[:keep], keep * kvm.block_size
    return hits, hit_tokens

  def _grow(self, r: Request, n: int, may_preempt: bool = True) -> bool:
    """blocks for `n` more tokens of `r` at `r.num_computed_tokens`, preempting
    the newest running request while the pool is short (with `may_preempt`). False when the
    pool stays short or `r` itself was preempted (it is then waiting again). True without a
    block manager."""
    kvm = self.kv_cache
    if kvm is None:
      return True
    while kvm.allocate_slots(r.request_id, n, num_computed_tokens=r.num_computed_tokens) is None:
      if not may_preempt:
        return False
      victim = self.running[kvm.choose_victim(list(self.running))]
      self._preempt(victim)
      if victim is r:
        return False
    return True

  def _preempt(self, r: Request) -> None:
    """Frees a running request's blocks and requeues it at the front (vLLM's recompute
    preemption): this plan's items for it are dropped; it later prefills prompt + output, and
    its last prefill chunk samples its next token. A Cake merge is dropped (the request
    recomputes instead of loading)."""
    rid = r.request_id
    self.kv_cache.preempt(rid)
    decodes, prefills, inserts = self._planned
    decodes[:] = [d for d in decodes if d.request_id != rid]
    prefills[:] = [c for c in prefills if c.request_id != rid]
    inserts[:] = [i for i in inserts if i.request_id != rid]
    del self.running[rid]
    bisect.insort(self._free_slots, r.slot)
    r.slot = None
    prefix = self._prefix.pop(rid, None)
    if prefix is not None:
      prefix.merge.cancel()
    self._releases = [x for x in self._releases if x[0] != rid]
    self._device_hit_tokens.pop(rid, None)
    self._device_hits = [x for x in self._device_hits if x[0] != rid]  # admitted this plan
    r.num_computed_tokens = 0
    r.prefill_len = r.num_tokens if r.output_token_ids else None
    r.status = RequestStatus.WAITING
    self.waiting.appendleft(r)
    self._preempted.append(rid)

  def _prefills_first(self) -> list[Request]:
    """The prefills planned before the first-come-first-served admissions, in their order
    (`prefill_order`).

    "fcfs": running ordinary prefills, in admission order. "shortest_first": those, running
    merges with every stored chunk resident (only their suffix left to compute), and the
    queue's first ordinary requests with fewer tokens left than the longest of those (up to
    the free slots; stopping at a merge, which is admitted whenever a slot is free anyway, and
    at the first with as many, so queued requests never pass each other), ordered by tokens
    left (stable: ties keep admission order).
    """
    fcfs = self.config.prefill_order == FCFS
    under_way = []
    for r in self.running.values():
      prefix = self._prefix.get(r.request_id)
      if r.status is RequestStatus.PREFILLING and (
          prefix is None or (not fcfs and prefix.merge.is_prefix_done)):
        under_way.append(r)
    if fcfs:
      return under_way
    left = {r.request_id: self._tokens_left(r) for r in under_way}
    longest = max(left.values(), default=0)
    ahead = 0  # the most tokens left of a queued request ahead: none passes one ahead of it
    if not self._preempted:
      for r in itertools.islice(self.waiting, len(self._free_slots)):
        if r.request_id in self._prefix:
          break
        ahead = max(ahead, r.num_prefill_tokens - self._device_prefix(r, record_stats=False)[1])
        if ahead >= longest:
          break
        left[r.request_id] = ahead
        under_way.append(r)
    return sorted(under_way, key=lambda r: left[r.request_id])

  def _hits_in_reach(self, queued: int) -> list[Request]:
    """Merges whose prefix is not all resident: running ones (oldest first), then those among
    the first `queued` waiting requests (the ones a step may admit)."""
    out = [r for r in self.cake_requests() if not self._prefix[r.request_id].merge.is_prefix_done]
    out += [r for r in itertools.islice(self.waiting, queued) if r.request_id in self._prefix]
    return out

  def _landing_cap(self, order: list[Request], now_s: float | None) -> tuple[int, int] | None:
    """Rule b of short first-token steps: (the prefill tokens this step may take so that it ends
    when a store hit's last loads are predicted to land (`CakeMerge.loads_land_s`), that hit's
    tokens left once they are in), or None when no hit is that close.

    A hit counts when it holds a slot (or is queued within the free slots' reach, to be
    admitted this step) and has fewer tokens left once its loads are in than the longest of
    `order` (the prefills it would otherwise wait behind); the earliest landing wins. At least
    the smallest chunk size: the prefills under way always advance.
    """
    merges = self._hits_in_reach(len(self._free_slots))
    if not merges or now_s is None:
      return None
    longest = max(self._tokens_left(r) for r in order)
    best = None
    for r in merges:
      m = self._prefix[r.request_id].merge
      left = m.tokens_left_after_loads()
      if left < longest:
        t = m.loads_land_s(now_s, self.cost_model)
        if t is not None and (best is None or t < best[0]):
          best = (t, left)
    if best is None:
      return None
    seconds = best[0] - now_s
    start = max(r.num_computed_tokens for r in order)
    tokens = self._plan_sizes[0]
    for n in self._plan_sizes:
      if self.cost_model.predict_compute_s(start, n) <= seconds:
        tokens = n
    return tokens, best[1]

  def _landing_wait(self, now_s: float | None) -> float | None:
    """Rule c of short first-token steps: when this step should compute nothing and wait for a
    store hit's loads, the latest time it waits until (engine clock), else None.

    A run of waiting steps starts for a hit that holds a slot with stored chunks still to come,
    or heads the queue with a slot free (it is admitted in the step: its loads need no budget);
    that has at most the token budget left once its loads are in (its tail then computes in one
    step); and whose loads are predicted to land (`CakeMerge.loads_land_s`, the earliest of
    such hits) within half the last computing step. The run waits for that hit's loads, its
    landed chunks inserted as they come, until none is left to come or half that step has
    passed since the run began, whichever is first: the hit's tail then joins the next step
    instead of the one after it, and everyone else loses at most half a step. No run before a
    step has computed (nothing to size it by), while nothing else would compute, or after a
    preemption.
    """
    if now_s is None or self._last_compute_step_s <= 0 or self._preempted or not any(
        self._would_compute(r) for r in self.running.values()):
      self._waiting_for = None
      return None
    half = self._last_compute_step_s / 2
    rid = self._waiting_for
    if rid is not None:  # a run under way
      prefix = self._prefix.get(rid)
      deadline = self._waiting_since_s + half
      if prefix is not None and now_s < deadline and prefix.merge.has_loads_to_come:
        return deadline
      self._waiting_for = None
      return None
    best = None
    for r in self._hits_in_reach(min(1, len(self._free_slots))):
      m = self._prefix[r.request_id].merge
      if m.tokens_left_after_loads() <= self.config.token_budget:
        t = m.loads_land_s(now_s, self.cost_model)
        if t is not None and t - now_s <= half and (best is None or t < best[0]):
          best = (t, r.request_id)
    if best is None:
      return None
    self._waiting_for, self._waiting_since_s = best[1], now_s
    return now_s + half

  def _would_compute(self, r: Request) -> bool:
    """Whether running request `r` would compute this step: it decodes, or it prefills and is
    not a merge still waiting at a stored chunk."""
    if r.status is RequestStatus.DECODING:
      return True
    prefix = self._prefix.get(r.request_id)
    return prefix is None or prefix.merge.is_prefix_done

  def _tokens_left(self, r: Request) -> int:
    """Prefill tokens request `r` has left to compute (a merge's: past its frontier; a queued
    one's: all of them)."""
    prefix = self._prefix.get(r.request_id)
    if prefix is None:
      return r.remaining_prefill_tokens
    return r.num_prompt_tokens - prefix.merge.frontier

  def _room_behind(self, budget: int) -> int:
    """Rule a for the queue: the tokens the queue's head leaves for the short prompts queued
    right behind it when it is long (it does not end its prompt within `budget`), so they are
    admitted in the same step, in queue order, and their first tokens come with it; 0 when it
    is short. Behind it: ordinary requests that end within what is left, up to the free slots,
    stopping at a merge or a longer one; the head keeps at least the smallest chunk size."""
    head = self.waiting[0]
    if head.request_id in self._prefix or self._queued_left(head) <= self._prefill_share(budget):
      return 0
    room, least = 0, self._plan_sizes[0]
    for r in itertools.islice(self.waiting, 1, len(self._free_slots)):
      if r.request_id in self._prefix:
        break
      n = self._queued_left(r)
      if n > self._prefill_share(budget - least - room) or room + n > budget - least:
        break
      room += n
    return room

  def _cut(self, left: int, exempt: int, budget: int) -> bool:
    """Whether short first-token steps' cap applies to a prefill with `left` tokens left when
    `budget` tokens of the step are left: not when it is short, i.e. it has at most `exempt`
    left or it ends its prompt within the budget (its first token then comes with the same
    step: cutting it would cost it a whole step to save the others its compute)."""
    return left > exempt and left > self._prefill_share(budget)

  def _queued_left(self, r: Request) -> int:
    """Prefill tokens queued request `r` would compute: past its device-resident prefix (a
    peek: the manager's hit-rate counters stay as they are); a merge's: past its loads."""
    if r.request_id in self._prefix:
      return self._prefix[r.request_id].merge.tokens_left_after_loads()
    return r.num_prefill_tokens - self._device_prefix(r, record_stats=False)[1]

  def _admit(self, r: Request, budget: int, prefills: list[PrefillChunk],
             admitted: list[RequestId]) -> tuple[int, bool]:
    """Admits queued request `r` into a free slot and plans its first chunks (an ordinary one)
    when a slot, the pool and the budget allow; returns the budget left and whether it was
    admitted. A plan that preempted admits nobody (vLLM's rule): the pool is short already."""
    if not self._free_slots or self._preempted or not self._admit_blocks(r, budget):
      return budget, False
    merge = r.request_id in self._prefix
    if not merge and (budget <= 0 or not chunk_tokens(
        r.remaining_prefill_tokens, self._prefill_share(budget), self._plan_sizes)):
      return budget, False
    self.waiting.remove(r)
    r.slot = self._free_slots.pop(0)
    r.status = RequestStatus.PREFILLING
    self.running[r.request_id] = r
    admitted.append(r.request_id)
    if not merge:
      budget = self._plan_chunks(r, budget, prefills, may_preempt=False)
    return budget, True

  def _plan_inserts(self, requests: list[Request], held: int
                    ) -> tuple[list[InsertItem], int]:
    """Landed chunks of `requests` (holding slots): inserted this step (marked resident now).

    Args:
      requests: running requests, in admission order.
      held: staged bytes the layer-wise deferring requests of this step hold already.

    Returns:
      The insert items, and `held` plus what the deferring ones among `requests` hold.
    """
    out = []
    for r in requests:
      prefix = self._prefix.get(r.request_id)
      if prefix is None:
        continue
      m = prefix.merge
      if self.load_config.layerwise_groups > 1 and self.kv_cache is not None:
        need = self._defer_bytes(prefix)
        if need is not None and held + need <= self.load_config.staging_bytes:
          held += need
          continue  # layer-wise: insert them with the step that computes after them
      for j, st in enumerate(m.states):
        if st is ChunkState.LANDED:
          m.inserted(j)
          n = m.unit_tokens(j)  # a stored tail's m rows, else the whole chunk
          out.append(InsertItem(r.request_id, j, r.slot, j * m.chunk_size,
                                n if n != m.chunk_size else None))
    return out, held

  @staticmethod
  def _defer_bytes(prefix) -> int | None:
    """Layer-wise pre-loading: the stored bytes (landed plus in flight) a request holds while
    its landed chunks wait for its other loads, or None when they must go in now (nothing
    landed, no load in flight, or compute waits at a landed chunk)."""
    m = prefix.merge
    states = m.states
    landed = sum(s is ChunkState.LANDED for s in states)
    if not landed or not m.in_flight:
      return None
    p, c = m.frontier, m.chunk_size
    if (m.mode is MergeMode.CAKE and p < m.prefix_tokens and p % c == 0
        and states[p // c] is ChunkState.LANDED):
      return None  # compute waits at it: it goes in now
    nbytes = max((max(ch.nbytes for ch in st.candidates) for st in prefix.stored.chunks
                  if st is not None and st.candidates), default=0)
    return (landed + len(m.in_flight)) * nbytes

  def _plan_loads(self, now_s: float | None) -> tuple[LoadItem, ...]:
    """Each merge's next loads (last chunk first), running requests first, then queued ones."""
    out = []
    lc = self.load_config
    cost = self.cost_model
    for r in self.cake_requests(include_waiting=True):
      prefix = self._prefix[r.request_id]
      m = prefix.merge
      nbytes = max((max(c.nbytes for c in ch.candidates) for ch in prefix.stored.chunks
                    if ch is not None and ch.candidates), default=0)
      if lc.max_loads_ahead is None:
        delay_s = max(self._last_step_s,
                      cost.predict_compute_s(r.num_computed_tokens, self.config.chunk_sizes[-1]))
        m.max_loads_in_flight = loads_ahead(cost.bandwidth_bytes_per_s, delay_s,
                                            lc.link_latency_s, nbytes, lc.staging_bytes)
      reads = lc.max_loads_in_flight or reads_at_once(cost.bandwidth_bytes_per_s,
                                                      lc.link_latency_s, nbytes)
      while (j := m.next_load(now_s, cost)) is not None:
        enc = m.load_encoding(j)
        prefix.outstanding[j] = enc.nbytes if enc is not None else 0
        out.append(LoadItem(r.request_id, j, enc.name if enc is not None else None,
                            enc.nbytes if enc is not None else 0, reads))
    return tuple(out)

  def _plan_releases(self) -> tuple[tuple[RequestId, int], ...]:
    """Outstanding loads of chunks compute has taken (not started: never start; landed: free),
    and landed loads the merges dropped since the last plan."""
    for rid, prefix in self._prefix.items():
      states = prefix.merge.states
      for j in sorted(prefix.outstanding):
        if states[j] in (ChunkState.COMPUTING, ChunkState.COMPUTED):
          self._releases.append((rid, j))
    out, self._releases = tuple(dict.fromkeys(self._releases)), []
    return out

  def _plan_cake(self, r: Request, budget: int, now_s: float, out: list[PrefillChunk]) -> int:
    """Appends the compute steps of `r`'s merge that the budget (and the long-prefill
    threshold) allows; returns the budget left."""
    m = self._prefix[r.request_id].merge
    own = self._prefill_share(budget)
    while step := m.next_compute(own, self._plan_sizes, now_s, self.cost_model):
      start, n = step
      budget -= n
      own -= n
      is_last = start + n == r.num_prompt_tokens
      out.append(self._chunk(r, start, n, is_last))
      if is_last:
        r.status = RequestStatus.DECODING
        break
    r.num_computed_tokens = m.frontier
    return budget

  def _plan_chunks(self, r: Request, budget: int, out: list[PrefillChunk],
                   may_preempt: bool = True) -> int:
    """Appends as many chunks of `r` as the budget (the long-prefill threshold, and, paged, the
    pool) allows; returns the budget left."""
    own = self._prefill_share(budget)
    while n := chunk_tokens(r.remaining_prefill_tokens, own, self._plan_sizes):
      if not self._grow(r, n, may_preempt):
        break
      start = r.num_computed_tokens
      r.num_computed_tokens += n
      budget -= n
      own -= n
      is_last = r.num_computed_tokens == r.num_prefill_tokens
      if is_last:
        r.status = RequestStatus.DECODING
      out.append(self._chunk(r, start, n, is_last))
    return budget

  def _chunk(self, r: Request, start: int, n: int, is_last: bool) -> PrefillChunk:
    c = self.save_chunk_size
    roundtrip = ()
    if self.consistent:
      roundtrip = tuple(range(start // c, (start + n) // c))  # chunks this step completes
    return PrefillChunk(r.request_id, r.slot, start, n, is_last,
                        tuple(r.token_ids(start, start + n)), self._saves(r, start, n),
                        roundtrip)

  def _decode_saves(self, r: Request) -> tuple[SaveItem, ...]:
    """With a store: the chunk a decode completes (its last position is this
    decode's), when no prefill step saved it: a chunk of generated tokens, or the one
    straddling the prompt's end. A chunk partly served from device blocks is saved too (the
    engine reads that part back from the pool); one wholly served from them is not. None in
    consistent mode: a decode's KV is not what a prefill of the same tokens (the cold run of a
    follow-up prompt) computes and passes through the codec."""
    c = self.save_chunk_size
    end = r.num_computed_tokens
    if c is None or self.kv_cache is None or end % c or self.consistent:
      return ()  # (a decode always ends past the prefill)
    j = end // c - 1
    if (j + 1) * c <= self._device_hit_tokens.get(r.request_id, 0):
      return ()
    return (SaveItem(j),)

  def _saves(self, r: Request, start: int, n: int) -> tuple[SaveItem, ...]:
    """Store chunks the step `[start, start + n)` completes that the store should get: chunks
    no tier holds, chunks whose stored copy was rejected, and (after a rejection) computed hits,
    checked. Loaded chunks are never saved back."""
    c = self.save_chunk_size
    if c is None:
      return ()
    prefix = self._prefix.get(r.request_id)
    end = start + n
    out = []
    hit = self._device_hit_tokens.get(r.request_id, 0)
    for j in range(start // c, end // c):
      if (j + 1) * c > end or (j + 1) * c <= start:
        continue
      if (j + 1) * c <= hit or (j + 1) * c > r.num_prefill_tokens:
        continue  # wholly a device hit (stored when it was computed), or past the prefill
      if prefix is None or j >= len(prefix.stored.chunks) or prefix.stored.is_tail(j):
        out.append(SaveItem(j))  # not stored (a stored tail is not its full chunk)
      elif j in prefix.rejected:
        out.append(SaveItem(j, replace=True))
      elif prefix.stored.chunks[j] is None:
        out.append(SaveItem(j))
      elif prefix.rejected:
        out.append(SaveItem(j, verify_existing=True))
    # A chunk beyond the lookup's candidates (the prompt's last full chunk holds the last
    # token): saved like any computed chunk.
    return tuple(out)

  # ----------------------------------------------------------------------------- update
  def update(self, result: StepResult) -> dict[RequestId, MergeTrace]:
    """Applies one executed step: load landings, cost observations, tokens, finishes.

    Returns:
      Snapshots of the merge traces of requests that produced their first token or finished in
      this step (for their outputs' metrics).
    """
    cost = self.cost_model
    # The link is observed once per step, bytes over the step's link seconds (the reports' link
    # times do not overlap): per-chunk samples of a fast link are milliseconds of jitter.
    link_bytes, link_s = 0, 0.0
    for rep in result.loads:
      prefix = self._prefix.get(rep.request_id)
      if prefix is None or rep.index not in prefix.outstanding:
        continue  # the request ended meanwhile: the executor has dropped the load
      del prefix.outstanding[rep.index]
      if not rep.ok and rep.reason == RELEASED:
        prefix.merge.load_dropped(rep.index, rep.done_s or result.now_s)
        continue
      if rep.ok:
        link_bytes += rep.nbytes
        link_s += rep.link_s
        cost.observe_decode(rep.nbytes, rep.decode_s)
      verdict = prefix.merge.load_done(rep.index, rep.ok, rep.nbytes,
                                       rep.done_s or result.now_s, level=rep.encoding)
      if verdict is LoadVerdict.REJECTED:
        prefix.rejected.add(rep.index)
      elif verdict is LoadVerdict.WASTED and rep.ok:
        self._releases.append((rep.request_id, rep.index))
    if link_bytes > 0 and link_s > 0:
      cost.observe_load(link_bytes, link_s)
    for t in result.compute:
      if not t.includes_compile:
        cost.observe_compute(t.start, t.num_tokens, t.seconds)
    traces = {}
    for rid, token in result.sampled:
      r = self.running.get(rid)
      if r is None:
        continue
      r.output_token_ids.append(token)
      if len(r.output_token_ids) == 1 and rid in self._prefix:
        traces[rid] = self.merge_trace(rid)
    for rid, reason in result.finished:
      self.finish_request(rid, reason)
    for rid, _ in result.failed:
      self.finish_request(rid, "error")
    traces.update(self._final_traces)
    self._final_traces = {}
    return traces
