"""Calibrates a model's kvtc transform (`kvjax.kernels.kvtc`) from real KV of the model.

The text is `kvjax/data/calibration_text.txt`, public-domain US founding documents, followed by
`kvjax/data/calibration_prose.txt`, prose written for this package and dedicated to the public
domain (CC0): two short stories with dialogue, a user/assistant chat, a letter and an
expository piece; both are shipped in the package (so an installed kvjax calibrates without any
data directory). The prose is there because the transform fitted on the founding documents
alone codes other text less well: on 2,048 tokens of book text (Alice in Wonderland, not part of
either file) kvtc version 2 level 1 takes 4,306 B/token with the transform fitted on the founding
documents, 3,880 with the prose added, and 3,756 with a transform fitted on 4,096 tokens of two
other novels (development measurements, `kvjax/kernels/kvtc.py`). Steps:

1. Prefill passages of up to `passage_tokens` tokens of the text (slot 0, from position 0) and
   collect every layer's K (before RoPE) and V (f32[L, 2, T, D] on the host, D = K * H channels
   of all KV heads; at most `max_tokens` tokens: 8,192 x 30 layers x 2 x 192 x 4 B = 377 MB for
   SmolLM2, freed on return) and the per-(layer, K/V) channel means.
2. Predictor (`kvjax.kernels.kvtc`, module docstring): per (layer, K/V) a ridge regression of the
   centred KV on the centred KV of the two layers before (and, for V, the layer's own K),
   `P = (F^T F + lambda I)^-1 F^T X` with lambda = `RIDGE` x the mean diagonal of F^T F (the
   calibration text is short: 4,578 tokens for 5 D = 960 features). Fitted on the exact KV (open
   loop); the codec predicts from reconstructions, whose extra noise the ridge term stands for.
   Least squares fits each output channel on its own, so the metric below does not change it.
3. Whitened PCA of the regression's remainder (kvtc version 5): with G the metric of step 4 and
   W = (G + WHITEN_EPS * mean eigenvalue * I)^(1/2), the eigenvectors V of the covariance of
   `remainder @ W`, by descending eigenvalue (the component variances); the analysis basis is
   `W V` and the synthesis `V^T W^-1`. In these coordinates a unit of squared error costs the
   same KL in every component of every layer, K or V, so one quantization step everywhere is the
   reverse water-filling allocation (`kvjax.kernels.kvtc`). Eigenvector signs are fixed (largest
   |entry| positive) so the result does not depend on the LAPACK build's sign choice.
4. The metric (`kv_fisher`): the Fisher information of the next tokens' log-likelihood with
   respect to one context token's KV, per (layer, K/V), from gradients of sampled targets'
   log-likelihood (`CalibrationModel.context_kv_gradient`, a dense differentiable forward). It is
   computed before steps 2-3. It replaces version 4's isotropic probe (noise added to a whole
   layer's K or V over a context), which measured one number per layer and K/V and was
   dominated by the attention sink at position 0, which kvtc codes apart: on SmolLM2 (a
   512-token context of the calibration text) the sink's V carries 19-538x the Fisher
   information of the other 511 tokens together in layers 12-29, so the probe spent bits on
   every token's V in those layers for the sink's sake. Within a layer the metric is far from
   isotropic too (eigenvalues of one layer's metric spread over 3-5 orders of magnitude; the
   arithmetic over the geometric mean 2-22), which one step per (layer, K/V) cannot exploit.

Cost on the 2-core VM: the statistics prefill, the Fisher probe (6 windows x 4 samples of a
1,024-token context and 128 scored tokens, a forward and a gradient each) and the fit, a few
minutes once; far longer when the machine is shared.

`load_or_calibrate` caches the result as `kvtc-<fingerprint>-<text digest>-v<version>.npz` in the
params cache dir and recomputes it when missing (or unreadable).

Sources: KVTC (transform coding of the KV cache, calibrated once per model); PCA (Pearson 1901,
Hotelling 1933); transform coding under a weighted squared error (Gersho & Gray, "Vector
Quantization and Signal Compression", 1992, ch. 8: whiten by the weight, then the KLT); the
Fisher information as the KL's quadratic term (Amari 1998).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.resources
import logging
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.kernels.kvtc import PREDICT_DEPTH, PREDICT_FEATURES, KVTCTransform

_log = logging.getLogger(__name__)

#: Bump when the calibration procedure changes (invalidates cached transforms).
CALIBRATION_VERSION = 3
#: Default sizes (tokens).
PASSAGE_TOKENS = 1024
MAX_CALIBRATION_TOKENS = 8192
#: Fisher probe: contexts of FISHER_CONTEXT tokens of the text, each followed by FISHER_TAIL
#: scored tokens; FISHER_SAMPLES target sequences sampled from the model per context.
FISHER_CONTEXT = 1024
FISHER_TAIL = 128
FISHER_SAMPLES = 4
#: Regularisation of the metric before whitening: G + WHITEN_EPS * (trace(G) / D) * I, so no
#: direction's error is amplified by more than 1 / sqrt(WHITEN_EPS) relative to the mean.
WHITEN_EPS = 0.2
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


def _fix_signs(basis_DD: np.ndarray) -> np.ndarray:
  idx = np.argmax(np.abs(basis_DD), axis=0)
  signs = np.sign(basis_DD[idx, np.arange(basis_DD.shape[1])])
  signs[signs == 0] = 1
  return basis_DD * signs


def _whitening(metric_DD: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
  """(W, W^-1) with W = (G + eps * mean eigenvalue * I)^(1/2), G the symmetrised metric."""
  d = metric_DD.shape[0]
  g = (metric_DD + metric_DD.T) / 2
  g = g + eps * max(float(np.trace(g)) / d, 1e-30) * np.eye(d)
  w, v = np.linalg.eigh(g)
  w = np.maximum(w, 1e-30 * max(float(w.max()), 1e-30))
  return (v * np.sqrt(w)) @ v.T, (v / np.sqrt(w)) @ v.T


def _fit(x, predict: bool = True, metric=None, eps: float = WHITEN_EPS):
  """Steps 2-3 on the calibration KV x: f32[L, 2, T, D], centred in place (predict=False: a zero
  predictor, i.e. the transform of the KV itself).

  With `metric` (f64[L, 2, D, D], step 4's Fisher metric) the basis is the PCA of the
  remainder whitened by the regularised metric (analysis `W V`, synthesis `V^T W^-1`); without
  it the plain PCA (orthonormal: synthesis = basis^T).

  Returns:
    (mean f64[L, 2, D], basis, synthesis, variance, predictor).
  """
  l_, _, _, d = x.shape
  mean = x.astype(np.float64).mean(axis=2)
  x -= mean[:, :, None].astype(np.float32)
  # 2. Predictor and 3. (whitened) PCA of the remainder, per (layer, K/V).
  nf = PREDICT_FEATURES * d
  predictor = np.zeros((l_, 2, nf, d), np.float64)
  basis = np.empty((l_, 2, d, d), np.float64)
  synthesis = np.empty((l_, 2, d, d), np.float64)
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
      w_dd, w_inv = (np.eye(d), np.eye(d)) if metric is None else _whitening(metric[li, a], eps)
      z = rem @ w_dd
      cov = z.T @ z / len(z)
      ev, vec = np.linalg.eigh((cov + cov.T) / 2)
      order = np.argsort(-ev, kind="stable")
      variance[li, a] = np.maximum(ev[order], 0)
      vec = _fix_signs(vec[:, order])
      basis[li, a] = w_dd @ vec
      synthesis[li, a] = vec.T @ w_inv
  return mean, basis, synthesis, variance, predictor


def fit_transform(kv_L2TD: np.ndarray, sensitivity: np.ndarray | None, num_kv_heads: int,
                  head_dim: int, *, predict: bool = True, metric: np.ndarray | None = None,
                  eps: float = WHITEN_EPS) -> KVTCTransform:
  """A kvtc transform fitted to given KV (steps 2-3) (for tests, and for transforms fitted on
  other data than the shipped text).

  Args:
    kv_L2TD: float[L, 2, T, D] KV (K before RoPE, and V), D = num_kv_heads * head_dim.
    sensitivity: float[L, 2] > 0, KL per token per unit of per-element noise variance of the
      coded coefficients; None with a metric (whitened coefficients all weigh the same: D).
    predict: False fits no predictor (zeros).
    metric: float[L, 2, D, D] KV metric (`kv_fisher`) to whiten by; None: plain PCA.
    eps: the whitening's regularisation (`WHITEN_EPS`).

  Raises:
    ValueError: inconsistent shapes, no sensitivity without a metric, or `KVTCTransform`'s
      errors.
  """
  x = np.array(kv_L2TD, np.float32)
  d = num_kv_heads * head_dim
  if x.ndim != 4 or x.shape[1] != 2 or x.shape[3] != d:
    raise ValueError(f"kv must be [L, 2, T, {d}], got {list(x.shape)}")
  if metric is not None and tuple(np.shape(metric)) != (x.shape[0], 2, d, d):
    raise ValueError(f"metric must be [L, 2, {d}, {d}], got {list(np.shape(metric))}")
  if sensitivity is None:
    if metric is None:
      raise ValueError("a transform without a metric needs its sensitivity")
    sensitivity = np.full((x.shape[0], 2), float(d))
  mean, basis, synthesis, variance, predictor = _fit(x, predict, metric, eps)
  return KVTCTransform(mean.astype(np.float32), basis.astype(np.float32),
                       variance.astype(np.float32), np.asarray(sensitivity, np.float32),
                       predictor.astype(np.float32), num_kv_heads, head_dim,
                       synthesis=synthesis.astype(np.float32))


def kv_fisher(model, token_ids, *, context: int = FISHER_CONTEXT, tail: int = FISHER_TAIL,
              samples: int = FISHER_SAMPLES, seed: int = 0,
              on_gradient: Callable[[], None] | None = None) -> np.ndarray:
  """Step 4: the Fisher metric of the KV of one context token, per (layer, K/V).

  For each window of `context + tail` tokens of `token_ids`: prefill the context (K before
  RoPE, V), compute the model's distribution over the `tail` tokens after it
  (`CalibrationModel.logits_after_context`), draw `samples` target sequences from it, and accumulate
  g g^T over the context positions 1.. (position 0, the attention sink, is coded apart) of the
  gradient g of the targets' log-likelihood with respect to each token's K or V
  (`CalibrationModel.context_kv_gradient`). With targets drawn from the model, E[g g^T] is the Fisher
  information F, so small independent noise e_j on the context tokens' KV costs
  KL(p || p_noisy) ~= sum_j e_j^T F_j e_j / 2 summed over the scored tokens (Amari, "Natural
  gradient works efficiently in learning", Neural Computation 1998; the quadratic term of the
  KL). The result is that KL per scored token when every context token carries noise of the
  same covariance Sigma, `trace(G Sigma)`:

      G[l, a] = sum_{windows, samples, j >= 1} g_j g_j^T / (2 * tail * samples * windows)

  Args:
    model: a `kvjax.models.nn.calibration_model.CalibrationModel`.
    token_ids: the calibration tokens (at least context + tail of them).
    context, tail, samples, seed: the probe's sizes and the sampling seed.
    on_gradient: called after each of the `samples` gradients of each window (progress).

  Returns:
    f64[L, 2, D, D], symmetric positive semi-definite.

  Raises:
    ValueError: too few tokens.
  """
  cfg = model.model_config
  l_, k, h = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
  d, ids, window = k * h, list(token_ids), context + tail
  if len(ids) < window or context < 2:
    raise ValueError(f"the Fisher probe needs {window} tokens (context >= 2), got {len(ids)}")
  rng = np.random.default_rng(seed)
  acc = np.zeros((l_, 2, d, d), np.float64)
  windows = 0
  for w0 in range(0, len(ids) - window + 1, window):
    ctx, scored = ids[w0:w0 + context], ids[w0 + context:w0 + window]
    k_pre, v = (np.asarray(a, np.float32) for a in model.context_kv(ctx))
    logits = np.asarray(model.logits_after_context(k_pre, v, scored), np.float64)
    probs = np.exp(logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True))
    for _ in range(samples):
      # Inverse-CDF sampling per position (deterministic for a seed, backend-independent).
      u = rng.random(len(scored))
      targets = np.minimum((np.cumsum(probs, axis=-1) < u[:, None]).sum(axis=-1),
                           probs.shape[-1] - 1)
      g_k, g_v = model.context_kv_gradient(k_pre, v, scored, targets)
      g = np.stack([np.asarray(g_k, np.float64), np.asarray(g_v, np.float64)], axis=1)
      g = g[:, :, 1:].reshape(l_, 2, context - 1, d)
      acc += np.einsum("latd,late->lade", g, g)
      if on_gradient is not None:
        on_gradient()
    windows += 1
  return acc / (2.0 * tail * samples * windows)


def calibrate_kvtc(model, token_ids, *, passage_tokens: int = PASSAGE_TOKENS,
                   max_tokens: int = MAX_CALIBRATION_TOKENS, fisher_context: int = FISHER_CONTEXT,
                   fisher_tail: int = FISHER_TAIL, fisher_samples: int = FISHER_SAMPLES,
                   eps: float = WHITEN_EPS, seed: int = 0,
                   progress: Callable[[int, int], None] | None = None) -> KVTCTransform:
  """Fits a kvtc transform from the model's KV of `token_ids` (module docstring).

  Args:
    model: a `kvjax.models.nn.calibration_model.CalibrationModel` (no KV cache is used).
    token_ids: the calibration tokens (at least 2 * D of them, and a Fisher window).
    passage_tokens: tokens per prefilled passage (capped at the model's max_seq_len).
    max_tokens: at most this many tokens are used for the statistics.
    fisher_context, fisher_tail, fisher_samples: the Fisher probe's sizes (`kv_fisher`;
      context + tail capped at the model's max_seq_len).
    eps: the whitening's regularisation.
    seed: seed of the probe's sampled targets.
    progress: called with (steps done, steps in all) after each step: each prefilled passage,
      each Fisher gradient (windows x samples), and the fit; what it raises propagates (a
      cancelled start-up).

  Returns:
    The transform (float32 arrays, deterministic for given weights, tokens and seed).

  Raises:
    ValueError: too few tokens.
  """
  cfg = model.model_config
  l_, k, h = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
  d = k * h
  ids = list(token_ids)[:max_tokens]
  passage = min(passage_tokens, model.max_seq_len)
  fisher_context = min(fisher_context, model.max_seq_len // 2)
  fisher_tail = min(fisher_tail, model.max_seq_len - fisher_context)
  if len(ids) < max(fisher_context + fisher_tail, 2 * d):
    raise ValueError(f"calibration needs at least {max(fisher_context + fisher_tail, 2 * d)} "
                     f"tokens, got {len(ids)}")
  starts = [p0 for p0 in range(0, len(ids), passage) if len(ids[p0:p0 + passage]) >= 16]
  total = len(starts) + fisher_samples * (len(ids) // (fisher_context + fisher_tail)) + 1
  done = 0

  def step():
    nonlocal done
    done += 1
    if progress is not None:
      progress(done, total)

  # 1. The calibration KV, f32[L, 2, T, D] on the host.
  pieces = []
  for p0 in starts:
    kk, vv = model.context_kv(ids[p0:p0 + passage])
    kk = np.asarray(kk, np.float32).reshape(l_, -1, d)
    vv = np.asarray(vv, np.float32).reshape(l_, -1, d)
    pieces.append(np.stack([kk, vv], axis=1))                          # [L, 2, T, D]
    step()
  x = np.concatenate(pieces, axis=2)
  del pieces
  # 4. The Fisher metric (before the fit, which whitens by it).
  metric = kv_fisher(model, ids, context=fisher_context, tail=fisher_tail,
                     samples=fisher_samples, seed=seed, on_gradient=step)
  # 2-3. Predictor and whitened PCA.
  t = fit_transform(x, None, k, h, metric=metric, eps=eps)
  step()
  return t


_ARRAYS = ("mean", "basis", "variance", "sensitivity", "predictor", "synthesis")


def cache_file_name(fingerprint: str) -> str:
  """The cache file name of a model's transform: fingerprint, text digest, procedure version."""
  text = hashlib.sha256(calibration_text().encode("utf-8")).hexdigest()[:12]
  return f"kvtc-{fingerprint[:32]}-{text}-v{CALIBRATION_VERSION}.npz"


def load_transform(path: str, num_kv_heads: int, head_dim: int) -> KVTCTransform:
  """A transform saved by `load_or_calibrate` (an .npz of mean, basis, variance, sensitivity,
  predictor, synthesis).

  Raises:
    OSError: unreadable file. KeyError: a missing array. ValueError: inconsistent arrays.
  """
  with np.load(path) as f:
    a = {n: np.asarray(f[n], np.float32) for n in _ARRAYS}
  return KVTCTransform(a["mean"], a["basis"], a["variance"], a["sensitivity"], a["predictor"],
                       num_kv_heads, head_dim, synthesis=a["synthesis"])


def load_or_calibrate(model, tokenizer, fingerprint: str, cache_dir: str | None,
                      progress: Callable[[int, int], None] | None = None,
                      **kwargs) -> KVTCTransform:
  """The model's kvtc transform: from `cache_dir` if cached there, else calibrated (and cached).

  Args:
    model: the model's `kvjax.models.nn.calibration_model.CalibrationModel`.
    tokenizer: encodes the calibration text (`encode(text) -> list[int]`).
    fingerprint: the model fingerprint (cache key).
    cache_dir: the params cache directory; None caches nothing.
    progress: `calibrate_kvtc`'s (called only when calibrating).
    **kwargs: `calibrate_kvtc` sizes.

  Returns:
    The transform.

  Raises:
    ValueError: `calibrate_kvtc`'s errors.
  """
  cfg = model.model_config
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
  t = calibrate_kvtc(model, ids, progress=progress, **kwargs)
  if path:
    os.makedirs(cache_dir, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp.npz"
    np.savez(tmp, **{n: getattr(t, n) for n in _ARRAYS})
    os.replace(tmp, path)
  return t
