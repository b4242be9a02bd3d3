"""Token-budget step planning: plain data in, a plain plan out.

Each engine step has a token budget (vLLM's `max_num_batched_tokens`). The scheduler spends it in
this order (Cake, arXiv 2410.03065, section 4 Part 3, adaptive mode):

  1. every decoding request takes one token;
  2. ordinary prefills already under way continue, oldest first;
  3. waiting requests are admitted into free decode slots, first come first served (a request
     with a Cake merge is admitted whenever a slot is free, budget or not: its loads need none);
  4. the compute side of each Cake merge (`Request.merge`, `kvjax.scheduler.cake`) takes what is
     left, oldest first: compiled chunk sizes aligned to store chunks, possibly several pieces
     (skipping resident chunks), none when loads are predicted to finish the next chunk first.

Loads are not in the budget: the engine's loaders run whatever the budget (Cake, section 3).

A prefill chunk is the largest compiled chunk size that fits the budget and the prompt's remaining
tokens, so only a prompt's last chunk is ever padded:

    prompt of 300 tokens, sizes (16, 32, ..., 512):  [0 --256--)[256 -32-)[288 12+pad)

The scheduler never touches arrays; the engine runs the plan and reports back. It advances
`num_computed_tokens` when it plans work, so a plan is a promise the engine must keep in order.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses

from kvjax._typing import RequestId
from kvjax.scheduler.cost_model import CostModel
from kvjax.scheduler.request import Request, RequestStatus


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
  """Attributes:
    num_slots: decode slots (maximum running requests).
    token_budget: tokens computed per step at most (decodes count one each).
    chunk_sizes: compiled prefill chunk sizes, ascending.
  """

  num_slots: int = 4
  token_budget: int = 512
  chunk_sizes: tuple[int, ...] = (16, 32, 64, 128, 256, 512)

  def __post_init__(self):
    if self.num_slots <= 0 or self.token_budget <= 0:
      raise ValueError(f"num_slots={self.num_slots} and token_budget={self.token_budget} must be "
                       "positive")
    if not self.chunk_sizes or list(self.chunk_sizes) != sorted(set(self.chunk_sizes)):
      raise ValueError(f"chunk_sizes must be ascending and distinct, got {self.chunk_sizes}")
    if self.token_budget < self.chunk_sizes[0]:
      raise ValueError(f"token_budget={self.token_budget} is below the smallest chunk size "
                       f"{self.chunk_sizes[0]}: long prompts could never be scheduled")


@dataclasses.dataclass(frozen=True)
class PrefillChunk:
  """Prefill `num_tokens` prompt tokens of one request at positions `[start, start + num_tokens)`.

  `is_last` marks the chunk that completes the prompt: its logits give the first output token.
  """

  request_id: RequestId
  slot: int
  start: int
  num_tokens: int
  is_last: bool


@dataclasses.dataclass(frozen=True)
class LoadItem:
  """Insert the request's staged stored chunks, positions `[0, num_tokens)`, into `slot`.

  Plain prefix loading only (a request with `num_cached_tokens`, no merge): the chunks were
  fetched before the request was queued. A Cake merge's chunks never appear here; the engine
  inserts them between steps as `CakeMerge.load_done` says. Loads cost no compute budget: they
  are the other resource (Cake, arXiv 2410.03065, section 3).
  """

  request_id: RequestId
  slot: int
  num_tokens: int


@dataclasses.dataclass(frozen=True)
class DecodeItem:
  """Feed `token_id` at `position` for the request in `slot`."""

  request_id: RequestId
  slot: int
  position: int
  token_id: int


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
  """One step's plan, run in field order (loads, decodes, prefills). Empty when nothing can run."""

  loads: tuple[LoadItem, ...] = ()
  decodes: tuple[DecodeItem, ...] = ()
  prefills: tuple[PrefillChunk, ...] = ()

  @property
  def num_scheduled_tokens(self) -> int:
    return len(self.decodes) + sum(c.num_tokens for c in self.prefills)

  @property
  def is_empty(self) -> bool:
    return not self.loads and not self.decodes and not self.prefills


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


class Scheduler:
  """Admits requests into decode slots and plans each step within the token budget.

  Args:
    config: slots, token budget, chunk sizes.
    cost_model: the cost model Cake merges plan with (one per engine; the engine feeds it);
      a fresh `CostModel()` when None.
  """

  def __init__(self, config: SchedulerConfig, cost_model: CostModel | None = None):
    self.config = config
    self.cost_model = cost_model if cost_model is not None else CostModel()
    self.waiting: collections.deque[Request] = collections.deque()
    self.running: dict[RequestId, Request] = {}  # insertion order = admission order
    self._free_slots = list(range(config.num_slots))

  def add_request(self, request: Request) -> None:
    if request.request_id in self.running or any(
        r.request_id == request.request_id for r in self.waiting):
      raise ValueError(f"request id {request.request_id!r} is already scheduled")
    if not 0 <= request.num_cached_tokens < request.num_prompt_tokens:
      raise ValueError(f"{request.num_cached_tokens} cached tokens for a prompt of "
                       f"{request.num_prompt_tokens}: the last prompt token is always computed")
    if request.merge is not None:
      if request.num_cached_tokens:
        raise ValueError("a request with a Cake merge loads through the merge: "
                         f"num_cached_tokens must be 0, got {request.num_cached_tokens}")
      if request.merge.num_prompt_tokens != request.num_prompt_tokens:
        raise ValueError(f"merge planned for {request.merge.num_prompt_tokens} prompt tokens, "
                         f"request has {request.num_prompt_tokens}")
    request.status = RequestStatus.WAITING
    self.waiting.append(request)

  def has_unfinished(self) -> bool:
    return bool(self.waiting or self.running)

  def cake_requests(self, include_waiting: bool = False) -> list[Request]:
    """Requests whose Cake merge still prefills: running ones oldest first, then (with
    `include_waiting`) queued ones in queue order.

    The engine issues their loads with `request.merge.next_load`. Loads need no slot until a
    chunk is inserted, so they may start while a request waits (its INSERT-verdict chunks stay
    staged until it holds a slot).
    """
    out = [r for r in self.running.values()
           if r.merge is not None and r.status is RequestStatus.PREFILLING]
    if include_waiting:
      out += [r for r in self.waiting if r.merge is not None]
    return out

  def schedule(self, now_s: float | None = None, token_budget: int | None = None
               ) -> SchedulerOutput:
    """Plans one step; see the module docstring for the order.

    Args:
      now_s: the engine clock at the step's start, seconds, increasing from step to step; needed
        when any request has a Cake merge (a merge tells steps apart by it).
      token_budget: this step's budget instead of `config.token_budget` (e.g. throttled under
        competing load), >= 0.

    Raises:
      ValueError: on a negative `token_budget`, or no `now_s` with a Cake merge to plan.
    """
    budget = self.config.token_budget if token_budget is None else token_budget
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
      raise ValueError(f"token_budget={token_budget!r} must be an int >= 0")
    if now_s is None and any(r.merge is not None for r in self.cake_requests(True)):
      raise ValueError("schedule() needs now_s (the engine clock) to plan Cake merges")
    decodes = []
    for r in self.running.values():
      if r.status is RequestStatus.DECODING and budget > 0:
        decodes.append(DecodeItem(r.request_id, r.slot, r.num_computed_tokens,
                                  r.output_token_ids[-1]))
        r.num_computed_tokens += 1
        budget -= 1
    prefills: list[PrefillChunk] = []
    loads: list[LoadItem] = []
    for r in self.running.values():
      if r.status is RequestStatus.PREFILLING and r.merge is None:
        budget = self._plan_chunks(r, budget, prefills)
    while self.waiting and self._free_slots:
      r = self.waiting[0]
      if r.merge is None and (budget <= 0 or not chunk_tokens(
          r.remaining_prefill_tokens, budget, self.config.chunk_sizes)):
        break
      self.waiting.popleft()
      r.slot = self._free_slots.pop(0)
      r.status = RequestStatus.PREFILLING
      self.running[r.request_id] = r
      if r.merge is not None:
        continue  # its compute side plans below, after every ordinary prefill
      if r.num_cached_tokens:
        loads.append(LoadItem(r.request_id, r.slot, r.num_cached_tokens))
        r.num_computed_tokens = r.num_cached_tokens
      budget = self._plan_chunks(r, budget, prefills)
    for r in self.cake_requests():
      budget = self._plan_cake(r, budget, now_s, prefills)
    return SchedulerOutput(loads=tuple(loads), decodes=tuple(decodes), prefills=tuple(prefills))

  def _plan_cake(self, r: Request, budget: int, now_s: float, out: list[PrefillChunk]) -> int:
    """Appends the compute steps of `r`'s merge that the budget allows; returns the budget left."""
    while step := r.merge.next_compute(budget, self.config.chunk_sizes, now_s, self.cost_model):
      start, n = step
      budget -= n
      is_last = start + n == r.num_prompt_tokens
      out.append(PrefillChunk(r.request_id, r.slot, start, n, is_last))
      if is_last:
        r.status = RequestStatus.DECODING
        break
    r.num_computed_tokens = r.merge.frontier
    return budget

  def _plan_chunks(self, r: Request, budget: int, out: list[PrefillChunk]) -> int:
    """Appends as many chunks of `r` as the budget allows; returns the budget left."""
    while n := chunk_tokens(r.remaining_prefill_tokens, budget, self.config.chunk_sizes):
      start = r.num_computed_tokens
      r.num_computed_tokens += n
      budget -= n
      is_last = r.num_computed_tokens == r.num_prompt_tokens
      if is_last:
        r.status = RequestStatus.DECODING
      out.append(PrefillChunk(r.request_id, r.slot, start, n, is_last))
    return budget

  def finish_request(self, request_id: RequestId, reason: str) -> Request | None:
    """Ends a request (stop, length or abort) and frees its slot; returns it, or None if unknown."""
    r = self.running.pop(request_id, None)
    if r is None:
      for i, w in enumerate(self.waiting):
        if w.request_id == request_id:
          r = w
          del self.waiting[i]
          break
      else:
        return None
    if r.merge is not None:
      r.merge.cancel()  # no chunk of a freed slot may be inserted any more
    if r.slot is not None:
      bisect.insort(self._free_slots, r.slot)
      r.slot = None
    r.status = RequestStatus.FINISHED
    r.finish_reason = reason
    return r
