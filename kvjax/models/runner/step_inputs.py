"""The host inputs of the paged runner's ragged step (`Llama.ragged_step`): a step's sequences
packed into fixed-size arrays per token bucket, the padding-only inputs a warmup compiles with,
and their abstract shapes for ahead-of-time compiles.

A step of bucket T holds S = `geometry.step_seqs(T)` sequence rows; the arrays, in the step's
argument order:

    tokens int32[T], positions int32[T], slots int32[T] (pool row p // B * B + p % B, -1 for
    padding), tables int32[S, M] (block tables, M = max_blocks_per_seq), lens int32[S]
    (tokens seen after the step), qsl int32[S + 1] (query start of each sequence),
    num_seqs int32[], and the logit rows int32[S] (each sequence's last token).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.models.runner.runner_api import RunnerGeometry, SeqChunk


@dataclasses.dataclass(frozen=True)
class PackedStep:
  """A step's sequences packed for its bucket.

  Attributes:
    bucket: T, the compiled token count.
    n_tokens: the real tokens (the rest is padding).
    arrays: (tokens, positions, slots, tables, lens, qsl, num_seqs), as the module describes.
    rows: int32[S], each sequence's last token's row (padding rows 0).
    offsets: each sequence's first row.
  """

  bucket: int
  n_tokens: int
  arrays: tuple
  rows: np.ndarray
  offsets: tuple[int, ...]


def pack_step(geometry: RunnerGeometry, seqs: Sequence[SeqChunk]) -> PackedStep:
  """Packs a step's sequences into its bucket's arrays.

  Raises:
    ValueError: no sequences, too many tokens or sequences for the compiled sizes, or a block
      table that does not cover a sequence's positions.
  """
  n_tokens, t = geometry.check_step(seqs)
  b, s_max, m = geometry.block_size, geometry.step_seqs(t), geometry.max_blocks_per_seq
  tokens = np.zeros(t, np.int32)
  positions = np.zeros(t, np.int32)
  slots = np.full(t, -1, np.int32)
  tables = np.zeros((s_max, m), np.int32)
  lens = np.zeros(s_max, np.int32)
  qsl = np.zeros(s_max + 1, np.int32)
  rows = np.zeros(s_max, np.int32)
  offsets = []
  o = 0
  for i, s in enumerate(seqs):
    n = len(s.token_ids)
    end = s.start + n
    ids = np.asarray(s.block_ids, np.int32)
    if n < 1 or s.start < 0 or end > geometry.max_seq_len or -(-end // b) > len(ids):
      raise ValueError(f"sequence {i}: positions [{s.start}, {end}) with {len(ids)} blocks of "
                       f"{b} (max_seq_len {geometry.max_seq_len})")
    pos = np.arange(s.start, end, dtype=np.int32)
    tokens[o:o + n] = s.token_ids
    positions[o:o + n] = pos
    slots[o:o + n] = ids[pos // b] * b + pos % b
    tables[i, :len(ids)] = ids
    lens[i] = end
    offsets.append(o)
    o += n
    qsl[i + 1] = o
    rows[i] = o - 1
  qsl[len(seqs) + 1:] = o
  return PackedStep(bucket=t, n_tokens=n_tokens,
                    arrays=(tokens, positions, slots, tables, lens, qsl, np.int32(len(seqs))),
                    rows=rows, offsets=tuple(offsets))


def padding_step(geometry: RunnerGeometry, t: int) -> tuple[tuple, np.ndarray]:
  """A step of bucket `t` with no real sequence (num_seqs 0, every slot -1): it compiles the
  bucket and writes nothing. Returns `(arrays, rows)` as `PackedStep`'s."""
  s_max = geometry.step_seqs(t)
  arrays = (np.zeros(t, np.int32), np.zeros(t, np.int32), np.full(t, -1, np.int32),
            np.zeros((s_max, geometry.max_blocks_per_seq), np.int32),
            np.zeros(s_max, np.int32), np.zeros(s_max + 1, np.int32), np.int32(0))
  return arrays, np.zeros(s_max, np.int32)


def step_arg_specs(geometry: RunnerGeometry, t: int, sharding) -> tuple:
  """The step's host arguments at bucket `t` (the seven arrays, then the logit rows) as
  int32 ShapeDtypeStructs on `sharding`."""
  s_max, m = geometry.step_seqs(t), geometry.max_blocks_per_seq
  shapes = ((t,), (t,), (t,), (s_max, m), (s_max,), (s_max + 1,), (), (s_max,))
  return tuple(jax.ShapeDtypeStruct(s, jnp.int32, sharding=sharding) for s in shapes)
