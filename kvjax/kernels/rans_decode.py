"""Interleaved rANS decoding on the device: a jit'd jnp reference and a Pallas kernel.

Decodes the entropy format of `kvjax/storage/format/rans.py` (its docstring is the format's spec; rANS:
Duda, arXiv 1311.2540; lanes sharing a word array: Giesen, arXiv 1402.3392, and DietGPU's warp
layout). Kernels do not import storage: both decoders take the arrays storage's `parse` returns,
by the same names, so a caller that sees both rooms writes

    symbols_MTS, ok = rans_decode(**rans.parse(data)._asdict())

Axis letters (the format's, not `kvjax._typing`'s): M models (frequency tables), T steps,
S streams per model, J blocks per model, B lanes per block, W words per block, A alphabet,
Z = 2**scale_bits slots.

Kernels. The GPU one (kvjax/kernels/rans_decode_gpu.py, Triton; its `decode_call`) runs one
program per block of B lanes (one warp when B = 32, DietGPU's choice) with table gathers and
an exclusive cumsum (a warp ballot + popcount). The TPU one (`_tpu_kernel`, what
`rans_decode` runs for "tpu" and in interpret mode on a CPU) is built from what Mosaic lowers:

    grid (G,): one program per ROWS = 8 blocks; block r in sublane row r, its B <= 128 lanes in
               the 128 lanes (padding lanes decode nothing): all state is one int32[8, 128] vreg
    in VMEM:   words[R, 8, 128]  block r's word k at [k // 128, r, k % 128] (R = W // 128 + 2)
               sym[Z/128, 8, 128], freq_bias[Z/128, 8, 128]  the slot tables of each row's
                 model (`tpu_tables`, built by compare-and-count: no search or gather)
    loop t = 0 .. T-1 (lax.fori_loop):
      slot = x & (Z-1); per 128-slot tile c: take_along_axis(sym[c], slot & 127) where
        slot >> 7 == c      (in-vreg lane gathers, Mosaic's dynamic_gather: 2 * Z / 128 per step)
      x = freq * (x >>> n) + bias                  (uint32 bits in int32: logical shifts)
      need = (x >>> 16) == 0; excl = need @ tri    (the exclusive prefix count of each lane: an
                                                    [8, 128] x [128, 128] f32 matmul, exact)
      rows q_r = pos_r // 128 and q_r + 1 of each block's words (a dynamic leading index), then
      w = take_along_axis(row, (pos_r % 128 + excl) % 128); x = x << 16 | w where need
      out[t] = sym                                 (one [8, 128] store)

No cumsum and no gather from memory inside: Mosaic lowers neither (nor blocks whose last two
dims break its 8 x 128 tiling), so blocks are packed into vregs outside the kernel (`tpu_call`).
The storage format is the same for both kernels; B = 128 fills a TPU row, B = 32 a warp.

Each step is a dependent chain of about ten integer ops, the table lookups and one word read
per lane. The parallelism is the number of lanes, and the time the number of steps of the
longest lane: format version 2 cuts each stream into K segments, each a lane of U = ceil(T / K)
steps with its own state (`segments`; the decoders loop over U and put the segments back in
stream order, `rans_step.lanes_to_streams`). A SmolLM2 chunk's kvtc codes are 11,520 lanes of
256 steps in version 2 (5,760 of 512 in version 1; the lane count is what the stored bytes
allow, docs/design/storage-format.md). The 4 GB/s link target is then 4e9 / 11,520 lanes /
(about 0.5 coded bytes per lane step) ~ 0.7 M steps per lane per second, about 1.4 us per
step: latency, not throughput, bounds it, and chunks can be batched along M for more lanes.
No GPU or TPU number is claimed here (scripts/compile_check.py compiles the TPU kernel without
a TPU and reports the compiler's estimates).

Both decoders return `ok`: every lane ended in the encoder's initial state 2**16 and every
block consumed exactly its words. Parsing already checked the checksum; `ok` is false only for
forged input or a decoder/encoder bug, and costs nothing to keep on the device.

File order (STYLE.md "Kernels"): constants, tables, the jnp reference, validation, the kernel
body, the jitted wrapper.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kvjax.kernels import rans_decode_gpu
from kvjax.kernels.platform import resolve_platform
from kvjax.kernels.rans_step import (STATE_LOWER, WORD_BITS, decode_tables, lanes_to_streams,
                                     steps_per_lane)
from kvjax.kernels.rans_step import step as _step

# ---------------------------------------------------------------------------------------------
# Constants (the format's; storage's rans.py holds the same numbers).

MIN_SCALE_BITS, MAX_SCALE_BITS = 8, 15
#: The TPU kernel's program: ROWS blocks (sublanes) x LANES lanes, one int32 vreg.
ROWS, LANES = 8, 128
#: The most VMEM the TPU kernel asks for (v5e and v6e have 128 MiB): its double-buffered
#: blocks, 4 KiB x (W / 128 + 2 + 2 * Z / 128 + T + 4) per buffer.
MAX_VMEM_BYTES = 100 << 20

# ---------------------------------------------------------------------------------------------
# Decode tables (built on the device from the small frequency table).



def tpu_tables(freqs_MA: jax.Array, scale_bits: int) -> tuple[jax.Array, jax.Array]:
  """`decode_tables` by compare-and-count over each model's cumulative frequencies.

  No search, gather, scatter or scan over the Z slots: one fused reduction over the alphabet
  per slot (M * Z * A compares), which the TPU compiler builds in seconds and estimates by what
  it reads (a searchsorted version costs it 20 s and an estimate of gigabytes). The same
  tables as `decode_tables` for every row with a symbol (all-0 rows, unused, differ).

  Args and returns as `decode_tables`, the second table as int32 (freq | bias << 16 < 2**31).
  """
  z = 1 << scale_bits
  incl = jnp.cumsum(freqs_MA.astype(jnp.int32), axis=1)[:, None, :]        # [M, 1, A]
  slots = jnp.arange(z, dtype=jnp.int32)[None, :, None]                     # [1, Z, 1]
  below = incl <= slots                                                     # [M, Z, A]
  sym = jnp.sum(below, axis=2, dtype=jnp.int32)
  sym = jnp.minimum(sym, freqs_MA.shape[1] - 1)
  lo = jnp.max(jnp.where(below, incl, 0), axis=2)                           # cumulative
  hi = jnp.min(jnp.where(below, z, incl), axis=2)
  return sym, (hi - lo) | ((slots[..., 0] - lo) << WORD_BITS)



# ---------------------------------------------------------------------------------------------
# Pure-jnp reference (all blocks of all models at once; the oracle for the kernel, and the
# CPU path).


def rans_decode_reference(words, states, lengths, num_words, freqs, *, scale_bits: int,
                          num_streams: int, num_steps: int, segments: int = 1
                          ) -> tuple[jax.Array, jax.Array]:
  """Decodes every stream with jnp: lax.fori_loop over the U = ceil(T / K) steps of a lane,
  vectorized over all lanes of all blocks.

  Args:
    words: uint16 (or int32/uint32 holding 16-bit words)[M, J, W] each block's word array,
      zero-padded past num_words.
    states: uint32[M, J, B] initial decoder states (2**16 on empty and padding lanes).
    lengths: int32[M, J, B] symbols per lane (0 on padding lanes).
    num_words: int32[M, J] words in each block.
    freqs: int32[M, A] quantized frequencies (rows sum to 2**scale_bits or are all 0).
    scale_bits: n, 8..15 (static).
    num_streams: S streams per model, S * K <= J * B (static).
    num_steps: T (static), the longest stream.
    segments: K (static), lanes per stream (format version 2; 1: a lane per stream).

  Returns:
    (symbols_MTS int32[M, T, S], 0 past each stream's length; ok bool[]: see the module
    docstring).

  Raises:
    ValueError: shapes, dtypes or static arguments that do not fit together.
  """
  _check(words, states, lengths, num_words, freqs, scale_bits, num_streams, num_steps, segments)
  return _reference_jit(words, states, lengths, num_words, freqs, scale_bits=int(scale_bits),
                        num_streams=int(num_streams), num_steps=int(num_steps),
                        segments=int(segments))


@functools.partial(jax.jit, static_argnames=("scale_bits", "num_streams", "num_steps",
                                             "segments"))
def _reference_jit(words, states, lengths, num_words, freqs, *, scale_bits, num_streams,
                   num_steps, segments):
  m_, j_, b_ = states.shape
  w_ = words.shape[2]
  sym_MZ, fb_MZ = decode_tables(freqs, scale_bits)
  words_KW = words.astype(jnp.uint32).reshape(m_ * j_, w_)
  lengths_KB = lengths.reshape(m_ * j_, b_)

  def slot_lookup(slot_KB):
    s = slot_KB.reshape(m_, j_ * b_)
    return (jnp.take_along_axis(sym_MZ, s, axis=1).reshape(m_ * j_, b_),
            jnp.take_along_axis(fb_MZ, s, axis=1).reshape(m_ * j_, b_))

  def word_lookup(idx_KB):
    return jnp.take_along_axis(words_KW, jnp.clip(idx_KB, 0, w_ - 1), axis=1)

  def body(t, carry):
    x, pos, out = carry
    x, pos, sym = _step(x, lengths_KB, pos, t, slot_lookup, word_lookup, scale_bits)
    return x, pos, lax.dynamic_update_index_in_dim(out, sym, t, axis=0)

  u_ = steps_per_lane(num_steps, segments)
  x0 = states.reshape(m_ * j_, b_).astype(jnp.uint32)
  pos0 = jnp.zeros((m_ * j_,), jnp.int32)
  out0 = jnp.zeros((u_, m_ * j_, b_), jnp.int32)
  x, pos, out_UKB = lax.fori_loop(0, u_, body, (x0, pos0, out0))
  ok = jnp.all(x == STATE_LOWER) & jnp.all(pos == num_words.reshape(-1))
  symbols = lanes_to_streams(out_UKB.reshape(u_, m_, j_ * b_), num_streams=num_streams,
                             num_steps=num_steps, segments=segments)
  return symbols, ok


# ---------------------------------------------------------------------------------------------
# Validation


def _check(words, states, lengths, num_words, freqs, scale_bits, num_streams, num_steps,
           segments):
  if not isinstance(scale_bits, int) or not MIN_SCALE_BITS <= scale_bits <= MAX_SCALE_BITS:
    raise ValueError(f"scale_bits must be an int in {MIN_SCALE_BITS}..{MAX_SCALE_BITS}, "
                     f"got {scale_bits!r}")
  if len(states.shape) != 3:
    raise ValueError(f"states must be uint32[M, J, B], got {list(states.shape)}")
  m_, j_, b_ = states.shape
  want = {"words": (3, (m_, j_)), "lengths": (3, (m_, j_, b_)), "num_words": (2, (m_, j_)),
          "freqs": (2, (m_,))}
  for name, arr in (("words", words), ("lengths", lengths), ("num_words", num_words),
                    ("freqs", freqs)):
    ndim, lead = want[name]
    if len(arr.shape) != ndim or tuple(arr.shape[:len(lead)]) != lead:
      raise ValueError(f"{name} has shape {list(arr.shape)}; states are {list(states.shape)}")
    if not jnp.issubdtype(arr.dtype, jnp.integer):
      raise ValueError(f"{name} must be integer, got {arr.dtype}")
  if jnp.dtype(states.dtype) != jnp.uint32:
    raise ValueError(f"states must be uint32, got {states.dtype}")
  if words.shape[2] < 1 or freqs.shape[1] < 1:
    raise ValueError(f"words [.., W={words.shape[2]}] and freqs [.., A={freqs.shape[1]}] "
                     f"need W, A >= 1")
  if not isinstance(num_steps, int) or num_steps < 0:
    raise ValueError(f"num_steps must be a non-negative int, got {num_steps!r}")
  if not isinstance(segments, int) or not 1 <= segments <= max(num_steps, 1):
    raise ValueError(f"segments={segments!r} must be an int in 1..max(T, 1)")
  if not isinstance(num_streams, int) or not 0 <= num_streams * segments <= j_ * b_:
    raise ValueError(f"num_streams={num_streams!r} x segments={segments} must be an int in "
                     f"0..J*B={j_ * b_}")


def _check_backend(interpret: bool, platform: str | None) -> str:
  """The target platform (`resolve_platform`); raises for the compiled kernel aimed at a CPU."""
  platform = resolve_platform(platform)
  if not interpret and platform == "cpu":
    raise ValueError("the compiled Pallas rANS decoder needs a GPU or TPU; on CPU use "
                     "rans_decode_reference or interpret=True")
  return platform


# ---------------------------------------------------------------------------------------------
# Kernel body (TPU layout: 8 blocks of up to 128 lanes, one vreg; the module docstring)


def _tpu_kernel(words_ref, states_ref, lengths_ref, sym_ref, fb_ref, out_ref, x_ref, pos_ref,
                *, scale_bits, num_steps):
  """One program: ROWS blocks, block r in sublane row r, its lanes in the LANES lanes.

  words_ref: int32[R, ROWS, LANES], word k of block r at [k // LANES, r, k % LANES];
  states_ref: int32[ROWS, LANES] (uint32 bits); lengths_ref: int32[ROWS, LANES];
  sym_ref, fb_ref: int32[Z / LANES, ROWS, LANES], slot s of block r's model at
  [s // LANES, r, s % LANES] (`tpu_tables`; fb < 2**31);
  out_ref: int32[T, ROWS, LANES] symbols; x_ref: int32[ROWS, LANES] final states (uint32
  bits); pos_ref: int32[ROWS, LANES] words read (every lane of a row holds its block's count).
  """
  rows, lanes = states_ref.shape
  tiles, last_row = sym_ref.shape[0], words_ref.shape[0] - 2
  row_id = lax.broadcasted_iota(jnp.int32, (rows, lanes), 0)
  # [k, l] = 1 where k < l: need @ tri is each lane's exclusive prefix count (exact in f32).
  tri = (lax.broadcasted_iota(jnp.int32, (lanes, lanes), 0) <
         lax.broadcasted_iota(jnp.int32, (lanes, lanes), 1)).astype(jnp.float32)
  length = lengths_ref[...]
  low_bits = lanes - 1
  shift = lanes.bit_length() - 1

  def lookup(slot):
    # Table lookups as in-vreg lane gathers: tile c holds slots c * LANES .. (c + 1) * LANES - 1.
    sub, tile = slot & low_bits, lax.shift_right_logical(slot, shift)

    def one(c, acc):
      sym, fb = acc
      hit = tile == c
      sym = jnp.where(hit, jnp.take_along_axis(sym_ref[c], sub, axis=1,
                                               mode="promise_in_bounds"), sym)
      fb = jnp.where(hit, jnp.take_along_axis(fb_ref[c], sub, axis=1,
                                              mode="promise_in_bounds"), fb)
      return sym, fb

    zero = jnp.zeros_like(slot)
    return lax.fori_loop(0, tiles, one, (zero, zero), unroll=min(tiles, 8))

  def body(t, carry):
    x, pos = carry
    active = t < length
    sym, fb = lookup(x & ((1 << scale_bits) - 1))
    x_dec = (fb & 0xFFFF) * lax.shift_right_logical(x, scale_bits) + \
        lax.shift_right_logical(fb, WORD_BITS)
    x = jnp.where(active, x_dec, x)
    need = active & (lax.shift_right_logical(x, WORD_BITS) == 0)    # x < 2**16 (unsigned)
    need_i = need.astype(jnp.int32)
    excl = jnp.dot(need_i.astype(jnp.float32), tri,
                   preferred_element_type=jnp.float32).astype(jnp.int32)
    # The words of this step lie in the block's word rows q and q + 1 (q = pos // LANES).
    q = jnp.minimum(lax.shift_right_logical(pos, shift), last_row)
    cur = nxt = jnp.zeros_like(x)
    for r in range(rows):  # a dynamic row index per block: scalars, one vreg load each
      q_r = jnp.max(jnp.where(row_id == r, q, 0))
      cur = jnp.where(row_id == r, words_ref[q_r], cur)
      nxt = jnp.where(row_id == r, words_ref[q_r + 1], nxt)
    idx = (pos & low_bits) + excl                                    # 0 .. 2 * LANES - 2
    sub = idx & low_bits
    w = jnp.where(idx < lanes, jnp.take_along_axis(cur, sub, axis=1, mode="promise_in_bounds"),
                  jnp.take_along_axis(nxt, sub, axis=1, mode="promise_in_bounds"))
    x = jnp.where(need, (x << WORD_BITS) | w, x)
    out_ref[t] = jnp.where(active, sym, 0)
    return x, pos + jnp.sum(need_i, axis=1, keepdims=True)

  x, pos = lax.fori_loop(0, num_steps, body,
                         (states_ref[...], jnp.zeros(states_ref.shape, jnp.int32)))
  x_ref[...] = x
  pos_ref[...] = pos


# ---------------------------------------------------------------------------------------------
# Jitted wrapper


def rans_decode(words, states, lengths, num_words, freqs, *, scale_bits: int, num_streams: int,
                num_steps: int, segments: int = 1, interpret: bool = False,
                platform: str | None = None) -> tuple[jax.Array, jax.Array]:
  """Decodes every stream with a Pallas kernel (the module docstring: the TPU layout for "tpu"
  and interpret mode on a CPU, the Triton kernel for "cuda").

  Arguments, results and errors as `rans_decode_reference` (bit-identical symbols), plus:

  Args:
    interpret: run the kernel in Pallas interpret mode (CPU tests); False compiles it for the
      target platform.
    platform: the target ("cpu" | "tpu" | "cuda"); None: the platform being compiled for
      (`kvjax.kernels.platform.resolve_platform`). "cuda" runs the Triton kernel
      `rans_decode_gpu` (kvjax/kernels/rans_decode_gpu.py), also in interpret mode on CPU, and
      lowers for CUDA on a CPU host.

  Raises:
    ValueError: also for interpret=False for a CPU target, an unknown platform, or blocks of
      more than LANES = 128 lanes, or blocks over MAX_VMEM_BYTES, for the TPU kernel.
  """
  _check(words, states, lengths, num_words, freqs, scale_bits, num_streams, num_steps, segments)
  platform = resolve_platform(platform)
  if platform == "cuda":
    return rans_decode_gpu.decode_jit(words, states, lengths, num_words, freqs,
                                      scale_bits=int(scale_bits), num_streams=int(num_streams),
                                      num_steps=int(num_steps), segments=int(segments),
                                      interpret=bool(interpret))
  platform = _check_backend(interpret, platform)
  if states.shape[2] > LANES:
    raise ValueError(f"the TPU rANS kernel decodes blocks of at most {LANES} lanes, got "
                     f"B={states.shape[2]}")
  return _pallas_jit(words, states, lengths, num_words, freqs, scale_bits=int(scale_bits),
                     num_streams=int(num_streams), num_steps=int(num_steps),
                     segments=int(segments), interpret=bool(interpret), platform=platform)



def tpu_call(words, states, lengths, freqs, *, scale_bits: int, num_steps: int,
             interpret: bool):
  """The TPU kernel's `pallas_call`: blocks packed ROWS to a program, lanes padded to LANES.

  Args:
    words: [M, J, W] int32 coded words; states, lengths: [M, J, B] (uint32, int32), B <= LANES.
    freqs, scale_bits, num_steps: as `rans_decode_reference`.
    interpret: `pl.pallas_call`'s.

  Returns:
    ([M, J, T, B] int32 symbols, [M, J, B] uint32 final states, [M, J] int32 words read).
  """
  m_, j_, b_ = states.shape
  k_, z = m_ * j_, 1 << scale_bits
  g_ = -(-k_ // ROWS)                       # programs
  r_ = words.shape[2] // LANES + 2          # word rows: q + 1 stays inside at pos = W
  t_ = max(num_steps, 1)                    # a zero-size block is not a block

  def blocks(a, fill):  # [K, ...] -> [G, ..., ROWS, LANES] (block r of program g in row r)
    a = a.reshape(k_, -1, a.shape[-1])
    a = jnp.pad(a, ((0, g_ * ROWS - k_), (0, 0), (0, LANES - a.shape[-1])),
                constant_values=fill)
    return a.reshape(g_, ROWS, a.shape[1], LANES).transpose(0, 2, 1, 3)

  w = words.astype(jnp.int32).reshape(k_, -1)
  w = jnp.pad(w, ((0, 0), (0, r_ * LANES - w.shape[1]))).reshape(k_, r_, LANES)
  sym_MZ, fb_MZ = tpu_tables(freqs, scale_bits)
  tables = [blocks(jnp.repeat(t, j_, axis=0).reshape(k_, z // LANES, LANES), 0)
            for t in (sym_MZ, fb_MZ)]
  x0 = blocks(lax.bitcast_convert_type(states, jnp.int32).reshape(k_, 1, b_),
              STATE_LOWER)[:, 0]
  len0 = blocks(lengths.astype(jnp.int32).reshape(k_, 1, b_), 0)[:, 0]
  vreg = (ROWS, LANES)
  lane_spec = pl.BlockSpec((None, *vreg), lambda g: (g, 0, 0))
  table_spec = pl.BlockSpec((None, z // LANES, *vreg), lambda g: (g, 0, 0, 0))
  block_bytes = 4 * ROWS * LANES * (r_ + 2 * (z // LANES) + t_ + 4)
  if 2 * block_bytes > MAX_VMEM_BYTES:
    raise ValueError(f"the TPU rANS kernel's blocks (W={words.shape[2]} words, T={num_steps} "
                     f"steps, Z={z}) need {2 * block_bytes / 2**20:.0f} MiB of VMEM, over "
                     f"{MAX_VMEM_BYTES >> 20} MiB: decode shorter streams")
  params = pltpu.CompilerParams(
      dimension_semantics=("parallel",),
      # Double-buffered blocks plus room for the compiler's scratch.
      vmem_limit_bytes=int(min(2 * block_bytes + (16 << 20), MAX_VMEM_BYTES)))
  out, x, pos = pl.pallas_call(
      functools.partial(_tpu_kernel, scale_bits=scale_bits, num_steps=num_steps),
      out_shape=(jax.ShapeDtypeStruct((g_, t_, *vreg), jnp.int32),
                 jax.ShapeDtypeStruct((g_, *vreg), jnp.int32),
                 jax.ShapeDtypeStruct((g_, *vreg), jnp.int32)),
      grid=(g_,),
      in_specs=[pl.BlockSpec((None, r_, *vreg), lambda g: (g, 0, 0, 0)), lane_spec, lane_spec,
                table_spec, table_spec],
      out_specs=(pl.BlockSpec((None, t_, *vreg), lambda g: (g, 0, 0, 0)), lane_spec,
                 lane_spec),
      compiler_params=params,
      cost_estimate=_tpu_cost(g_, t_, r_, z // LANES),
      interpret=interpret,
      name="rans_decode",
  )(blocks(w, 0), x0, len0, *tables)
  unpack = lambda a: a.transpose(0, 2, 1, 3).reshape(g_ * ROWS, -1, LANES)[:k_, :, :b_]
  symbols = unpack(out)[:, :num_steps].reshape(m_, j_, num_steps, b_)
  x = lax.bitcast_convert_type(unpack(x[:, None])[:, 0], jnp.uint32).reshape(m_, j_, b_)
  return symbols, x, unpack(pos[:, None])[:, 0, 0].reshape(m_, j_)


def _tpu_cost(programs: int, steps: int, word_rows: int, tiles: int) -> pl.CostEstimate:
  """What the TPU kernel does, for XLA's cost model (which cannot see into a kernel): per step
  and program the prefix matmul (2 * 8 * 128 * 128 flops) and about 6 ops per table tile and
  40 more per vreg element; bytes: every block read and written once."""
  vreg = ROWS * LANES
  return pl.CostEstimate(
      flops=programs * steps * (2 * vreg * LANES + vreg * (6 * tiles + 40)),
      transcendentals=0,
      bytes_accessed=4 * vreg * programs * (word_rows + 2 * tiles + steps + 4))


@functools.partial(jax.jit, static_argnames=("scale_bits", "num_streams", "num_steps",
                                             "segments", "interpret", "platform"))
def _pallas_jit(words, states, lengths, num_words, freqs, *, scale_bits, num_streams, num_steps,
                segments, interpret, platform):
  del platform  # the TPU kernel (also what interpret mode runs on a CPU)
  m_, j_, b_ = states.shape
  if m_ * j_ == 0:  # no lanes: nothing to decode (a zero-size grid is not a grid)
    return jnp.zeros((m_, num_steps, num_streams), jnp.int32), jnp.bool_(True)
  u_ = steps_per_lane(num_steps, segments)
  sym_MJUB, x_MJB, pos_MJ = tpu_call(words, states, lengths, freqs, scale_bits=scale_bits,
                                     num_steps=u_, interpret=interpret)
  ok = jnp.all(x_MJB == STATE_LOWER) & jnp.all(pos_MJ == num_words)
  sym_UML = sym_MJUB.transpose(2, 0, 1, 3).reshape(u_, m_, j_ * b_)
  return lanes_to_streams(sym_UML, num_streams=num_streams, num_steps=num_steps,
                          segments=segments), ok
