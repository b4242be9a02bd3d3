"""Query tiles: the work items both Pallas kernels run over (jnp, inside the kernels' jit).

A ragged batch's flattened query rows are cut into tiles of `tq` rows that never straddle two
sequences. Tile w carries its sequence, the absolute position of its first row and how many kv
positions any of its rows can see (`kv_len`, 0 for an unused tile). The kernels read only the
pool blocks holding `[0, kv_len)`; queries travel gathered into `[W, K, tq * G, H]` so every grid
step's query block is whole trailing dims, and outputs are gathered back to `[T, N, H]`.

    query_start_loc  0     5  6       13                   (T = 16, tq = 4)
    rows             |s0...|s1|s2.....|pad|
    tiles            [s0 0:4][s0 4:5][s1 0:1][s2 0:4][s2 4:7][unused] ...   W = cdiv(T, tq) + S

A sequence adds at most one partial tile, so `W = cdiv(T, tq) + S` tiles always suffice.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from kvjax.kernels.paged_attention.reference import MASK_VALUE, cdiv


class QueryTiles(NamedTuple):
  """Per-tile metadata, each int32[W]."""
  seq: jax.Array      # sequence of the tile (0 for unused tiles)
  tok0: jax.Array     # flattened query row of the tile's first row
  pos0: jax.Array     # absolute position of the tile's first row (L - q_len + j * tq)
  kv_len: jax.Array   # kv positions [0, kv_len) are visible to some row; 0 if unused
  # Inverse map, int32[T] each: token t lives in tile tok_tile[t], row tok_row[t].
  tok_tile: jax.Array
  tok_row: jax.Array
  tok_valid: jax.Array  # bool[T]: t < query_start_loc[num_seqs]


def num_tiles(num_tokens: int, num_seqs_max: int, tq: int) -> int:
  return cdiv(num_tokens, tq) + num_seqs_max


def make_tiles(query_start_loc, context_lens, num_seqs, num_tokens: int, tq: int) -> QueryTiles:
  """Cuts the ragged query rows into tiles of tq rows; see the module docstring."""
  s_ = context_lens.shape[0]
  w_ = num_tiles(num_tokens, s_, tq)
  ns = jnp.clip(jnp.asarray(num_seqs, jnp.int32).reshape(()), 0, s_)
  seq_ok = jnp.arange(s_) < ns
  q_len = jnp.where(seq_ok, jnp.maximum(query_start_loc[1:] - query_start_loc[:-1], 0), 0)
  n_tiles = cdiv(q_len, tq)
  tile_end = jnp.cumsum(n_tiles)
  tile_start = tile_end - n_tiles
  w = jnp.arange(w_, dtype=jnp.int32)
  seq = jnp.minimum(jnp.searchsorted(tile_end, w, side="right"), s_ - 1).astype(jnp.int32)
  used = w < tile_end[-1]
  j = w - tile_start[seq]
  rows = jnp.where(used, jnp.minimum(tq, q_len[seq] - j * tq), 0)
  pos0 = context_lens[seq] - q_len[seq] + j * tq
  kv_len = jnp.where(used, jnp.maximum(pos0 + rows, 0), 0)
  tok0 = jnp.where(used, query_start_loc[seq] + j * tq, 0)

  t = jnp.arange(num_tokens, dtype=jnp.int32)
  ends = jnp.where(seq_ok, query_start_loc[1:], jnp.iinfo(jnp.int32).max)
  tok_seq = jnp.minimum(jnp.searchsorted(ends, t, side="right"), s_ - 1)
  i = t - query_start_loc[tok_seq]
  tok_valid = (t < query_start_loc[ns]) & (i >= 0)
  tok_tile = jnp.where(tok_valid, tile_start[tok_seq] + i // tq, 0).astype(jnp.int32)
  tok_row = jnp.where(tok_valid, i % tq, 0).astype(jnp.int32)
  return QueryTiles(seq, tok0.astype(jnp.int32), pos0.astype(jnp.int32),
                    kv_len.astype(jnp.int32), tok_tile, tok_row, tok_valid)


def gather_queries(q_TNH, tiles: QueryTiles, tq: int, num_kv_heads: int, group_pad: int):
  """[T, N, H] -> [W, K, tq * Gp, H], rows ordered (token, group); groups padded with zeros."""
  t_, n_, h_ = q_TNH.shape
  g_ = n_ // num_kv_heads
  idx_WQ = jnp.clip(tiles.tok0[:, None] + jnp.arange(tq), 0, t_ - 1)
  q_WQKGH = q_TNH[idx_WQ].reshape(-1, tq, num_kv_heads, g_, h_)
  q_WQKGH = jnp.pad(q_WQKGH, ((0, 0), (0, 0), (0, 0), (0, group_pad - g_), (0, 0)))
  return q_WQKGH.transpose(0, 2, 1, 3, 4).reshape(-1, num_kv_heads, tq * group_pad, h_)


def scatter_outputs(o_WKRH, tiles: QueryTiles, tq: int, num_heads: int, dtype):
  """[W, K, tq * Gp, H] -> [T, N, H] in `dtype`; rows past the real tokens are zeros."""
  w_, k_, r_, h_ = o_WKRH.shape
  gp = r_ // tq
  o_WQKGH = o_WKRH.reshape(w_, k_, tq, gp, h_).transpose(0, 2, 1, 3, 4)[:, :, :, :num_heads // k_]
  o_TKGH = o_WQKGH[tiles.tok_tile, tiles.tok_row]
  o_TKGH = jnp.where(tiles.tok_valid[:, None, None, None], o_TKGH, 0)
  return o_TKGH.reshape(-1, num_heads, h_).astype(dtype)


def combine_splits(o_PWKRH, m_PWKR, l_PWKR):
  """Merges per-split online-softmax partials (flash-decoding): P splits -> f32[W, K, R, H]."""
  m = jnp.max(m_PWKR, axis=0)
  w = jnp.where(m_PWKR > MASK_VALUE, jnp.exp(m_PWKR - m[None]), 0.0)
  l = jnp.sum(l_PWKR * w, axis=0)
  o = jnp.sum(o_PWKRH * w[..., None], axis=0)
  return o / jnp.where(l > 0, l, 1.0)[..., None]
