"""A deterministic simulator of the Cake merge: fake clock, scripted link, per-chunk costs.

It is a fake executor (`SimExecutor`) under the real `Scheduler`, run by the engine's own step
loop (`kvjax.engine.core.EngineCore`): there is no second loop to drift from the engine's. Each
plan is executed on a fake clock:

    plan        `scheduler.schedule(now_s, token_budget)`: finished ids, releases, loads,
                inserts, decodes, prefills, exactly as the engine gets them
    run         clock += inserts' cost + the plan's compute costs (+ decode step, + competing
                work); loads queue in plan order and refill the moment one lands
    report      a `StepResult` with the landings (their own times), sampled tokens and the true
                compute seconds, fed back through `scheduler.update`

The link moves one chunk at a time in issue order at a piecewise-constant bandwidth; one host
decoder follows in the same order; a chunk lands when decoded. With a compute-budget script, the
Cake side gets `tokens(t)` of each step's budget and competing work takes the rest (it costs
`costs.compute_s(0, rest)`: short prompts at position 0), so steps run even while Cake waits.

Everything is exact float arithmetic on the scripts: the same inputs give the same TTFTs.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import heapq
import math
from typing import Callable, Sequence

from kvjax._typing import RequestId
from kvjax.engine.core import EngineCore, StepRecord
from kvjax.scheduler import (Candidate, ComputeTiming, CostModel, LoadConfig, LoadItem, LoadReport,
                             MergeMode, MergeTrace, PrefillChunk, Request, SamplingParams, Scheduler,
                             SchedulerConfig, SchedulerOutput, StepResult, StoredChunk,
                             StoredPrefix, chunk_tokens, ideal_merge_s)


#: The built-in cost line of `scripts/simulate_cake.py`: SmolLM2-135M f32 on 2 CPU cores,
#: seconds per 256-token chunk by chunk index (0.69 s at position 0 to 3.40 s at 7936), and a
#: raw f32 chunk's stored bytes (30 layers x K, V x 256 tokens x 3 KV heads x 64 x 4 bytes).
SMOLLM2_CPU_CHUNK_S = tuple(0.69 + (3.40 - 0.69) * j / 31 for j in range(32))
SMOLLM2_RAW_CHUNK_BYTES = 30 * 2 * 256 * 3 * 64 * 4


@dataclasses.dataclass(frozen=True)
class PiecewiseConstant:
  """A value over time: `values[i]` holds from `starts_s[i]` until the next start.

  Raises:
    ValueError: if the starts are not ascending from 0 or the lengths differ.
  """

  starts_s: tuple[float, ...]
  values: tuple[float, ...]

  def __post_init__(self):
    if not self.starts_s or self.starts_s[0] != 0 or list(self.starts_s) != sorted(
        set(self.starts_s)) or len(self.starts_s) != len(self.values):
      raise ValueError(f"need ascending starts from 0 and one value each: {self}")

  @classmethod
  def constant(cls, value: float) -> "PiecewiseConstant":
    return cls((0.0,), (value,))

  def at(self, t_s: float) -> float:
    return self.values[bisect.bisect_right(self.starts_s, t_s) - 1]


@dataclasses.dataclass(frozen=True)
class LinkScript:
  """The link: bandwidth over time (bytes/s, piecewise constant) and loads in flight per request.

  Attributes:
    bandwidth_bytes_per_s: bandwidth trace; 0 stalls the link while it lasts.
    max_in_flight: `CakeMerge.max_loads_in_flight` of every simulated merge.
  """

  bandwidth_bytes_per_s: PiecewiseConstant
  max_in_flight: int = 2

  @classmethod
  def constant(cls, bandwidth_bytes_per_s: float, max_in_flight: int = 2) -> "LinkScript":
    return cls(PiecewiseConstant.constant(bandwidth_bytes_per_s), max_in_flight)

  def transfer_end_s(self, start_s: float, nbytes: int) -> float:
    """When a transfer of `nbytes` started at `start_s` with the link to itself ends (inf: never)."""
    trace, t, left = self.bandwidth_bytes_per_s, start_s, float(nbytes)
    i = bisect.bisect_right(trace.starts_s, t) - 1
    while left > 0:
      bw = trace.values[i]
      seg_end = trace.starts_s[i + 1] if i + 1 < len(trace.starts_s) else math.inf
      if bw > 0:
        if t + left / bw <= seg_end:
          return t + left / bw
        left -= (seg_end - t) * bw
      elif math.isinf(seg_end):
        return math.inf
      t, i = seg_end, i + 1
    return t


@dataclasses.dataclass(frozen=True)
class ChunkCosts:
  """True costs of the simulated machine.

  Attributes:
    compute_s: seconds to prefill `(start, num_tokens)`.
    decode_chunk_s: host decode seconds per loaded chunk (0 for raw chunks).
    decode_step_s: seconds of a decode step (when the plan has decodes).
    insert_s: engine-thread seconds to insert one loaded chunk (between steps).
  """

  compute_s: Callable[[int, int], float]
  decode_chunk_s: float = 0.0
  decode_step_s: float = 0.0
  insert_s: float = 0.0

  @classmethod
  def linear(cls, a: float, b: float, c: float, **kw) -> "ChunkCosts":
    """compute = a + b * n + c * n * (start + (n - 1) / 2), the `CostModel`'s form."""
    return cls(lambda s, n: a + b * n + c * n * (s + (n - 1) / 2), **kw)

  @classmethod
  def from_chunk_curve(cls, chunk_tokens: int, chunk_s: Sequence[float], **kw) -> "ChunkCosts":
    """Costs from measured seconds of chunk j (positions `[j * C, (j + 1) * C)`), linearly
    interpolated (and extrapolated) by mean position and scaled by tokens."""
    curve = list(chunk_s)

    def at(x: float) -> float:
      if len(curve) == 1:
        return curve[0]
      i = min(max(int(math.floor(x)), 0), len(curve) - 2)
      return curve[i] + (x - i) * (curve[i + 1] - curve[i])

    def compute_s(start: int, n: int) -> float:
      return n / chunk_tokens * max(0.0, at((start + n / 2) / chunk_tokens - 0.5))
    return cls(compute_s, **kw)


@dataclasses.dataclass(frozen=True)
class SimRequest:
  """A simulated request.

  Attributes:
    request_id: its id.
    num_prompt_tokens: n.
    hits: per prefix chunk, stored or not; None makes a plain request (no merge: competing work).
    mode: the merge mode.
    chunk_nbytes: stored bytes of a chunk.
    arrival_s: arrival time.
    reject: chunks whose loads fail verification.
    max_tokens: output tokens (1: the request ends at its first token).
    encodings: optional per-chunk candidate encodings (then `chunk_nbytes` is the fallback).
    kv_ttft_target_s: passed to the merge.
  """

  request_id: str
  num_prompt_tokens: int
  hits: Sequence[bool] | None
  mode: MergeMode = MergeMode.CAKE
  chunk_nbytes: int = 0
  arrival_s: float = 0.0
  reject: frozenset[int] = frozenset()
  max_tokens: int = 1
  encodings: Sequence[Sequence[Candidate] | None] | None = None
  kv_ttft_target_s: float | None = None


@dataclasses.dataclass
class SimResult:
  """One request's outcome.

  Attributes:
    ttft_s: first token time minus arrival, seconds.
    first_token_s: clock at the first token.
    meeting_index: `trace.meeting_index` (N for a plain request).
    trace: the merge's trace (None for a plain request).
    chunk_writers: `CakeMerge.chunk_writers()` ("" for a plain request).
    unwritten_positions: prompt positions nobody wrote (0 once the prompt is done; the merge's
      writer map raises on a second write).
    chunk_done_s: per prefix chunk, the clock when it became present (its compute step ended or
      it was inserted).
    prefills: the request's planned steps, (clock at the step's start, start, num_tokens).
  """

  request_id: str
  ttft_s: float | None = None
  first_token_s: float | None = None
  meeting_index: int = 0
  trace: MergeTrace | None = None
  chunk_writers: str = ""
  unwritten_positions: int = 0
  chunk_done_s: list[float] = dataclasses.field(default_factory=list)
  prefills: list[tuple[float, int, int]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class SimRun:
  """A whole simulation: per-request results, every step's (start, end) and the final clock."""

  results: dict[str, SimResult]
  steps: list[tuple[float, float]]
  end_s: float

  @property
  def max_step_s(self) -> float:
    return max((e - s for s, e in self.steps), default=0.0)


class SimExecutor:
  """A fake executor: runs each plan on a fake clock and a scripted link (the `Executor`
  protocol of `kvjax.engine.core`). The real scheduler plans; this only moves time.

  Loads run as the real store client runs them on one tier: in plan order (a read never
  starts before one queued ahead of it), each request's `LoadItem.max_in_flight` at a time,
  the next started the moment one lands; the link moves one
  transfer at a time and one host decoder follows. Landings during a step are reported at the
  step's end with their own times; inserts cost `costs.insert_s` each before the step.
  """

  def __init__(self, requests: Sequence[SimRequest], *, costs: ChunkCosts, link: LinkScript,
               scheduler: Scheduler, chunk_size: int, budget: PiecewiseConstant | None,
               competing_s: Callable[[int], float], num_layers: int = 1):
    self.costs, self.link, self.scheduler, self.chunk_size = costs, link, scheduler, chunk_size
    self.num_layers = num_layers
    self.budget = budget
    self.competing = competing_s
    self.t = 0.0
    self.arrivals = sorted(requests, key=lambda r: r.arrival_s)
    self.specs = {r.request_id: r for r in requests}
    self.results = {r.request_id: SimResult(r.request_id) for r in requests}
    self.outputs: dict[str, int] = {}
    self.queue: list[LoadItem] = []
    self.reading: dict[tuple[str, int], tuple[float, float, float, int]] = {}  # key: (land, ..)
    self.reports: list[LoadReport] = []
    self.link_free_s = self.decode_free_s = 0.0
    self.steps: list[tuple[float, float]] = []
    self.live: set[str] = set()

  def now_s(self) -> float:
    return self.t

  def admit_arrivals(self) -> None:
    while self.arrivals and self.arrivals[0].arrival_s <= self.t:
      spec = self.arrivals.pop(0)
      stored = None
      if spec.hits is not None:
        cands = []
        for j, h in enumerate(spec.hits):
          enc = spec.encodings[j] if spec.encodings is not None else None
          if not h:
            cands.append(None)
          else:
            cands.append(StoredChunk("sim", tuple(enc) if enc else (
                Candidate("raw/0", spec.chunk_nbytes, 0, layer_sliceable=True),)))
        stored = StoredPrefix(self.chunk_size, tuple(cands))
        self.results[spec.request_id].chunk_done_s = [math.nan] * len(spec.hits)
      self.scheduler.add_request(Request(RequestId(spec.request_id),
                                         list(range(spec.num_prompt_tokens)),
                                         SamplingParams(max_tokens=spec.max_tokens),
                                         arrival_s=spec.arrival_s), stored,
                                 merge_mode=spec.mode, kv_ttft_target_s=spec.kv_ttft_target_s)
      self.live.add(spec.request_id)

  def _pump(self, now: float) -> None:
    per_req: dict[str, int] = collections.Counter(k[0] for k in self.reading)
    for item in list(self.queue):
      if per_req[item.request_id] >= item.max_in_flight:
        break  # one tier: later reads keep the queue's order (`Loader._pump`)
      self.queue.remove(item)
      xs = max(now, self.link_free_s)
      xe = self.link.transfer_end_s(xs, item.nbytes)
      self.link_free_s = xe
      de = max(xe, self.decode_free_s) + self.costs.decode_chunk_s
      self.decode_free_s = de
      self.reading[(item.request_id, item.index)] = (de, xs, xe, item.nbytes)
      per_req[item.request_id] += 1

  def _land_until(self, t: float) -> None:
    while self.reading:
      key, (de, xs, xe, nbytes) = min(self.reading.items(), key=lambda kv: (kv[1][0], kv[0][1]))
      if de > t:
        return
      del self.reading[key]
      rid, index = key
      ok = index not in self.specs[rid].reject
      self.reports.append(LoadReport(rid, index, ok, nbytes if ok else 0, tier="sim",
                                     encoding=None, started_s=xs, done_s=de,
                                     link_s=xe - xs if ok else 0.0,
                                     decode_s=self.costs.decode_chunk_s))
      self._pump(de)

  def execute(self, plan: SchedulerOutput) -> StepResult:
    for rid in plan.finished_request_ids:  # drop their loads, as the store client does
      self.queue = [q for q in self.queue if q.request_id != rid]
      for key in [k for k in self.reading if k[0] == rid]:
        del self.reading[key]
      self.reports = [r for r in self.reports if r.request_id != rid]
    for rid, index in plan.releases:
      queued = [q for q in self.queue if (q.request_id, q.index) == (rid, index)]
      for q in queued:
        self.queue.remove(q)
        self.reports.append(LoadReport(rid, index, False, 0, reason="released",
                                       done_s=self.t))
    self.queue.extend(plan.loads)
    self._pump(self.t)
    for ins in plan.inserts:
      self.results[ins.request_id].chunk_done_s[ins.index] = self.t
      self.t += self.costs.insert_s
    tokens = self.scheduler_budget_tokens
    rest = 0 if tokens is None else self.scheduler.config.token_budget - tokens
    if plan.is_empty and rest <= 0:
      nxt = [v[0] for v in self.reading.values()]
      nxt += [self.arrivals[0].arrival_s] if self.arrivals else []
      if plan.wait_s is not None:
        nxt.append(self.t + plan.wait_s)
      nxt = [x for x in nxt if x < math.inf]
      if not nxt:
        raise RuntimeError(f"deadlock at t={self.t}: nothing to run and nothing will land")
      self.t = max(self.t, min(nxt))
      self._land_until(self.t)
      reports, self.reports = tuple(self.reports), []
      return StepResult(now_s=self.t, loads=reports)
    step_s = self.competing(rest) + (self.costs.decode_step_s if plan.decodes else 0.0)
    # A piece of a layer-split chunk runs k of the L layers (`PrefillChunk.num_layers`).
    chunk_s = [self.costs.compute_s(c.start, c.num_tokens) * (
        1.0 if c.num_layers is None else c.num_layers / self.num_layers) for c in plan.prefills]
    step_s += sum(chunk_s)
    t_end = self.t + step_s
    self.steps.append((self.t, t_end))
    self._land_until(t_end)
    for c in plan.prefills:
      if c.num_layers is None:  # a split chunk is present when its high layers are inserted
        _record_prefill(self.results[c.request_id], c, self.t, t_end, self.chunk_size,
                        self.specs[c.request_id].hits is not None)
    self.t = t_end
    sampled, finished = [], []
    for rid in [c.request_id for c in plan.prefills if c.is_last] + [
        d.request_id for d in plan.decodes]:
      sampled.append((rid, 0))
      self.outputs[rid] = self.outputs.get(rid, 0) + 1
      res = self.results[rid]
      if res.first_token_s is None:
        res.first_token_s, res.ttft_s = self.t, self.t - self.specs[rid].arrival_s
      if self.outputs[rid] >= self.specs[rid].max_tokens:
        finished.append((rid, "length"))
    reports, self.reports = tuple(self.reports), []
    return StepResult(now_s=self.t, sampled=tuple(sampled), finished=tuple(finished),
                      loads=reports,
                      compute=tuple(ComputeTiming(c.start, c.num_tokens, s,
                                                  num_layers=c.num_layers)
                                    for c, s in zip(plan.prefills, chunk_s)))

  scheduler_budget_tokens: int | None = None


def simulate(requests: Sequence[SimRequest], *, costs: ChunkCosts, link: LinkScript,
             scheduler_config: SchedulerConfig, chunk_size: int,
             cost_model: CostModel | None = None, budget: PiecewiseConstant | None = None,
             competing_s: Callable[[int], float] | None = None,
             max_steps: int = 100_000, joint_planning: bool = True,
             observe: Callable[[StepRecord], None] | None = None,
             check_writes: bool = True, num_layers: int = 1,
             layer_split_points: Sequence[int] = ()) -> SimRun:
  """Runs requests to their last token on a fake clock: the real `Scheduler` under a
  `SimExecutor`, through the engine's own step loop (`kvjax.engine.core.EngineCore`).

  Args:
    requests: what arrives, and when.
    costs: the simulated machine's true costs.
    link: the scripted link (`max_in_flight`: each merge's loads in flight, fixed).
    scheduler_config: slots, token budget, compiled chunk sizes.
    chunk_size: C, tokens per store chunk.
    cost_model: the planner's model (learns from the run); a fresh `CostModel()` when None.
    budget: Cake's share of each step's budget over time (tokens); the rest of
      `scheduler_config.token_budget` goes to competing work. None: the whole budget.
    competing_s: seconds of `k` competing tokens; default `costs.compute_s(0, k)`.
    max_steps: a guard against a planner that never finishes.
    joint_planning: `LoadConfig.joint_planning` (requests restoring at once planned together).
    observe: called with each step's `StepRecord` (its planner seconds among them).
    check_writes: keep each merge's writer map (`LoadConfig.check_writes`; then each result's
      `chunk_writers`); False times the planner as an engine runs it (no map).
    num_layers: L, the simulated model's layers: a piece of a layer-split chunk running k of
      them costs k / L of the full step.
    layer_split_points: `LoadConfig.layer_split_points` (the layer axis; () off).

  Returns:
    A `SimRun`.

  Raises:
    RuntimeError: if nothing can run and nothing will land (a planner deadlock), or on
      `max_steps`.
  """
  if len({r.request_id for r in requests}) != len(requests):
    raise ValueError("request ids must be distinct")
  model = cost_model if cost_model is not None else CostModel()
  sched = Scheduler(scheduler_config, model, load_config=LoadConfig(
      max_loads_in_flight=link.max_in_flight, check_writes=check_writes,
      joint_planning=joint_planning, num_layers=num_layers if layer_split_points else 0,
      layer_split_points=tuple(layer_split_points)))
  competing = competing_s or (lambda k: costs.compute_s(0, k) if k > 0 else 0.0)
  ex = SimExecutor(requests, costs=costs, link=link, scheduler=sched, chunk_size=chunk_size,
                   budget=budget, competing_s=competing, num_layers=num_layers)
  core = EngineCore(sched, ex)
  if observe is not None:
    core.observers.append(observe)
  traces: dict[str, MergeTrace] = {}
  steps = 0
  while ex.arrivals or sched.has_unfinished():
    steps += 1
    if steps > max_steps:
      raise RuntimeError(f"no end after {max_steps} steps")
    ex.admit_arrivals()
    if not sched.has_unfinished():
      ex.t = ex.arrivals[0].arrival_s
      continue
    tokens = None if budget is None else int(budget.at(ex.t))
    ex.scheduler_budget_tokens = tokens
    _, _, got = core.step(token_budget=tokens)
    traces.update(got)
  for rid, trace in traces.items():
    res = ex.results[rid]
    res.trace, res.meeting_index = trace, trace.meeting_index
    res.chunk_writers = trace.chunk_writers
    res.unwritten_positions = trace.unwritten_positions or 0
  return SimRun(ex.results, ex.steps, ex.t)


def _record_prefill(res: SimResult, c: PrefillChunk, t: float, t_end: float, chunk_size: int,
                    has_merge: bool) -> None:
  res.prefills.append((t, c.start, c.num_tokens))
  if not has_merge:
    return
  end = c.start + c.num_tokens
  for j in range(c.start // chunk_size, min(len(res.chunk_done_s), (end - 1) // chunk_size + 1)):
    if end >= (j + 1) * chunk_size:
      res.chunk_done_s[j] = t_end


def warm_cost_model(costs: ChunkCosts, *, chunk_sizes: Sequence[int], max_position: int,
                    bandwidth_bytes_per_s: float, nbytes: int) -> CostModel:
  """A `CostModel` that has seen what an engine sees after one request: each compiled size at
  positions 0, `max_position / 2` and `max_position`, and one chunk load on the link."""
  model = CostModel()
  for pos in (0, max_position // 2, max_position):
    for k in chunk_sizes:
      model.observe_compute(pos, k, costs.compute_s(pos, k))
  model.observe_load(nbytes, nbytes / bandwidth_bytes_per_s)
  model.observe_decode(nbytes, costs.decode_chunk_s)
  return model


# --------------------------------------------------------------------------- the ideal bound
def load_curve_s(link: LinkScript, nbytes: int, num_chunks: int,
                 decode_chunk_s: float = 0.0) -> list[float]:
  """`L(k)` for k = 0..N: when the k-th chunk from the top lands if loads start at 0 and run
  back to back (`max_in_flight` issued at a time, the next issued when one lands)."""
  out, link_free, dec_free = [0.0], 0.0, 0.0
  slots = [0.0] * link.max_in_flight
  for _ in range(num_chunks):
    issue = heapq.heappop(slots)
    xe = link.transfer_end_s(max(issue, link_free), nbytes)
    link_free = xe
    dec_free = max(xe, dec_free) + decode_chunk_s
    heapq.heappush(slots, dec_free)
    out.append(dec_free)
  return out


@dataclasses.dataclass(frozen=True)
class IdealBound:
  """`min over m of max(C(m), L(N - m))` plus the suffix.

  Attributes:
    ttft_s: the bound.
    best_m: the best split (chunks computed).
    compute_prefix_s: `C(m)`, m = 0..N: when a compute-only run of just the first m chunks (same
      costs, budget script and compiled sizes) had them.
    load_top_s: `L(k)`, k = 0..N: `load_curve_s` of the link.
    suffix_s: seconds to compute the suffix `[N * C, n)` in budget-sized steps once the prefix is
      present (competing work included).
  """

  ttft_s: float
  best_m: int
  compute_prefix_s: list[float]
  load_top_s: list[float]
  suffix_s: float


def ideal_bound(spec: SimRequest, *, costs: ChunkCosts, link: LinkScript,
                scheduler_config: SchedulerConfig, chunk_size: int,
                budget: PiecewiseConstant | None = None,
                competing_s: Callable[[int], float] | None = None) -> IdealBound:
  """The ideal TTFT of `spec` alone (see `IdealBound`); `spec.hits` must be all True.

  The suffix is costed from the time the bound's prefix is complete, with the budget script.
  """
  if spec.hits is None or not all(spec.hits):
    raise ValueError("the ideal bound is defined for a fully stored prefix")
  n_chunks = len(spec.hits)
  prefix = n_chunks * chunk_size
  # C(m): compute-only on exactly the first m chunks (plus the one token a prompt must compute),
  # so the last step may be shorter than a full budget, as Cake's would be.
  c_m = [0.0]
  for m in range(1, n_chunks + 1):
    co = dataclasses.replace(spec, num_prompt_tokens=m * chunk_size + 1, hits=[True] * m,
                             mode=MergeMode.COMPUTE_ONLY, arrival_s=0.0)
    run = simulate([co], costs=costs, link=link, scheduler_config=scheduler_config,
                   chunk_size=chunk_size, cost_model=CostModel(), budget=budget,
                   competing_s=competing_s)
    c_m.append(run.results[spec.request_id].chunk_done_s[m - 1])
  l_k = load_curve_s(link, spec.chunk_nbytes, n_chunks, costs.decode_chunk_s)
  best, m = ideal_merge_s(c_m, l_k)
  competing = competing_s or (lambda k: costs.compute_s(0, k) if k > 0 else 0.0)
  t, p = best, prefix
  while p < spec.num_prompt_tokens:
    tokens = scheduler_config.token_budget if budget is None else int(budget.at(t))
    k = chunk_tokens(spec.num_prompt_tokens - p, tokens, scheduler_config.chunk_sizes)
    if not k and competing(scheduler_config.token_budget - tokens) <= 0:
      raise ValueError(f"the budget script gives the suffix no tokens at t={t}")
    t += competing(scheduler_config.token_budget - tokens) + (
        costs.compute_s(p, k) if k else 0.0)
    p += k
  return IdealBound(t, m, c_m, l_k, t - best)
