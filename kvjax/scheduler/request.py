"""Requests and sampling parameters: plain Python, shared by the scheduler, engine and server."""

from __future__ import annotations

import dataclasses
import enum
from typing import Mapping, Sequence

from kvjax._typing import RequestId


MAX_LOGPROBS = 20

#: Most `logit_bias` entries a request may give (OpenAI's limit).
MAX_LOGIT_BIAS = 300


class SamplingParamsError(ValueError):
  """A `SamplingParams` field out of range; `param` is the field's name (the server's `param`).

  Attributes:
    param: the field, e.g. "top_p".
  """

  def __init__(self, param: str, message: str):
    super().__init__(message)
    self.param = param


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
  """A grammar the output must follow (constrained decoding, `kvjax/engine/grammar.py`): give
  exactly one of the two.

  Attributes:
    json_schema: a JSON Schema as JSON text; the output is one JSON value valid for it
      (`'{"type": "object"}'`: any object).
    lark: a grammar in llguidance's Lark dialect (may embed `%json {schema}`).

  Raises:
    ValueError: neither or both given, or one that is not a non-empty string.
  """

  json_schema: str | None = None
  lark: str | None = None

  def __post_init__(self):
    given = [v for v in (self.json_schema, self.lark) if v is not None]
    if len(given) != 1 or not isinstance(given[0], str) or not given[0]:
      raise ValueError("StructuredOutput takes exactly one of json_schema and lark, a "
                       "non-empty string")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How to pick output tokens, in vLLM's names.

  Attributes:
    max_tokens: output tokens to generate at most (>= 1).
    temperature: 0 is greedy; otherwise logits are divided by it before sampling.
    top_p: nucleus sampling mass in (0, 1].
    top_k: keep the k most likely tokens; -1 (or 0) keeps all.
    seed: per-request seed; None draws from the engine's generator.
    stop: strings that end generation; the matched string is not returned.
    stop_token_ids: token ids that end generation (kept in `token_ids`).
    ignore_eos: keep generating after the end-of-sequence token.
    logprobs: return the top-`logprobs` log-probabilities of each generated token (plus the
      sampled token's), 0..20; None returns none.
    truncate_prompt_tokens: keep at most this many prompt tokens, the LAST ones (vLLM's name;
      a plain left cut, so the cache stays exact: the truncated ids hit by prefix like any
      prompt); None keeps the whole prompt.
    presence_penalty: in [-2, 2]; subtracted once from the logit of every token generated so
      far (OpenAI's semantics: positive values favour new tokens).
    frequency_penalty: in [-2, 2]; subtracted from each token's logit once per time it was
      generated so far. Both penalties count generated tokens only, not the prompt (OpenAI's
      formula: `logit[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty`).
    logit_bias: token id -> bias in [-100, 100], added to that token's logit before sampling
      (-100 bans it, +100 forces it at temperature 0); at most `MAX_LOGIT_BIAS` entries; stored
      as a tuple of (id, bias) pairs sorted by id. Ids beyond the vocabulary are rejected when
      the request is added (`Engine.validate`).
    n: output sequences for the prompt (>= 1); `LLM.generate` and the server compute the
      prompt once and fork it into n sequences, choice i seeded with `choice_seed(seed, i)`.
    structured: a grammar the output must follow (`StructuredOutput`), or None.

  Penalties and bias change the logits the token is sampled from (on the device,
  `kvjax.engine.sampling.process_logits`); returned log-probabilities stay the model's raw ones.

  Raises:
    SamplingParamsError: (a ValueError) a field out of range, naming the field.
  """

  max_tokens: int = 16
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = -1
  seed: int | None = None
  stop: str | Sequence[str] | None = None
  stop_token_ids: Sequence[int] | None = None
  ignore_eos: bool = False
  logprobs: int | None = None
  truncate_prompt_tokens: int | None = None
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  logit_bias: Mapping[int, float] | Sequence[tuple[int, float]] | None = None
  n: int = 1
  structured: StructuredOutput | None = None

  def __post_init__(self):
    def bad(field, want):
      raise SamplingParamsError(field, f"{field}={getattr(self, field)!r}: {want}")

    if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or (
        self.max_tokens < 1):
      bad("max_tokens", "must be an int >= 1")
    if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or (
        not self.temperature >= 0):
      bad("temperature", "must be a number >= 0")
    if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or (
        not 0 < self.top_p <= 1):
      bad("top_p", "must be in (0, 1]")
    if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
      bad("top_k", "must be -1, 0 (all tokens) or a positive int")
    if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
      bad("seed", "must be an int or None")
    if self.logprobs is not None and (
        isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
        or not 0 <= self.logprobs <= MAX_LOGPROBS):
      bad("logprobs", f"must be None or an int in [0, {MAX_LOGPROBS}]")
    if self.truncate_prompt_tokens is not None and (
        isinstance(self.truncate_prompt_tokens, bool)
        or not isinstance(self.truncate_prompt_tokens, int) or self.truncate_prompt_tokens < 1):
      bad("truncate_prompt_tokens", "must be None or an int >= 1")
    stop = self.stop
    if isinstance(stop, str):
      stop = (stop,)
    stop = tuple(stop or ())
    if any(not isinstance(s, str) or not s for s in stop):
      bad("stop", "must be a non-empty string or a list of them")
    object.__setattr__(self, "stop", stop)
    ids = tuple(self.stop_token_ids or ())
    if any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
      bad("stop_token_ids", "must be a list of ints")
    object.__setattr__(self, "stop_token_ids", ids)
    for name in ("presence_penalty", "frequency_penalty"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, float)) or not -2 <= v <= 2:
        bad(name, "must be a number in [-2, 2]")
      object.__setattr__(self, name, float(v))
    if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
      bad("n", "must be an int >= 1")
    object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
    if self.structured is not None and not isinstance(self.structured, StructuredOutput):
      bad("structured", "must be None or a StructuredOutput")

  @property
  def processes_logits(self) -> bool:
    """Whether penalties or a logit bias change the logits before sampling."""
    return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)


def choice_seed(seed: int | None, index: int) -> int | None:
  """The seed of choice `index` of a request with `n` choices: `seed` for choice 0, and a
  distinct seed derived from (`seed`, `index`) for the others, so identical requests get
  identical choices; None without a seed (each choice draws from the engine's generator)."""
  if seed is None or index == 0:
    return seed
  return (seed * 1_000_003 + index * 0x9E3779B97F4A7C15) % 2**63


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
  """The params of choice `index` of an `n` > 1 request: the same, seeded with
  `choice_seed(params.seed, index)`."""
  return dataclasses.replace(params, seed=choice_seed(params.seed, index))


def _logit_bias(bias) -> tuple[tuple[int, float], ...]:
  """`SamplingParams.logit_bias` as sorted (id, bias) pairs, checked.

  Raises:
    SamplingParamsError: not a mapping or pairs, more than `MAX_LOGIT_BIAS` entries, an id that
      is not an int >= 0, a bias outside [-100, 100], or an id given twice.
  """
  def bad(want: str):
    raise SamplingParamsError("logit_bias", f"logit_bias: {want}")

  if bias is None:
    return ()
  items = list(bias.items()) if isinstance(bias, Mapping) else list(bias)
  if len(items) > MAX_LOGIT_BIAS:
    bad(f"{len(items)} entries; at most {MAX_LOGIT_BIAS} are allowed")
  out = {}
  for item in items:
    if not isinstance(item, (tuple, list)) or len(item) != 2:
      bad(f"{item!r} is not a (token id, bias) pair")
    tid, b = item
    if isinstance(tid, bool) or not isinstance(tid, int) or tid < 0:
      bad(f"token id {tid!r} must be an int >= 0")
    if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
      bad(f"bias {b!r} of token {tid} must be a number in [-100, 100]")
    if tid in out:
      bad(f"token id {tid} is given twice")
    out[tid] = float(b)
  return tuple(sorted(out.items()))


class RequestStatus(enum.Enum):
  WAITING = "waiting"
  PREFILLING = "prefilling"
  DECODING = "decoding"
  FINISHED = "finished"


@dataclasses.dataclass
class Request:
  """One generation request as the scheduler sees it (the scheduler owns it once added).

  Attributes:
    request_id: unique id.
    prompt_token_ids: the prompt, tokens.
    sampling_params: sampling settings.
    arrival_s: arrival time, seconds (engine clock).
    num_computed_tokens: prompt and output tokens whose KV is in the slot (planned).
    output_token_ids: generated tokens so far.
    slot: decode slot while running, else None.
    status: lifecycle state.
    finish_reason: "stop", "length" or "abort" once finished.
    prefill_len: tokens to prefill when not the prompt: after a preemption the
      request recomputes prompt + output tokens, and its last prefill chunk samples the next
      token. None means the prompt.
  """

  request_id: RequestId
  prompt_token_ids: list[int]
  sampling_params: SamplingParams
  arrival_s: float = 0.0
  num_computed_tokens: int = 0
  output_token_ids: list[int] = dataclasses.field(default_factory=list)
  slot: int | None = None
  status: RequestStatus = RequestStatus.WAITING
  finish_reason: str | None = None
  prefill_len: int | None = None

  @property
  def num_prefill_tokens(self) -> int:
    """Tokens the prefill covers: the prompt, or prompt + output after a preemption."""
    return len(self.prompt_token_ids) if self.prefill_len is None else self.prefill_len

  def token_ids(self, start: int, end: int) -> list[int]:
    """Token ids `[start, end)` of prompt + output."""
    n = len(self.prompt_token_ids)
    if end <= n:
      return list(self.prompt_token_ids[start:end])
    return (list(self.prompt_token_ids[start:])
            + list(self.output_token_ids[max(0, start - n):end - n]))

  @property
  def num_prompt_tokens(self) -> int:
    return len(self.prompt_token_ids)

  @property
  def num_tokens(self) -> int:
    """Prompt plus output tokens."""
    return len(self.prompt_token_ids) + len(self.output_token_ids)

  @property
  def remaining_prefill_tokens(self) -> int:
    return max(0, self.num_prefill_tokens - self.num_computed_tokens)

  @property
  def is_finished(self) -> bool:
    return self.status is RequestStatus.FINISHED
