"""The OpenAI wire protocol: request models, error bodies, and response builders.

Requests are parsed from the raw body with strict pydantic models (no coercion: `"5"` is not an
int). Every 400 names its field in `param` (null only for a body that is not a JSON object) and
sets `code`, as OpenAI's error objects do: "unknown_parameter" for a field the OpenAI API does
not have ("Unrecognized request argument supplied: X"), "unsupported_parameter" for one of
OpenAI's own fields that kvjax does not serve ("X is not supported": `OPENAI_CHAT_PARAMS` and
`OPENAI_COMPLETION_PARAMS` list OpenAI's fields, from the `openai` package's
`CompletionCreateParams` types, which a test compares them with), "missing_required_parameter",
"invalid_type", "invalid_value" (also the default of `bad_request`), "unsupported_value" (a
value kvjax does not serve, e.g. `echo=true`), "context_length_exceeded", "invalid_json".
Harmless bookkeeping fields (`user`, `store`, `metadata`, `service_tier`, `safety_identifier`,
`prompt_cache_key`) are accepted and ignored. Message content is a string or a list of parts of
type "text" (another type, such as "image_url", gets a 400 naming it), and `seed` an int64.

Sampling: `n` (1 to `MAX_N` choices; the prompt is computed once and forked), `presence_penalty`,
`frequency_penalty` ([-2, 2]) and `logit_bias` (token id string -> bias in [-100, 100], at most
300 entries, ids inside the vocabulary) as OpenAI (`kvjax.scheduler.request.SamplingParams`).

Extensions (accepted by kvjax, not by OpenAI; vLLM has the first three):
  cache_salt: str   tenant key for the prefix cache (stored KV is shared only within one salt);
                    1 to `MAX_CACHE_SALT_CHARS` (256) characters.
  top_k: int        keep the k most likely tokens (-1 or 0: all).
  ignore_eos: bool  keep generating after the end-of-sequence token.
Chat only (SGLang has `session_id`; `kvjax.sessions`):
  session_id: str      a chat session, 1 to 128 characters from [A-Za-z0-9._:-] (not . or
                       ..), keyed together with `cache_salt`. When the messages are the
                       session's last turn's messages, its reply and new messages, the
                       prompt is that turn's exact token ids plus the new part (the prefix
                       cache then hits on every earlier token); otherwise the normal templated
                       prompt (a miss). A second request while a turn of the session runs
                       gets 409 (`conflict_error`).
  close_session: bool  close the session after this turn (needs `session_id`).
Tools (`tools`, `tool_choice`, `parallel_tool_calls`, assistant `tool_calls` and `tool`
messages) are checked, rendered and parsed by `kvjax.serve.tool_calls`; `response_format`
(`json_object`, `json_schema`) and forced calls decode under a grammar (`kvjax.serve.structured`).
Responses add `usage.prompt_tokens_details.cached_tokens` (as OpenAI) and a `kvjax` object
(see `kvjax_extension`).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import re
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
import pydantic
import pydantic_core
from pydantic import BaseModel, ConfigDict, Field

from kvjax.engine import MergeTrace
from kvjax.scheduler.request import MAX_LOGIT_BIAS, MAX_LOGPROBS
from kvjax.sessions import check_client_salt, check_session_id


class ApiError(Exception):
  """An error answered with an OpenAI-style body `{"error": {message, type, param, code}}`."""

  def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
               param: str | None = None, code: str | None = None,
               headers: dict[str, str] | None = None):
    super().__init__(message)
    self.status, self.message, self.type, self.param, self.code = (status, message, type, param,
                                                                   code)
    self.headers = headers  # extra response headers (Retry-After, WWW-Authenticate)

  def body(self) -> dict[str, Any]:
    return {"error": {"message": self.message, "type": self.type, "param": self.param,
                      "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value"
                ) -> ApiError:
  """A 400 `invalid_request_error`; `code` "invalid_value" unless told (OpenAI's codes)."""
  return ApiError(400, message, param=param, code=code)


#: The top-level fields of OpenAI's chat completion request, as the `openai` package's
#: `ChatCompletionCreateParams` types list them (3.63.0; `OpenAIParamsTest` compares).
OPENAI_CHAT_PARAMS = frozenset((
    "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
    "max_completion_tokens", "max_tokens", "messages", "metadata", "modalities", "model",
    "moderation", "n", "parallel_tool_calls", "prediction", "presence_penalty",
    "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention", "reasoning_effort",
    "response_format", "safety_identifier", "seed", "service_tier", "stop", "store", "stream",
    "stream_options", "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user",
    "verbosity", "web_search_options"))

#: The same for the legacy completion request (`openai.types.CompletionCreateParams`).
OPENAI_COMPLETION_PARAMS = frozenset((
    "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "model", "n",
    "presence_penalty", "prompt", "seed", "stop", "stream", "stream_options", "suffix",
    "temperature", "top_p", "user"))


def unknown_field(model: type[BaseModel], loc: tuple[Any, ...]) -> ApiError:
  """The 400 for a field `model` does not take: "X is not supported" ("unsupported_parameter")
  for one of OpenAI's own top-level fields, else OpenAI's wording for a name it does not have
  either ("Unrecognized request argument supplied: X", "unknown_parameter")."""
  param = _param(loc)
  openai_names = model.openai_params if issubclass(model, _Strict) else frozenset()
  if len(loc) == 1 and loc[0] in openai_names:
    return bad_request(f"{param} is not supported: kvjax does not serve this OpenAI parameter; "
                       "remove it from the request.", param, "unsupported_parameter")
  return bad_request(f"Unrecognized request argument supplied: {param}", param,
                     "unknown_parameter")


def model_not_found(model: str) -> ApiError:
  return ApiError(404, f"The model `{model}` does not exist or you do not have access to it.",
                  param="model", code="model_not_found")


def too_many_requests(message: str) -> ApiError:
  """429: the waiting queue is full (`--max_waiting_requests`); retry after a second."""
  return ApiError(429, message, type="rate_limit_exceeded", code="too_many_waiting_requests",
                  headers={"Retry-After": "1"})


def session_busy(message: str) -> ApiError:
  """409: a turn of this session is still running (never queued behind it). `x-should-retry:
  false` stops the OpenAI clients' automatic retry of a 409, whose late copy would run as the
  session's next turn."""
  return ApiError(409, message, type="conflict_error", param="session_id", code="session_busy",
                  headers={"x-should-retry": "false"})


def session_not_found(session_id: str) -> ApiError:
  return ApiError(404, f"No open session {session_id!r} (under this cache_salt): it was never "
                  "opened, or it was closed, expired or evicted.", param="session_id",
                  code="session_not_found")


#: Longest `cache_salt`, characters (a tenant key; it is hashed into every chunk key and a
#: session's key, so a longer one buys nothing and costs every lookup).
MAX_CACHE_SALT_CHARS = 256


def check_cache_salt(cache_salt: Any) -> None:
  """Raises `ApiError` 400 naming `cache_salt` when it is empty, longer than
  `MAX_CACHE_SALT_CHARS`, or in the reserved re-rotated namespace."""
  if cache_salt is None:
    return
  if not cache_salt:
    raise bad_request("cache_salt must be a non-empty string.", "cache_salt")
  if len(cache_salt) > MAX_CACHE_SALT_CHARS:
    raise bad_request(f"cache_salt is {len(cache_salt)} characters; at most "
                      f"{MAX_CACHE_SALT_CHARS} are allowed.", "cache_salt")
  try:
    check_client_salt(cache_salt)
  except ValueError as e:
    raise bad_request(f"{e}.", "cache_salt") from None


def check_session_params(session_id: Any, cache_salt: Any) -> None:
  """Raises `ApiError` 400 naming `session_id` or `cache_salt` when one is malformed."""
  try:
    check_session_id(session_id)
  except ValueError as e:
    raise bad_request(f"{e}.", "session_id") from None
  check_cache_salt(cache_salt)


def server_error(message: str, status: int = 500) -> ApiError:
  return ApiError(status, message, type="server_error", code=None)


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _param(loc: tuple[Any, ...]) -> str | None:
  """`("messages", 0, "content")` -> "messages[0].content"; pydantic's union tags dropped."""
  out = ""
  for part in loc:
    if isinstance(part, int):
      out += f"[{part}]"
    elif isinstance(part, str) and part.isidentifier() and part.lower() not in _UNION_TAGS:
      out += f".{part}" if out else part
  return out or None


def parse(model: type[BaseModel], body: bytes) -> BaseModel:
  """Parses a request body; raises `ApiError` 400 naming the first bad field.

  Raises:
    ApiError: invalid JSON, not an object, unknown field, wrong type or value.
  """
  try:
    return model.model_validate_json(body or b"")
  except pydantic.ValidationError as e:
    err = e.errors(include_url=False)[0]
    param = _param(err["loc"])
    if err["type"] == "json_invalid":
      lone = lone_surrogate(body or b"")
      if lone is not None:
        raise bad_request(f"The JSON body holds an invalid unicode escape: {lone}. Text must be "
                          "valid unicode: a surrogate escape (\\ud800-\\udfff) is only valid "
                          "as a high one followed by a low one, encoding one character.",
                          code="invalid_json") from None
      raise bad_request(f"We could not parse the JSON body of your request: {err['msg']}. The "
                        "body must be a JSON object.", code="invalid_json") from None
    if err["type"] == "extra_forbidden":
      raise unknown_field(model, err["loc"]) from None
    if err["type"] == "missing":
      raise bad_request(f"Missing required parameter: '{param}'.", param,
                        "missing_required_parameter") from None
    if err["type"] == "model_type" and param is None:
      raise bad_request("The request body must be a JSON object.", code="invalid_type") from None
    got = err.get("input")
    got = json.dumps(got)[:80] if not isinstance(got, (dict, list)) else type(got).__name__
    code = "invalid_type" if err["type"].endswith(_TYPE_ERRORS) else "invalid_value"
    raise bad_request(f"Invalid value for '{param}': {err['msg']} (got {got}).", param,
                      code) from None


#: pydantic error types (suffixes) that mean "wrong JSON type", not "wrong value".
_TYPE_ERRORS = ("_type", "_parsing", "union_tag_invalid", "is_instance_of")


_ESCAPE = re.compile(rb"(\\+)u([0-9a-fA-F]{4})")


def lone_surrogate(body: bytes) -> str | None:
  """Where a JSON body holds a lone-surrogate escape ("\\ud800" not followed by a low
  surrogate escape, or a low one not after a high one), described for an error message
  ("'\\ud800' at line 1, column 58, a lone surrogate"); None when it holds none."""
  lone = pending = None  # pending: a high surrogate escape waiting for its low half
  for m in _ESCAPE.finditer(body):
    if len(m.group(1)) % 2 == 0:
      continue  # an escaped backslash followed by plain "u...": not an escape
    cp = int(m.group(2), 16)
    if pending is not None:
      if 0xDC00 <= cp <= 0xDFFF and m.start() + len(m.group(1)) - 1 == pending.end():
        pending = None  # a pair: one character
        continue
      lone = pending
      break
    if 0xD800 <= cp <= 0xDBFF:
      pending = m
    elif 0xDC00 <= cp <= 0xDFFF:
      lone = m
      break
  m = lone or pending
  if m is None:
    return None
  start = m.end() - 6  # the escape itself: backslash, "u", four hex digits
  line = body.count(b"\n", 0, start) + 1
  col = start - (body.rfind(b"\n", 0, start) + 1) + 1
  return (f"'{m.group(0)[-6:].decode()}' at line {line}, column {col} is a lone surrogate (half "
          "of a UTF-16 pair without its other half)")


class _Strict(BaseModel):
  model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
  #: OpenAI's own top-level fields of this request (`unknown_field`'s wording).
  openai_params: ClassVar[frozenset[str]] = frozenset()

  @pydantic.model_validator(mode="before")
  @classmethod
  def _null_means_default(cls, data: Any) -> Any:
    """An explicit `null` for an optional field means its default, as in the OpenAI API."""
    if not isinstance(data, dict):
      return data
    fields = cls.model_fields
    return {k: v for k, v in data.items()
            if not (v is None and k in fields and not fields[k].is_required()
                    and fields[k].default is not None)}


class StreamOptions(_Strict):
  include_usage: bool = False


Temperature = Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)]
TopP = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]

#: Most choices (`n`) one request may ask for (OpenAI's limit).
MAX_N = 128


class _Sampling(_Strict):
  """Fields both endpoints share."""

  model: str
  max_tokens: int | None = None
  temperature: Temperature = 1.0
  top_p: TopP = 1.0
  n: int = 1
  stream: bool = False
  stream_options: StreamOptions | None = None
  stop: str | list[str] | None = None
  seed: Annotated[int, Field(ge=-2**63, le=2**63 - 1)] | None = None  # int64, as OpenAI, vLLM
  presence_penalty: Penalty = 0.0
  frequency_penalty: Penalty = 0.0
  logit_bias: dict[str, float] | None = None
  user: str | None = None
  # Extensions (vLLM names).
  cache_salt: str | None = None
  top_k: int = -1
  ignore_eos: bool = False
  truncate_prompt_tokens: int | None = None

  def check_supported(self) -> None:
    """Rejects OpenAI features kvjax does not implement (400 naming the field)."""
    if not 1 <= self.n <= MAX_N:
      raise bad_request(f"n={self.n} must be in [1, {MAX_N}].", "n")
    logit_bias_pairs(self.logit_bias, None)  # keys and values; the vocabulary later
    if self.stream_options is not None and not self.stream:
      raise bad_request("The 'stream_options' parameter is only allowed when 'stream' is "
                        "enabled.", "stream_options")
    if isinstance(self.stop, list) and len(self.stop) > 4:
      raise bad_request("stop takes at most 4 sequences.", "stop")
    if self.max_tokens is not None and self.max_tokens < 1:
      raise bad_request(f"max_tokens={self.max_tokens} must be at least 1.", "max_tokens")
    check_cache_salt(self.cache_salt)
    if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
      raise bad_request(f"truncate_prompt_tokens={self.truncate_prompt_tokens} must be at "
                        "least 1 (keep that many of the prompt's last tokens).",
                        "truncate_prompt_tokens")


class CompletionRequest(_Sampling):
  """POST /v1/completions."""

  prompt: str | list[str] | list[int] | list[list[int]]
  logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
  echo: bool = False
  suffix: str | None = None
  best_of: int | None = None

  openai_params: ClassVar[frozenset[str]] = OPENAI_COMPLETION_PARAMS

  def check_supported(self) -> None:
    super().check_supported()
    if self.echo:
      raise bad_request("echo is not supported.", "echo", "unsupported_value")
    if self.suffix:
      raise bad_request("suffix is not supported.", "suffix", "unsupported_value")
    if self.best_of not in (None, 1):
      raise bad_request("best_of is not supported (must be 1).", "best_of", "unsupported_value")


class TextPart(_Strict):
  type: Literal["text"]
  text: str


class ToolFunction(_Strict):
  """A function the model may call: `parameters` is its arguments' JSON Schema (checked by
  `kvjax.serve.tool_calls.check_request`)."""

  name: str
  description: str | None = None
  parameters: dict[str, Any] | None = None
  strict: bool | None = None


class Tool(_Strict):
  type: Literal["function"]
  function: ToolFunction


class FunctionName(_Strict):
  name: str


class NamedToolChoice(_Strict):
  """`tool_choice` naming one function: the reply is a call of it."""

  type: Literal["function"]
  function: FunctionName


class ToolCallFunction(_Strict):
  name: str
  arguments: str  # JSON text, as OpenAI


class ToolCall(_Strict):
  """One call of an assistant message in the history (as a response's `message.tool_calls`)."""

  id: str
  type: Literal["function"]
  function: ToolCallFunction


class ChatMessage(_Strict):
  role: Literal["system", "developer", "user", "assistant", "tool"]
  content: str | list[TextPart] | None = None
  name: str | None = None
  tool_calls: list[ToolCall] | None = None  # assistant only
  tool_call_id: str | None = None  # tool only

  @pydantic.model_validator(mode="before")
  @classmethod
  def _text_parts_only(cls, data: Any) -> Any:
    """A content part of another type (`image_url`, `input_audio`, `file`) gets a 400 that
    names it, not pydantic's generic union error."""
    parts = data.get("content") if isinstance(data, dict) else None
    for part in parts if isinstance(parts, list) else ():
      kind = part.get("type") if isinstance(part, dict) else None
      if isinstance(kind, str) and kind != "text":
        raise pydantic_core.PydanticCustomError(
            "unsupported_part", "content parts of type '{kind}' are not supported: kvjax serves "
            "text-only models, so every part must have type 'text'", {"kind": kind})
    return data

  def text(self) -> str:
    if self.content is None:
      return ""
    if isinstance(self.content, str):
      return self.content
    return "".join(p.text for p in self.content)


class JsonSchemaFormat(_Strict):
  """`response_format.json_schema`: the schema the reply follows (constrained decoding)."""

  name: str
  description: str | None = None
  schema_: dict[str, Any] | None = Field(default=None, alias="schema")
  strict: bool | None = None


class ResponseFormat(_Strict):
  """`response_format`: "text", "json_object" (any JSON object) or "json_schema"
  (`kvjax.serve.structured`)."""

  type: Literal["text", "json_object", "json_schema"]
  json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(_Sampling):
  """POST /v1/chat/completions."""

  messages: list[ChatMessage]
  max_completion_tokens: int | None = None
  logprobs: bool = False
  top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
  response_format: ResponseFormat | None = None
  tools: list[Tool] | None = None
  tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
  parallel_tool_calls: bool | None = None
  store: bool | None = None
  metadata: dict[str, str] | None = None
  service_tier: str | None = None
  safety_identifier: str | None = None  # accepted and ignored, as `user`
  prompt_cache_key: str | None = None  # accepted and ignored: kvjax caches by prefix
  # Extensions (sessions; SGLang's name).
  session_id: str | None = None
  close_session: bool = False

  openai_params: ClassVar[frozenset[str]] = OPENAI_CHAT_PARAMS

  def check_supported(self) -> None:
    super().check_supported()
    if self.session_id is not None:
      check_session_params(self.session_id, self.cache_salt)
      if self.n != 1:
        raise bad_request("n > 1 is not supported with session_id: a session turn records one "
                          "reply.", "n", "unsupported_value")
    elif self.close_session:
      raise bad_request("close_session needs a session_id.", "close_session")
    if not self.messages:
      raise bad_request("messages must hold at least one message.", "messages")
    for i, m in enumerate(self.messages):
      if m.content is None and m.role not in ("assistant", "tool"):  # OpenAI: an assistant's
        # may be null (kvjax.serve.tool_calls checks tool messages)
        raise bad_request(f"messages[{i}].content is null: a '{m.role}' message needs content "
                          "(a string, or a list of text parts).", f"messages[{i}].content")
    if self.max_tokens is not None and self.max_completion_tokens is not None:
      raise bad_request("give max_tokens or max_completion_tokens, not both.",
                        "max_completion_tokens")
    if self.max_completion_tokens is not None and self.max_completion_tokens < 1:
      raise bad_request(f"max_completion_tokens={self.max_completion_tokens} must be at least "
                        "1.", "max_completion_tokens")
    if self.top_logprobs is not None and not self.logprobs:
      raise bad_request("top_logprobs needs logprobs=true.", "top_logprobs")

  @property
  def output_limit(self) -> int | None:
    return self.max_completion_tokens if self.max_completion_tokens is not None else (
        self.max_tokens)

  def conversation(self) -> list[dict[str, str]]:
    """Messages as the chat template takes them (role "developer" is the system prompt)."""
    return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in self.messages]


def logit_bias_pairs(logit_bias: dict[str, float] | None, vocab_size: int | None
                     ) -> tuple[tuple[int, float], ...]:
  """OpenAI's `logit_bias` (token id strings -> bias) as (id, bias) pairs sorted by id.

  Raises:
    ApiError: 400 naming `logit_bias`: more than `MAX_LOGIT_BIAS` entries, a key that is not a
      decimal token id, a bias outside [-100, 100], or (given `vocab_size`) an id outside the
      vocabulary.
  """
  if not logit_bias:
    return ()
  if len(logit_bias) > MAX_LOGIT_BIAS:
    raise bad_request(f"logit_bias has {len(logit_bias)} entries; at most {MAX_LOGIT_BIAS} are "
                      "allowed.", "logit_bias")
  out = {}
  for key, bias in logit_bias.items():
    if not re.fullmatch(r"[0-9]{1,10}", key):
      raise bad_request(f"Invalid key in 'logit_bias': {key!r} is not a token id (a decimal "
                        "integer string).", "logit_bias")
    if not -100 <= bias <= 100 or not math.isfinite(bias):
      raise bad_request(f"Invalid value in 'logit_bias' for token {key}: {bias} is outside "
                        "[-100, 100].", "logit_bias")
    tid = int(key)
    if vocab_size is not None and tid >= vocab_size:
      raise bad_request(f"Invalid key in 'logit_bias': token id {tid} is outside the "
                        f"vocabulary [0, {vocab_size}).", "logit_bias")
    out[tid] = float(bias)
  return tuple(sorted(out.items()))


# ------------------------------------------------------------------------------- responses
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens,
          "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _json_value(x: Any) -> Any:
  """`x` if JSON can carry it (non-finite floats become None), else None."""
  if x is None or isinstance(x, (bool, int, str)):
    return x
  if isinstance(x, float):
    return x if math.isfinite(x) else None
  if isinstance(x, (list, tuple)):
    return [_json_value(v) for v in x]
  if isinstance(x, dict):
    return {str(k): _json_value(v) for k, v in x.items()}
  if isinstance(x, enum.Enum) and isinstance(x.value, (str, int)):
    return x.value
  if isinstance(x, np.generic):  # numpy scalars
    return _json_value(x.item())
  if dataclasses.is_dataclass(x):
    return {f.name: _json_value(getattr(x, f.name)) for f in dataclasses.fields(x)}
  return None


#: Fields of the engine's merge trace copied to `kvjax.merge`: every field of `MergeTrace`, so the
#: protocol cannot drift from the record it mirrors.
MERGE_FIELDS = tuple(f.name for f in dataclasses.fields(MergeTrace))


def session_extension(session_id: str, number: int, prompt: Any, *, closed: bool) -> dict:
  """The `session` member of the `kvjax` object of a chat turn under a session.

  Keys: `id`; `turn` (this turn's number in the session, from 1); `outcome` ("first",
  "extended" or "not_extended"); `extended` (bool: the prompt starts with the session's exact
  ids); `reused_tokens` (how many); `reason` (why not extended, else null); `closed` (the
  session does not hold this turn: closed by this request or while it ran, or dropped over the
  session caps; its next turn is a first turn); `truncation` (null, or `dropped_turns`,
  `dropped_tokens` and `rerotated_tokens`: prompt tokens served by re-rotated kept KV, after
  the computed boundary chunks).
  """
  tr = prompt.truncation
  return {"id": session_id, "turn": number, "outcome": prompt.outcome,
          "extended": prompt.outcome == "extended", "reused_tokens": prompt.reused_tokens,
          "reason": prompt.reason, "closed": closed,
          "truncation": None if tr is None else {
              "dropped_turns": tr.dropped_turns, "dropped_tokens": tr.dropped_tokens,
              "rerotated_tokens": prompt.rerotated_tokens}}


def kvjax_extension(request_id: str, metrics: Any, *, ttft_s: float | None,
                    prompt_tokens: int, cached_tokens: int, e2e_s: float | None,
                    session: dict | None = None) -> dict:
  """The `kvjax` object of a response: per-request timing and the KV merge trace.

  Keys: `request_id`; `ttft_s` (server side: request received to first token, seconds);
  `prefill_s` (the engine's prefill wall time, `RequestMetrics.prefill_s`: its first scheduled
  step to its first token, seconds; queueing before admission excluded; null before the first
  token); `e2e_s`; `prompt_tokens`, `tokens_computed`, `tokens_loaded` (store loads and device hits),
  `tokens_device_cached` (of those, served from the device prefix cache), `cached_tokens`;
  `rejected_chunks`; `loaded_from_tiers` ({tier: chunks}); `loaded_chunks` (per store chunk
  inserted, `{"index", "tier"}`: which tier each came from; device hits are blocks, counted in
  `tokens_device_cached`); `merge`, the Cake merge trace
  (`MERGE_FIELDS`; null when nothing was stored) and its `meeting_index` at the top level;
  `engine_metrics`, every field of the engine's `RequestMetrics` (engine clock); and `session`
  (`session_extension`; null without a `session_id`).
  """
  tiers: dict[str, int] = {}
  for t in metrics.loaded_from_tiers:
    tiers[str(t)] = tiers.get(str(t), 0) + 1
  out = {"request_id": request_id, "ttft_s": ttft_s, "prefill_s": metrics.prefill_s,
         "e2e_s": e2e_s,
         "prompt_tokens": prompt_tokens,
         "tokens_computed": metrics.num_computed_tokens,
         "tokens_loaded": metrics.num_loaded_tokens,
         "tokens_device_cached": metrics.num_device_cached_tokens,
         "cached_tokens": cached_tokens,
         "rejected_chunks": metrics.num_rejected_chunks,
         "loaded_from_tiers": tiers,
         "loaded_chunks": [{"index": int(i), "tier": str(t)}
                           for i, t in metrics.loaded_chunks]}
  trace = metrics.merge
  out["merge"] = None if trace is None else {
      name: _json_value(getattr(trace, name)) for name in MERGE_FIELDS}
  out["meeting_index"] = None if trace is None else trace.meeting_index
  out["engine_metrics"] = _json_value(metrics) if dataclasses.is_dataclass(metrics) else None
  out["session"] = session
  return out
