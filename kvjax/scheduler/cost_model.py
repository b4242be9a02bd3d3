"""Online cost model of the two sides of a Cake merge: chunk compute and chunk load.

Cake (arXiv 2410.03065, section 3) rests on two facts: computing a chunk costs more the later it
sits in the prompt (attention reads every earlier token), while loading a stored chunk costs the
same wherever it sits. The planner predicts both from observations, in plain floats:

  compute   t(n, s) = pace * (a + b * n + c * n * m),    m = s + (n - 1) / 2  (mean position)
            n tokens at positions [s, s + n), learned from whole steps (`observe_step`:
            one a per step, b per token the step ran padded to its compiled bucket, the
            attention summed over its pieces); (a, b, c) fitted by ridge-regularised least
            squares with exponential forgetting, pulled toward the prior's shape (rescaled to
            the data's level) until enough observations pin all three coefficients;
            pace: a fast EWMA (in log space) of each observation over the fit's prediction
            before it: the slow fit keeps the engine's own cost shape (what its pieces cost,
            which its plans change), the pace the machine's current speed against it (other
            processes on its CPUs, loads competing for memory bandwidth), so a machine that
            turns busy or quiet is priced within a few pieces, not after the fit has
            forgotten the other; with exact data it returns to 1;
  relevel   when `relevel_steps` steps in a row ran more than `relevel_ratio` times slower
            (or faster) than the fit, the machine changed, not the engine's cost shape: the
            history from before them is rescaled by the least of those ratios, so it keeps
            its shape at the new level (fed as it was, the quiet history's large steps fast
            beside the busy present's small ones slow, the fit tilted: `a` up, `b` down, and
            it underpriced the large steps it had not seen busy: 512 tokens at the front
            priced 1.5 s, run 2.45 s, on a busy 2-core VM). Only steps of 64 tokens or
            more whose fitted fixed cost `a` is at most half their time count: a small
            step's time rests on `a`, which noise pins worst;
  transfer  nbytes / bandwidth,                 bandwidth: EWMA of observed bytes/s;
  decode    nbytes / decode rate,               decode rate: EWMA of observed stored bytes/s;
  load      max(transfer, decode)               (the loader overlaps one chunk's transfer with
                                                 the previous chunk's decode).

The default prior is SmolLM2-135M f32 on 2 CPU cores (benchmarks/README.md): a 256-token chunk
takes 0.69 s at position 0 and 3.40 s at position 7936. The first compute observation rescales it
to the machine at hand, so a GPU reads its own numbers after one step.
"""

from __future__ import annotations

import math

# Feature scales keep the 3x3 normal equations well conditioned: x = (1, n / N0, n * m / (N0 * M0)).
_N0 = 256.0
_M0 = 4096.0

#: Compute observations before the pace moves: the first ones rescale the prior to the machine
#: (a GPU reads its own level after one), so a ratio to the prior would say nothing of its pace.
_PACE_AFTER = 3

#: A step counts toward a relevel only when the fit's fixed cost is at most this share of its
#: fitted time (`a` is the coefficient noise pins worst; on a GPU, where every step is mostly
#: fixed cost, the model never relevels).
_RELEVEL_MAX_FIXED_SHARE = 0.5

#: The fewest tokens (padded) of a step that counts toward a relevel: a smaller one's time rests
#: on the fixed cost, which noise pins worst (+-20% noise on every shape put a decode at a late
#: position at 0.4x its fit five times in a row).
_RELEVEL_MIN_TOKENS = 64

#: Compute observations before a relevel may happen: until the fit has pinned its shape, its
#: errors are its own, not the machine's.
_RELEVEL_AFTER = 16

#: Seconds per step, per token, per token-position (SmolLM2-135M f32, 2 CPU cores).
DEFAULT_COMPUTE_PRIOR = (0.02, 2.4471e-3, 1.3339e-6)


def _features(pieces, padded_tokens: int) -> tuple[float, float, float]:
  """A step's features: (1, its padded tokens, each piece's tokens x mean position), scaled."""
  return (1.0, padded_tokens / _N0,
          sum(n * (s + (n - 1) / 2) for s, n in pieces) / (_N0 * _M0))


def _fitted(theta, x) -> float:
  """A fit's seconds for a step of features `x` (the pace not included)."""
  return sum(t * v for t, v in zip(theta, x))


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
  """Solves a small dense linear system by Gaussian elimination with partial pivoting."""
  n = len(b)
  m = [row[:] + [v] for row, v in zip(a, b)]
  for col in range(n):
    piv = max(range(col, n), key=lambda r: abs(m[r][col]))
    m[col], m[piv] = m[piv], m[col]
    for r in range(col + 1, n):
      f = m[r][col] / m[col][col]
      for k in range(col, n + 1):
        m[r][k] -= f * m[col][k]
  x = [0.0] * n
  for r in reversed(range(n)):
    x[r] = (m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))) / m[r][r]
  return x


class CostModel:
  """Predicts compute, transfer, decode and load seconds from what it has observed.

  One model per engine (shared by every request), fed by the engine thread (compute) and the
  loaders (transfer, decode). Not thread-safe: call it under the caller's lock.

  Args:
    compute_prior: (a seconds, b seconds/token, c seconds/(token*position)) used before data.
    prior_weight: how many observations the prior is worth (ridge strength), > 0.
    forget: per-observation decay of old compute observations in (0, 1]; 1 keeps all.
    bandwidth_bytes_per_s: prior link bandwidth, bytes/s (replaced by the first observation).
    decode_bytes_per_s: prior decode rate, stored bytes/s; `math.inf` means decode is free.
    ewma: weight of a new bandwidth or decode-rate sample in (0, 1].
    relevel_steps: steps in a row that must all run more than `relevel_ratio` times slower (or
      faster) than the fit before the history is rescaled to the new level, >= 0; 0 never
      relevels. Five keeps a machine with +-20% noise from ever relevelling and a 2-core VM
      that a competing process made 1.65x slower priced within 5% after its next five steps.
    relevel_ratio: the ratio, > 1.
    pace_ewma: weight of a new compute observation in the pace (log space), in [0, 1]; 0 (the
      default) keeps the pace at 1 (the fit alone). 0.3 priced a busy machine within five
      pieces, but with it a warm request of the tiny model on a CPU shared with four busy
      processes computed its whole prompt instead of loading (the quickstart notebook's test),
      so it stays off until that is understood.
    learn: False freezes the model at its priors (tests, simulations with an exact model).

  Raises:
    ValueError: on a non-positive prior, weight or rate, or `forget`/`ewma` outside (0, 1].
  """

  def __init__(self, *, compute_prior: tuple[float, float, float] = DEFAULT_COMPUTE_PRIOR,
               prior_weight: float = 1.0, forget: float = 0.99,
               bandwidth_bytes_per_s: float = 1e9, decode_bytes_per_s: float = math.inf,
               ewma: float = 0.5, relevel_steps: int = 5, relevel_ratio: float = 1.25,
               pace_ewma: float = 0.0, learn: bool = True):
    if len(compute_prior) != 3 or any(not v >= 0 for v in compute_prior) or not any(compute_prior):
      raise ValueError(f"compute_prior={compute_prior!r} must be three numbers >= 0, not all 0")
    if not prior_weight > 0:
      raise ValueError(f"prior_weight={prior_weight!r} must be > 0")
    if not 0 < forget <= 1 or not 0 < ewma <= 1:
      raise ValueError(f"forget={forget!r} and ewma={ewma!r} must be in (0, 1]")
    if isinstance(relevel_steps, bool) or not isinstance(relevel_steps, int) or relevel_steps < 0:
      raise ValueError(f"relevel_steps={relevel_steps!r} must be an int >= 0")
    if not relevel_ratio > 1:
      raise ValueError(f"relevel_ratio={relevel_ratio!r} must be > 1")
    if not 0 <= pace_ewma <= 1:
      raise ValueError(f"pace_ewma={pace_ewma!r} must be in [0, 1]")
    if not bandwidth_bytes_per_s > 0 or not decode_bytes_per_s > 0:
      raise ValueError(f"bandwidth_bytes_per_s={bandwidth_bytes_per_s!r} and decode_bytes_per_s="
                       f"{decode_bytes_per_s!r} must be > 0")
    a, b, c = compute_prior
    self._prior = (a, b * _N0, c * _N0 * _M0)  # in feature units
    self._prior_weight = float(prior_weight)
    self._forget = float(forget)
    self._ewma = float(ewma)
    self._pace_ewma = float(pace_ewma)
    self._log_pace = 0.0
    self._pace = 1.0  # exp(_log_pace), kept beside it: the planner reads it thousands of times
    self._learn = learn
    self._xx = [[0.0] * 3 for _ in range(3)]
    self._xy = [0.0] * 3
    self._sum_y = 0.0
    self._sum_prior_y = 0.0
    self._theta = list(self._prior)
    self.num_compute_observations = 0
    self._relevel_steps = relevel_steps
    self._relevel_log = math.log(relevel_ratio)
    # The streak of steps beyond the ratio on one side: each one's log ratio to the fit from
    # before the streak (the fit itself follows the streak's steps and would understate it),
    # and the history's sums from then with the decay since, the part a relevel rescales.
    self._streak: list[float] = []
    self._streak_theta: list[float] = []
    self._streak_xy: list[float] = []
    self._streak_sum_y = 0.0
    self._streak_decay = 1.0
    #: Times the history was rescaled to a new machine level (`relevel_steps`).
    self.num_relevels = 0
    self._transfer_s_per_byte = 1.0 / bandwidth_bytes_per_s
    self._decode_s_per_byte = 0.0 if math.isinf(decode_bytes_per_s) else 1.0 / decode_bytes_per_s
    self._bw_seen = False
    self._decode_seen = False

  @property
  def load_rate_known(self) -> bool:
    """The transfer rate rests on an observation (or the model is frozen at exact priors).

    The Cake planner lets compute wait for a load only at a known rate: a wrong prior must never
    hold compute back for long.
    """
    return not self._learn or self._bw_seen

  # ------------------------------------------------------------------ compute
  @property
  def compute_coefficients(self) -> tuple[float, float, float]:
    """Current (a seconds, b seconds/token, c seconds/(token*position)), the pace included."""
    a, b, c = self._theta
    pace = self.pace
    return (pace * a, pace * b / _N0, pace * c / (_N0 * _M0))

  @property
  def pace(self) -> float:
    """The machine's current speed against the fit: recent observed / fitted compute time (1:
    as fitted; 2: pieces take twice as long now, e.g. another process took a CPU, and the slow
    fit has not caught up)."""
    return self._pace

  def observe_compute(self, start: int, num_tokens: int, seconds: float) -> None:
    """Records that prefilling `num_tokens` tokens at `[start, start + num_tokens)` took `seconds`
    (a step of that one piece, unpadded: `observe_step`).

    Raises:
      ValueError: on `num_tokens < 1`, `start < 0` or a negative or non-finite time.
    """
    if num_tokens < 1 or start < 0 or not 0 <= seconds < math.inf:
      raise ValueError(f"observe_compute(start={start}, num_tokens={num_tokens}, seconds={seconds})"
                       ": need start >= 0, num_tokens >= 1, finite seconds >= 0")
    self.observe_step(((start, num_tokens),), num_tokens, seconds)

  def observe_step(self, pieces, padded_tokens: int, seconds: float) -> None:
    """Records that one step (one model call) holding `pieces` took `seconds`: one fixed cost
    `a`, `b` per token the call ran (`padded_tokens`, its compiled bucket: padding runs the
    same matmuls), and each piece's attention, `c * n * m` (the model the joint Cake planner
    prices a step with, `cake_joint.step_s`).

    A step split into one observation per piece would count `a` once per piece and the
    padding in none: on a competing machine, where the steps come in two or three shapes and
    their times scatter, that fit put `a` at 0.7 s against a true floor near 0.

    Args:
      pieces: (start position, tokens) per prefill chunk or decode (1 token) in the step.
      padded_tokens: the tokens the call ran, >= the pieces' tokens.
      seconds: its wall seconds, the device work included.

    Raises:
      ValueError: on no pieces, a piece with `start < 0` or fewer than 1 token, fewer padded
        tokens than the pieces hold, or a negative or non-finite time.
    """
    pieces = tuple(pieces)
    tokens = sum(n for _, n in pieces)
    if (not pieces or any(s < 0 or n < 1 for s, n in pieces) or padded_tokens < tokens
        or not 0 <= seconds < math.inf):
      raise ValueError(f"observe_step(pieces={pieces}, padded_tokens={padded_tokens}, "
                       f"seconds={seconds}): need pieces of start >= 0 and tokens >= 1, at least "
                       "their tokens padded, finite seconds >= 0")
    if not self._learn:
      return
    x = _features(pieces, padded_tokens)
    self._extend_streak(x, padded_tokens, seconds)
    if self._pace_ewma > 0 and self.num_compute_observations >= _PACE_AFTER and seconds > 0:
      fitted = max(1e-12, _fitted(self._theta, x))
      self._log_pace += self._pace_ewma * (math.log(seconds / fitted) - self._log_pace)
      self._pace = math.exp(self._log_pace)
    g = self._forget
    for i in range(3):
      self._xy[i] = g * self._xy[i] + x[i] * seconds
      for j in range(3):
        self._xx[i][j] = g * self._xx[i][j] + x[i] * x[j]
    self._sum_y = g * self._sum_y + seconds
    self._sum_prior_y = g * self._sum_prior_y + sum(p * v for p, v in zip(self._prior, x))
    self.num_compute_observations += 1
    if self._streak:
      self._streak_decay *= g
      if len(self._streak) == self._relevel_steps:
        self._relevel()
    self._refit()

  def _extend_streak(self, x, padded_tokens: int, seconds: float) -> None:
    """Extends, ends or starts the streak of steps beyond `relevel_ratio` of the fit on one
    side with a step of features `x` that ran `padded_tokens` in `seconds` (before it is
    learnt). A step that does not count (relevels off, the fit's first `_RELEVEL_AFTER`
    observations, under `_RELEVEL_MIN_TOKENS` tokens, or a fitted fixed cost over
    `_RELEVEL_MAX_FIXED_SHARE` of its fitted time) neither extends nor ends it."""
    if (not self._relevel_steps or self.num_compute_observations < _RELEVEL_AFTER
        or not seconds > 0 or padded_tokens < _RELEVEL_MIN_TOKENS):
      return
    if self._streak:
      r = self._log_ratio(self._streak_theta, x, seconds)
      if r is None:
        return
      if abs(r) > self._relevel_log and (r > 0) == (self._streak[0] > 0):
        self._streak.append(r)
        return
      self._streak = []
    r = self._log_ratio(self._theta, x, seconds)
    if r is not None and abs(r) > self._relevel_log:
      self._streak = [r]
      self._streak_theta = list(self._theta)
      self._streak_xy = list(self._xy)
      self._streak_sum_y = self._sum_y
      self._streak_decay = 1.0

  @staticmethod
  def _log_ratio(theta, x, seconds: float) -> float | None:
    """log(seconds / the fit `theta`'s time for features `x`), or None where the fit's fixed
    cost is over `_RELEVEL_MAX_FIXED_SHARE` of that time."""
    fitted = _fitted(theta, x)
    if not fitted > 0 or theta[0] > _RELEVEL_MAX_FIXED_SHARE * fitted:
      return None
    return math.log(seconds / fitted)

  def _relevel(self) -> None:
    """The streak is `relevel_steps` long: the machine changed. The history from before it
    (decayed since) is rescaled by the least of its ratios, the change all its steps agree
    on; the streak's own steps stay as they were observed."""
    factor = math.exp(min(self._streak, key=abs))
    w = (factor - 1.0) * self._streak_decay
    self._xy = [v + w * v0 for v, v0 in zip(self._xy, self._streak_xy)]
    # The ridge's target, the prior's shape at the data's level, follows.
    self._sum_y += w * self._streak_sum_y
    self._streak = []
    self.num_relevels += 1

  def _refit(self) -> None:
    # Ridge toward the prior's shape at the data's level: theta0 = s * prior, s = sum y / sum y_prior.
    scale = self._sum_y / self._sum_prior_y if self._sum_prior_y > 0 else 1.0
    lam = self._prior_weight
    theta0 = [scale * p for p in self._prior]
    a = [[self._xx[i][j] + (lam if i == j else 0.0) for j in range(3)] for i in range(3)]
    b = [self._xy[i] + lam * theta0[i] for i in range(3)]
    # Keep the physical signs: coefficients that come out negative are pinned at 0 and the rest
    # refitted (the ridge term keeps every subsystem positive definite).
    free = [0, 1, 2]
    while True:
      sub = _solve([[a[i][j] for j in free] for i in free], [b[i] for i in free])
      theta = [0.0, 0.0, 0.0]
      for i, v in zip(free, sub):
        theta[i] = v
      negative = [i for i in free if theta[i] < 0]
      if not negative:
        break
      free = [i for i in free if i not in negative]
      if not free:
        break
    self._theta = theta

  def predict_compute_s(self, start: int, num_tokens: int) -> float:
    """Predicted seconds to prefill `num_tokens` tokens at `[start, start + num_tokens)`."""
    if num_tokens <= 0:
      return 0.0
    x = _features(((start, num_tokens),), num_tokens)
    return max(1e-9, self._pace * _fitted(self._theta, x))

  def predict_step_s(self, pieces, padded_tokens: int) -> float:
    """Predicted seconds of one step (one model call) holding `pieces` ((start, tokens) each)
    run as `padded_tokens` tokens: the shape `observe_step` learns."""
    return self._pace * _fitted(self._theta, _features(pieces, padded_tokens))

  # ------------------------------------------------------------------ loads
  # Rates are kept as EWMAs of seconds per byte: time is what gets predicted, and a free decode
  # (0 s/byte) needs no special case.
  @property
  def bandwidth_bytes_per_s(self) -> float:
    """Link bandwidth estimate, bytes/s."""
    return 1.0 / self._transfer_s_per_byte

  @property
  def decode_bytes_per_s(self) -> float:
    """Decode rate estimate, stored bytes/s (`math.inf`: free)."""
    return math.inf if self._decode_s_per_byte == 0 else 1.0 / self._decode_s_per_byte

  def observe_load(self, nbytes: int, seconds: float) -> None:
    """Records a transfer of `nbytes` stored bytes that held the link for `seconds`.

    With concurrent reads, pass the link time attributable to this chunk (e.g. the time between
    successive completions), so the estimate is the link's bandwidth, not one stream's.

    Raises:
      ValueError: on negative bytes or non-positive seconds.
    """
    if nbytes < 0 or not 0 < seconds < math.inf:
      raise ValueError(f"observe_load(nbytes={nbytes}, seconds={seconds}): need nbytes >= 0 and "
                       "finite seconds > 0")
    if self._learn and nbytes > 0:
      sample = seconds / nbytes
      self._transfer_s_per_byte = sample if not self._bw_seen else (
          (1 - self._ewma) * self._transfer_s_per_byte + self._ewma * sample)
      self._bw_seen = True

  def observe_decode(self, nbytes: int, seconds: float) -> None:
    """Records that decoding `nbytes` stored bytes on the host took `seconds` (0: free).

    Raises:
      ValueError: on negative bytes or negative seconds.
    """
    if nbytes < 0 or not 0 <= seconds < math.inf:
      raise ValueError(f"observe_decode(nbytes={nbytes}, seconds={seconds}): need nbytes >= 0 "
                       "and finite seconds >= 0")
    if self._learn and nbytes > 0:
      sample = seconds / nbytes
      self._decode_s_per_byte = sample if not self._decode_seen else (
          (1 - self._ewma) * self._decode_s_per_byte + self._ewma * sample)
      self._decode_seen = True

  @property
  def transfer_s_per_byte(self) -> float:
    return self._transfer_s_per_byte

  @property
  def decode_s_per_byte(self) -> float:
    return self._decode_s_per_byte

  def predict_transfer_s(self, nbytes: int) -> float:
    """Seconds to move `nbytes` stored bytes over the link."""
    return nbytes * self._transfer_s_per_byte

  def predict_decode_s(self, nbytes: int) -> float:
    """Seconds to decode `nbytes` stored bytes on the host."""
    return nbytes * self._decode_s_per_byte

  def predict_load_s(self, nbytes: int) -> float:
    """Seconds a chunk of `nbytes` stored bytes occupies the loader pipeline: max(transfer, decode)."""
    return max(self.predict_transfer_s(nbytes), self.predict_decode_s(nbytes))
