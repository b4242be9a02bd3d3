"""KV transform codec ("kvtc", version 5): inter-layer prediction + a PCA whitened by the
model's Fisher metric.

A stored chunk is `kv_L2CKH: [L, 2, C, K, H]` (axis 1: 0 = K before RoPE, 1 = V). Per layer l and
K/V a (a = 0, 1), its K * H channels of all KV heads form one vector per token, D = K * H. The
codec is closed-loop predictive transform coding (DPCM over the layer axis, Jayant & Noll,
"Digital Coding of Waveforms", ch. 6; transform coding of the remainder, Goyal, "Theoretical
foundations of transform coding", IEEE SPM 2001): each layer is predicted from the
*reconstruction* of the layers before it, so encoder and decoder make the same prediction and the
quantization error of one layer is not carried into the next. Per token, with centred
reconstructions r[l] = x̂[l] - mean[l] (r[-1] = r[-2] = 0) and the token's step
st[l, a] = step[l, a] * g (g = KVTC_PROTECT_STEP for the first KVTC_PROTECT_TOKENS positions of a
sequence, 1 elsewhere; "Quantization" below):

    f[l, K] = [r[l-1, K], r[l-1, V], r[l-2, K], r[l-2, V], 0]          (5 D features)
    f[l, V] = [r[l-1, K], r[l-1, V], r[l-2, K], r[l-2, V], r[l, K]]    (V also sees its own K)
    p[l, a] = f[l, a] @ predictor[l, a]                                 predictor: f32[L, 2, 5D, D]
    y[l, a] = (x[l, a] - mean[l, a] - p[l, a]) @ basis[l, a]           basis (analysis): [L,2,D,D]
    q[l, a] = clip(sign(y) * floor(|y| / st[l, a] + rho), +-32767)      int16, rho = 0.42
    r[l, a] = p[l, a] + (q[l, a] * st[l, a]) @ synthesis[l, a];  x̂ = r + mean

The predictor is a ridge regression of each layer's centred KV on those features, fitted on the
model's calibration KV (`kvjax.models.loading.kv_calibration`, a public-domain text shipped in the
package). What the codec minimises is not the squared error of the KV but what the error costs
the model's next-token distributions: for small noise e on one token's KV of a (layer, K/V), the
KL of the next tokens grows as e^T G[l, a] e, G the Fisher information of the next tokens'
log-likelihood with respect to that KV (calibrated once per model by gradients,
`kv_calibration.kv_fisher`; Amari, Neural Computation 1998). Version 5 codes in coordinates
where that cost is plain squared error (transform coding under a weighted squared error: whiten
by the weight, then the KLT; Gersho & Gray, "Vector Quantization and Signal Compression", 1992,
ch. 8): with W = (G + eps * mean eigenvalue * I)^(1/2) and V the PCA basis of the whitened
remainder `(x - mean - p) @ W` (variance descending),

    basis = W V,   synthesis = V^T W^-1   (exact inverses; for an orthonormal transform, as
                                           version 4's, synthesis = basis^T)

so a component's quantization error e_y costs KL |e_y|^2 whichever layer, K or V and component
it is in. Then one uniform step for every component of every layer and K/V is the reverse
water-filling bit allocation for an entropy-coded Gaussian source (Cover & Thomas, "Elements of
Information Theory", 13.3.3): every component above the water level gets the same cost in KL,
components whose spread is below the step round to zero and cost almost nothing. With per-element
noise step^2 / 12 in all D components of 2 L (layer, K/V) pairs, KL ~= 2 L D step^2 / 12, so

    step[level] = sqrt(12 * KVTC_LEVEL_KL[level] / (2 * L * s)),  s = D      (f32[L, 2], equal)

(`KVTCTransform.sensitivity` holds s per (layer, K/V): D for a whitened transform, the
isotropic probe's measurement in version 4, which whitened nothing). eps = 0.2
(`kv_calibration.WHITEN_EPS`) bounds how much the synthesis amplifies the error of a direction
the calibration saw as nearly free (at most 1 / sqrt(eps) times the mean). What it changed,
measured: see "Version 5" below.

Version 4 and before coded an orthonormal PCA with one step per (layer, K/V) from an isotropic
probe (noise added to a whole layer's K or V). The probe's number was dominated by the attention
sink (position 0, which kvtc codes apart: on SmolLM2 the sink's V carries 19-538x the Fisher
information of the other 511 tokens of a 512-token context together in layers 12-29), so every
token's V in those layers got fine steps for the sink's sake; and within a (layer, K/V) the
metric's eigenvalues spread over 3-5 orders of magnitude, which one step cannot follow.

Prediction (version 2) leaves the steps (so the error) as they were and shrinks what is coded:
the remainder keeps 5-25% of the KV's variance, and on real SmolLM2 KV (2,048 tokens of Alice in
Wonderland from token 1,000, chunks of 256, not part of any calibration text) the bytes per token at
version 2's levels 0 / 1 / 3 (predicted KL 0.003 / 0.006 / 0.024, round to nearest) go from
6,200 / 5,506 / 4,157 (version 1) to 4,937 / 4,306 / 3,170 with prediction (transform fitted on
the founding documents) and to 4,482 / 3,880 / 2,826 with the CC0 prose added to the calibration
text (development measurements; `scripts/kvtc_design.py` repeats them).
Predicting from one layer before instead of two costs 5% more bytes; without V's own K, 12% more.
Entropy coding of `q` (one model per band of components of a (layer, K/V)) is storage's job
(`kvjax.storage.format.entropy.encode_components`).

Quantization (version 3; each measured on the same Alice passage with `scripts/kvtc_design.py
--rounding_sweep`, bytes vs the sensitivity-weighted error, then with the reduced bench_codec
protocol, `scripts/bench_codec_reduced.py`, 5 book passages x 2,048 + 256 scored tokens):

  - Deadzone rounding. The encoder rounds toward zero with offset rho = KVTC_ROUNDING = 0.42
    instead of 0.5 (a uniform threshold quantizer with a wider zero bin, as H.264 encoders do:
    Sullivan & Wiegand, "Rate-distortion optimization for video compression", IEEE SPM 1998;
    the decoder is unchanged): about 2% fewer bytes at the same predicted KL (0.35: 1%, 0.28:
    worse). A decoder reconstruction offset toward zero (KVTC_RECON_OFFSET) saved about 1.5%
    with rho = 0.5 and nothing on top of rho = 0.42, so it is 0.
  - Per-component steps: multiplying the step of components by their spread relative to the
    step (x0.8 / x1.2 / x1.3 / x2 for sigma/step below 0.5, below 1, 1-4 or above 4) moved along
    the same bytes-vs-KL curve or below it (e.g. coarser steps for sigma/step < 1: 7% fewer bytes
    for 39% more predicted KL, where the uniform step gives 9% fewer bytes for that KL), so the
    step stays one per (layer, K/V), as reverse water-filling says. The sensitivity model has no
    per-component term (the probe adds isotropic noise), so nothing finer is supported by it.
  - Protected first token. The first position of a sequence (the attention sink, StreamingLLM,
    arXiv 2309.17453, section 3) is coded at a fraction of the step: 1/16 in versions 3-4, 1/64
    in version 5 (see there). Measured in version 3 (KL per token, same
    bytes): the first 4 tokens kept exact take the KL from 0.0087 / 0.0151 / 0.0174 to 0.0048 /
    0.0097 / 0.0110 at predicted KL 0.012 / 0.018 / 0.024; 16 exact tokens gain nothing more, and
    token 0 alone at 1/16 of the step gives the KL of 4 exact tokens (0.01095 at 0.024) for
    about 6 B/token on a 2,048-token prefix (chunk 0 only;
    `benchmarks/results/archive/kvtc_v3_reduced/development/`). A chunk is always
    decoded at the position it was encoded at (its prefix hash fixes it), so `start` tells both
    sides which tokens are protected; `kvtc_encode` and the decoders take it.
  - Level ladder (version 4): predicted KL per token 0.001 / 0.006 / 0.012 / 0.024 / 0.036;
    on the 20 x 4K-token protocol 5,468 / 3,768 / 3,198 / 2,685 / 2,412 stored B/token at
    perplexity x1.0011 / x1.0020 / x1.0100 / x1.0156 / x1.0133, LongChat outputs identical to
    raw 5/5, 2/5, 1/5, 1/5, 2/5 (`benchmarks/results/archive/kvtc_v4/`).

Version 5 (the Fisher-whitened transform above; calibration version 3 of
`kv_calibration`). Development measurements on 4 book passages x 2,048-token prefix + 256
scored tokens (order-0 entropy estimates of the codes, 2-core Intel Xeon VM): at equal measured
KL the whitened transform codes 37-45% fewer bytes than version 4's (e.g. 1,926 B/token at KL
0.0047 against 3,045 at 0.0058); a hybrid (the metric's shape within a layer, the isotropic
probe's scale across layers) did worse than version 4. eps: 0.1 and 0.3 as good as 0.2, 1.0
worse, 1000 (no whitening) much worse. Token 0's step: 1/16 -> 1/64 took the KL from 0.0047 to
0.0039 for about 4 B/token; 1/256 gained nothing more (token 0's largest code at level 0 is
12,929, within int16). The measured KL follows the ladder's prediction, so the ladder is
0.0005 / 0.003 / 0.006 / 0.009 / 0.018. The 20 x 4K-token protocol
(`benchmarks/results/archive/kvtc_v5/`, same passages and chunks as version 4's run):
    3,743 / 2,271 / 1,824 / 1,594 / 1,255 stored B/token at perplexity x1.0001 / x1.0049 /
    x1.0097 / x1.0103 / x1.0201 (95% t upper ends 1.0010 / 1.0104 / 1.0137 / 1.0156 / 1.0274;
    KL 0.00066 / 0.0038 / 0.0070 / 0.0105 / 0.0202), against version 4's 5,468 / 3,768 /
    3,198 / 2,685 / 2,412: level 1 codes 40% fewer bytes than version 4's level 1 at the same
    KL (0.0038 vs 0.0040), level 0 32% fewer at a perplexity ratio 10x closer to 1. Level 1 is
    the default (x1.0049; the upper end of its interval, 1.0104, touches the 1% line), level 2
    the smallest within 1% by its mean. LongChat outputs identical to raw: 4/5 / 3/5 / 2/5 at levels
    0-2, int8 4/5 (`longchat.json`).

Encode and decode are one `lax.scan` over layers each (the prediction is sequential), jit'd jnp:
the CPU path and the reference of any device kernel.

Payload (`KVTCPayload`): q: int16[L, 2, C, D]; step: f32[L, 2]; transform_id: uint8[16], the
transform's identity (`KVTCTransform.transform_id`, a BLAKE2b-128 digest of its arrays,
synthesis included, personalised `kvjax-kvtc-v5`). A chunk is decoded only with the transform it
names (the store client turns a mismatch into a miss); chunks of versions 1-4 (another
transform, token-0 step and level ladder: a stored level would not match a computed chunk's
under `kv_codec_consistent`) are `UnknownCodec` for the storage reader, so the store client
recomputes them.

Tensor parallelism. The transform spans all KV heads of a layer and the prediction all channels
of the two layers before, so a shard holding the KV heads S cannot decode its heads alone: the
payload (small: about 1/10 of the bf16 KV) is replicated to every shard and each shard runs the
whole scan (C x D x 7D MACs per layer and token block: the predictor and the inverse transform),
then keeps its own channels `x̂[..., S]`. The extra work is the other shards' channels, a few
percent of a prefill; no collective is needed. Encoding likewise runs on one shard after an
all-gather of the chunk's KV (or every shard encodes and one stores). A per-shard variant would
restrict the predictor and basis to block-diagonal per head group (the study measured per-head
PCA about 10% larger).

Not done here: rate-distortion optimized (trellis) quantization with the entropy coder's code
lengths, per-component sensitivity, and a Pallas kernel (the jnp reference is jit'd and is the
CPU path; on a GPU the scan is two matmuls per layer and K/V).

Sources: KVTC (KV cache transform coding, 2025); DPCM (Jayant & Noll 1984); PCA (Pearson 1901,
Hotelling 1933); CacheGen (arXiv 2310.07240) for comparison; KIVI (arXiv 2402.02750) for K/V
asymmetry.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.codecs import CODEC_LEVELS, KVTC as CODEC_KVTC
from kvjax.kernels.kv_codec_ref import rope_CH, write_chunk

#: Predicted KL(raw || kvtc) per token, nats, at each level (finest first).
KVTC_LEVEL_KL = (0.0005, 0.003, 0.006, 0.009, 0.018)
#: Encoder rounding offset: q = sign(y) * floor(|y| / step + KVTC_ROUNDING) (0.5: round to nearest;
#: below 0.5 widens the zero bin, a deadzone quantizer). Not stored: only the encoder uses it.
KVTC_ROUNDING = 0.42
#: Decoder reconstruction offset toward zero: y^ = sign(q) * (|q| - KVTC_RECON_OFFSET) * step.
#: Part of what a payload means (the codec version).
KVTC_RECON_OFFSET = 0.0
#: Protected first tokens: the first KVTC_PROTECT_TOKENS positions of a sequence (the attention
#: sinks of StreamingLLM, arXiv 2309.17453, section 3) are coded at KVTC_PROTECT_STEP x the step.
KVTC_PROTECT_TOKENS = 1
KVTC_PROTECT_STEP = 1.0 / 64
#: Largest code magnitude (int16, symmetric).
KVTC_QMAX = 32767
#: Bytes of a transform identity.
TRANSFORM_ID_BYTES = 16
#: Layers before l whose reconstruction predicts layer l.
PREDICT_DEPTH = 2
#: Predictor features per (layer, K/V), in units of D: PREDICT_DEPTH layers of K and V, then K of
#: the layer itself (used by V only).
PREDICT_FEATURES = 2 * PREDICT_DEPTH + 1


class KVTCPayload(NamedTuple):
  """A kvtc-coded chunk, before entropy coding.

  Attributes:
    q: int16[L, 2, C, D] component codes (D = K * H, components by descending variance).
    step: f32[L, 2] quantization step per layer and K/V (coefficient units).
    transform_id: uint8[16] identity of the transform the codes are in.
  """
  q: jax.Array
  step: jax.Array
  transform_id: jax.Array


@dataclasses.dataclass(frozen=True, eq=False)
class KVTCTransform:
  """A calibrated kvtc transform of one model (`kvjax.models.loading.kv_calibration` fits it).

  Attributes:
    mean: f32[L, 2, D] per-layer, K/V channel means (D = K * H, channels in (k, h) order).
    basis: f32[L, 2, D, D] orthonormal PCA bases of the prediction remainder; column j is
      component j (descending variance).
    variance: f32[L, 2, D] calibration variance of each remainder component.
    predictor: f32[L, 2, 5D, D] inter-layer predictor (module docstring; rows of features a
      layer lacks, e.g. K's own-K block or layers before 0, are zero).
    sensitivity: f32[L, 2] KL per token per unit of per-element noise variance, > 0.
    num_kv_heads: K.
    head_dim: H.

  Raises:
    ValueError: shapes or dtypes that do not agree, or a non-positive sensitivity.
  """

  mean: np.ndarray
  basis: np.ndarray
  variance: np.ndarray
  sensitivity: np.ndarray
  predictor: np.ndarray
  num_kv_heads: int
  head_dim: int
  synthesis: np.ndarray | None = None

  def __post_init__(self):
    if self.synthesis is None and isinstance(self.basis, np.ndarray) and self.basis.ndim == 4:
      # An orthonormal analysis basis is its own inverse (transposed).
      object.__setattr__(self, "synthesis",
                         np.ascontiguousarray(np.swapaxes(self.basis, -1, -2)))
    self._validate()

  def _validate(self):
    d = self.num_kv_heads * self.head_dim
    l_ = self.mean.shape[0] if self.mean.ndim == 3 else -1
    want = {"mean": (l_, 2, d), "basis": (l_, 2, d, d), "synthesis": (l_, 2, d, d),
            "variance": (l_, 2, d), "sensitivity": (l_, 2),
            "predictor": (l_, 2, PREDICT_FEATURES * d, d)}
    for name, shape in want.items():
      a = getattr(self, name)
      if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.shape != shape or l_ < 1:
        raise ValueError(f"KVTCTransform.{name} must be float32{list(shape)} (L, D={d}), got "
                         f"{getattr(a, 'dtype', type(a).__name__)}{list(getattr(a, 'shape', ()))}")
    if not (np.isfinite(self.sensitivity).all() and (self.sensitivity > 0).all()):
      raise ValueError("KVTCTransform.sensitivity must be finite and > 0")

  @property
  def num_layers(self) -> int:
    return self.mean.shape[0]

  @functools.cached_property
  def transform_id(self) -> bytes:
    """16 bytes: BLAKE2b-128 over the shapes and the bytes of every array."""
    h = hashlib.blake2b(digest_size=TRANSFORM_ID_BYTES, person=b"kvjax-kvtc-v5")
    h.update(np.asarray([self.num_layers, self.num_kv_heads, self.head_dim, PREDICT_DEPTH],
                        np.int64).tobytes())
    for a in (self.mean, self.basis, self.synthesis, self.variance, self.sensitivity,
              self.predictor):
      h.update(np.ascontiguousarray(a).tobytes())
    return h.digest()

  def steps(self, level: int) -> np.ndarray:
    """f32[L, 2] quantization steps at `level` (module docstring).

    Raises:
      ValueError: unknown level.
    """
    if level not in CODEC_LEVELS[CODEC_KVTC]:
      raise ValueError(f"kvtc has levels {list(CODEC_LEVELS[CODEC_KVTC])}, got {level!r}")
    kl = KVTC_LEVEL_KL[level]
    return np.sqrt(12.0 * kl / (2 * self.num_layers * self.sensitivity.astype(np.float64))
                   ).astype(np.float32)

  def device_arrays(self) -> "KVTCDeviceTransform":
    """The arrays encode and decode need, as device arrays (steps of every level stacked)."""
    steps = np.stack([self.steps(level) for level in CODEC_LEVELS[CODEC_KVTC]])
    return KVTCDeviceTransform(jnp.asarray(self.mean), jnp.asarray(self.basis),
                               jnp.asarray(self.synthesis), jnp.asarray(steps),
                               jnp.asarray(self.predictor),
                               jnp.asarray(np.frombuffer(self.transform_id, np.uint8)))


class KVTCDeviceTransform(NamedTuple):
  """Device copy of a transform: mean f32[L, 2, D], basis and synthesis f32[L, 2, D, D], steps
  f32[levels, L, 2], predictor f32[L, 2, 5D, D], transform_id uint8[16]."""
  mean: jax.Array
  basis: jax.Array
  synthesis: jax.Array
  steps: jax.Array
  predictor: jax.Array
  transform_id: jax.Array


def _as_device(transform) -> KVTCDeviceTransform:
  if isinstance(transform, KVTCTransform):
    return transform.device_arrays()
  if isinstance(transform, KVTCDeviceTransform):
    return transform
  raise ValueError(f"want a KVTCTransform or KVTCDeviceTransform, got {type(transform).__name__}")


def validate_payload(payload: KVTCPayload, transform: KVTCDeviceTransform | None = None
                     ) -> tuple[int, int, int]:
  """Checks a payload's shapes and dtypes (and its transform, if given); returns (L, C, D).

  Raises:
    ValueError: not a KVTCPayload, wrong shapes or dtypes, or a transform of another shape.
  """
  if not isinstance(payload, KVTCPayload):
    raise ValueError(f"not a kvtc payload: {type(payload).__name__}")
  q, step, tid = payload
  if q.ndim != 4 or q.shape[1] != 2 or jnp.dtype(q.dtype) != jnp.int16 or min(q.shape) < 1:
    raise ValueError(f"kvtc.q must be int16[L, 2, C, D], got {q.dtype}{list(q.shape)}")
  l_, _, c, d = q.shape
  if tuple(step.shape) != (l_, 2) or jnp.dtype(step.dtype) != jnp.float32:
    raise ValueError(f"kvtc.step must be float32[{l_}, 2], got {step.dtype}{list(step.shape)}")
  if tuple(tid.shape) != (TRANSFORM_ID_BYTES,) or jnp.dtype(tid.dtype) != jnp.uint8:
    raise ValueError(f"kvtc.transform_id must be uint8[16], got {tid.dtype}{list(tid.shape)}")
  if transform is not None and (tuple(transform.basis.shape) != (l_, 2, d, d) or tuple(
      transform.predictor.shape) != (l_, 2, PREDICT_FEATURES * d, d)):
    raise ValueError(f"kvtc payload for L={l_}, D={d}; transform basis "
                     f"{list(transform.basis.shape)}")
  return l_, c, d


# ---------------------------------------------------------------------------------------------
# jnp references (jit'd; the CPU path).


_HI = jax.lax.Precision.HIGHEST


def _quantize(y, step, rounding):
  """Deadzone quantizer (module docstring): int codes of coefficients y, as f32."""
  return jnp.clip(jnp.sign(y) * jnp.floor(jnp.abs(y) / step + rounding), -KVTC_QMAX, KVTC_QMAX)


def _reconstruct(q, step, offset):
  """Coefficients of codes q (f32): sign(q) * (|q| - offset) * step, and 0 for q = 0."""
  return jnp.sign(q) * jnp.maximum(jnp.abs(q) - offset, 0.0) * step


def token_step_scale(start, c: int) -> jax.Array:
  """f32[C]: the step multiplier of each token of a chunk of C tokens at position `start` (a
  traced int is fine): KVTC_PROTECT_STEP for the first KVTC_PROTECT_TOKENS positions of a
  sequence, 1 elsewhere."""
  pos = jnp.asarray(start, jnp.int32) + jnp.arange(c, dtype=jnp.int32)
  return jnp.where(pos < KVTC_PROTECT_TOKENS, jnp.float32(KVTC_PROTECT_STEP), jnp.float32(1))


def _scan_layers(t: KVTCDeviceTransform, step_L2, code_LaCD, encode: bool, scale_C,
                 rounding: float = None, offset: float = None):
  """The closed-loop scan over layers (module docstring).

  Args:
    t: the device transform.
    step_L2: f32[L, 2] steps.
    code_LaCD: encode: f32[L, 2, C, D] centred KV; decode: int16[L, 2, C, D] codes.
    encode: which of the two.
    scale_C: f32[C] step multiplier per token (`token_step_scale`).
    rounding: the encoder's rounding offset (default `KVTC_ROUNDING`).
    offset: the decoder's reconstruction offset (default `KVTC_RECON_OFFSET`).

  Returns:
    (q int16[L, 2, C, D] codes (decode: the given codes), r f32[L, 2, C, D] centred
    reconstruction).
  """
  rounding = KVTC_ROUNDING if rounding is None else rounding
  offset = KVTC_RECON_OFFSET if offset is None else offset
  _, _, c, d = code_LaCD.shape
  zero = jnp.zeros((2, c, d), jnp.float32)

  def one(x_or_q, pred, basis, synthesis, step):
    step = step * scale_C[:, None]                                      # [C, 1] (or [C, D])
    if encode:
      y = jnp.einsum("cd,de->ce", x_or_q - pred, basis, precision=_HI)
      q = _quantize(y, step, rounding)
    else:
      q = x_or_q.astype(jnp.float32)
    rec = pred + jnp.einsum("ce,ed->cd", _reconstruct(q, step, offset), synthesis,
                            precision=_HI)
    return q.astype(jnp.int16), rec

  def body(carry, inp):
    r1, r2 = carry
    code, predictor, basis, synthesis, step = inp
    f = jnp.concatenate([r1[0], r1[1], r2[0], r2[1]], axis=-1)          # [C, 4D]
    pk = jnp.einsum("cf,fd->cd", f, predictor[0, :4 * d], precision=_HI)
    qk, rk = one(code[0], pk, basis[0], synthesis[0], step[0])
    pv = jnp.einsum("cf,fd->cd", jnp.concatenate([f, rk], axis=-1), predictor[1], precision=_HI)
    qv, rv = one(code[1], pv, basis[1], synthesis[1], step[1])
    rec = jnp.stack([rk, rv])
    return (rec, r1), (jnp.stack([qk, qv]), rec)

  _, (q, r) = jax.lax.scan(body, (zero, zero),
                           (code_LaCD, t.predictor, t.basis, t.synthesis, step_L2))
  return q, r


def _encode(kv_L2CKH, t: KVTCDeviceTransform, level, start):
  l_, _, c, k, h = kv_L2CKH.shape
  x = kv_L2CKH.astype(jnp.float32).reshape(l_, 2, c, k * h) - t.mean[:, :, None]
  step = t.steps[level]                                                   # [L, 2]
  q, _ = _scan_layers(t, step, x, True, token_step_scale(start, c))
  finite = jnp.all(jnp.isfinite(kv_L2CKH))
  return KVTCPayload(q, step, t.transform_id), finite


def _dequantize(payload: KVTCPayload, t: KVTCDeviceTransform, k, h, start):
  q, step, _ = payload
  l_, _, c, d = q.shape
  _, r = _scan_layers(t, step.astype(jnp.float32), q, False, token_step_scale(start, c))
  return (r + t.mean[:, :, None]).reshape(l_, 2, c, k, h)


@functools.partial(jax.jit, static_argnames=("rounding", "offset"))
def experiment_round_trip(kv_L2CKH, t: KVTCDeviceTransform, step_L2, start=0, *,
                          rounding: float, offset: float):
  """Design experiments only (`scripts/kvtc_design.py`): codes and reconstruction of a chunk at
  position `start` at given steps (f32[L, 2], or f32[L, 2, D] per component) and
  rounding/reconstruction offsets, none of which is a stored format.

  Returns:
    (q int16[L, 2, C, D], x̂ f32[L, 2, C, K, H]).
  """
  l_, _, c, k, h = kv_L2CKH.shape
  x = kv_L2CKH.astype(jnp.float32).reshape(l_, 2, c, k * h) - t.mean[:, :, None]
  q, r = _scan_layers(t, step_L2, x, True, token_step_scale(start, c), rounding=rounding,
                      offset=offset)
  return q, (r + t.mean[:, :, None]).reshape(l_, 2, c, k, h)


@functools.partial(jax.jit, static_argnames=("level",))
def _encode_jit(kv_L2CKH, t, start, *, level):
  return _encode(kv_L2CKH, t, level, start)


def kvtc_encode(kv_L2CKH: jax.Array, transform, level: int, *, start
                ) -> tuple[KVTCPayload, jax.Array]:
  """Encodes a chunk (K before RoPE) with a kvtc transform, on the device (jit'd jnp).

  Callable inside another jit (the runner encodes all levels in one call).

  Args:
    kv_L2CKH: float32/bfloat16/float16[L, 2, C, K, H], K before RoPE, and V.
    transform: a `KVTCTransform` or its `device_arrays()` (pass the latter in hot paths).
    level: a kvtc level (0 finest .. 3 coarsest).
    start: position of the chunk's first token in its sequence, int >= 0 (may be traced): the
      first KVTC_PROTECT_TOKENS positions are coded at a finer step, and the decoder must be
      given the same start.

  Returns:
    (payload, finite): device arrays, and a bool scalar, False when the KV holds NaN/inf.

  Raises:
    ValueError: unknown level, a negative start, or a chunk whose shape does not match the
      transform.
  """
  t = _as_device(transform)
  _check_start(start)
  if level not in CODEC_LEVELS[CODEC_KVTC]:
    raise ValueError(f"kvtc has levels {list(CODEC_LEVELS[CODEC_KVTC])}, got {level!r}")
  shape = tuple(kv_L2CKH.shape)
  l_, _, d, _ = t.basis.shape
  if len(shape) != 5 or shape[1] != 2 or shape[0] != l_ or shape[3] * shape[4] != d:
    raise ValueError(f"kvtc chunk must be [L={l_}, 2, C, K, H] with K * H = {d}, got {shape}")
  return _encode_jit(kv_L2CKH, t, jnp.asarray(start, jnp.int32), level=int(level))


def _check_start(start) -> None:
  if isinstance(start, jax.core.Tracer):
    return
  if isinstance(start, bool) or not isinstance(start, (int, np.integer, np.ndarray, jax.Array)
                                               ) or np.ndim(start) != 0 or int(start) < 0:
    raise ValueError(f"kvtc start must be an int >= 0 (the chunk's first position), got "
                     f"{start!r}")


def kvtc_encode_host(kv_L2CKH: jax.Array, transform, level: int, *, start
                     ) -> dict[str, np.ndarray]:
  """`kvtc_encode`, then the payload on the host as `{name: np.ndarray}` (what storage codes).

  Raises:
    ValueError: NaN/inf in the chunk, or `kvtc_encode`'s errors.
  """
  payload, finite = kvtc_encode(kv_L2CKH, transform, level, start=start)
  if not bool(finite):
    raise ValueError(f"KV chunk {list(kv_L2CKH.shape)} holds NaN/inf; refusing to encode it")
  return {name: np.asarray(v) for name, v in payload._asdict().items()}


def payload_from_arrays(arrays: dict) -> KVTCPayload:
  """A `KVTCPayload` from `{name: array}` (what storage hands the engine).

  Raises:
    ValueError: missing or unexpected names, or shapes/dtypes that break the contract.
  """
  if not isinstance(arrays, dict) or set(arrays) != set(KVTCPayload._fields):
    got = sorted(arrays) if isinstance(arrays, dict) else type(arrays).__name__
    raise ValueError(f"kvtc payload needs arrays {list(KVTCPayload._fields)}, got {got}")
  payload = KVTCPayload(**{n: arrays[n] for n in KVTCPayload._fields})
  validate_payload(payload)
  return payload


def dequantize_reference(payload: KVTCPayload, transform, num_kv_heads: int,
                         head_dim: int, *, start) -> jax.Array:
  """f32[L, 2, C, K, H]: a payload of the chunk at position `start` back to K (before RoPE)
  and V.

  Raises:
    ValueError: a payload that breaks the contract or does not match the transform, or a
      negative start.
  """
  t = _as_device(transform)
  validate_payload(payload, t)
  _check_start(start)
  return _dequantize(payload, t, num_kv_heads, head_dim, jnp.asarray(start, jnp.int32))


@functools.partial(jax.jit, static_argnames=("k", "h"), donate_argnums=(2, 3))
def _decode_jit(payload, t, k_LBSKH, v_LBSKH, slot, start, cos_CH, sin_CH, *, k, h):
  kv = _dequantize(payload, t, k, h, start)
  k_LCKH = rope_CH(kv[:, 0], cos_CH.astype(jnp.float32)[:, None],
                   sin_CH.astype(jnp.float32)[:, None])
  return write_chunk(k_LBSKH, v_LBSKH, k_LCKH, kv[:, 1], slot, start)


def kvtc_decode(payload: KVTCPayload, transform: KVTCDeviceTransform, k_LBSKH: jax.Array,
                v_LBSKH: jax.Array, slot, start, cos_CH: jax.Array, sin_CH: jax.Array, *,
                use_pallas: bool = False) -> tuple[jax.Array, jax.Array]:
  """Decodes a kvtc chunk into a cache slot: dequantize, inverse transform, RoPE K, cast, write.

  One jit'd call with the caches donated (like `kv_codec.kv_decode`); `slot` and `start` are
  traced. The payload must be in `transform` (same `transform_id`); the caller checks that.

      cache [L, slots, S_max, K, H]:  slot `slot`, positions [start, start + C) <- the chunk

  Args:
    payload: a `KVTCPayload` of a chunk of C tokens.
    transform: the device transform the payload is coded in.
    k_LBSKH: [L, slots, S_max, K, H] key cache (after RoPE), float32/bfloat16/float16. Donated.
    v_LBSKH: value cache, same shape and dtype. Donated.
    slot: int32 scalar decode slot.
    start: int32 scalar position of the chunk's first token (the encoder's `start`).
    cos_CH: float[C, H] RoPE cosines at positions start..start + C - 1 (HF rotate_half layout).
    sin_CH: float[C, H] RoPE sines.
    use_pallas: must be False (no Pallas kernel for kvtc yet; the jnp path runs everywhere).

  Returns:
    (k_LBSKH, v_LBSKH), updated.

  Raises:
    ValueError: a payload or cache that does not match the transform, wrong cos/sin shapes,
      transform ids that differ, or use_pallas=True.
  """
  if use_pallas:
    raise ValueError("kvtc has no Pallas kernel yet; use use_pallas=False (jit'd jnp)")
  l_, c, d = validate_payload(payload, transform)
  shape = tuple(k_LBSKH.shape)
  if len(shape) != 5 or shape[0] != l_ or shape[3] * shape[4] != d or (
      tuple(v_LBSKH.shape) != shape):
    raise ValueError(f"caches {list(shape)} / {list(v_LBSKH.shape)} do not fit a kvtc payload "
                     f"of L={l_}, D={d}")
  if tuple(cos_CH.shape) != (c, shape[4]) or tuple(sin_CH.shape) != (c, shape[4]):
    raise ValueError(f"cos/sin must be [C={c}, H={shape[4]}], got {list(cos_CH.shape)}")
  if bytes(np.asarray(payload.transform_id)) != bytes(np.asarray(transform.transform_id)):
    raise ValueError("kvtc payload was coded with another transform")
  return _decode_jit(payload, transform, k_LBSKH, v_LBSKH, jnp.asarray(slot, jnp.int32),
                     jnp.asarray(start, jnp.int32), cos_CH, sin_CH, k=shape[3], h=shape[4])
