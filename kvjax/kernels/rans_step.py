"""The rANS decode step and tables shared by the TPU kernel's module
(kvjax/kernels/rans_decode.py: its reference and dispatch) and the Triton kernel
(kvjax/kernels/rans_decode_gpu.py), below both so neither imports the other's module back.

Format: docs/design/storage-format.md (interleaved rANS, 16-bit words, Z = 2**scale_bits slots).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

#: The state's lower bound, the encoder's initial state, and the word base: 2**16.
STATE_LOWER = 1 << 16
WORD_BITS = 16


def steps_per_lane(num_steps: int, segments: int) -> int:
  """U = ceil(T / K): the steps each lane decodes (storage's `rans.steps_per_lane`)."""
  return -(-int(num_steps) // max(1, int(segments)))


def lanes_to_streams(sym_UML: jax.Array, *, num_streams: int, num_steps: int,
                     segments: int) -> jax.Array:
  """Decoded lanes back to streams: lane l = s * K + k holds symbols k * U .. k * U + U - 1
  of stream s (the format's segments; K = 1 is a lane per stream).

  Args:
    sym_UML: int32[U, M, >= S * K] symbol u of each lane (lanes past S * K are padding).

  Returns:
    int32[M, T, S].
  """
  u_, m_ = sym_UML.shape[:2]
  k_, s_ = segments, num_streams
  lanes = sym_UML[:, :, :s_ * k_].reshape(u_, m_, s_, k_)
  return lanes.transpose(1, 3, 0, 2).reshape(m_, k_ * u_, s_)[:, :num_steps]


def decode_tables(freqs_MA: jax.Array, scale_bits: int) -> tuple[jax.Array, jax.Array]:
  """Slot -> symbol and packed (frequency, bias) tables of each model.

  Args:
    freqs_MA: int32[M, A] frequencies, each row summing to 2**scale_bits (or all 0: unused).
    scale_bits: n (static).

  Returns:
    (sym_MZ int32[M, Z], freq_bias_MZ uint32[M, Z]) with freq in the low 16 bits and
    bias = slot - cumulative frequency of the symbol in the high 16 (both < 2**16 for n <= 15).
  """
  z = 1 << scale_bits
  freqs = freqs_MA.astype(jnp.int32)
  incl = jnp.cumsum(freqs, axis=1)
  slots = jnp.arange(z, dtype=jnp.int32)
  sym = jax.vmap(lambda row: jnp.searchsorted(row, slots, side="right"))(incl)
  sym = jnp.minimum(sym, freqs.shape[1] - 1).astype(jnp.int32)
  f = jnp.take_along_axis(freqs, sym, axis=1)
  bias = slots[None] - jnp.take_along_axis(incl - freqs, sym, axis=1)
  packed = f.astype(jnp.uint32) | (bias.astype(jnp.uint32) << WORD_BITS)
  return sym, packed


def step(x, length, pos, t, slot_lookup, word_lookup, scale_bits):
  """One decode step of a set of lanes.

  x: uint32[..., B] states; length: int32[..., B]; pos: int32[...] words read per block.
  slot_lookup(slot) -> (sym int32, freq_bias uint32); word_lookup(idx) -> uint32 words.
  Returns (x, pos, sym int32[..., B] (0 on inactive lanes)).
  """
  active = t < length
  slot = (x & jnp.uint32((1 << scale_bits) - 1)).astype(jnp.int32)
  sym, fb = slot_lookup(slot)
  x_dec = (fb & jnp.uint32(0xFFFF)) * (x >> scale_bits) + (fb >> WORD_BITS)
  x = jnp.where(active, x_dec, x)
  need = active & (x < jnp.uint32(STATE_LOWER))
  need_i = need.astype(jnp.int32)
  idx = pos[..., None] + jnp.cumsum(need_i, axis=-1) - need_i
  w = word_lookup(idx)
  x = jnp.where(need, (x << WORD_BITS) | w, x)
  return x, pos + jnp.sum(need_i, axis=-1), jnp.where(active, sym, 0)
