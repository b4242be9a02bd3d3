"""The two plain records that cross between the scheduler and the executor, one each per step.

vLLM v1's shape (`schedule()` then `update_from_output()`):

    Scheduler.schedule(now_s) ──> SchedulerOutput ──> executor runs it ──> StepResult
          ^                                                                   │
          └────────────────────── Scheduler.update(result) <─────────────────┘

`SchedulerOutput` says everything the executor does in one step, in field order: forget finished
requests, drop staged or queued loads, start loads, insert staged chunks, run decodes, run prefill
chunks, save chunks those prefills completed. `StepResult` says what happened: tokens sampled,
requests finished (and why), loads landed or failed (bytes, times), measured compute seconds.
Nothing else is shared: neither side keeps a reference to the other's objects, both records are
frozen, and every field is plain data (ints, strings, tuples, `EncodingId`-like hashables).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

from kvjax._typing import RequestId


@dataclasses.dataclass(frozen=True)
class SaveItem:
  """Store chunk `index` of the request once its positions `[index * C, (index + 1) * C)` are
  computed (they are, by the end of the prefill chunk or decode that carries this item). The
  chunk's tokens are the request's prompt followed by its output tokens.

  Attributes:
    index: the store chunk's index in the sequence (prompt, then output).
    replace: its stored copy failed verification: delete it, then write afresh.
    verify_existing: the request saw a rejected chunk, so this computed chunk's stored copy
      (a lookup hit that compute took) may be bad too: read it back and rewrite it if it is.
  """

  index: int
  replace: bool = False
  verify_existing: bool = False


@dataclasses.dataclass(frozen=True)
class PrefillChunk:
  """Prefill `num_tokens` prompt tokens of one request at positions `[start, start + num_tokens)`.

  Attributes:
    request_id: the request.
    slot: its decode slot (KV cache rows).
    start: position of the first token.
    num_tokens: tokens in this step (a compiled size, or a shorter tail the runner pads).
    is_last: the chunk completes the prompt: its logits give the first output token.
    token_ids: the `num_tokens` prompt tokens (plain data, so the executor needs no request).
    saves: store chunks whose last position is in this step and that must be saved.
    roundtrip: with consistent codecs, the store chunks this step completes: their KV passes
      through the stored encoding (encode, decode back into the cache) before the next step, so a
      computed chunk holds exactly what a loaded one would.
    num_layers: None: the full forward. k: a piece of a chunk split along layers (CacheFlow,
      arXiv 2604.25080; `kvjax/scheduler/layer_split.py`): its forward stops after layer k - 1,
      writing only layers `[0, k)` of its KV (the chunk's load brings layers `[k, L)`); it is
      never the last step, has no saves nor round trip, and its logits and its K and V above
      layer k - 1 are not the prompt's.
  """

  request_id: RequestId
  slot: int
  start: int
  num_tokens: int
  is_last: bool
  token_ids: tuple[int, ...] = dataclasses.field(default=(), compare=False)  # the request's
  saves: tuple[SaveItem, ...] = ()
  roundtrip: tuple[int, ...] = ()
  num_layers: int | None = None


@dataclasses.dataclass(frozen=True)
class DecodeItem:
  """Feed `token_id` at `position` for the request in `slot`; sample its next token.

  Attributes:
    saves: store chunks this decode completes (its position is a chunk's last): chunks of the
      generated tokens (or straddling the prompt's end), saved so the next turn of a
      conversation reuses every historical token (CachedAttention, arXiv 2403.19708, section
      3.2.2) (a step returns every token's K before RoPE).
  """

  request_id: RequestId
  slot: int
  position: int
  token_id: int
  saves: tuple[SaveItem, ...] = ()


@dataclasses.dataclass(frozen=True)
class LoadItem:
  """Fetch stored chunk `index` of a request in the background (read, verify, decode on the host,
  stage). Loads need no slot and cost no compute budget (Cake, arXiv 2410.03065, section 3).

  The executor keeps them in plan order: a tier's reads start in the order they were planned
  (a request's never before those of a request planned ahead of it), a request's loads run
  `max_in_flight` at a time, and the next starts the moment one lands, without waiting for a
  step boundary.

  Attributes:
    request_id: the owner.
    index: chunk index in the prompt.
    encoding: which stored encoding to read (the level policy's pick), or None for any.
    nbytes: its stored bytes (the planner's figure; of layers `[layer_start, L)` only).
    max_in_flight: the request's reads at once (from the link's bandwidth-delay product).
    layer_start: 0: the whole chunk. k > 0: only layers `[k, L)` (a chunk split along layers,
      `PrefillChunk.num_layers`; a layer-sliceable encoding, raw): the read and the link move
      those layers' bytes alone.
  """

  request_id: RequestId
  index: int
  encoding: Hashable | None
  nbytes: int
  max_in_flight: int
  layer_start: int = 0


@dataclasses.dataclass(frozen=True)
class InsertItem:
  """Write staged chunk `index` of a request into `slot` at `[start, start + num_tokens)` (RoPE
  applied to K there), before this step's decodes and prefills. `num_tokens` is C but for a
  stored tail (`StoredPrefix.tail_tokens`), whose first m rows alone are the request's.
  `layer_start` k > 0: the staged chunk holds layers `[k, L)` only (`LoadItem.layer_start`);
  they are written to those layers, and compute writes layers `[0, k)`."""

  request_id: RequestId
  index: int
  slot: int
  start: int
  num_tokens: int | None = None  # None: the whole chunk
  layer_start: int = 0


@dataclasses.dataclass(frozen=True)
class ForkItem:
  """A request forked from another's prompt (`n` > 1: one prefill, n decodes): after the step
  runs the parent's last prefill chunk, copy the parent's partly filled last block into the
  child's (`copies`, (source, destination) block pairs; empty when the prompt fills whole
  blocks) and sample the child's first token from the parent's last logits row, with the
  child's own generator. The child shares the parent's full blocks and decodes from then on.
  """

  parent_id: RequestId
  child_id: RequestId
  copies: tuple[tuple[int, int], ...] = ()


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
  """One step's plan, run in field order. Empty (`is_empty`) when nothing can run.

  Attributes:
    finished_request_ids: requests that ended (finished, aborted) since the last plan: the
      executor drops their loads, staging and per-request state.
    releases: (request_id, chunk index) of loads whose result is no longer wanted (compute took
      the chunk, or it was rejected): a queued load is not started, a staged one is freed.
    loads: loads to start, in order.
    inserts: staged chunks to insert now.
    decodes: one token for each decoding request.
    prefills: prefill chunks, in order.
    wait_s: with nothing to compute, the longest the executor may block waiting for a load to
      land before asking again (None: do not wait).
    block_tables: (request_id, block ids in position order) of every
      running request after this plan's allocations; block i holds positions `[iB, (i+1)B)`.
      The executor writes a request's new tokens, inserts and round trips into these blocks.
    preempted: requests preempted by this plan (their blocks were freed):
      the executor drops their loads and partial chunk pieces; they recompute later.
    device_hits: (request_id, tokens) served from the device prefix cache
      at this plan's admissions (whole blocks, shared without a copy).
    layer_groups: run this step's compute as this many layer-group calls and
      insert each raw inserted chunk layer group by layer group, group g of every chunk before
      the step's tokens run through layer group g (layer-wise pre-loading, CachedAttention
      arXiv 2403.19708 section 3.2.1); 1: inserts first, then one step call.
    lookahead: the look-ahead window (CachedAttention, arXiv 2403.19708, section 3.3): ids of
      the requests that will read stored chunks next, in the order they will run: running
      requests whose merge still prefills, then the first `LoadConfig.lookahead_window` waiting
      requests with stored chunks. The executor keeps their chunks from eviction and
      prefetches them toward the host tier; () when the window is off (plain LRU).
    admitted: requests this plan admitted from the waiting queue (given a slot), in admission
      order; a preempted request appears again when it is admitted anew. The executor stamps a
      request's first admission as its `scheduled_s` (the start of its prefill wall time: the
      queueing before it is not prefill). Forked requests (`forks`) are listed too.
    forks: requests forked in this step from a parent whose last prefill chunk it runs
      (`ForkItem`), in order.
  """

  finished_request_ids: tuple[RequestId, ...] = ()
  releases: tuple[tuple[RequestId, int], ...] = ()
  loads: tuple[LoadItem, ...] = ()
  inserts: tuple[InsertItem, ...] = ()
  decodes: tuple[DecodeItem, ...] = ()
  prefills: tuple[PrefillChunk, ...] = ()
  wait_s: float | None = None
  block_tables: tuple[tuple[RequestId, tuple[int, ...]], ...] = ()
  preempted: tuple[RequestId, ...] = ()
  device_hits: tuple[tuple[RequestId, int], ...] = ()
  layer_groups: int = 1
  lookahead: tuple[RequestId, ...] = ()
  admitted: tuple[RequestId, ...] = ()
  forks: tuple[ForkItem, ...] = ()

  @property
  def num_scheduled_tokens(self) -> int:
    return len(self.decodes) + sum(c.num_tokens for c in self.prefills)

  @property
  def is_empty(self) -> bool:
    """No compute and no insert this step (loads may still be started or released)."""
    return not self.inserts and not self.decodes and not self.prefills


@dataclasses.dataclass(frozen=True)
class LoadReport:
  """A background load that finished: landed (verified, staged on the host) or failed.

  Attributes:
    request_id: the owner.
    index: chunk index in the prompt.
    ok: it passed verification (token ids, checksum) and decoded; its payload is staged.
    nbytes: stored bytes read (0 for a miss).
    tier: the tier it came from ("" for a miss).
    encoding: the encoding read (None for a miss).
    started_s: when its read started (executor clock, seconds).
    done_s: when it landed.
    link_s: seconds of link time it took: from its start or the previous landing, whichever
      is later (concurrent reads share the link), so bytes / link_s measures the link, never the
      engine's pacing. 0 when unknown.
    decode_s: host seconds spent verifying and entropy-decoding it.
    reason: why it failed (a `MissReason` value), "" when ok.
  """

  request_id: RequestId
  index: int
  ok: bool
  nbytes: int
  tier: str = ""
  encoding: Hashable | None = None
  started_s: float = 0.0
  done_s: float = 0.0
  link_s: float = 0.0
  decode_s: float = 0.0
  reason: str = ""


@dataclasses.dataclass(frozen=True)
class ComputeTiming:
  """Measured wall seconds of one prefill chunk.

  Attributes:
    start: its first position.
    num_tokens: its tokens.
    seconds: wall seconds, the device work included.
    request_id: the request ("" when unknown).
    started_s: executor clock at its start.
    includes_compile: the run compiled its program (the cost model ignores it).
    num_layers: the layers it ran (`PrefillChunk.num_layers`; None: all). The cost model
      learns full-depth steps only.
  """

  start: int
  num_tokens: int
  seconds: float
  request_id: RequestId = RequestId("")
  started_s: float = 0.0
  includes_compile: bool = False
  num_layers: int | None = None


@dataclasses.dataclass(frozen=True)
class StepTiming:
  """Measured wall seconds of one step's model call: every decode and prefill chunk in it.

  The cost model learns from it whole (`CostModel.observe_step`): one fixed cost, the tokens
  as the runner padded them, each piece's attention. Split pro rata into `ComputeTiming`s, a
  step of several pieces would count its fixed cost once per piece and its padding in none.

  Attributes:
    pieces: (start position, tokens) per decode and prefill chunk, in the call's order.
    padded_tokens: the tokens the call ran (its compiled bucket, `Runner.bucket_for`).
    seconds: wall seconds, the device work included.
    includes_compile: the call compiled its program (the cost model ignores it).
    full_depth: every piece ran all layers (False: a layer-split chunk's low layers were in
      it, `PrefillChunk.num_layers`; the cost model learns full-depth calls only).
  """

  pieces: tuple[tuple[int, int], ...]
  padded_tokens: int
  seconds: float
  includes_compile: bool = False
  full_depth: bool = True


@dataclasses.dataclass(frozen=True)
class InsertTiming:
  """Measured wall seconds of inserting one staged chunk (the device work included)."""

  request_id: RequestId
  index: int
  started_s: float
  seconds: float


@dataclasses.dataclass(frozen=True)
class StepResult:
  """What one executed step did, reported back through `Scheduler.update`.

  Attributes:
    now_s: the executor clock when the step ended, seconds.
    sampled: (request_id, token id) of every request that produced a token, in plan order.
    finished: (request_id, reason) of requests that ended at this step ("stop", "length").
    loads: loads that finished since the last step.
    compute: measured prefill timings, each chunk's share of its step pro rata to its tokens.
    inserts: measured insertion timings.
    step: the model call's timing (the cost model's observation); None when the step computed
      nothing, or from an executor that reports its chunks only (the cost model then learns
      from `compute`, each chunk as a step of its own).
    failed: (request_id, message) of requests the executor could not serve (an exception in a
      jit call); the scheduler ends them with reason "error".
  """

  now_s: float
  sampled: tuple[tuple[RequestId, int], ...] = ()
  finished: tuple[tuple[RequestId, str], ...] = ()
  loads: tuple[LoadReport, ...] = ()
  compute: tuple[ComputeTiming, ...] = ()
  inserts: tuple[InsertTiming, ...] = ()
  failed: tuple[tuple[RequestId, str], ...] = ()
  step: StepTiming | None = None


@dataclasses.dataclass(frozen=True)
class StoredChunk:
  """What one batched store lookup said about one prefix chunk (plain data for the scheduler).

  Attributes:
    tier: the tier holding it.
    candidates: its stored encodings the executor can decode, as level-policy candidates.
  """

  tier: str
  candidates: tuple = ()


@dataclasses.dataclass(frozen=True)
class StoredPrefix:
  """The lookup result of a prompt's prefix: one entry per candidate chunk (full chunks of
  `prompt[:-1]`), None where no tier holds a decodable copy.

  Attributes:
    chunk_size: C, tokens per store chunk.
    chunks: per chunk, `StoredChunk` or None.
    tail_tokens: m > 0 when the last entry is a stored tail (a session turn's history ending
      m tokens into that chunk, `keys.tail_hash`): it covers `[j * C, j * C + m)` only, and
      the full chunk there is not stored. 0: every entry is a full chunk.
  """

  chunk_size: int
  chunks: tuple[StoredChunk | None, ...]
  tail_tokens: int = 0

  def __post_init__(self):
    if self.tail_tokens and not (0 < self.tail_tokens < self.chunk_size and self.chunks
                                 and self.chunks[-1] is not None):
      raise ValueError(f"a stored tail of {self.tail_tokens} tokens must be a stored last entry "
                       f"of fewer than {self.chunk_size} tokens")

  @property
  def hits(self) -> list[bool]:
    return [c is not None for c in self.chunks]

  def is_tail(self, index: int) -> bool:
    """Whether entry `index` is the stored tail (not a full chunk)."""
    return bool(self.tail_tokens) and index == len(self.chunks) - 1

  @property
  def end(self) -> int:
    """The position after the last hit (0 without hits)."""
    last = max((j for j, c in enumerate(self.chunks) if c is not None), default=-1)
    if last < 0:
      return 0
    return last * self.chunk_size + (self.tail_tokens if self.is_tail(last) else self.chunk_size)


__all__ = ["ComputeTiming", "DecodeItem", "InsertItem", "InsertTiming", "LoadItem", "LoadReport",
           "PrefillChunk", "SaveItem", "SchedulerOutput", "StepResult", "StoredChunk",
           "StoredPrefix"]
