"""Calibrates a model's kvtc transform (`kvjax.kernels.kvtc`) from real KV of the model.

The text is `kvjax/data/calibration_text.txt`, public-domain US founding documents, followed by
`kvjax/data/calibration_prose.txt`, prose written for this package and dedicated to the public
domain (CC0): two short stories with dialogue, a user/assistant chat, a letter and an
expository piece; both are shipped in the package (so an installed kvjax calibrates without any
data directory). The prose is there because the transform fitted on the founding documents
alone codes other text less well: on 2,048 tokens of book text (Alice in Wonderland, not part of
either file) kvtc version 2 level 1 takes 4,306 B/token with the transform fitted on the founding
documents, 3,880 with the prose added, and 3,756 with a transform fitted on 4,096 tokens of two
other novels (development measurements, `kvjax/kernels/kvtc.py`). Cost on the 2-core VM: the
statistics prefill and the fit (about 80 s of ridge solves and eigendecompositions) plus 60
sensitivity probes, a few minutes once; far longer when the machine is shared. Steps:

1. Prefill passages of up to `passage_tokens` tokens of the text (slot 0, from position 0) and
   collect every layer's K (before RoPE) and V (f32[L, 2, T, D] on the host, D = K * H channels
   of all KV heads; at most `max_tokens` tokens: 8,192 x 30 layers x 2 x 192 x 4 B = 377 MB for
   SmolLM2, freed on return) and the per-(layer, K/V) channel means.
2. Predictor (`kvjax.kernels.kvtc`, module docstring): per (layer, K/V) a ridge regression of the
   centred KV on the centred KV of the two layers before (and, for V, the layer's own K),
   `P = (F^T F + lambda I)^-1 F^T X` with lambda = `RIDGE` x the mean diagonal of F^T F (the
   calibration text is short: 4,578 tokens for 5 D = 960 features). Fitted on the exact KV (open
   loop); the codec predicts from reconstructions, whose extra noise the ridge term stands for.
3. PCA of the regression's remainder: eigenvectors of its covariance, by descending eigenvalue
   (the basis), and eigenvalues (the component variances). Eigenvector signs are fixed (largest
   |entry| positive) so the result does not depend on the LAPACK build's sign choice.
4. Sensitivity: prefill a context of `sens_context` tokens, then for each (layer, K/V) add
   Gaussian noise of variance `sigma^2 = (SENS_NOISE_REL)^2 * mean channel variance` to that
   layer's K or V cache over the whole context and prefill the next `sens_tokens` tokens with
   all logits; `s = mean KL(clean || noisy) per token / sigma^2`. Noise in the post-RoPE K cache
   has the distribution of noise before RoPE (RoPE is a rotation of channel pairs). Values are
   clamped below at 1e-3 of the median, so a layer that measured no loss still gets finite steps.

`load_or_calibrate` caches the result as `kvtc-<fingerprint>-<text digest>-v<version>.npz` in the
params cache dir and recomputes it when missing (or unreadable).

Sources: KVTC (transform coding of the KV cache, calibrated once per model); PCA (Pearson 1901,
Hotelling 1933).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.resources
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.kernels.kvtc import PREDICT_DEPTH, PREDICT_FEATURES, KVTCTransform

_log = logging.getLogger(__name__)

#: Bump when the calibration procedure changes (invalidates cached transforms).
CALIBRATION_VERSION = 2
#: Noise std of the sensitivity probe, relative to the RMS of the (layer, K/V) channels.
SENS_NOISE_REL = 0.1
#: Default sizes (tokens).
PASSAGE_TOKENS = 1024
MAX_CALIBRATION_TOKENS = 8192
SENS_CONTEXT = 512
SENS_TOKENS = 128
#: Ridge strength of the predictor fit, relative to the mean diagonal of the Gram matrix.
RIDGE = 1e-2


#: The shipped calibration texts, in order (the sensitivity probe reads the start of the first).
CALIBRATION_FILES = ("calibration_text.txt", "calibration_prose.txt")


def calibration_text() -> str:
  """The shipped public-domain calibration text: the Declaration of Independence and the US
  Constitution, then prose written for kvjax (CC0), separated by a blank line."""
  data = importlib.resources.files("kvjax.data")
  return "\n\n".join(data.joinpath(name).read_text(encoding="utf-8").strip()
                      for name in CALIBRATION_FILES)


def _prefill(runner, ids, start: int, all_logits: bool = False):
  """Prefills `ids` into slot 0 from `start`, in runner-sized pieces; returns the outputs."""
  outs, pos = [], start
  step = runner.max_chunk_size
  for i in range(0, len(ids), step):
    piece = ids[i:i + step]
    outs.append(runner.prefill_chunk(piece, 0, pos, all_logits=all_logits))
    pos += len(piece)
  return outs


def _fix_signs(basis_DD: np.ndarray) -> np.ndarray:
  idx = np.argmax(np.abs(basis_DD), axis=0)
  signs = np.sign(basis_DD[idx, np.arange(basis_DD.shape[1])])
  signs[signs == 0] = 1
  return basis_DD * signs


def _fit(x, predict: bool = True):
  """Steps 2-3 on the calibration KV x: f32[L, 2, T, D], centred in place (predict=False: a zero
  predictor, i.e. the PCA of the KV itself, kvtc version 1's transform).

  Returns:
    (channel variance f64[L, 2], mean f64[L, 2, D], basis, variance, predictor).
  """
  l_, _, _, d = x.shape
  mean = x.astype(np.float64).mean(axis=2)
  x -= mean[:, :, None].astype(np.float32)
  # Mean channel variance per (layer, K/V): the sensitivity probe's noise level.
  channel_var = np.stack([[float(np.mean(np.square(x[li, a], dtype=np.float64)))
                           for a in range(2)] for li in range(l_)])
  # 2. Predictor and 3. PCA of the remainder, per (layer, K/V).
  nf = PREDICT_FEATURES * d
  predictor = np.zeros((l_, 2, nf, d), np.float64)
  basis = np.empty((l_, 2, d, d), np.float64)
  variance = np.empty((l_, 2, d), np.float64)
  for li in range(l_):
    prev = [x[li - j, a] if li - j >= 0 else np.zeros_like(x[0, 0])
            for j in range(1, PREDICT_DEPTH + 1) for a in range(2)]
    for a in range(2):
      feats = np.concatenate(prev + [x[li, 0] if a == 1 else np.zeros_like(x[0, 0])],
                             axis=1).astype(np.float64)                 # [T, 5D]
      target = x[li, a].astype(np.float64)
      gram = feats.T @ feats
      lam = RIDGE * max(float(np.trace(gram)) / nf, 1e-12)
      live = np.diag(gram) > 0                                          # rows of real features
      p = np.zeros((nf, d))
      if live.any() and predict:
        g = gram[np.ix_(live, live)] + lam * np.eye(int(live.sum()))
        p[live] = np.linalg.solve(g, feats[:, live].T @ target)
      predictor[li, a] = p
      rem = target - feats @ p
      cov = rem.T @ rem / len(rem)
      w, v = np.linalg.eigh((cov + cov.T) / 2)
      order = np.argsort(-w, kind="stable")
      variance[li, a] = np.maximum(w[order], 0)
      basis[li, a] = _fix_signs(v[:, order])
  return channel_var, mean, basis, variance, predictor


def fit_transform(kv_L2TD: np.ndarray, sensitivity: np.ndarray, num_kv_heads: int,
                  head_dim: int, *, predict: bool = True) -> KVTCTransform:
  """A kvtc transform fitted to given KV (steps 2-3) with given sensitivities (for tests, and for
  transforms fitted on other data than the shipped text).

  Args:
    kv_L2TD: float[L, 2, T, D] KV (K before RoPE, and V), D = num_kv_heads * head_dim.
    sensitivity: float[L, 2] > 0.
    predict: False fits no predictor (zeros; the basis is the PCA of the KV itself).

  Raises:
    ValueError: inconsistent shapes, or `KVTCTransform`'s errors.
  """
  x = np.array(kv_L2TD, np.float32)
  if x.ndim != 4 or x.shape[1] != 2 or x.shape[3] != num_kv_heads * head_dim:
    raise ValueError(f"kv must be [L, 2, T, {num_kv_heads * head_dim}], got {list(x.shape)}")
  _, mean, basis, variance, predictor = _fit(x, predict)
  return KVTCTransform(mean.astype(np.float32), basis.astype(np.float32),
                       variance.astype(np.float32), np.asarray(sensitivity, np.float32),
                       predictor.astype(np.float32), num_kv_heads, head_dim)


def calibrate_kvtc(runner, token_ids, *, passage_tokens: int = PASSAGE_TOKENS,
                   max_tokens: int = MAX_CALIBRATION_TOKENS, sens_context: int = SENS_CONTEXT,
                   sens_tokens: int = SENS_TOKENS, seed: int = 0) -> KVTCTransform:
  """Fits a kvtc transform from the model's KV of `token_ids` (module docstring).

  Uses slot 0 of `runner` and resets its cache afterwards (call before serving).

  Args:
    runner: a `kvjax.models.runner.ModelRunner`.
    token_ids: the calibration tokens (at least sens_context + sens_tokens of them).
    passage_tokens: tokens per prefilled passage (capped at the runner's max_seq_len).
    max_tokens: at most this many tokens are used for the statistics.
    sens_context: context tokens of the sensitivity probe.
    sens_tokens: scored tokens of the sensitivity probe.
    seed: PRNG seed of the probe noise.

  Returns:
    The transform (float32 arrays, deterministic for given weights, tokens and seed).

  Raises:
    ValueError: too few tokens.
  """
  cfg = runner.model_config
  l_, k, h = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
  d = k * h
  ids = list(token_ids)[:max_tokens]
  passage = min(passage_tokens, runner.max_seq_len)
  sens_context = min(sens_context, runner.max_seq_len // 2)
  sens_tokens = min(sens_tokens, runner.max_seq_len - sens_context)
  if len(ids) < max(sens_context + sens_tokens, 2 * d):
    raise ValueError(f"calibration needs at least {max(sens_context + sens_tokens, 2 * d)} "
                     f"tokens, got {len(ids)}")
  # 1. The calibration KV, f32[L, 2, T, D] on the host.
  pieces = []
  for p0 in range(0, len(ids), passage):
    piece = ids[p0:p0 + passage]
    if len(piece) < 16:
      break
    for out in _prefill(runner, piece, 0):
      kk = np.asarray(out.k_pre_rope_LTKH, np.float32).reshape(l_, -1, d)
      vv = np.asarray(out.v_LTKH, np.float32).reshape(l_, -1, d)
      pieces.append(np.stack([kk, vv], axis=1))                        # [L, 2, T, D]
  x = np.concatenate(pieces, axis=2)
  del pieces
  channel_var, mean, basis, variance, predictor = _fit(x)
  del x
  # 4. Sensitivity.
  ctx, tail = ids[:sens_context], ids[sens_context:sens_context + sens_tokens]
  runner.reset()
  _prefill(runner, ctx, 0)
  base = jax.tree_util.tree_map(jnp.copy, runner.cache)

  def logp(cache):
    runner.cache = jax.tree_util.tree_map(jnp.copy, cache)
    outs = _prefill(runner, tail, sens_context, all_logits=True)
    logits = np.concatenate([np.asarray(o.logits, np.float64) for o in outs])
    return logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)

  clean = logp(base)
  rng = np.random.default_rng(seed)
  sens = np.empty((l_, 2), np.float64)
  for li in range(l_):
    for a in range(2):
      sigma2 = SENS_NOISE_REL ** 2 * float(channel_var[li, a])
      noise = rng.normal(size=(sens_context, k, h)) * np.sqrt(sigma2)
      cache_arr = base.k_LBSKH if a == 0 else base.v_LBSKH
      noisy = cache_arr.at[li, 0, :sens_context].add(jnp.asarray(noise, cache_arr.dtype))
      cache = (dataclasses.replace(base, k_LBSKH=noisy) if a == 0
               else dataclasses.replace(base, v_LBSKH=noisy))
      lp = logp(cache)
      kl = float(np.mean(np.sum(np.exp(clean) * (clean - lp), axis=-1)))
      sens[li, a] = max(kl, 0.0) / sigma2 if sigma2 > 0 else 0.0
  runner.reset()
  floor = max(1e-3 * float(np.median(sens)), 1e-12)
  sens = np.maximum(sens, floor)
  return KVTCTransform(mean.astype(np.float32), basis.astype(np.float32),
                       variance.astype(np.float32), sens.astype(np.float32),
                       predictor.astype(np.float32), k, h)


_ARRAYS = ("mean", "basis", "variance", "sensitivity", "predictor")


def cache_file_name(fingerprint: str) -> str:
  """The cache file name of a model's transform: fingerprint, text digest, procedure version."""
  text = hashlib.sha256(calibration_text().encode("utf-8")).hexdigest()[:12]
  return f"kvtc-{fingerprint[:32]}-{text}-v{CALIBRATION_VERSION}.npz"


def load_transform(path: str, num_kv_heads: int, head_dim: int) -> KVTCTransform:
  """A transform saved by `load_or_calibrate` (an .npz of mean, basis, variance, sensitivity,
  predictor).

  Raises:
    OSError: unreadable file. KeyError: a missing array. ValueError: inconsistent arrays.
  """
  with np.load(path) as f:
    return KVTCTransform(*(np.asarray(f[n], np.float32) for n in _ARRAYS), num_kv_heads,
                         head_dim)


def load_or_calibrate(runner, tokenizer, fingerprint: str, cache_dir: str | None,
                      **kwargs) -> KVTCTransform:
  """The model's kvtc transform: from `cache_dir` if cached there, else calibrated (and cached).

  Args:
    runner: the model's `ModelRunner` (its slot 0 is used and reset when calibrating).
    tokenizer: encodes the calibration text (`encode(text) -> list[int]`).
    fingerprint: the model fingerprint (cache key).
    cache_dir: the params cache directory; None caches nothing.
    **kwargs: `calibrate_kvtc` sizes.

  Returns:
    The transform.

  Raises:
    ValueError: `calibrate_kvtc`'s errors.
  """
  cfg = runner.model_config
  path = os.path.join(cache_dir, cache_file_name(fingerprint)) if cache_dir else None
  if path and os.path.isfile(path):
    try:
      t = load_transform(path, cfg.n_kv_heads, cfg.head_dim)
      if t.num_layers == cfg.n_layers:
        return t
    except (OSError, ValueError, KeyError) as e:
      _log.warning("kvtc transform cache %s unreadable (%r); recalibrating", path, e)
  ids = tokenizer.encode(calibration_text())
  _log.warning("calibrating the kvtc transform of this model on %d tokens of shipped text (once "
               "per model: a few minutes on a 2-core CPU; cached as %s)", len(ids),
               path or "nothing: no cache_dir")
  t = calibrate_kvtc(runner, ids, **kwargs)
  if path:
    os.makedirs(cache_dir, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp.npz"
    np.savez(tmp, **{n: getattr(t, n) for n in _ARRAYS})
    os.replace(tmp, path)
  return t
