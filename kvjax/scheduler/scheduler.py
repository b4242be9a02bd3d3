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
  3. prefills already under way continue, in `SchedulerConfig.prefill_order`
     ("shortest_first", the default, admits the queue's first short ordinary requests here);
  4. waiting requests are admitted into free decode slots, first come first served (a request
     with a Cake merge is admitted whenever a slot is free, budget or not: its loads need none);
     their staged chunks are inserted, and every merge issues its next loads, last chunk first,
     queued requests included (loads need no slot), judged at the compute share the budget
     left to the merges gives them (`CakeMerge.expect_budget`);
  5. the compute side of each merge takes what is left, oldest first: compiled chunk sizes
     aligned to store chunks, possibly several pieces (skipping resident chunks), none when loads
     are predicted to finish the next chunk first.

A plan that runs a request's last prefill chunk also forks the requests waiting on its prompt
(`n` > 1, `add_request(fork_of=)`): they take free slots, share its full blocks and get a copy
of its partly filled last block (`KVCacheManager.fork`, `SchedulerOutput.forks`).

The policies live beside it as plain functions: the prefill order, short first-token steps
(rules a, b, c), the long-prefill threshold and chunk sizing in
`kvjax/scheduler/prefill_policy.py`; loads ahead, saves and layer-wise deferral in
`kvjax/scheduler/transfer_policy.py`; the store side of its requests (each stored prefix's
merge, its loads and inserts, what the policies ask of the store hits) in
`kvjax/scheduler/prefix_loads.py`; the configuration records in `kvjax/scheduler/config.py`.
The scheduler holds the state they read and applies their answers.

A plan is a promise the executor keeps in order: the scheduler advances `num_computed_tokens` and
marks inserted chunks resident when it plans them. `update` learns the rest: sampled tokens are
appended, finished requests free their slots (their ids reach the executor in the next plan),
each landed load goes to its merge (`load_done`), and measured times feed the cost model.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
import math
from collections.abc import Sequence

from kvjax._typing import RequestId
from kvjax.block_hash import blocks_per_chunk
from kvjax.scheduler import (cake_joint, device_prefix, prefill_policy, prefix_loads,
                             transfer_policy)
from kvjax.scheduler.cake import CakeMerge, MergeMode, MergeTrace
from kvjax.scheduler.config import LoadConfig, SchedulerConfig
from kvjax.scheduler.cost_model import CostModel
from kvjax.scheduler.forks import ForkQueue
from kvjax.scheduler.kv_cache_manager import KVCacheManager
from kvjax.scheduler.output import (DecodeItem, ForkItem, InsertItem, PrefillChunk, SaveItem,
                                    SchedulerOutput, StepResult, StoredPrefix)
from kvjax.scheduler.prefix_loads import Prefix
from kvjax.scheduler.prefill_policy import FCFS, SHORTEST_FIRST, chunk_tokens
from kvjax.scheduler.request import Request, RequestStatus


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
    kv_cache: the KV pool's block manager; None plans without one (slots only, no blocks: plan
      tests). With it the scheduler allocates blocks before planning a request's tokens (a request with a
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
    if kv_cache is not None and save_chunk_size is not None:
      blocks_per_chunk(kv_cache.block_size, save_chunk_size)
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
    # One request's prefill tokens per step at most (None: the budget's; `prefill_share`).
    cap = config.long_prefill_token_threshold
    # Consistent mode: exactly one store chunk. A step runs all its tokens in one ragged call,
    # where a request's later chunk would attend to its earlier chunk's computed KV, not to the
    # round-tripped KV a load (or a later step) gives it.
    self._prefill_cap = save_chunk_size if consistent else (cap or None)
    self.config = config
    self.cost_model = cost_model if cost_model is not None else CostModel()
    self.load_config = load_config or LoadConfig()
    self.save_chunk_size = save_chunk_size
    self.waiting: collections.deque[Request] = collections.deque()
    self.running: dict[RequestId, Request] = {}  # insertion order = admission order
    self._free_slots = list(range(config.num_slots))
    self._prefix: dict[RequestId, Prefix] = {}  # the store side (`prefix_loads`)
    self._finished_ids: list[RequestId] = []
    self._releases: list[tuple[RequestId, int]] = []
    self._last_step_s = 0.0
    self._last_now_s: float | None = None
    # Rule c of short first-token steps: the last step that computed, seconds (0: none yet);
    # whether the last plan computed; the run of waiting steps.
    self._last_compute_step_s = 0.0
    self._computed_last = False
    self._landing = prefill_policy.LandingWait()
    self._final_traces: dict[RequestId, MergeTrace] = {}
    # n > 1: requests waiting to fork from a parent's prompt, by parent (`add_request(fork_of=)`),
    # and this plan's forks.
    self._forks = ForkQueue()
    self._planned_forks: list[ForkItem] = []

  # ----------------------------------------------------------------------------- requests
  def add_request(self, request: Request, stored: StoredPrefix | None = None, *,
                  merge_mode: MergeMode | str | None = None,
                  kv_ttft_target_s: float | None = None,
                  namespace_root: str | None = None,
                  fork_of: RequestId | None = None, layer_split: bool = True) -> None:
    """Takes ownership of a new request (the caller keeps no reference to it).

    Args:
      request: the request, status WAITING.
      stored: the store lookup of its prefix; a Cake merge plans it when any chunk is stored
        (and the mode uses hits).
      merge_mode: this request's merge mode instead of `load_config.merge_mode`.
      kv_ttft_target_s: this request's TTFT target instead of `load_config.kv_ttft_target_s`.
      namespace_root: the root of its block hashes (the store's namespace with
        its `cache_salt`); None: the manager's default.
      fork_of: `n` > 1: the request whose prompt this one shares (the same tokens and root).
        It waits for the parent's last prefill chunk and is forked in that plan
        (`SchedulerOutput.forks`: the parent's full blocks shared, its partly filled last block
        copied, the first token sampled from the parent's logits), so the prompt is computed
        once. When the parent is already past its prompt, or at the fork there is no free
        slot or block, it is queued as an ordinary request (it then hits the parent's blocks in
        the device prefix cache). `stored` is ignored for it.
      layer_split: False plans this request's merge token-only although
        `load_config.layer_split_points` allow the layer axis (benchmarks compare the two on
        one warm engine).

    Raises:
      ValueError: a duplicate id, a lookup that does not fit the prompt, (paged) a request
        whose prompt + max_tokens can never fit the pool, or a `fork_of` that is unknown or has
        another prompt.
    """
    rid = request.request_id
    if rid in self.running or rid in self._prefix or any(
        r.request_id == rid for r in self.waiting) or self._forks.parent_of(rid) is not None:
      raise ValueError(f"request id {rid!r} is already scheduled")
    self.check_fits(request.num_prompt_tokens + request.sampling_params.max_tokens)
    if fork_of is not None:
      parent = self.running.get(fork_of) or next(
          (r for r in self.waiting if r.request_id == fork_of), None)
      if parent is None or parent.prompt_token_ids != request.prompt_token_ids or (
          self._roots.get(fork_of) != namespace_root):
        raise ValueError(f"request {rid!r} cannot fork from {fork_of!r}: unknown, or another "
                         "prompt or cache salt")
      self._roots[rid] = namespace_root
      request.status = RequestStatus.WAITING
      if parent.output_token_ids or parent.status is RequestStatus.DECODING:
        self.waiting.append(request)  # past its prompt: an ordinary request
      else:
        self._forks.add(fork_of, request)
      return
    self._roots[rid] = namespace_root
    if stored is not None and any(stored.hits) and self.kv_cache is not None and (
        device_prefix.covers(self.kv_cache, request, stored, namespace_root)):
      stored = None  # the device holds every stored chunk: its blocks (and parked block) serve
    if stored is not None and any(stored.hits):
      resident = self._hold_device_prefix(request, stored.chunk_size, namespace_root)
      self._prefix[rid] = prefix_loads.new_prefix(request, stored, self.load_config, merge_mode,
                                                  kv_ttft_target_s, resident, layer_split)
    request.status = RequestStatus.WAITING
    self.waiting.append(request)

  def _hold_device_prefix(self, r: Request, chunk_size: int, root: str | None) -> int:
    """A request with a Cake merge: takes its device-resident whole store chunks
    now (`device_prefix.hold`); returns how many chunks (0 when none, or the pool is short)."""
    if self.kv_cache is None:
      return 0
    tokens = device_prefix.hold(self.kv_cache, r, chunk_size, root)
    if tokens:
      self._device_hit_tokens[r.request_id] = tokens
      self._device_hits.append((r.request_id, tokens))
    return tokens // chunk_size

  def check_fits(self, num_tokens: int) -> None:
    """Raises ValueError when a sequence of `num_tokens` tokens can never fit the pool (a no-op
    without a block manager)."""
    if self.kv_cache is not None:
      self.kv_cache.check_fits(num_tokens)

  def reset_prefix_cache(self) -> int:
    """Empties the device prefix cache; returns blocks unindexed (0 without a
    block manager)."""
    return self.kv_cache.reset_prefix_cache() if self.kv_cache is not None else 0

  def set_check_writes(self, on: bool) -> None:
    """Keep (or stop keeping) a writer map in the merges of requests added from now on."""
    self.load_config = dataclasses.replace(self.load_config, check_writes=bool(on))

  def has_unfinished(self) -> bool:
    return bool(self.waiting or self.running or self._forks)

  def num_waiting(self) -> int:
    return len(self.waiting) + len(self._forks)

  def num_running(self) -> int:
    return len(self.running)

  def _fork_children(self, parent: Request) -> None:
    """The plan runs `parent`'s last prefill chunk (its prompt, no output yet): forks every
    request waiting on it into a free slot (`KVCacheManager.fork`), or queues it as an
    ordinary request when no slot or block is free."""
    for child in self._forks.pop_children(parent.request_id):
      copies = () if self.kv_cache is None else (
          self.kv_cache.fork(parent.request_id, child.request_id, parent.num_prompt_tokens)
          if self._free_slots else None)
      if not self._free_slots or copies is None:
        self.waiting.append(child)
        continue
      child.slot = self._free_slots.pop(0)
      child.status = RequestStatus.DECODING
      child.num_computed_tokens = parent.num_prompt_tokens
      self.running[child.request_id] = child
      # Its store chunks (a decode's completing one) read the shared rows back from the pool.
      self._device_hit_tokens[child.request_id] = parent.num_prompt_tokens
      self._planned_forks.append(ForkItem(parent.request_id, child.request_id, copies))

  def merge(self, request_id: RequestId) -> CakeMerge | None:
    """The request's merge (read-only use: tests and traces), or None."""
    p = self._prefix.get(request_id)
    return p.merge if p is not None else None

  def merge_trace(self, request_id: RequestId) -> MergeTrace | None:
    """A snapshot (a copy) of the request's merge trace, or None without a merge."""
    p = self._prefix.get(request_id)
    return prefix_loads.snapshot(p.merge) if p is not None else None

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
    # Its forks run as ordinary requests.
    self.waiting.extend(self._forks.pop_children(request_id))
    r = self.running.pop(request_id, None)
    if r is None:
      r = self._forks.remove(request_id)
    if r is None:
      for i, w in enumerate(self.waiting):
        if w.request_id == request_id:
          r = w
          del self.waiting[i]
          break
      else:
        return None
    prefix = self._prefix.pop(request_id, None)
    if prefix is not None:  # no chunk of a freed slot may be inserted any more
      now = self._last_now_s if self._last_now_s is not None else 0.0
      self._final_traces[request_id] = prefix_loads.close(prefix, now)
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
    self._planned_forks = []
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
    # Short first-token steps (rules a and b, `prefill_policy.StepCap`).
    cap = prefill_policy.StepCap.start(short, self._landing_cap(order, now_s)
                                       if short and order else None)
    # Joint planning: once a merge's suffix here samples its first token at this step's end,
    # the merges after it add only what costs that token less than a step of their own.
    beside_first = None
    for r in order:
      offer, capped = cap.offer(lambda r=r: self._tokens_left(r), budget,
                                self._prefill_share(budget))
      left = offer
      if r.status is RequestStatus.WAITING:  # "shortest_first": a queued one, admitted early
        if admitting:
          left, admitting = self._admit(r, offer, prefills, admitted)
      elif r.request_id in self.running and r.status is RequestStatus.PREFILLING:
        if r.request_id in self._prefix:
          if beside_first is not None:
            offer = self._offer_within(r, offer, self._step_pieces(prefills, decodes),
                                       beside_s=beside_first)
          left = self._plan_cake(r, offer, now_s, prefills)
          if (beside_first is None and self.load_config.joint_planning
              and r.status is RequestStatus.DECODING):
            beside_first = cake_joint.beside_first_token_s(len(self.cake_requests()),
                                                           self.cost_model)
        else:
          left = self._plan_chunks(r, offer, prefills)
      budget -= offer - left
      cap.took(offer - left, capped)
      if cap.rule_a and r.status is RequestStatus.DECODING:  # its first token comes with it
        cap.ended(step_budget - budget, self._plan_sizes[0])
    # Admissions (first come first served) are the step's rest: under a cap, a queued request
    # that is short (`cut`) goes whole, as it would in the order above; a longer one takes
    # what the cap leaves.
    while admitting and self.waiting:
      r = self.waiting[0]
      offer, capped = cap.offer(lambda r=r: self._queued_left(r), budget,
                                self._prefill_share(budget))
      if short:  # rule a for the queue (`_room_behind`)
        offer = min(offer, budget - self._room_behind(budget))
      left, admitting = self._admit(r, offer, prefills, admitted)
      budget -= offer - left
      cap.took(offer - left, capped)
    budget = cap.rest(budget)  # merges' compute is the step's rest
    # One admitted early may have been preempted by a later prefill's blocks (the newest goes
    # first): it is queued again, at the front.
    admitted = [rid for rid in admitted if rid in self.running]
    late, _ = self._plan_inserts([self.running[rid] for rid in admitted], held)
    inserts += late
    restoring, link_free = self._restore_order(now_s, self._prefill_share(budget))
    for r in restoring:  # their compute's share judges their loads (`expect_budget`)
      if r.status is RequestStatus.PREFILLING:
        self._prefix[r.request_id].merge.expect_budget(self._prefill_share(budget),
                                                       self._plan_sizes, now_s)
    loads = prefix_loads.plan_loads(self._prefix, restoring, now_s, self.load_config,
                                    self.cost_model, self._last_step_s,
                                    self.config.chunk_sizes[-1], link_free)
    land_by = None  # joint: when the loads of a merge ahead that waits for them land
    behind = sum(r.status is RequestStatus.PREFILLING for r in restoring)
    if beside_first is not None:  # joint: a merge's suffix above samples its first token
      beside_first = cake_joint.beside_first_token_s(behind, self.cost_model)
    for r in restoring:
      if r.status is not RequestStatus.PREFILLING:
        continue
      behind -= 1
      m = self._prefix[r.request_id].merge
      # The step (all planned in it so far) ends before those land.
      offer = self._offer_within(r, budget, self._step_pieces(prefills, decodes),
                                 beside_s=beside_first,
                                 until_s=None if land_by is None else land_by - now_s)
      budget -= offer - self._plan_cake(r, offer, now_s, prefills)
      if link_free and beside_first is None and r.status is RequestStatus.DECODING:
        beside_first = cake_joint.beside_first_token_s(behind, self.cost_model)
      if link_free and not m.is_prefix_done and m.has_loads_to_come:
        t = m.loads_land_s(now_s, self.cost_model, overdue_lands_now=True)
        if t is not None and (land_by is None or t < land_by):
          land_by = t
    releases = prefix_loads.plan_releases(self._prefix, self._releases)
    self._releases = []
    block_tables: tuple = ()
    preempted: tuple = ()
    device_hits: tuple = ()
    if self.kv_cache is not None:
      kvm = self.kv_cache
      for r in self.running.values():
        # Index the blocks this plan fills (after admissions: a lookup never hits a block
        # whose KV this very plan writes).
        kvm.cache_full_blocks(r, device_prefix.indexable_tokens(
            r, self.save_chunk_size if self.consistent else None))
      block_tables = tuple((rid, kvm.block_table(rid)) for rid in self.running)
      preempted, self._preempted = tuple(self._preempted), []
      device_hits, self._device_hits = tuple(self._device_hits), []
    self._computed_last = bool(decodes or prefills)
    wait_s = prefill_policy.wait_s(
        now_s, land_at, not inserts and not decodes and not prefills and any(
            p.outstanding for p in self._prefix.values()),
        (self._prefix[r.request_id].merge.recheck_s(now_s, self.cost_model)
         for r in self.cake_requests()))
    finished, self._finished_ids = tuple(self._finished_ids), []
    forks, self._planned_forks = tuple(self._planned_forks), []
    layer_groups = (self.load_config.layerwise_groups
                    if inserts and (decodes or prefills) and self.kv_cache is not None else 1)
    return SchedulerOutput(finished_request_ids=finished, releases=releases, loads=loads,
                           inserts=tuple(inserts), decodes=tuple(decodes), prefills=tuple(prefills),
                           wait_s=wait_s, block_tables=block_tables, preempted=preempted,
                           device_hits=device_hits, layer_groups=layer_groups,
                           lookahead=prefix_loads.lookahead(
                               self._prefix, self.cake_requests(), self.waiting,
                               self.load_config.lookahead_window),
                           admitted=tuple(admitted) + tuple(f.child_id for f in forks),
                           forks=forks)

  # ----------------------------------------------------------------------------- blocks
  def _prefill_share(self, budget: int) -> int:
    """The tokens one request's prefill may take of `budget` left in this step
    (`prefill_policy.prefill_share`)."""
    return prefill_policy.prefill_share(budget, self._prefill_cap)

  def _admit_blocks(self, r: Request, budget: int) -> bool:
    """Looks up `r`'s device-resident prefix and allocates the blocks of its first
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
    """A queued ordinary request's device-resident prefix (`device_prefix.lookup`; whole store
    chunks only in consistent mode); ([], 0) without a block manager."""
    if self.kv_cache is None:
      return [], 0
    return device_prefix.lookup(self.kv_cache, r, self._roots.get(r.request_id),
                                self.save_chunk_size if self.consistent else None, record_stats)

  def _grow(self, r: Request, n: int, may_preempt: bool = True) -> bool:
    """Blocks for `n` more tokens of `r` (`device_prefix.grow`, preempting with
    `may_preempt`). True without a block manager."""
    return self.kv_cache is None or device_prefix.grow(self.kv_cache, r, n, may_preempt,
                                                       self.running, self._preempt)

  def _preempt(self, r: Request) -> None:
    """Frees a running request's blocks and requeues it at the front (vLLM's recompute
    preemption): this plan's items for it are dropped; it later prefills prompt + output, and
    its last prefill chunk samples its next token. A Cake merge is dropped (the request
    recomputes instead of loading)."""
    rid = r.request_id
    self.kv_cache.preempt(rid)
    # A fork of this plan holds no KV yet: dropped with its parent, requeued without it.
    for f in [f for f in self._planned_forks if f.parent_id == rid]:
      if f.child_id in self.running:
        self._preempt(self.running[f.child_id])
    self._planned_forks = [f for f in self._planned_forks if rid not in (f.parent_id, f.child_id)]
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

    "fcfs": running ordinary prefills, in admission order. "shortest_first"
    (`prefill_policy.shortest_first`): those, running merges with every stored chunk resident
    (only their suffix left to compute), and the queue's first ordinary requests with fewer
    tokens left than the longest of those (up to the free slots; none after a preemption).
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
    left = [(r, self._tokens_left(r)) for r in under_way]
    queued = () if self._preempted else (
        (r, None if r.request_id in self._prefix else self._queued_left(r))
        for r in itertools.islice(self.waiting, len(self._free_slots)))
    return prefill_policy.shortest_first(left, queued)

  def _hits_in_reach(self, queued: int) -> list[Request]:
    """Store hits not all resident, running or among the first `queued` waiting requests
    (`prefix_loads.hits_in_reach`)."""
    return prefix_loads.hits_in_reach(self._prefix, self.cake_requests(), self.waiting, queued)

  def _landing_cap(self, order: list[Request], now_s: float | None) -> tuple[int, int] | None:
    """Rule b of short first-token steps (`prefill_policy.landing_cap`): (the prefill tokens this
    step may take so that it ends when a store hit's last loads are predicted to land, that
    hit's tokens left once they are in), or None when no hit is that close. A hit counts when
    it holds a slot (or is queued within the free slots' reach, to be admitted this step)."""
    merges = self._hits_in_reach(len(self._free_slots))
    if not merges or now_s is None:
      return None
    longest = max(self._tokens_left(r) for r in order)
    hits = [(left, land) for _, left, land in prefix_loads.landing_hits(
        self._prefix, merges, now_s, self.cost_model)]
    return prefill_policy.landing_cap(hits, longest, now_s,
                                      max(r.num_computed_tokens for r in order), self._plan_sizes,
                                      self.cost_model.predict_compute_s)

  def _landing_wait(self, now_s: float | None) -> float | None:
    """Rule c of short first-token steps (`prefill_policy.LandingWait`): when this step should
    compute nothing and wait for a store hit's loads, the latest time it waits until (engine
    clock), else None.

    A hit counts when it holds a slot with stored chunks still to come, or heads the queue with
    a slot free (it is admitted in the step: its loads need no budget). No run before a step has
    computed (nothing to size it by), while nothing else would compute, or after a preemption.
    """
    if now_s is None or self._last_compute_step_s <= 0 or self._preempted or not any(
        self._would_compute(r) for r in self.running.values()):
      self._landing.stop()
      return None

    def loads_to_come(rid: RequestId) -> bool:
      prefix = self._prefix.get(rid)
      return prefix is not None and prefix.merge.has_loads_to_come

    def hits():
      return prefix_loads.landing_hits(
          self._prefix, self._hits_in_reach(min(1, len(self._free_slots))), now_s,
          self.cost_model)

    return self._landing.until(now_s, self._last_compute_step_s / 2, loads_to_come, hits,
                               self.config.token_budget)

  def _would_compute(self, r: Request) -> bool:
    """Whether running request `r` would compute this step: it decodes, or it prefills and is
    not a merge still waiting at a stored chunk."""
    if r.status is RequestStatus.DECODING:
      return True
    prefix = self._prefix.get(r.request_id)
    return prefix is None or prefix.merge.is_prefix_done


  def _tokens_left(self, r: Request) -> int:
    """Prefill tokens request `r` has left to compute (`prefix_loads.tokens_left`)."""
    return prefix_loads.tokens_left(self._prefix.get(r.request_id), r)


  def _room_behind(self, budget: int) -> int:
    """Rule a for the queue (`prefill_policy.room_behind`): the tokens the queue's head leaves
    for the short prompts queued right behind it, up to the free slots."""
    head = self.waiting[0]
    behind = (None if r.request_id in self._prefix else self._queued_left(r)
              for r in itertools.islice(self.waiting, 1, len(self._free_slots)))
    return prefill_policy.room_behind(
        budget, None if head.request_id in self._prefix else self._queued_left(head), behind,
        self._plan_sizes[0], self._prefill_cap)

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
    """Landed chunks of `requests` (holding slots), inserted this step, and `held` plus the
    staged bytes of layer-wise deferring ones (`prefix_loads.plan_inserts`)."""
    lc = self.load_config
    return prefix_loads.plan_inserts(self._prefix, requests, held,
                                     lc.layerwise_groups > 1 and self.kv_cache is not None,
                                     lc.staging_bytes)

  def _restore_order(self, now_s: float | None, budget: int
                     ) -> tuple[list[Request], dict[RequestId, float]]:
    """The requests whose merges still prefill (running, then queued ones), in the order they
    take the link and the budget, and when the link is free for each one's loads.

    Planned alone (`LoadConfig.joint_planning` off, or at most one): running oldest first, then
    the queue, no link backlog. Jointly (`kvjax/scheduler/cake_joint.py`): shortest remaining
    first aged by arrival, each merge told its backlog (`CakeMerge.set_backlog`); `budget`,
    the tokens left to the merges this step, over the largest compiled size is their compute
    share.
    """
    requests = self.cake_requests(include_waiting=True)
    if not self.load_config.joint_planning or len(requests) < 2 or now_s is None:
      for r in requests:  # no backlog (one restoring request, or planned alone)
        self._prefix[r.request_id].merge.set_backlog(-math.inf, -math.inf)
      return requests, {}
    by_id = {r.request_id: r for r in requests}
    entries = cake_joint.plan([(r.request_id, r.arrival_s, self._prefix[r.request_id].merge)
                               for r in requests], now_s, self.cost_model,
                              min(1.0, max(budget, 1) / self._plan_sizes[-1]))
    for e in entries:
      self._prefix[e.request_id].merge.set_backlog(e.compute_free_s, e.link_free_s,
                                                   e.meeting_index)
    return [by_id[e.request_id] for e in entries], {e.request_id: e.link_free_s for e in entries}

  @staticmethod
  def _step_pieces(prefills: Sequence[PrefillChunk], decodes: Sequence[DecodeItem]
                   ) -> list[tuple[int, int]]:
    """(start, tokens) of every prefill chunk and decode planned in the step so far."""
    return [(c.start, c.num_tokens) for c in prefills] + [(d.position, 1) for d in decodes]

  def _offer_within(self, r: Request, offer: int, pieces: Sequence[tuple[int, int]], *,
                    beside_s: float | None = None, until_s: float | None = None) -> int:
    """`offer`, or the largest compiled size below it, whose piece at `r`'s merge frontier
    keeps the step holding `pieces` within the joint limits (`cake_joint.largest_fitting`;
    each priced as the runner pads the step, `SchedulerConfig.step_buckets`): beside a
    first token it adds at most `beside_s` seconds and never grows the step past its bucket
    (`cake_joint.beside_first_token_s`), and the whole step takes at most `until_s` (the
    landing it must end before). No limit: `offer`."""
    if beside_s is None and until_s is None:
      return offer
    p, cost, buckets = self._prefix[r.request_id].merge.frontier, self.cost_model, (
        self.config.step_buckets)
    base_s = cake_joint.step_s(pieces, cost, buckets)  # priced once, not per candidate
    tokens = sum(n for _, n in pieces)
    room = cake_joint.padded_tokens(tokens, buckets) - tokens if buckets and tokens else None

    def fits(n: int) -> bool:
      total_s = cake_joint.step_s([*pieces, (p, n)], cost, buckets)
      # `cake_joint.added_s` is total_s - base_s.
      return ((beside_s is None or (total_s - base_s <= beside_s
                                    and (room is None or n <= room)))
              and (until_s is None or total_s <= until_s))

    return cake_joint.largest_fitting(offer, self._plan_sizes, fits)

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
      layers = m.compute_layers(start)
      out.append(self._chunk(r, start, n, is_last) if layers is None else PrefillChunk(
          r.request_id, r.slot, start, n, False, tuple(r.token_ids(start, start + n)),
          num_layers=layers))  # a layer-split chunk's low layers: stored, never saved
      if is_last:
        r.status = RequestStatus.DECODING
        if not r.output_token_ids:
          self._fork_children(r)
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
      if is_last and not r.output_token_ids:
        self._fork_children(r)
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
    """With a store: the chunk a decode completes when no prefill step saved it
    (`transfer_policy.decode_saves`). None in consistent mode: a decode's KV is not what a
    prefill of the same tokens (the cold run of a follow-up prompt) computes and passes through
    the codec."""
    c = self.save_chunk_size
    end = r.num_computed_tokens
    if c is None or self.kv_cache is None or end % c or self.consistent:
      return ()  # (a decode always ends past the prefill)
    return transfer_policy.decode_saves(c, end, self._device_hit_tokens.get(r.request_id, 0))

  def _saves(self, r: Request, start: int, n: int) -> tuple[SaveItem, ...]:
    """Store chunks the step `[start, start + n)` completes that the store should get
    (`transfer_policy.saves`)."""
    c = self.save_chunk_size
    if c is None:
      return ()
    p = self._prefix.get(r.request_id)
    return transfer_policy.saves(c, start, n, self._device_hit_tokens.get(r.request_id, 0),
                                 r.num_prefill_tokens, p.stored if p is not None else None,
                                 p.rejected if p is not None else set())

  # ----------------------------------------------------------------------------- update
  def update(self, result: StepResult) -> dict[RequestId, MergeTrace]:
    """Applies one executed step: load landings, cost observations, tokens, finishes.

    Returns:
      Snapshots of the merge traces of requests that produced their first token or finished in
      this step (for their outputs' metrics).
    """
    cost = self.cost_model
    self._releases += prefix_loads.apply_load_reports(self._prefix, result.loads, result.now_s,
                                                      cost)
    step = result.step
    if step is not None:  # the call whole: one fixed cost, its padded tokens
      if not step.includes_compile and step.full_depth:
        cost.observe_step(step.pieces, step.padded_tokens, step.seconds)
    else:  # an executor that reports chunks only (the simulator): each one its own step
      for t in result.compute:
        if not t.includes_compile and t.num_layers is None:
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
