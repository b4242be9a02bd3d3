"""Which stored encoding of a chunk to fetch: CacheGen's bandwidth adaptation.

CacheGen (arXiv 2310.07240, section 5.3 and Appendix C.1) stores each chunk at several encoding
levels and, before streaming a chunk, picks the most accurate level whose transfer fits the time
left. Here the planner (`kvjax.scheduler.cake.CakeMerge`) has already decided that the chunk is
loaded rather than computed, so the policy only chooses among encodings:

  * the most accurate candidate that lands by the deadline, else
  * the smallest candidate (the fastest to land; quality as a tie-break).

A chunk "lands" `load_time_s` after `now_s`: the loader pipeline overlaps the transfer of one chunk
with the decode of the previous, so a chunk costs `max(transfer, decode)` seconds. Landing exactly
at the deadline counts as in time.

Two deadlines:
  * default (Cake): the time compute is predicted to reach the chunk; a load landing by then never
    makes compute wait;
  * TTFT target (`kv_ttft_target_s`, CacheGen's SLO): the time left until `arrival_s +
    kv_ttft_target_s`, shared evenly among the chunks still to load (`ttft_deadline_s`).

Plain functions over plain data; no JAX, no storage types (the engine maps the store's
`Encoding` records to `Candidate`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Hashable, Sequence


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One stored encoding of a chunk.

  Attributes:
    name: the encoding's id as the engine knows it (a `kvjax.codecs.EncodingId`, e.g.
      EncodingId("cachegen", 2)); opaque and hashable here.
    nbytes: stored bytes to transfer, >= 0.
    quality_rank: 0 is the most accurate; larger is coarser. Ranks need not be contiguous.
    layer_sliceable: its bytes divide evenly by layer and layers `[k, L)` can be read and
      inserted alone (raw): a Cake merge may split its chunk along layers
      (`kvjax/scheduler/layer_split.py`).
  """

  name: Hashable
  nbytes: int
  quality_rank: int
  layer_sliceable: bool = False

  def __post_init__(self):
    if isinstance(self.nbytes, bool) or not isinstance(self.nbytes, int) or self.nbytes < 0:
      raise ValueError(f"Candidate {self.name!r}: nbytes={self.nbytes!r} must be an int >= 0")
    if isinstance(self.quality_rank, bool) or not isinstance(self.quality_rank, int):
      raise ValueError(f"Candidate {self.name!r}: quality_rank={self.quality_rank!r} must be an int")


def _check_rates(bandwidth_bytes_per_s: float, decode_bytes_per_s: float) -> None:
  if not bandwidth_bytes_per_s > 0:
    raise ValueError(f"bandwidth_bytes_per_s={bandwidth_bytes_per_s!r} must be > 0")
  if not decode_bytes_per_s > 0:
    raise ValueError(f"decode_bytes_per_s={decode_bytes_per_s!r} must be > 0 (math.inf: free)")


def load_time_s(nbytes: int, bandwidth_bytes_per_s: float,
                decode_bytes_per_s: float = math.inf) -> float:
  """Seconds one chunk occupies the loader pipeline: `max(transfer, decode)`.

  Args:
    nbytes: stored bytes of the chunk.
    bandwidth_bytes_per_s: link bandwidth, bytes/s, > 0.
    decode_bytes_per_s: host decode rate in stored bytes/s, > 0; `math.inf` for raw chunks.

  Raises:
    ValueError: on a non-positive rate.
  """
  _check_rates(bandwidth_bytes_per_s, decode_bytes_per_s)
  return max(nbytes / bandwidth_bytes_per_s, nbytes / decode_bytes_per_s)


def _smallest(candidates: Sequence[Candidate]) -> Candidate:
  return min(candidates, key=lambda c: (c.nbytes, c.quality_rank))


def pick_encoding(candidates: Sequence[Candidate], bandwidth_bytes_per_s: float,
                  decode_bytes_per_s: float, now_s: float, deadline_s: float) -> Candidate:
  """The most accurate candidate landing by `deadline_s`, else the smallest.

  CacheGen, arXiv 2310.07240, section 5.3: pick the level for the next chunk from the measured
  bandwidth and the time left.

  Args:
    candidates: the chunk's encodings, any order (ties in rank: fewer bytes first).
    bandwidth_bytes_per_s: measured link bandwidth, bytes/s.
    decode_bytes_per_s: measured decode rate, stored bytes/s (`math.inf`: no decode cost).
    now_s: when the chunk's transfer can start, seconds.
    deadline_s: when it must have landed, seconds (`math.inf`: most accurate always).

  Returns:
    One of `candidates`.

  Raises:
    ValueError: on no candidates or a non-positive rate.
  """
  if not candidates:
    raise ValueError("no candidate encodings to pick from")
  _check_rates(bandwidth_bytes_per_s, decode_bytes_per_s)
  for c in sorted(candidates, key=lambda c: (c.quality_rank, c.nbytes)):
    if now_s + load_time_s(c.nbytes, bandwidth_bytes_per_s, decode_bytes_per_s) <= deadline_s:
      return c
  return _smallest(candidates)


def ttft_deadline_s(now_s: float, arrival_s: float, kv_ttft_target_s: float,
                    chunks_left: int) -> float:
  """A chunk's deadline under a TTFT target: an even share of the time left.

  CacheGen, arXiv 2310.07240, Appendix C.1: with `chunks_left` chunks still to stream (this one
  included) and `arrival_s + kv_ttft_target_s - now_s` seconds left, this chunk may take
  `left / chunks_left`. Once the target has passed, the deadline is `now_s` (smallest encoding).

  Raises:
    ValueError: if `chunks_left < 1` or the target is not positive.
  """
  if isinstance(chunks_left, bool) or not isinstance(chunks_left, int) or chunks_left < 1:
    raise ValueError(f"chunks_left={chunks_left!r} must be an int >= 1")
  if not kv_ttft_target_s > 0:
    raise ValueError(f"kv_ttft_target_s={kv_ttft_target_s!r} must be > 0")
  left = arrival_s + kv_ttft_target_s - now_s
  return now_s + max(0.0, left) / chunks_left


def pick_encoding_for_ttft(candidates: Sequence[Candidate], bandwidth_bytes_per_s: float,
                           decode_bytes_per_s: float, now_s: float, arrival_s: float,
                           kv_ttft_target_s: float, chunks_left: int) -> Candidate:
  """`pick_encoding` with the TTFT-target deadline of `ttft_deadline_s`."""
  return pick_encoding(candidates, bandwidth_bytes_per_s, decode_bytes_per_s, now_s,
                       ttft_deadline_s(now_s, arrival_s, kv_ttft_target_s, chunks_left))
