"""Interleaved rANS decoding as a Pallas GPU kernel (Triton lowering).

Same format, arguments and (bit-identical) results as `kvjax/kernels/rans_decode.py`;
`rans_decode.rans_decode` calls this with `platform="cuda"` (the TPU kernel there packs blocks
into vregs; a GPU runs one program per block). Launched by `decode_call` with
Triton params (without them Pallas picks Mosaic GPU, which lowers the block copies as async
copies it cannot place; with Triton params every band shape lowers). The step math is
`rans_step.step` (shared with the jnp reference); this file owns the GPU launch:

    grid (M, J)       one program per block: B lanes (32 in storage's format: one warp),
                      each lane decoding U = ceil(T / K) steps of one stream segment
    num_warps 1       B lanes fit one warp; more warps would idle
    table gathers     sym[slot], freq_bias[slot], words[pos + prefix]: pointer-tensor loads
                      from global memory (the Z-entry tables, 8 * Z bytes, stay in L1/L2)
    out               int32[T, B] per program, row t written at step t (a coalesced row)

Triton wants power-of-two block dims: Z = 2**scale_bits is one; B (lanes: padding lanes decode
nothing), W (words: zeros past num_words) and T (output rows) are padded up to powers of two in
the jit, and the padding is cut off the result. Tested in interpret mode against the jnp
reference (tests/integration/kernels/rans_decode_gpu_test.py), lowered for CUDA on CPU there,
compiled on an H200 by scripts/device_check.sh.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kvjax.kernels import rans_step as rd
from kvjax.kernels.kv_codec_gpu import triton_params

#: Warps per program (B = 32 lanes is one warp).
NUM_WARPS = 1


def _pow2_at_least(x: int) -> int:
  return 1 << max(0, int(x) - 1).bit_length()


def _decode_kernel(words_ref, states_ref, lengths_ref, sym_ref, fb_ref, out_ref, x_ref, pos_ref,
                   *, scale_bits, num_steps):
  """words_ref: int32[W]; states_ref: uint32[B]; lengths_ref: int32[B]; sym_ref: int32[Z];
  fb_ref: uint32[Z]; out_ref: int32[T, B]; x_ref: uint32[B] final states; pos_ref: int32[B]
  words read (every lane holds the block's count)."""
  length = lengths_ref[...]
  w_ = words_ref.shape[0]

  def slot_lookup(slot):
    return sym_ref[slot], fb_ref[slot]

  def word_lookup(idx):
    return words_ref[jnp.clip(idx, 0, w_ - 1)].astype(jnp.uint32)

  def body(t, carry):
    x, pos = carry
    x, pos, sym = rd.step(x, length, pos, t, slot_lookup, word_lookup, scale_bits)
    out_ref[pl.ds(t, 1), :] = sym[None]
    return x, pos

  x, pos = lax.fori_loop(0, num_steps, body, (states_ref[...], jnp.zeros((), jnp.int32)))
  x_ref[...] = x
  pos_ref[...] = jnp.full(x.shape, pos, jnp.int32)


def decode_call(words, states, lengths, freqs, *, scale_bits: int, num_steps: int, rows: int,
                interpret: bool, name: str, kernel, compiler_params=None):
  """The GPU decoders' `pallas_call` over a grid of (model, block), one program per block (the
  Triton kernel of this module pads the lanes and words first; the TPU kernel has its own layout:
  `rans_decode.tpu_call`).

  Args:
    words: [M, J, W] int32 coded words; states, lengths: [M, J, B] (uint32, int32).
    freqs: as `rans_decode_reference` (the decode tables are built from it).
    scale_bits, num_steps: as `rans_decode_reference`; rows: the output block's step rows,
      >= max(num_steps, 1).
    interpret, name, compiler_params: `pl.pallas_call`'s.
    kernel: the kernel body (arguments as `_decode_kernel`).

  Returns:
    ([M, J, rows, B] int32 symbols, [M, J, B] uint32 final states, [M, J, B] int32 word
    positions).
  """
  m_, j_, b_ = states.shape
  w_ = words.shape[2]
  z = 1 << scale_bits
  sym_MZ, fb_MZ = rd.decode_tables(freqs, scale_bits)
  lane_spec = pl.BlockSpec((None, None, b_), lambda m, j: (m, j, 0))
  table_spec = pl.BlockSpec((None, z), lambda m, j: (m, 0))
  extra = {} if compiler_params is None else {"compiler_params": compiler_params}
  return pl.pallas_call(
      functools.partial(kernel, scale_bits=scale_bits, num_steps=num_steps),
      out_shape=(jax.ShapeDtypeStruct((m_, j_, rows, b_), jnp.int32),
                 jax.ShapeDtypeStruct((m_, j_, b_), jnp.uint32),
                 jax.ShapeDtypeStruct((m_, j_, b_), jnp.int32)),
      grid=(m_, j_),
      in_specs=[pl.BlockSpec((None, None, w_), lambda m, j: (m, j, 0)), lane_spec, lane_spec,
                table_spec, table_spec],
      out_specs=(pl.BlockSpec((None, None, rows, b_), lambda m, j: (m, j, 0, 0)), lane_spec,
                 lane_spec),
      interpret=interpret,
      name=name,
      **extra,
  )(words.astype(jnp.int32), states, lengths.astype(jnp.int32), sym_MZ, fb_MZ)


@functools.partial(jax.jit, static_argnames=("scale_bits", "num_streams", "num_steps",
                                             "segments", "interpret"))
def decode_jit(words, states, lengths, num_words, freqs, *, scale_bits, num_streams, num_steps,
               segments=1, interpret=False):
  """The Triton decoder; arguments and results as `rans_decode.rans_decode` (validated there)."""
  m_, j_, b0 = states.shape
  if m_ * j_ == 0:  # no lanes: nothing to decode (a zero-size grid is not a grid)
    return jnp.zeros((m_, num_steps, num_streams), jnp.int32), jnp.bool_(True)
  # Power-of-two blocks: padding lanes start in the final state and decode nothing, padding
  # words are never read by a valid stream, padding rows are never written (all cut off below).
  u_ = rd.steps_per_lane(num_steps, segments)
  b_, w_ = _pow2_at_least(b0), _pow2_at_least(words.shape[2])
  t_ = _pow2_at_least(max(u_, 1))
  lanes = ((0, 0), (0, 0), (0, b_ - b0))
  states = jnp.pad(states, lanes, constant_values=rd.STATE_LOWER)
  lengths = jnp.pad(lengths.astype(jnp.int32), lanes)
  words = jnp.pad(words.astype(jnp.int32), ((0, 0), (0, 0), (0, w_ - words.shape[2])))
  out_TB, x_MJB, pos_MJB = decode_call(
      words, states, lengths, freqs, scale_bits=scale_bits, num_steps=u_, rows=t_,
      interpret=interpret, name="rans_decode_gpu", kernel=_decode_kernel,
      compiler_params=triton_params(num_warps=NUM_WARPS, num_stages=1))
  out_MJUB = out_TB[:, :, :u_, :b0]
  ok = jnp.all(x_MJB == rd.STATE_LOWER) & jnp.all(pos_MJB == num_words[..., None])
  sym_UML = out_MJUB.transpose(2, 0, 1, 3).reshape(u_, m_, j_ * b0)
  return rd.lanes_to_streams(sym_UML, num_streams=num_streams, num_steps=num_steps,
                             segments=segments), ok
