"""Token sampling: penalties and logit bias on the device, then host-side sampling per row.

    logits_SV (host) --process_logits--> the R rows with penalties or bias, on the device
                     (one jit'd program per power of two of R) --> f32[S, V]
                     --sample_token per row (numpy: temperature, top-k, top-p; f32[V] in,
                       a token id out)

`process_logits` runs only in steps where some request sets `presence_penalty`,
`frequency_penalty` or `logit_bias` (`SamplingParams.processes_logits`); its inputs have fixed
shapes per padded row count (dense per-request counts f32[R, V], bias as E = `MAX_LOGIT_BIAS`
(id, value) pairs per row), so no request compiles a program of its own. `penalize_reference`
is the same formula in numpy (OpenAI's, from its API reference "frequency and presence
penalties"):

    logit[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty;  logit[j] += bias[j]

where c[j] counts token j among the tokens generated so far (not the prompt).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.scheduler.request import MAX_LOGIT_BIAS, SamplingParams


def penalize_reference(logits_V: np.ndarray, counts_V: np.ndarray, params: SamplingParams
                       ) -> np.ndarray:
  """OpenAI's penalties and logit bias on one row, in numpy (the reference of `process_logits`).

  Args:
    logits_V: f32[V] raw logits.
    counts_V: int[V] times each token was generated so far.
    params: the request's `presence_penalty`, `frequency_penalty` and `logit_bias`.

  Returns:
    f32[V] processed logits.
  """
  x = np.asarray(logits_V, np.float32).copy()
  c = np.asarray(counts_V, np.float32)
  x -= c * np.float32(params.frequency_penalty) + (c > 0) * np.float32(params.presence_penalty)
  for tid, b in params.logit_bias:
    x[tid] += np.float32(b)
  return x


@jax.jit
def _process(logits_RV, counts_RV, presence_R, frequency_R, bias_ids_RE, bias_RE):
  x = logits_RV.astype(jnp.float32)
  x = x - counts_RV * frequency_R[:, None] - (counts_RV > 0) * presence_R[:, None]
  rows_R1 = jnp.arange(x.shape[0])[:, None]
  return x.at[rows_R1, bias_ids_RE].add(bias_RE)  # padding adds 0.0 to token 0: exact


def process_logits(logits_SV: np.ndarray, rows: list[tuple[SamplingParams | None,
                                                            np.ndarray | None]]) -> np.ndarray:
  """Applies each row's penalties and logit bias on the device, in one jit'd call.

  Only the R rows whose request sets penalties or a bias go to the device, padded to a power
  of two (zero rows), so the programs are one per power of two up to the step's rows, never
  one per request; the other rows are returned untouched.

  Args:
    logits_SV: f32[S, V] host logits (the step's, as sampled from).
    rows: per row of `logits_SV`, its request's params and int32[V] counts of its generated
      tokens; (None, None) or a request without penalties or bias leaves the row as is (e.g. a
      prefill chunk that samples nothing).

  Returns:
    f32[S, V] processed logits (host), a new array.
  """
  out = np.array(logits_SV, np.float32)
  todo = [i for i, (params, c) in enumerate(rows)
          if c is not None and params is not None and params.processes_logits]
  if not todo:
    return out
  r, v = 1 << (len(todo) - 1).bit_length(), out.shape[1]
  logits = np.zeros((r, v), np.float32)
  counts = np.zeros((r, v), np.float32)
  presence = np.zeros(r, np.float32)
  frequency = np.zeros(r, np.float32)
  bias_ids = np.zeros((r, MAX_LOGIT_BIAS), np.int32)
  bias = np.zeros((r, MAX_LOGIT_BIAS), np.float32)
  for k, i in enumerate(todo):
    params, c = rows[i]
    logits[k], counts[k] = out[i], c
    presence[k], frequency[k] = params.presence_penalty, params.frequency_penalty
    for j, (tid, b) in enumerate(params.logit_bias):
      bias_ids[k, j], bias[k, j] = tid, b
  done = np.asarray(_process(logits, counts, presence, frequency, bias_ids, bias))
  out[todo] = done[:len(todo)]
  return out


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
