"""The Cake planner: compute a prompt's stored prefix from the front while loading it from the back.

Cake, arXiv 2410.03065, section 4 and Appendix A. The prefix `[0, P)` of a prompt of `n` tokens is
split into `N = P / C` store chunks of `C` tokens; `hits[j]` says chunk `j` is stored. Background
loaders fetch stored chunks from the LAST to the first; chunked prefill computes from the FRONT.
Compute cost per chunk grows with position and load cost is flat, so the two sides meet somewhere
in the middle, and where they meet adapts to the bandwidth and the compute share of the moment.

    chunk:      0     1     2     3     4     5     6     7    suffix
              [ C ][ C ][ . ][ L ][ L ][ ~ ][ L ][ L ][ s s s )
    compute --------->                         <-------- loads
    C computed  . hole (miss or rejected; compute's)  L resident (loaded)  ~ load in flight

One `CakeMerge` per request holds each chunk's state:

    HIT ──next_load──> LOADING ──load_done ok──> LANDED ──inserted──> RESIDENT
     │                   │  └────load_done bad──> MISSING (REJECTED; a hole, compute's)
     │                   └──compute takes it───> COMPUTING (its late load is WASTED)
     └──compute takes it──────────────────────> COMPUTING ──> COMPUTED
    MISSING ──compute reaches it──────────────> COMPUTING ──> COMPUTED

Rules (docs/design/cake.md):
  * The compute frontier `p` is the first position not resident or planned; everything below it
    is present, so a compute step at `p` is always valid. It skips resident runs, computes holes,
    never passes a resident or landed chunk, never plans a position twice.
  * A step that touches a chunk takes the whole chunk: a load of it still in flight is wasted when
    it lands. Chunks above a hole stay valid (keys chain through token ids, not KV).
  * Going past the paper, each side skips work it cannot win, by the `CostModel`: a load is issued
    only if it is predicted to land before compute would finish that chunk; compute takes a chunk
    only if it would finish it before the chunk's load (in flight or still to issue) lands, so
    steps shrink as the sides close in, and compute idles when loads finish everything first.
    Compute waits on a predicted landing only once the link's rate is known
    (`CostModel.load_rate_known`); before that it waits for the first landing at most one
    compute step. A load that overstays both `late_factor` times its predicted latency and its
    chunk's compute time past its predicted landing (ski rental: waiting longer than computing
    would take never pays) stops holding compute back, and so do chunks queued behind it.
  * Compute steps are compiled sizes, aligned to store chunks: a step that crosses a chunk
    boundary inside the prefix ends on one. After the prefix, the suffix is ordinary chunked
    prefill; the step covering the last prompt token is the last.
  * The last unit may be a stored tail of m < C tokens (a session turn's history ending inside
    a chunk, `last_unit_tokens`): it is loaded and inserted like a chunk, the prefix ends at its
    end, and the suffix starts there, inside its chunk.

Ownership: the scheduler owns each request's merge and is its only caller (`schedule` plans
loads, inserts and compute with it; `update` hands it every `LoadReport`); the executor never
sees it, only the plain records the scheduler derives from it. It is not thread-safe and needs
not be: the scheduler runs on one thread. Time is the executor's clock in seconds (`now_s`); the
simulator passes a fake one.

The merge's state records (chunk states, verdicts, writers, the trace) are in
`kvjax/scheduler/cake_state.py`; its predictions of landings, late loads and compute time are
plain functions in `kvjax/scheduler/cake_forecast.py`; its compute share (how fast its compute
runs in wall time) is estimated by `kvjax/scheduler/cake_share.py`.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

from kvjax.block_hash import loadable_units
from kvjax.scheduler import cake_forecast, layer_split, level_policy
from kvjax.scheduler.cake_forecast import ideal_merge_s
from kvjax.scheduler.cake_share import ComputeShare
from kvjax.scheduler.cake_state import (ChunkState, DoubleWriteError, LoadInFlight, LoadVerdict,
                                        MergeMode, MergeTrace, Writer)
from kvjax.scheduler.cost_model import CostModel
from kvjax.scheduler.level_policy import Candidate

__all__ = ["CakeMerge", "ChunkState", "DoubleWriteError", "LoadVerdict", "MergeMode",
           "MergeTrace", "Writer", "ideal_merge_s"]


class CakeMerge:
  """Plans one request's prefix: which chunk to load next, which positions to compute next.

  Args:
    num_prompt_tokens: n, the prompt's length, tokens.
    chunk_size: C, tokens per store chunk.
    hits: one bool per prefix chunk (chunk j covers `[j * C, (j + 1) * C)`): stored or not.
      `len(hits) * C` must stay below n (the last prompt token is always computed).
    mode: `MergeMode` (or its value).
    chunk_nbytes: stored bytes per chunk (one int, or one per chunk) for the cost model; needed
      when there are hits to load, unless `encodings` is given.
    encodings: per chunk, its stored encodings (`level_policy.Candidate`), or None for chunks
      that are not hits; `next_load` then picks one per load (`load_encoding`).
    max_loads_in_flight: loads issued and not yet finished, at most.
    kv_ttft_target_s: pick encodings for this TTFT target (CacheGen's SLO) instead of for the
      time compute would finish the chunk.
    arrival_s: the request's arrival (engine clock), for `kv_ttft_target_s`.
    late_factor: an in-flight load whose age reaches `late_factor` times its predicted latency is
      late: compute may take its chunk (the load is then wasted).
    compute_share_prior: the fraction of a step's wall time this request's compute is expected
      to get before a step has been observed, in (0, 1]; None takes the first budget offered
      over the largest compiled size (64 of 512 tokens: 1/8).
    check_writes: keep a per-position writer map and raise `DoubleWriteError` on a second write
      (one byte per prompt token; tests and simulations always keep it on).
    resident: leading chunks already resident on the device (the device prefix cache,
      device hits): they start RESIDENT (written by "load" in the writer map), so the merge never
      loads nor computes them and its frontier starts after them.
    last_unit_tokens: m in [1, C) when the last prefix unit is a stored tail (a session turn's
      history ending m tokens into that chunk, `kvjax.storage.format.keys.tail_hash`): it covers
      `[(N - 1) * C, (N - 1) * C + m)` and the prefix ends there; loads take it first like any
      last chunk, and the suffix is computed from its end. None: every unit is a whole chunk.
    num_layers: L, the model's layers (for the layer axis).
    layer_split_points: the layer counts k in `[1, L)` compute may take of a chunk split along
      layers (CacheFlow, arXiv 2604.25080; `kvjax/scheduler/layer_split.py`): when the next
      load would be the meeting chunk, the merge may load only its layers `[k, L)` and compute
      its layers `[0, k)`. () (default): token-only Cake.

  Raises:
    ValueError: on inconsistent sizes, hits, byte counts or encodings.
  """

  def __init__(self, num_prompt_tokens: int, chunk_size: int, hits: Sequence[bool],
               mode: MergeMode | str = MergeMode.CAKE, *,
               chunk_nbytes: int | Sequence[int] | None = None,
               encodings: Sequence[Sequence[Candidate] | None] | None = None,
               max_loads_in_flight: int = 2, kv_ttft_target_s: float | None = None,
               arrival_s: float = 0.0, late_factor: float = 2.0,
               compute_share_prior: float | None = None, check_writes: bool = True,
               resident: int = 0, last_unit_tokens: int | None = None,
               num_layers: int = 1, layer_split_points: Sequence[int] = ()):
    def positive_int(name, v):
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name}={v!r} must be an int >= 1")

    positive_int("num_prompt_tokens", num_prompt_tokens)
    positive_int("chunk_size", chunk_size)
    positive_int("max_loads_in_flight", max_loads_in_flight)
    self.mode = MergeMode(mode)
    hits = list(hits)
    if any(not isinstance(h, bool) for h in hits):
      raise ValueError("hits must be bools, one per prefix chunk")
    if last_unit_tokens is not None and (
        isinstance(last_unit_tokens, bool) or not isinstance(last_unit_tokens, int)
        or not 0 < last_unit_tokens < chunk_size or not hits):
      raise ValueError(f"last_unit_tokens={last_unit_tokens!r} must be an int in [1, "
                       f"{chunk_size}) after at least one unit")
    prefix_tokens = len(hits) * chunk_size if last_unit_tokens is None else (
        (len(hits) - 1) * chunk_size + last_unit_tokens)
    if prefix_tokens >= num_prompt_tokens:
      raise ValueError(f"{len(hits)} prefix units ({prefix_tokens} tokens, chunks of "
                       f"{chunk_size}) cover the last token of a {num_prompt_tokens}-token "
                       f"prompt: at most {loadable_units(num_prompt_tokens, chunk_size)} chunks")
    if not late_factor >= 1:
      raise ValueError(f"late_factor={late_factor!r} must be >= 1")
    if compute_share_prior is not None and not 0 < compute_share_prior <= 1:
      raise ValueError(f"compute_share_prior={compute_share_prior!r} must be in (0, 1]")
    if kv_ttft_target_s is not None and not kv_ttft_target_s > 0:
      raise ValueError(f"kv_ttft_target_s={kv_ttft_target_s!r} must be > 0 or None")
    self.layer_split_points = layer_split.check_points(layer_split_points, num_layers)
    self.num_layers = num_layers
    self.num_prompt_tokens = num_prompt_tokens
    self.chunk_size = chunk_size
    self.num_chunks = len(hits)
    self.prefix_tokens = prefix_tokens
    self.max_loads_in_flight = max_loads_in_flight
    self.kv_ttft_target_s = kv_ttft_target_s
    self.arrival_s = arrival_s
    self.late_factor = float(late_factor)
    uses_hits = self.mode is not MergeMode.COMPUTE_ONLY
    self._states = [ChunkState.HIT if (h and uses_hits) else ChunkState.MISSING for h in hits]
    # Device-resident leading chunks (the device prefix cache): resident
    # from the start, never loaded nor computed.
    whole = len(hits) if last_unit_tokens is None else len(hits) - 1
    if isinstance(resident, bool) or not isinstance(resident, int) or not (
        0 <= resident <= whole):
      raise ValueError(f"resident={resident!r} must be an int in [0, {whole}] (whole chunks)")
    self.num_device_resident = resident
    for j in range(resident):
      self._states[j] = ChunkState.RESIDENT
    self._encodings: list[tuple[Candidate, ...] | None] | None = None
    if encodings is not None:
      if len(encodings) != self.num_chunks:
        raise ValueError(f"encodings for {len(encodings)} chunks, hits for {self.num_chunks}")
      self._encodings = [tuple(e) if e is not None else None for e in encodings]
      for j, h in enumerate(hits):
        if h and not self._encodings[j]:
          raise ValueError(f"chunk {j} is a hit but has no candidate encodings")
    if chunk_nbytes is None:
      if self._encodings is not None:
        self._nbytes = [min(c.nbytes for c in e) if e else 0 for e in self._encodings]
      elif uses_hits and any(hits):
        raise ValueError("chunk_nbytes (or encodings) is needed to plan loads of the hits")
      else:
        self._nbytes = [0] * self.num_chunks
    elif isinstance(chunk_nbytes, int) and not isinstance(chunk_nbytes, bool):
      self._nbytes = [chunk_nbytes] * self.num_chunks
    else:
      self._nbytes = list(chunk_nbytes)
      if len(self._nbytes) != self.num_chunks:
        raise ValueError(f"chunk_nbytes for {len(self._nbytes)} chunks, hits for {self.num_chunks}")
    if any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in self._nbytes):
      raise ValueError(f"chunk_nbytes must be ints >= 0, got {chunk_nbytes!r}")
    self._in_flight: dict[int, LoadInFlight] = {}   # issue order
    # Layer-split chunks: chunk -> k (compute owns layers [0, k), the load [k, L)).
    self._split: dict[int, int] = {}
    self._frontier = 0
    self._cancelled = False
    self._writers = bytearray(num_prompt_tokens) if check_writes else None
    if self._writers is not None and resident:
      self._writers[:resident * chunk_size] = bytes([Writer.LOAD]) * (resident * chunk_size)
    self.trace = MergeTrace(num_chunks=self.num_chunks, meeting_index=self.num_chunks)
    # Compute share: cost-model seconds of this request's compute per wall second of a step.
    self._pace = ComputeShare(compute_share_prior, chunk_size)
    self._load_busy_since_s: float | None = None
    self._last_landing_s = -math.inf
    self._first_issue_s: float | None = None
    self._cold_wait_until_s: float | None = None
    # Joint planning (`kvjax/scheduler/cake_joint.py`): when compute and the link are free of
    # the restoring requests ahead of this one (engine clock; -inf: planned alone).
    self._compute_free_s = -math.inf
    self._link_free_s = -math.inf
    self._planned_meeting = self.num_chunks

  # ---------------------------------------------------------------------------- views
  def unit_tokens(self, index: int) -> int:
    """Tokens of prefix unit `index`: C, or m for a stored tail (`last_unit_tokens`)."""
    return self._end(index) - index * self.chunk_size

  def _end(self, j: int) -> int:
    """The position after prefix unit `j`."""
    return min((j + 1) * self.chunk_size, self.prefix_tokens)

  @property
  def frontier(self) -> int:
    """First prompt position not yet resident or planned; `[0, frontier)` is all present."""
    self._advance()
    return self._frontier

  @property
  def states(self) -> tuple[ChunkState, ...]:
    return tuple(self._states)

  @property
  def keeps_writers(self) -> bool:
    """Whether it keeps a per-position writer map (`check_writes`)."""
    return self._writers is not None

  @property
  def in_flight(self) -> tuple[int, ...]:
    """Chunks whose loads were issued and have not finished, in issue order."""
    return tuple(self._in_flight)

  @property
  def compute_share(self) -> float:
    """Estimated fraction of a step's wall time this request's compute gets."""
    return self._pace.share

  @property
  def is_prefix_done(self) -> bool:
    """Every prefix chunk is resident or planned for compute (a layer-split chunk: its low
    layers planned and its high layers inserted)."""
    return self.frontier >= self.prefix_tokens and self._split_waiting() is None

  def split_layers(self, index: int) -> int:
    """k of chunk `index` when it is split along layers (compute owns layers `[0, k)`, its load
    `[k, L)`); 0 when it is not."""
    return self._split.get(index, 0)

  def compute_layers(self, start: int) -> int | None:
    """The layers a compute step `next_compute` returned at `start` runs: k for a piece of a
    layer-split chunk (its forward stops after layer k - 1; its K and V above are not the
    prompt's), None for a full-depth step."""
    if start >= self.prefix_tokens:
      return None
    k = self._split.get(start // self.chunk_size)
    return k or None

  def load_layer_start(self, index: int) -> int:
    """The first layer the load of chunk `index` in flight reads (0: the whole chunk).

    Raises:
      ValueError: if chunk `index` has no load in flight.
    """
    return self._load_in_flight(index).layer_start

  def load_nbytes(self, index: int) -> int:
    """Stored bytes the load of chunk `index` in flight moves (of its layers only).

    Raises:
      ValueError: if chunk `index` has no load in flight.
    """
    return self._load_in_flight(index).nbytes

  def _load_in_flight(self, index: int):
    load = self._in_flight.get(index)
    if load is None:
      raise ValueError(f"chunk {index} has no load in flight")
    return load

  def _split_waiting(self) -> int | None:
    """A layer-split chunk whose low layers compute has planned (the frontier is past it)
    and whose high layers are not inserted yet: every position above it waits for it (a
    full-depth step reads its high layers)."""
    for j in self._split:
      if self._end(j) <= self._frontier and self._states[j] is not ChunkState.RESIDENT:
        return j
    return None

  @property
  def is_done(self) -> bool:
    """Every prompt position is resident or planned."""
    return self.frontier >= self.num_prompt_tokens

  def tokens_left_after_loads(self) -> int:
    """Prompt tokens compute still has to cover once every stored chunk still to come (not yet
    loaded, in flight, or landed and not inserted) is resident: the suffix and the holes
    (`MISSING` chunks) past the frontier."""
    p = self.frontier
    covered = sum(self.unit_tokens(j) for j, s in enumerate(self._states)
                  if s is not ChunkState.MISSING and j * self.chunk_size >= p)
    return self.num_prompt_tokens - p - covered

  @property
  def has_loads_to_come(self) -> bool:
    """Some stored chunk is still to be loaded or in flight (not cancelled)."""
    return not self._cancelled and any(s in (ChunkState.HIT, ChunkState.LOADING)
                                       for s in self._states)

  def loads_land_s(self, now_s: float, cost: CostModel, *,
                   overdue_lands_now: bool = False) -> float | None:
    """Predicted time (engine clock, seconds) by which every stored chunk still to come has
    landed (`_landings`' model of the link and the decoder), or None: nothing left to load.

    A load in flight past its predicted landing is overdue: the model is off for it. By
    default that is None too (no prediction: short first-token steps turn off). With
    `overdue_lands_now` it lands now, as `_landings` models it, and the rest after it: joint
    planning holds the merges behind to short steps while the merge ahead waits for that load,
    which it does at most until the load turns late (`_late_at_s`, the ski-rental bound);
    without the prediction, the first step of an overdue load went to a merge behind, whole.
    """
    if not self.has_loads_to_come:
      return None
    land, _ = self._landings(now_s, cost)
    if not land or (not overdue_lands_now and any(land[j] <= now_s for j in self._in_flight)):
      return None
    return max(now_s, *land.values())

  def load_encoding(self, index: int) -> Candidate | None:
    """The encoding `next_load` chose for chunk `index` (None without `encodings`)."""
    load = self._in_flight.get(index)
    if load is None:
      raise ValueError(f"chunk {index} has no load in flight")
    return load.encoding

  def writer_map(self) -> list[Writer]:
    """Who wrote each prompt position (compute at planning, load at `inserted`).

    Raises:
      ValueError: if the merge was built with `check_writes=False`.
    """
    if self._writers is None:
      raise ValueError("this merge keeps no writer map (check_writes=False)")
    return [Writer(w) for w in self._writers]

  def chunk_writers(self) -> str:
    """One letter per prefix chunk: C compute, L load, S split along layers (compute's low
    layers, the load's high ones), . nobody yet, ! mixed (a bug)."""
    out, writers = [], self.writer_map()
    for j in range(self.num_chunks):
      seg = set(writers[j * self.chunk_size:self._end(j)])
      out.append({frozenset({Writer.COMPUTE}): "C", frozenset({Writer.LOAD}): "L",
                  frozenset({Writer.SPLIT}): "S",
                  frozenset({Writer.NONE}): "."}.get(frozenset(seg), "!"))
    return "".join(out)

  def outlook(self, cost: CostModel, share: float) -> tuple[list[float], list[float], float]:
    """What is left of the prefix, priced for `cake_forecast.split_at` at compute share `share`
    (in (0, 1]: the fraction of a step's wall time compute gets).

    Returns:
      Per prefix unit from the compute frontier's up, seconds to compute it (0: resident or
      landed) and seconds it holds the link if loaded (0: resident or landed; `math.inf`: a
      hole, or the unit compute has begun); and the suffix's compute seconds.
    """
    p, c = self.frontier, self.chunk_size
    a, b, k = cost.compute_coefficients  # t(n, s) = a + b n + k n (s + (n - 1) / 2)
    load_s_per_byte = max(cost.transfer_s_per_byte, cost.decode_s_per_byte)
    compute_s, load_s = [], []
    for j in range(p // c, self.num_chunks if p < self.prefix_tokens else 0):
      s = self._states[j]
      lo = max(p, j * c)
      if s in (ChunkState.RESIDENT, ChunkState.LANDED):
        compute_s.append(0.0)
        load_s.append(0.0)
        continue
      n = self._end(j) - lo
      compute_s.append(max(1e-9, a + b * n + k * n * (lo + (n - 1) / 2)) / share)
      loadable = (s in (ChunkState.HIT, ChunkState.LOADING) and lo == j * c
                  and not self._cancelled)
      load_s.append(self._nbytes[j] * load_s_per_byte if loadable else math.inf)
    start = max(p, self.prefix_tokens)
    return compute_s, load_s, cost.predict_compute_s(start, self.num_prompt_tokens - start) / share

  def set_backlog(self, compute_free_s: float, link_free_s: float,
                  meeting_index: int | None = None) -> None:
    """Joint planning (`kvjax/scheduler/cake_joint.py`): this step, the merge's compute is
    free of the restoring requests ahead of it at `compute_free_s` and the shared link at
    `link_free_s` (engine clock, seconds). Its forecasts start its stored chunks' transfers no
    earlier than `link_free_s` and its compute no earlier than `compute_free_s`.
    `(-inf, -inf)`: planned alone (the default).

    `meeting_index`: the joint plan's first loaded chunk for this merge (None: `num_chunks`,
    none). While behind (`compute_free_s` after the step's time), its compute leaves no chunk
    at or above it part-computed: a piece that fits a gap in the others' steps (32 tokens of a
    256-token chunk) would leave the chunk's rest to this merge's last step, on its first
    token's path, where the chunk's load would have landed in time (four restores on a busy
    2-core VM: 0.9 s more on that step)."""
    self._compute_free_s = float(compute_free_s)
    self._link_free_s = float(link_free_s)
    self._planned_meeting = self.num_chunks if meeting_index is None else int(meeting_index)

  # ---------------------------------------------------------------------------- loads
  def expect_budget(self, budget_tokens: int, chunk_sizes: Sequence[int], now_s: float) -> None:
    """Tells the merge, before its loads are planned, the budget its compute will be offered in
    the step at `now_s` (at most; `next_compute` gets the exact one).

    `next_load` skips a load that compute would finish first, judged at the merge's compute
    share. Before the first `next_compute` that share is unknown: without this call the first
    step's loads are judged at a full share while compute then runs at its real one (64 of 512
    tokens: 1/8), so a load skipped as too slow is one compute then waits for, a whole step.

    Args:
      budget_tokens: tokens the merge's compute may take this step, >= 0.
      chunk_sizes: the compiled chunk sizes, ascending.
      now_s: the step's time (engine clock, seconds).
    """
    if budget_tokens < 0 or not chunk_sizes:
      raise ValueError(f"expect_budget({budget_tokens!r}, {chunk_sizes!r}): need a budget >= 0 "
                       "and chunk sizes")
    self._pace.begin_step(now_s)
    self._pace.offered(budget_tokens, chunk_sizes)

  def next_load(self, now_s: float, cost: CostModel) -> int | None:
    """The next chunk to fetch: the highest-index chunk still only stored; marks it LOADING.

    Call it whenever a load finishes and between steps, until it returns None, for every request
    with a merge, queued ones included (loads need no slot; INSERT-verdict chunks wait, staged,
    until the request holds one). With `encodings`, `load_encoding(index)` says which to fetch:
    the most accurate that lands before compute would finish the chunk (or by the TTFT target's
    share), else the smallest (`level_policy.pick_encoding`).

    Args:
      now_s: engine clock, seconds.
      cost: the engine's cost model.

    Returns:
      The chunk index, or None: no stored chunk is left, `max_loads_in_flight` loads are in
      flight, the mode loads nothing, or (CAKE) the load could not land before compute would
      finish that chunk (then no lower chunk could either).
    """
    if self._cancelled or self.mode is MergeMode.COMPUTE_ONLY:
      return None
    if len(self._in_flight) >= self.max_loads_in_flight:
      return None
    index = next((j for j in reversed(range(self.num_chunks))
                  if self._states[j] is ChunkState.HIT), None)
    if index is None:
      return None
    nbytes = self._nbytes[index]
    encoding = None
    layers = 0
    if self.mode is MergeMode.CAKE:
      land, start = self._landings(now_s, cost)
      deadline = self._compute_until_s(index, now_s, cost, finish=True)
      sliced = self._sliceable(index)
      if sliced is not None and self._is_meeting(index, land, now_s, cost):
        # The layer axis: the meeting chunk may load only its layers [k, L).
        full, sliced_encoding = sliced
        land_full = start[index] + (land[index] - start[index]) * (full / nbytes if nbytes
                                                                   else 1.0)
        # A step's wall time; while compute waits, a landing is seen at the end of a step of
        # the others' work (its share of it).
        share = self._pace.share
        step_s = cost.predict_compute_s(self._frontier, self._pace.step_tokens) / share
        _, layers = layer_split.best_layers(
            self._compute_until_s(index, now_s, cost, finish=False), deadline, start[index],
            land_full, self.num_layers, self.layer_split_points, share, step_s * (1 - share))
        if layers == self.num_layers:
          layers = 0  # no split pays: token-only Cake decides, below
        if layers and (len(self._in_flight) > 1 or start[index] - now_s > step_s):
          # A split is decided when the link reaches the chunk, on the rates of that step, and
          # with at most one load of this merge ahead of it: every position above the chunk
          # waits for its high layers, so they must move next (decided at arrival behind six
          # queued loads on a stale link rate, they moved last and compute sat idle: 4.67 s
          # against token-only's 2.94 s, 2,048 tokens at B*, the real engine).
          return None
        if layers:
          encoding = sliced_encoding
          nbytes = layer_split.split_nbytes(full, self.num_layers, layers)
      if not layers and land[index] >= deadline:
        return None
      link_free_s = start[index]
    else:
      deadline, link_free_s = math.inf, now_s
    cands = self._encodings[index] if self._encodings is not None else None
    if cands and not layers:
      if self.kv_ttft_target_s is not None:
        left = sum(s is ChunkState.HIT for s in self._states)
        deadline = level_policy.ttft_deadline_s(now_s, self.arrival_s, self.kv_ttft_target_s, left)
      encoding = level_policy.pick_encoding(cands, cost.bandwidth_bytes_per_s,
                                            cost.decode_bytes_per_s, link_free_s, deadline)
      nbytes = encoding.nbytes
    if not self._in_flight:
      self._load_busy_since_s = now_s
    if self._first_issue_s is None:
      self._first_issue_s = now_s
    self._in_flight[index] = LoadInFlight(now_s, nbytes, encoding, layers)
    self._states[index] = ChunkState.LOADING
    self.trace.loads_issued += 1
    if layers:
      self._split[index] = layers
      self.trace.layer_splits[index] = layers
    return index

  def _sliceable(self, index: int) -> tuple[int, Candidate | None] | None:
    """(whole stored bytes, encoding) chunk `index` may be split along layers with (a merge
    without encodings takes its `chunk_nbytes` as raw: encoding None), or None: no layer axis
    for it (off, a stored tail, one split per merge, no layer-sliceable copy, or planned
    jointly with other restoring requests: the joint plan's backlogs price token-only merges,
    and a split priced against them landed late and was wasted in the simulator)."""
    if not self.layer_split_points or self._split or (
        self._end(index) - index * self.chunk_size != self.chunk_size):
      return None
    if self._compute_free_s > -math.inf or self._link_free_s > -math.inf:
      return None
    if self._encodings is None:
      return self._nbytes[index], None
    cand = next((e for e in self._encodings[index] or () if e.layer_sliceable), None)
    return None if cand is None else (cand.nbytes, cand)

  def _is_meeting(self, index: int, land: dict[int, float], now_s: float,
                  cost: CostModel) -> bool:
    """Whether chunk `index`, the next load, is where compute and loads meet: the chunk below
    it is not one a load would land before compute finishes it (a hole, compute's already, or
    too late for the link)."""
    below = index - 1
    if below < 0 or self._states[below] is not ChunkState.HIT:
      return True
    return land[below] >= self._compute_until_s(below, now_s, cost, finish=True)

  def load_done(self, index: int, ok: bool, nbytes: int, now_s: float,
                level: Hashable | None = None) -> LoadVerdict:
    """A load finished (read, verified, decoded and staged, or failed).

    Args:
      index: the chunk `next_load` returned.
      ok: the chunk passed verification (token ids, checksum) and decoded.
      nbytes: stored bytes that were transferred.
      now_s: engine clock, seconds.
      level: the encoding level that was read (recorded in the trace); defaults to the name of
        the encoding `next_load` chose.

    Returns:
      INSERT: insert the unit at positions `[index * C, index * C + unit_tokens(index))` before
      the next step, then call `inserted(index)`. WASTED: drop it (compute owns the chunk, or the request was
      cancelled); its bytes count as wasted. REJECTED: drop it; compute will fill the hole.

    Raises:
      ValueError: if chunk `index` has no load in flight.
    """
    load = self._in_flight.pop(index, None)
    if load is None:
      raise ValueError(f"chunk {index} has no load in flight")
    self._last_landing_s = max(self._last_landing_s, now_s)
    if not self._in_flight and self._load_busy_since_s is not None:
      self.trace.load_s += max(0.0, now_s - self._load_busy_since_s)
      self._load_busy_since_s = None
    state = self._states[index]
    if self._cancelled or state in (ChunkState.COMPUTING, ChunkState.COMPUTED):
      self.trace.chunks_wasted.append(index)
      self.trace.wasted_bytes += nbytes
      return LoadVerdict.WASTED
    if not ok:
      self._states[index] = ChunkState.MISSING
      self.trace.chunks_rejected.append(index)
      self._unsplit(index)
      return LoadVerdict.REJECTED
    self._states[index] = ChunkState.LANDED
    self.trace.levels[index] = level if level is not None else (
        load.encoding.name if load.encoding is not None else None)
    self.trace.loaded_bytes += nbytes
    return LoadVerdict.INSERT

  def load_dropped(self, index: int, now_s: float) -> None:
    """A load the planner released before it started (compute took its chunk) never ran: it
    leaves the in-flight set without counting as waste (no byte moved).

    Raises:
      ValueError: if chunk `index` has no load in flight.
    """
    if self._in_flight.pop(index, None) is None:
      raise ValueError(f"chunk {index} has no load in flight")
    self.trace.chunks_released.append(index)
    if not self._in_flight and self._load_busy_since_s is not None:
      self.trace.load_s += max(0.0, now_s - self._load_busy_since_s)
      self._load_busy_since_s = None
    if self._states[index] is ChunkState.LOADING:
      self._states[index] = ChunkState.HIT

  def inserted(self, index: int) -> None:
    """The engine inserted chunk `index` (after an INSERT verdict); it is now RESIDENT.

    Raises:
      ValueError: if the chunk is not LANDED.
      DoubleWriteError: if any of its positions was already written.
    """
    if not 0 <= index < self.num_chunks or self._states[index] is not ChunkState.LANDED:
      raise ValueError(f"chunk {index} was not landed (state "
                       f"{self._states[index].value if 0 <= index < self.num_chunks else '-'})")
    if index in self._split:  # its high layers: compute writes (or wrote) its low ones
      self._write(index * self.chunk_size, self._end(index), Writer.SPLIT, Writer.SPLIT)
    else:
      self._write(index * self.chunk_size, self._end(index), Writer.LOAD)
    self._states[index] = ChunkState.RESIDENT
    self.trace.chunks_loaded.append(index)
    self.trace.meeting_index = min(self.trace.meeting_index, index)
    self._advance()

  def cancel(self) -> list[int]:
    """Stops the merge (request aborted or finished). Idempotent.

    Returns:
      Chunks whose staging the engine should release: loads still in flight (their `load_done`
      will say WASTED) and landed chunks not yet inserted (never insert them).
    """
    self._cancelled = True
    landed = [j for j, s in enumerate(self._states) if s is ChunkState.LANDED]
    return sorted(set(self._in_flight) | set(landed))

  def recheck_s(self, now_s: float, cost: CostModel) -> float | None:
    """The next time after `now_s` at which compute may go on without any load landing (a late
    load's grace runs out, or a cold-start wait ends), else None.

    An engine whose step plans nothing should wait for the next finished load, but no longer
    than this.
    """
    times = list(self._late_at_s(cost).values())
    if self._cold_wait_until_s is not None and self._in_flight:
      times.append(self._cold_wait_until_s)
    times = [t for t in times if t > now_s]
    return min(times) if times else None

  # ---------------------------------------------------------------------------- compute
  def next_compute(self, budget_tokens: int, chunk_sizes: Sequence[int], now_s: float,
                   cost: CostModel) -> tuple[int, int] | None:
    """The next compute step of this request within `budget_tokens`, or None.

    The scheduler calls it once per step with the budget left after decodes and ordinary
    prefills (even 0, so the merge can measure its compute share), and again with what is left
    while it returns steps. A returned step is planned: its positions are compute's.

    Args:
      budget_tokens: tokens this request may compute in this step, >= 0.
      chunk_sizes: the compiled chunk sizes, ascending.
      now_s: the step's time (engine clock, seconds); equal across the calls of one step.
      cost: the engine's cost model.

    Returns:
      (start, num_tokens): prefill positions `[start, start + num_tokens)`; it is the prompt's
      last step when `start + num_tokens == num_prompt_tokens`. num_tokens is a compiled size,
      or a shorter piece the runner pads (a prompt tail, or up to a chunk boundary when C is not
      a multiple of the sizes). None: nothing fits the budget, the prompt is planned, or compute
      waits for loads.

    Raises:
      ValueError: on a negative budget or chunk sizes that are not ascending positive ints.
    """
    if isinstance(budget_tokens, bool) or not isinstance(budget_tokens, int) or budget_tokens < 0:
      raise ValueError(f"budget_tokens={budget_tokens!r} must be an int >= 0")
    sizes = list(chunk_sizes)
    if not sizes or sizes != sorted(set(sizes)) or sizes[0] < 1:
      raise ValueError(f"chunk_sizes={chunk_sizes!r} must be ascending distinct ints >= 1")
    self._pace.begin_step(now_s)
    self._pace.offered(budget_tokens, sizes)
    if budget_tokens < sizes[0] and self._compute_free_s > now_s:
      self._pace.queued()  # others' compute goes first (joint planning): not its share
    if self._cancelled:
      return None
    self._advance()
    waiting = self._split_waiting()
    if waiting is not None:
      if now_s < self._late_at_s(cost).get(waiting, math.inf):
        return self._wait()  # every position above waits for its high layers
      self._unsplit(waiting)  # late: compute takes it whole; its load will be wasted
      self._advance()
    p, n, c = self._frontier, self.num_prompt_tokens, self.chunk_size
    if p >= n:
      return None
    if p < self.prefix_tokens and p // c in self._split:
      return self._next_low_piece(p, budget_tokens, sizes, cost)
    if self.mode is MergeMode.LOAD_ONLY and any(
        s in (ChunkState.HIT, ChunkState.LOADING, ChunkState.LANDED) for s in self._states):
      return self._wait()
    hard = n  # compute never passes a resident or landed chunk
    if p < self.prefix_tokens:
      f = p // c
      if p % c == 0 and self._states[f] is ChunkState.LANDED:
        return self._wait()
      for j in range(f + 1 if p % c else f, self.num_chunks):
        if self._states[j] in (ChunkState.RESIDENT, ChunkState.LANDED) or j in self._split:
          hard = j * c
          break
    room = min(hard - p, budget_tokens)
    cands = [s for s in reversed(sizes) if s <= room]
    if p < self.prefix_tokens and p % c:
      to_end = self._end(p // c) - p
      if to_end <= room and to_end not in cands:
        cands.append(to_end)   # up to the chunk boundary, padded by the runner
    if hard - p < sizes[0] and hard - p <= budget_tokens and hard - p not in cands:
      cands.append(hard - p)   # a tail shorter than every size, padded by the runner
    if not cands:
      return None              # the budget is too small for any step: not a wait
    t0 = max(now_s, self._pace.busy_until_s)
    for k in cands:
      end = p + k
      if end < self.prefix_tokens and (end - 1) // c != p // c and end % c:
        continue               # crossing a chunk boundary inside the prefix must end on one
      if (end < self.prefix_tokens and end % c and self._compute_free_s > now_s
          and (end - 1) // c >= self._planned_meeting):
        continue               # behind others (joint), no chunk the plan loads is left part-
                               # computed: its rest would wait for this merge's last step
      if self.mode is MergeMode.CAKE and not self._step_ok(p, end, k, t0, now_s, cost):
        continue
      self._plan(p, k, cost)
      return (p, k)
    return self._wait()

  # ---------------------------------------------------------------------------- internals
  def _next_low_piece(self, p: int, budget_tokens: int, sizes: list[int],
                      cost: CostModel) -> tuple[int, int] | None:
    """The next piece of a layer-split chunk's low layers from `p` (inside the chunk): the
    rest of the chunk when the budget holds it (padded by the runner), else the largest
    compiled size that fits; planned at k / L of a full-depth step's cost."""
    j = p // self.chunk_size
    to_end = self._end(j) - p
    if to_end <= budget_tokens:
      k = to_end
    else:
      fit = [s for s in sizes if s <= budget_tokens]
      if not fit:
        return None
      k = fit[-1]
    self._write(p, p + k, Writer.SPLIT, Writer.SPLIT)
    self._frontier = p + k
    pred = cost.predict_compute_s(p, k) * self._split[j] / self.num_layers
    self.trace.compute_s += pred
    self._pace.planned(pred)
    return (p, k)

  def _wait(self) -> None:
    self._pace.waited()
    return None

  def _plan(self, start: int, k: int, cost: CostModel) -> None:
    end, c = start + k, self.chunk_size
    for j in range(start // c, min(self.num_chunks, (end - 1) // c + 1)):
      if self._end(j) <= start:
        continue  # the suffix starts after a stored tail, inside its chunk
      s = self._states[j]
      if s not in (ChunkState.COMPUTING, ChunkState.COMPUTED):
        self.trace.chunks_computed.append(j)
      self._states[j] = ChunkState.COMPUTED if end >= self._end(j) else ChunkState.COMPUTING
    self._write(start, end, Writer.COMPUTE)
    self._frontier = end
    pred = cost.predict_compute_s(start, k)
    self.trace.compute_s += pred
    self._pace.planned(pred)

  def _write(self, start: int, end: int, who: Writer, may_find: Writer = Writer.NONE) -> None:
    """Marks `[start, end)` written by `who`; raises `DoubleWriteError` where a position holds
    a writer other than NONE or `may_find` (a layer-split chunk's two sides each write SPLIT,
    over disjoint layers)."""
    if self._writers is None:
      return
    seg = self._writers[start:end]
    if may_find is not Writer.NONE:
      seg = seg.replace(bytes([may_find]), b"\0")
    if any(seg):
      first = next(i for i, w in enumerate(seg) if w)
      raise DoubleWriteError(
          f"position {start + first} written by {Writer(seg[first]).name} and again by "
          f"{who.name} (positions [{start}, {end}))")
    self._writers[start:end] = bytes([who]) * (end - start)

  def _advance(self) -> None:
    c = self.chunk_size
    while (self._frontier < self.prefix_tokens and self._frontier % c == 0
           and self._states[self._frontier // c] is ChunkState.RESIDENT
           and self._frontier // c not in self._split):  # a split chunk's low layers: compute's
      self._frontier = self._end(self._frontier // c)

  def _unsplit(self, index: int) -> None:
    """Chunk `index` is no longer split along layers (its high layers' load failed or is late):
    compute takes it whole, from its start (the positions above it waited for it, so nothing
    past it was planned; its low layers are computed again, to the same values)."""
    if self._split.pop(index, None) is None:
      return
    start = index * self.chunk_size
    if self._writers is not None:
      self._writers[start:self._end(index)] = bytes(self._end(index) - start)
    self._frontier = min(self._frontier, start)

  def _late_at_s(self, cost: CostModel) -> dict[int, float]:
    """When each in-flight load turns late (`cake_forecast.late_at_s`)."""
    return cake_forecast.late_at_s(self._in_flight, self._last_landing_s, self.late_factor,
                                   self._pace.share, self.chunk_size, self.prefix_tokens, cost)

  def _landings(self, now_s: float, cost: CostModel) -> tuple[dict[int, float], dict[int, float]]:
    """Predicted landing and transfer-start times of in-flight loads and of stored chunks
    (`cake_forecast.landings`)."""
    return cake_forecast.landings(now_s, cost, self._in_flight, self._last_landing_s,
                                  self.max_loads_in_flight, self._states, self._nbytes,
                                  self._link_free_s)

  def _compute_until_s(self, index: int, now_s: float, cost: CostModel, finish: bool) -> float:
    """When compute would start (finish=False) or finish chunk `index`, computing every position
    from the frontier that is not resident, landed or loading on time."""
    c = self.chunk_size
    end = self._end(index) if finish else index * c
    total, run_start, p = 0.0, None, self.frontier
    late = self._late_at_s(cost)
    for j in range(p // c, end // c + (1 if end % c else 0)):
      lo, hi = max(p, j * c), min(end, (j + 1) * c)
      if lo >= hi:
        continue
      s = self._states[j]
      skip = j != index and (s in (ChunkState.RESIDENT, ChunkState.LANDED) or (
          s is ChunkState.LOADING and now_s < late[j]))
      if j in self._split:  # its low layers only
        skip = True
        part = cake_forecast.span_s(lo, hi, self._pace.step_tokens, cost)
        total += part * layer_split.low_fraction(self._split[j], self.num_layers,
                                                 self._pace.share)
      if skip:
        if run_start is not None:
          total += cake_forecast.span_s(run_start, lo, self._pace.step_tokens, cost)
          run_start = None
      elif run_start is None:
        run_start = lo
    if run_start is not None:
      total += cake_forecast.span_s(run_start, end, self._pace.step_tokens, cost)
    return max(now_s, self._pace.busy_until_s, self._compute_free_s) + total / self._pace.share

  def _step_ok(self, p: int, end: int, k: int, t0: float, now_s: float, cost: CostModel) -> bool:
    """Whether compute should take every chunk the step `[p, end)` touches: it must finish each
    such chunk before that chunk's load (in flight or still to issue) would land."""
    c = self.chunk_size
    if not cost.load_rate_known:
      # Cold start: wait for the first landing (it calibrates the link) for at most one
      # compute step, then compute without waiting on a guess.
      if not self._in_flight or self._first_issue_s is None:
        return True
      f = p // c
      if f >= self.num_chunks or self._states[f] not in (ChunkState.HIT, ChunkState.LOADING):
        return True
      self._cold_wait_until_s = (self._first_issue_s
                                 + cost.predict_compute_s(p, k) / self._pace.share)
      return now_s >= self._cold_wait_until_s
    land = None
    late = self._late_at_s(cost)
    link_late = any(now_s >= t for t in late.values())
    order = list(self._in_flight)
    first_late = next((i for i, j in enumerate(order) if now_s >= late[j]), len(order))
    behind_late = set(order[first_late + 1:])
    for j in range(p // c, min(self.num_chunks, (end - 1) // c + 1)):
      s = self._states[j]
      if (s is ChunkState.HIT and link_late) or j in behind_late:
        continue  # queued behind a late load: its landing is anyone's guess
      if s not in (ChunkState.HIT, ChunkState.LOADING):
        continue
      if s is ChunkState.LOADING and now_s >= late[j]:
        continue  # late: compute takes it, the load will be wasted
      if land is None:
        land = self._landings(now_s, cost)[0]
      # A step lands atomically: a chunk inside it is done when the whole step is. Planned
      # jointly, the rest of a chunk this step leaves waits for the compute of the requests
      # ahead (`set_backlog`).
      finish = t0 + cake_forecast.span_s(p, max(end, self._end(j)), k, cost) / self._pace.share
      if end < self._end(j) and self._compute_free_s > t0:
        finish = (max(t0 + cake_forecast.span_s(p, end, k, cost) / self._pace.share,
                      self._compute_free_s)
                  + cake_forecast.span_s(end, self._end(j), k, cost) / self._pace.share)
      if land[j] < finish:
        return False
    return True
