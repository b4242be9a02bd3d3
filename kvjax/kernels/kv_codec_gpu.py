"""KV chunk codecs as Pallas GPU kernels (Triton lowering): decode (dequant + RoPE) and encode.

Same math, payloads and results as `kvjax/kernels/kv_codec.py` (its docstring is the codec spec;
CacheGen: arXiv 2310.07240 section 5.2); `kv_codec.kv_decode` / `kv_encode` call these with
`platform="cuda"`. The generic kernels there (grid (layer, kv head), one `(2, C, H)` block) go to
Mosaic GPU when no Triton compiler params are given, where whole-chunk blocks overflow shared
memory and value-level slicing is missing; Triton keeps blocks in registers and wants power-of-two
block dims, no value slicing or concatenation and no `round`. So here:

  * every K/V and RoPE half is a *ref* slice (`ref[part, :, pl.ds(half * H/2, H/2)]`), never a
    slice of a loaded value: rotate_half is `lo' = lo cos - hi sin`, `hi' = hi cos + lo sin`,
    each half loaded and stored on its own;
  * int4 runs in a parity layout: the wrapper splits the even and odd channels of the chunk (and
    of scale/zero/cos/sin, all small) into `[.., 2 (parity), .., H/2]`, so a packed byte holds
    one even and one odd channel of the same RoPE half and nothing is interleaved in the kernel;
  * `round` (half to even, as `jnp.round`) is built from `floor` (`round_half_even`);
  * int8's and int4's encoders are `kvjax/kernels/exact_quant.py`, shared with the references
    and the TPU kernels: their payloads are bit-identical on every backend although f32
    division on a GPU is not correctly rounded, `a * b + c` may become a fused multiply-add
    and reductions sum in their own order (that module says how). CacheGen's codes may move
    one step at a rounding boundary against another backend's (its means and RMS are float
    sums; measured on an H200: 7 of 16.8M delta codes, 1 of 1M anchor codes).

Grids and blocks (C tokens, H head dim, G int4 group, T CacheGen anchor stride):

    decode  grid (L, K, C / tc)  tc = min(C, 64) tokens per program (a multiple of G and T):
            per program K and V of tc tokens, 2 x tc x H values (32 KiB f32 at tc 64, H 128)
    encode  grid (L, 2, K)       int8, cachegen: one whole (C, H) slice per program
                                 (their reductions run over C)
            grid (L, 2, K, C / G)  int4: one group, [2 (parity), G, H/2] per program

Triton needs C, H, tc, C / G and C / T to be powers of two (SmolLM2 and LLaMA chunks of 256 are;
checked, ValueError otherwise). Launch: 4 warps for decode and int4 encode, 8 for the
whole-slice encoders, 1 stage (no loop to pipeline).

Tested in interpret mode against the jnp references (tests/integration/kernels/kv_codec_gpu_test.py), lowered
for CUDA on CPU through `jax.export` there, and compiled on an H200 by scripts/device_check.sh
(scripts/device_check_codec.py: codes against the CPU reference, decode error in ulps, GB/s;
figures in benchmarks/README.md, "Kernels on a GPU").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kvjax.codecs import CACHEGEN, INT4, INT8, RAW
from kvjax.kernels import exact_quant
from kvjax.kernels.exact_quant import round_half_even

# ---------------------------------------------------------------------------------------------
# Constants.

#: Tokens per decode program (upper bound; a power of two, multiple of G and T).
DEFAULT_DECODE_TOKENS = 64
NUM_WARPS = 4
#: Encode programs hold a whole [C, H] slice (128 KiB f32 at C 256, H 128): more threads.
ENCODE_NUM_WARPS = 8
#: int4 encode programs hold one [2, G, H/2] group (16 KiB f32 at G 64, H 128).
INT4_ENCODE_NUM_WARPS = 4
NUM_STAGES = 1
_Q8_MAX = 127


def triton_params(num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES):
  """Triton compiler params (selects Triton over Mosaic GPU in `pallas_call`).

  jax 0.10 names the class `jax.experimental.pallas.triton.CompilerParams`; older releases named
  it `TritonCompilerParams`. Whichever exists is used.
  """
  cls = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams")
  return cls(num_warps=num_warps, num_stages=num_stages)


def _pow2(x: int) -> bool:
  return x >= 1 and x & (x - 1) == 0


def _quant(x, scale, lo, hi):
  """Codes of x at `scale` clipped to [lo, hi]; 0 where scale is 0 (as the references)."""
  return jnp.where(scale > 0, jnp.clip(round_half_even(x / jnp.where(scale > 0, scale, 1)),
                                       lo, hi), 0)


def check_gpu_shapes(c: int, h: int, group: int = 0, stride: int = 0,
                     tokens: int = DEFAULT_DECODE_TOKENS) -> int:
  """Checks Triton's power-of-two rule; returns the decode tile tc (tokens per program).

  Raises:
    ValueError: C, H, C / G or C / T not a power of two, or H not a multiple of 4.
  """
  if not (_pow2(c) and _pow2(h) and h >= 4):
    raise ValueError(f"the GPU codec kernels need C and H powers of two (H >= 4), got C={c}, "
                     f"H={h}")
  for name, n in (("G", group), ("T", stride)):
    if n and not _pow2(c // n):
      raise ValueError(f"the GPU codec kernels need C / {name} a power of two, got C={c}, "
                       f"{name}={n}")
  tc = min(c, max(tokens, group, stride))
  return tc


# ---------------------------------------------------------------------------------------------
# Decode bodies. Grid (layer l, kv head k, token tile i). Each `load(part, half)` returns the
# dequantized f32[tc, H/2] of part 0 = K (before RoPE) or 1 = V, channel half `half`.


def _raw_loader(values_ref):
  # values_ref: [2, tc, H] stored dtype
  hh = values_ref.shape[-1] // 2
  return lambda part, half: values_ref[part, :, pl.ds(half * hh, hh)].astype(jnp.float32)


def _int8_loader(q_ref, scale_ref):
  # q_ref: int8[2, tc, H]; scale_ref: f32[2, 1, H]
  hh = q_ref.shape[-1] // 2
  return lambda part, half: (q_ref[part, :, pl.ds(half * hh, hh)].astype(jnp.float32)
                             * scale_ref[part, :, pl.ds(half * hh, hh)])


def _cachegen_loader(anchor_q_ref, anchor_scale_ref, delta_q_ref, delta_step_ref):
  # anchor_q_ref: int8[2, a, H] (a = tc / T anchors of this tile); anchor_scale_ref,
  # delta_step_ref: f32[2, 1, H]; delta_q_ref: int8[2, tc, H]
  _, tc, h = delta_q_ref.shape
  hh = h // 2
  a = anchor_q_ref.shape[1]

  def load(part, half):
    cols = pl.ds(half * hh, hh)
    anchor = anchor_q_ref[part, :, cols].astype(jnp.float32) * anchor_scale_ref[part, :, cols]
    delta = delta_q_ref[part, :, cols].astype(jnp.float32) * delta_step_ref[part, :, cols]
    return (anchor[:, None, :] + delta.reshape(a, tc // a, hh)).reshape(tc, hh)
  return load


def _halves_kernel(make_loader, *refs):
  """raw / int8 / cachegen: out blocks [tc, H] of K (rotated) and V, written by halves."""
  *payload_refs, cos_ref, sin_ref, k_ref, v_ref = refs
  # cos_ref, sin_ref: f32[tc, H]; k_ref, v_ref: cache dtype[tc, H]
  load = make_loader(*payload_refs)
  hh = k_ref.shape[-1] // 2
  lo_cols, hi_cols = pl.ds(0, hh), pl.ds(hh, hh)
  lo, hi = load(0, 0), load(0, 1)
  k_ref[:, lo_cols] = (lo * cos_ref[:, lo_cols] - hi * sin_ref[:, lo_cols]).astype(k_ref.dtype)
  k_ref[:, hi_cols] = (hi * cos_ref[:, hi_cols] + lo * sin_ref[:, hi_cols]).astype(k_ref.dtype)
  v_ref[:, lo_cols] = load(1, 0).astype(v_ref.dtype)
  v_ref[:, hi_cols] = load(1, 1).astype(v_ref.dtype)


def _int4_kernel(q_ref, scale_ref, zero_ref, cos_ref, sin_ref, k_ref, v_ref):
  """int4 in the parity layout: channel 2j + p is column j of parity p.

  q_ref: uint8[2, tc, H/2] (byte j: even channel 2j low nibble, odd 2j + 1 high nibble);
  scale_ref, zero_ref: f16[2, 2 (parity), n, H/2] (n = tc / G groups of this tile);
  cos_ref, sin_ref: f32[2 (parity), tc, H/2]; k_ref, v_ref: cache dtype[2 (parity), tc, H/2].
  RoPE pairs channel c with c + H/2: column j with column j + H/4 of the same parity.
  """
  _, tc, hb = q_ref.shape
  n = scale_ref.shape[2]
  qq = hb // 2

  def load(part, parity, half):
    cols = pl.ds(half * qq, qq)
    byte = q_ref[part, :, cols].astype(jnp.int32)
    code = (byte & 0xF) if parity == 0 else (byte >> 4)
    scale = scale_ref[part, parity, :, cols].astype(jnp.float32)[:, None, :]
    zero = zero_ref[part, parity, :, cols].astype(jnp.float32)[:, None, :]
    x = code.astype(jnp.float32).reshape(n, tc // n, qq) * scale + zero
    return x.reshape(tc, qq)

  lo_cols, hi_cols = pl.ds(0, qq), pl.ds(qq, qq)
  for parity in (0, 1):
    lo, hi = load(0, parity, 0), load(0, parity, 1)
    cos = lambda cols, p=parity: cos_ref[p, :, cols]
    sin = lambda cols, p=parity: sin_ref[p, :, cols]
    k_ref[parity, :, lo_cols] = (lo * cos(lo_cols) - hi * sin(lo_cols)).astype(k_ref.dtype)
    k_ref[parity, :, hi_cols] = (hi * cos(hi_cols) + lo * sin(hi_cols)).astype(k_ref.dtype)
    v_ref[parity, :, lo_cols] = load(1, parity, 0).astype(v_ref.dtype)
    v_ref[parity, :, hi_cols] = load(1, parity, 1).astype(v_ref.dtype)


_LOADERS = {RAW: _raw_loader, INT8: _int8_loader, CACHEGEN: _cachegen_loader}


# ---------------------------------------------------------------------------------------------
# Layout helpers (wrapper side; they touch only the chunk and its small per-channel arrays).


def _heads(x_L2nKH):
  """[L, 2, n, K, H] <-> [L, 2, K, n, H]."""
  return jnp.transpose(x_L2nKH, (0, 1, 3, 2, 4))


def _parity(x_L2nKH):
  """[L, 2, n, K, H] -> [L, 2, K, 2 (parity), n, H/2]: channel 2j + p at [.., p, :, j]."""
  l_, two, n, k, h = x_L2nKH.shape
  return jnp.transpose(x_L2nKH.reshape(l_, two, n, k, h // 2, 2), (0, 1, 3, 5, 2, 4))


def _unparity(x_L2KPnJ):
  """Inverse of `_parity`: [L, 2, K, 2, n, H/2] -> [L, 2, n, K, H]."""
  l_, two, k, _, n, j = x_L2KPnJ.shape
  return jnp.transpose(x_L2KPnJ, (0, 1, 4, 2, 5, 3)).reshape(l_, two, n, k, 2 * j)


def _parity_CH(x_CH):
  """[C, H] -> [2 (parity), C, H/2]."""
  c, h = x_CH.shape
  return jnp.transpose(x_CH.reshape(c, h // 2, 2), (2, 0, 1))


# ---------------------------------------------------------------------------------------------
# Wrappers (called inside `kv_codec`'s jits; the arrays are validated there).


def dequant_rope(codec: str, payload, cos_CH, sin_CH, dtype, *, interpret: bool = False,
                 tokens: int = DEFAULT_DECODE_TOKENS):
  """Dequantize + RoPE K of a chunk with the Triton kernel `kv_decode_<codec>_gpu`.

  Args:
    codec: the payload's codec id ("raw", "int8", "int4", "cachegen").
    payload: the codec's payload (kv_codec's NamedTuples), chunk [L, 2, C, K, H], validated.
    cos_CH, sin_CH: f32[C, H] RoPE tables (HF rotate_half layout).
    dtype: the cache dtype of the result.
    interpret: Pallas interpret mode (CPU tests).
    tokens: tokens per program (upper bound; see `check_gpu_shapes`).

  Returns:
    (k_LCKH, v_LCKH) in `dtype`, K rotated.

  Raises:
    ValueError: shapes Triton cannot tile (`check_gpu_shapes`).
  """
  if codec == INT4:
    l_, _, c, k_, hb = payload.q.shape
    h = 2 * hb
    group = c // payload.scale.shape[2]
    tc = check_gpu_shapes(c, h, group=group, tokens=tokens)
    n = tc // group
    grid = (l_, k_, c // tc)
    q = _heads(payload.q)                                     # [L, 2, K, C, H/2]
    scale, zero = _parity(payload.scale), _parity(payload.zero)  # [L, 2, K, 2, C/G, H/2]
    cs_spec = pl.BlockSpec((2, tc, h // 2), lambda l, k, i: (0, i, 0))
    sz_spec = pl.BlockSpec((None, 2, None, 2, n, h // 2), lambda l, k, i: (l, 0, k, 0, i, 0))
    out_spec = pl.BlockSpec((None, None, 2, tc, h // 2), lambda l, k, i: (l, k, 0, i, 0))
    out_shape = jax.ShapeDtypeStruct((l_, k_, 2, c, h // 2), dtype)
    k_out, v_out = pl.pallas_call(
        _int4_kernel, out_shape=(out_shape, out_shape), grid=grid,
        in_specs=[pl.BlockSpec((None, 2, None, tc, h // 2), lambda l, k, i: (l, 0, k, i, 0)),
                  sz_spec, sz_spec, cs_spec, cs_spec],
        out_specs=(out_spec, out_spec), compiler_params=triton_params(), interpret=interpret,
        name="kv_decode_int4_gpu",
    )(q, scale, zero, _parity_CH(cos_CH), _parity_CH(sin_CH))
    # [L, K, 2, C, H/2] -> [L, C, K, H/2, 2] -> [L, C, K, H]
    back = lambda x: jnp.transpose(x, (0, 3, 1, 4, 2)).reshape(l_, c, k_, h)
    return back(k_out), back(v_out)

  main = payload[2] if codec == CACHEGEN else payload[0]  # the array holding every token
  l_, _, c, k_, h = main.shape
  stride = c // payload.anchor_q.shape[2] if codec == CACHEGEN else 0
  tc = check_gpu_shapes(c, h, stride=stride, tokens=tokens)
  grid = (l_, k_, c // tc)
  arrays, specs = [], []
  for x in payload:
    if x.ndim == 4:  # per channel [L, 2, K, H] -> [L, 2, K, 1, H]
      arrays.append(x[:, :, :, None, :])
      specs.append(pl.BlockSpec((None, 2, None, 1, h), lambda l, k, i: (l, 0, k, 0, 0)))
    else:  # per token (C) or per anchor (C / T)
      rows = tc * x.shape[2] // c
      arrays.append(_heads(x))
      specs.append(pl.BlockSpec((None, 2, None, rows, h), lambda l, k, i: (l, 0, k, i, 0)))
  cs_spec = pl.BlockSpec((tc, h), lambda l, k, i: (i, 0))
  out_spec = pl.BlockSpec((None, None, tc, h), lambda l, k, i: (l, k, i, 0))
  out_shape = jax.ShapeDtypeStruct((l_, k_, c, h), dtype)
  k_LKCH, v_LKCH = pl.pallas_call(
      functools.partial(_halves_kernel, _LOADERS[codec]),
      out_shape=(out_shape, out_shape), grid=grid, in_specs=specs + [cs_spec, cs_spec],
      out_specs=(out_spec, out_spec), compiler_params=triton_params(), interpret=interpret,
      name=f"kv_decode_{codec}_gpu",
  )(*arrays, cos_CH, sin_CH)
  return jnp.transpose(k_LKCH, (0, 2, 1, 3)), jnp.transpose(v_LKCH, (0, 2, 1, 3))


# ---------------------------------------------------------------------------------------------
# Encode bodies. Grid (layer l, K/V part p, kv head k); x_ref is one whole [C, H] slice.


def _int8_encode_kernel(x_ref, q_ref, scale_ref):
  # x_ref: [C, H] KV dtype; q_ref: int8[C, H]; scale_ref: f32[1, H]
  q, scale = exact_quant.int8_quantize(x_ref[...].astype(jnp.float32), axis=0)
  q_ref[...] = q.astype(jnp.int8)
  scale_ref[...] = scale


def _int4_encode_kernel(x_ref, q_ref, scale_ref, zero_ref):
  """One group of G tokens of one (layer, K/V part, kv head), in the parity layout.

  x_ref: KV dtype[2 (parity), G, H/2]; q_ref: uint8[G, H/2] (byte j: even channel 2j low
  nibble, odd 2j + 1 high nibble); scale_ref, zero_ref: f16[2 (parity), H/2]. The fit is
  `exact_quant.int4_fit` (bit-identical to the reference on every backend).
  """
  codes = []
  for parity in (0, 1):
    x = x_ref[parity].astype(jnp.float32)                      # [G, H/2]
    code, scale, zero = exact_quant.int4_fit(x, axis=0, loop=True)
    codes.append(code.astype(jnp.int32))
    scale_ref[parity] = scale[0].astype(scale_ref.dtype)       # f16 values: exact
    zero_ref[parity] = zero[0].astype(zero_ref.dtype)
  q_ref[...] = (codes[0] | (codes[1] << 4)).astype(jnp.uint8)


def _cachegen_encode_kernel(factors, x_ref, anchor_q_ref, anchor_scale_ref, delta_q_ref,
                            delta_step_ref):
  # x_ref: [C, H] KV dtype; anchor_q_ref: int8[A, H]; anchor_scale_ref, delta_step_ref:
  # f32[1, H]; delta_q_ref: int8[C, H]. factors: per layer group `bin / steps per rms`.
  x = x_ref[...].astype(jnp.float32)
  c, h = x.shape
  a = anchor_q_ref.shape[0]
  anchor = jnp.mean(x.reshape(a, c // a, h), axis=1)
  anchor_scale = jnp.max(jnp.abs(anchor), axis=0, keepdims=True) / _Q8_MAX
  anchor_q = _quant(anchor, anchor_scale, -_Q8_MAX, _Q8_MAX)
  delta = (x.reshape(a, c // a, h) - (anchor_q * anchor_scale)[:, None, :]).reshape(c, h)
  rms = jnp.sqrt(jnp.mean(jnp.square(delta), axis=0, keepdims=True))
  group = (len(factors) * pl.program_id(0)) // pl.num_programs(0)
  factor = jnp.float32(factors[-1])
  for g in reversed(range(len(factors) - 1)):
    factor = jnp.where(group == g, jnp.float32(factors[g]), factor)
  step = jnp.maximum(rms * factor, jnp.max(jnp.abs(delta), axis=0, keepdims=True) / _Q8_MAX)
  anchor_q_ref[...] = anchor_q.astype(jnp.int8)
  anchor_scale_ref[...] = anchor_scale
  delta_q_ref[...] = _quant(delta, step, -_Q8_MAX, _Q8_MAX).astype(jnp.int8)
  delta_step_ref[...] = step


def encode(kv_L2CKH, codec: str, *, group: int, stride: int, factors: tuple[float, ...],
           interpret: bool = False):
  """Encodes a chunk with the Triton kernel `kv_encode_<codec>_gpu` (int8, int4, cachegen).

  Args:
    kv_L2CKH: float[L, 2, C, K, H] K before RoPE, and V (validated by kv_codec).
    codec: "int8", "int4" or "cachegen" (raw has no kernel: its payload is the chunk).
    group: int4 G (0 otherwise); stride: CacheGen T (0 otherwise).
    factors: CacheGen per-layer-group step factors (`bin / CACHEGEN_STEPS_PER_RMS`).
    interpret: Pallas interpret mode (CPU tests).

  Returns:
    The payload's arrays in contract layout, in field order (kv_codec builds the NamedTuple).

  Raises:
    ValueError: shapes Triton cannot tile (`check_gpu_shapes`), or an unknown codec.
  """
  l_, _, c, k_, h = kv_L2CKH.shape
  check_gpu_shapes(c, h, group=group, stride=stride)
  grid = (l_, 2, k_)
  spec = lambda *blk: pl.BlockSpec((None, None, None) + blk,
                                   lambda l, p, k: (l, p, k) + (0,) * len(blk))
  shape = lambda *tail, dtype: jax.ShapeDtypeStruct((l_, 2, k_) + tail, dtype)

  def call(kernel, x, outs):
    return pl.pallas_call(
        kernel, out_shape=[shape(*t, dtype=d) for t, d in outs], grid=grid,
        in_specs=[spec(*x.shape[3:])], out_specs=[spec(*t) for t, _ in outs],
        compiler_params=triton_params(num_warps=ENCODE_NUM_WARPS), interpret=interpret,
        name=f"kv_encode_{codec}_gpu")(x)

  if codec == INT8:
    q, scale = call(_int8_encode_kernel, _heads(kv_L2CKH),
                    [((c, h), jnp.int8), ((1, h), jnp.float32)])
    return _heads(q), scale[:, :, :, 0]
  if codec == INT4:
    # Grid (layer, part, kv head, group): one [2 (parity), G, H/2] block per program, so the
    # fit's temporaries stay small (a whole-chunk program unrolled 6 candidates x 2 parities
    # over [C / G, G, H/2] tensors: slow to compile, heavy on registers).
    n, hh = c // group, h // 2
    x = jnp.transpose(kv_L2CKH.reshape(l_, 2, c, k_, hh, 2), (0, 1, 3, 5, 2, 4))  # [L,2,K,2,C,J]
    q, scale, zero = pl.pallas_call(
        _int4_encode_kernel,
        out_shape=[jax.ShapeDtypeStruct((l_, 2, k_, c, hh), jnp.uint8),
                   jax.ShapeDtypeStruct((l_, 2, k_, 2, n, hh), jnp.float16),
                   jax.ShapeDtypeStruct((l_, 2, k_, 2, n, hh), jnp.float16)],
        grid=(l_, 2, k_, n),
        in_specs=[pl.BlockSpec((None, None, None, 2, group, hh),
                               lambda l, p, k, g: (l, p, k, 0, g, 0))],
        out_specs=[pl.BlockSpec((None, None, None, group, hh), lambda l, p, k, g: (l, p, k, g, 0)),
                   pl.BlockSpec((None, None, None, 2, None, hh),
                                lambda l, p, k, g: (l, p, k, 0, g, 0)),
                   pl.BlockSpec((None, None, None, 2, None, hh),
                                lambda l, p, k, g: (l, p, k, 0, g, 0))],
        compiler_params=triton_params(num_warps=INT4_ENCODE_NUM_WARPS), interpret=interpret,
        name="kv_encode_int4_gpu")(x)
    return _heads(q), _unparity(scale), _unparity(zero)
  if codec == CACHEGEN:
    a = c // stride
    anchor_q, anchor_scale, delta_q, delta_step = call(
        functools.partial(_cachegen_encode_kernel, tuple(float(np.float32(f)) for f in factors)),
        _heads(kv_L2CKH),
        [((a, h), jnp.int8), ((1, h), jnp.float32), ((c, h), jnp.int8), ((1, h), jnp.float32)])
    return _heads(anchor_q), anchor_scale[:, :, :, 0], _heads(delta_q), delta_step[:, :, :, 0]
  raise ValueError(f"no GPU encode kernel for codec {codec!r}")
