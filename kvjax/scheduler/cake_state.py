"""A Cake merge's state records: chunk states, load verdicts, writers and the merge's trace.

The vocabulary of `kvjax.scheduler.cake.CakeMerge` (Cake, arXiv 2410.03065, section 4): each
prefix chunk moves through `ChunkState`s (the state diagram in `kvjax/scheduler/cake.py`), a
finished load gets a `LoadVerdict`, each prompt position has one `Writer`, and `MergeTrace`
records what the merge did. Plain data, no behaviour. The merge modes (`MergeMode`) live in
`kvjax/merge_mode.py`, below every room; they are re-exported here.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Hashable

from kvjax.merge_mode import MergeMode
from kvjax.scheduler.level_policy import Candidate


class ChunkState(enum.Enum):
  HIT = "hit"                # stored; no load issued yet
  LOADING = "loading"        # load in flight (compute may still take the chunk)
  LANDED = "landed"          # verified; the engine must insert it, then call `inserted`
  RESIDENT = "resident"      # loaded and inserted
  MISSING = "missing"        # compute's: not stored, or rejected on load
  COMPUTING = "computing"    # compute owns it; some positions planned
  COMPUTED = "computed"      # compute planned all its positions


class LoadVerdict(enum.Enum):
  """What the engine does with a finished load (`CakeMerge.load_done`)."""

  INSERT = "insert"      # insert it now, then call `inserted(index)`
  WASTED = "wasted"      # compute owns the chunk (or the request was cancelled): drop it
  REJECTED = "rejected"  # verification failed: drop it; the chunk is now a hole for compute


class Writer(enum.IntEnum):
  NONE = 0
  COMPUTE = 1
  LOAD = 2
  SPLIT = 3   # a layer-split chunk: compute wrote layers [0, k), its load layers [k, L)


class DoubleWriteError(RuntimeError):
  """A position of the KV cache would be written twice (a planner bug, never user input)."""


@dataclasses.dataclass
class MergeTrace:
  """What one merge did.

  Attributes:
    num_chunks: prefix chunks N.
    chunks_computed: prefix chunks compute took, in the order taken.
    chunks_loaded: prefix chunks loaded and inserted, in insertion order.
    chunks_wasted: loads that landed after compute took their chunk or after `cancel`.
    chunks_rejected: loads that failed verification (their chunks were computed).
    chunks_released: loads released before they started (compute took the chunk first; no
      byte moved). `loads_issued` = loaded + wasted + rejected + released + still in flight.
    levels: encoding level (or name) of each loaded chunk.
    meeting_index: the first chunk that was loaded, N if none: compute wrote `[0, meeting * C)`
      up to holes above it.
    loads_issued: loads handed to the engine.
    loaded_bytes: stored bytes of inserted chunks.
    wasted_bytes: stored bytes of wasted loads.
    compute_s: cost-model seconds of every compute step planned (prefix and suffix), as predicted
      when planned.
    load_s: wall seconds during which at least one load was in flight.
    layer_splits: chunk -> k of each chunk split along layers (CacheFlow, arXiv 2604.25080):
      compute took its layers `[0, k)`, its load layers `[k, L)`.
    chunk_writers: one letter per chunk (`CakeMerge.chunk_writers`), in snapshots of a merge that
      keeps a writer map; "" otherwise.
    unwritten_positions: prompt positions nobody wrote, in such snapshots (None otherwise).
  """

  num_chunks: int
  chunks_computed: list[int] = dataclasses.field(default_factory=list)
  chunks_loaded: list[int] = dataclasses.field(default_factory=list)
  chunks_wasted: list[int] = dataclasses.field(default_factory=list)
  chunks_rejected: list[int] = dataclasses.field(default_factory=list)
  chunks_released: list[int] = dataclasses.field(default_factory=list)
  levels: dict[int, Hashable] = dataclasses.field(default_factory=dict)
  meeting_index: int = 0
  loads_issued: int = 0
  loaded_bytes: int = 0
  wasted_bytes: int = 0
  compute_s: float = 0.0
  load_s: float = 0.0
  layer_splits: dict[int, int] = dataclasses.field(default_factory=dict)
  chunk_writers: str = ""
  unwritten_positions: int | None = None



@dataclasses.dataclass
class LoadInFlight:
  """A load `CakeMerge.next_load` issued: when (engine clock, seconds), its stored bytes (of
  the layers it reads), the encoding it chose (None without encodings) and its first layer
  (0: the whole chunk; k > 0: layers `[k, L)` of a layer-split chunk)."""

  issue_s: float
  nbytes: int
  encoding: Candidate | None
  layer_start: int = 0
