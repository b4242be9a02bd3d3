"""Host-side token sampling from one row of logits (numpy; f32[V] in, a token id out)."""

from __future__ import annotations

import numpy as np

from kvjax.scheduler.request import SamplingParams


def log_softmax(logits_V: np.ndarray) -> np.ndarray:
  """f64[V] log-probabilities of f32[V] logits."""
  x = logits_V.astype(np.float64)
  x = x - x.max()
  return x - np.log(np.exp(x).sum())


def sample_token(logits_V: np.ndarray, params: SamplingParams, rng: np.random.Generator,
                 allowed_V: np.ndarray | None = None) -> int:
  """Picks the next token: greedy at temperature 0, else temperature, top-k, top-p sampling.

  Args:
    logits_V: f32[V] raw next-token logits.
    params: sampling settings.
    rng: the request's generator (seeded from `params.seed` when given).
    allowed_V: bool[V], the tokens a grammar allows (`kvjax/engine/grammar.py`; at least one
      True), or None: all. The others' logits are -inf before anything else.
  """
  if allowed_V is not None:
    logits_V = np.where(allowed_V, logits_V, -np.inf)
  if params.temperature == 0:
    return int(np.argmax(logits_V))
  x = logits_V.astype(np.float64) / params.temperature
  if 0 < params.top_k < x.shape[0]:
    kth = np.partition(x, -params.top_k)[-params.top_k]
    x = np.where(x >= kth, x, -np.inf)
  probs = np.exp(x - x.max())
  probs /= probs.sum()
  if params.top_p < 1.0:
    order = np.argsort(-probs, kind="stable")
    cum = np.cumsum(probs[order])
    keep = cum - probs[order] < params.top_p  # keep tokens until the mass reaches top_p
    mask = np.zeros_like(probs, bool)
    mask[order[keep]] = True
    probs = np.where(mask, probs, 0.0)
    probs /= probs.sum()
  return int(rng.choice(probs.shape[0], p=probs))


def top_logprobs(logits_V: np.ndarray, k: int, token_id: int) -> dict[int, float]:
  """Log-probabilities of the k most likely tokens plus the sampled one (vLLM's convention).

  Log-probabilities are of the model's raw distribution, before temperature or filtering.
  """
  lp = log_softmax(logits_V)
  ids = np.argsort(-lp, kind="stable")[:k].tolist() if k else []
  if token_id not in ids:
    ids.append(token_id)
  return {int(i): float(lp[i]) for i in ids}
