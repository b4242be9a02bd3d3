"""The two generation endpoints: prompt and parameters in, a JSON body or an SSE stream out.

Flow of one request (docs/design/step-loop.md):

    parse (protocol) -> model name -> text length cap -> prompt ids (chat template for chat; in
      a worker thread, off the event loop) -> context check -> SamplingParams
      -> AsyncEngine.submit (429 when the waiting queue is full) -> outputs on an asyncio queue
      -> JSON body, or SSE chunks (`data: {...}` ... `data: [DONE]`)

A client that disconnects gets its request aborted (slot freed): a non-streaming handler races
the outputs against `http.disconnect`; a stream also ends when Starlette cancels it, and its
`finally` aborts what is unfinished. Streams start only once the first output (or a fault) is
known, so a request the engine rejects still gets a 4xx status, not a broken stream.

A chat turn under a `session_id` (`kvjax.sessions`) leases its session before its prompt
is built (409 if leased), plans it with `kvjax.sessions.run_turn` (the flow `LLM.chat` runs too), records its exact ids when its last output arrives (before the body or
the last stream event goes out, so the client's next turn finds the session free), and releases
the lease unrecorded on every other ending: a fault, a disconnect, a rejected request.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvjax.engine import RequestOutput
from kvjax.scheduler.request import SamplingParams, SamplingParamsError
from kvjax.serve import protocol, tool_calls
from kvjax.serve.async_engine import EngineFault
from kvjax.serve.detokenizer import IncrementalDetokenizer
from kvjax.serve.protocol import ApiError, bad_request
from kvjax.sessions import (SessionBusy, SessionRegistry, SessionTurn, StageFn, TurnPlan,
                            run_turn)

#: Output tokens of a completion that gives no max_tokens (OpenAI's default), clamped to the room
#: left in the context.
DEFAULT_COMPLETION_TOKENS = 16


def check_prompt_chars(n_chars: int, max_model_len: int, max_token_chars: int,
                       what: str) -> None:
  """Rejects a text prompt that cannot fit before it is tokenized (tokenizing is the expensive
  part: a long text would hold a CPU for seconds).

  A text of `n_chars` characters needs at least `n_chars / max_token_chars` tokens, so more than
  `max_model_len * max_token_chars` characters cannot fit in the context.

  Raises:
    ApiError: 400 `context_length_exceeded` naming `what` ("prompt" or "messages").
  """
  limit = max_model_len * max_token_chars
  if n_chars > limit:
    raise bad_request(
        f"This model's maximum context length is {max_model_len} tokens. However, your {what} "
        f"{'have' if what == 'messages' else 'has'} {n_chars} characters, more than {max_model_len} tokens can hold (at most "
        f"{max_token_chars} characters per token). Please reduce the length of the {what}.",
        what, "context_length_exceeded")


def completion_prompt(req: protocol.CompletionRequest, vocab_size: int) -> str | list[int]:
  """The one prompt of `req`: a string, or token ids checked against the vocabulary.

  Raises:
    ApiError: 400 for a batch of prompts, an empty prompt, or ids outside [0, vocab_size).
  """
  prompt = req.prompt
  if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
    if len(prompt) != 1:
      raise bad_request(f"a batch of {len(prompt)} prompts is not supported; send one prompt "
                        "per request", "prompt")
    prompt = prompt[0]
  if isinstance(prompt, str):
    if not prompt:
      raise bad_request("prompt is empty: give at least one character.", "prompt")
    return prompt
  if not prompt:
    raise bad_request("prompt is empty: give at least one token.", "prompt")
  bad = [t for t in prompt if not 0 <= t < vocab_size]
  if bad:
    raise bad_request(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size}).",
                      "prompt")
  return list(prompt)


def encode_prompt(prompt: str, tokenizer: Any, *, parse_special: bool) -> list[int]:
  """Token ids of a text prompt; special-token text is plain text unless `parse_special`."""
  return tokenizer.encode(prompt, parse_special=parse_special)


def prompt_ids_for_chat(req: protocol.ChatCompletionRequest, tokenizer: Any) -> list[int]:
  """Token ids of the conversation under the model's chat template (ends with the assistant's
  turn header); special-token text in any message's content is plain text."""
  try:
    return tokenizer.encode_chat(tool_calls.render_conversation(req),
                                 add_generation_prompt=True)
  except Exception as e:  # noqa: BLE001 - a template that rejects the messages is a 400
    raise bad_request(f"messages cannot be rendered with the model's chat template: {e}",
                      "messages") from None


def begin_session_turn(sessions: SessionRegistry | None,
                       req: protocol.ChatCompletionRequest) -> SessionTurn:
  """Leases the request's session for this turn.

  Raises:
    ApiError: 409 `session_busy` while a turn of the session runs; 400 without sessions.
  """
  if sessions is None:
    raise bad_request("this server keeps no sessions.", "session_id")
  try:
    return sessions.begin(req.session_id, req.cache_salt)
  except SessionBusy as e:
    raise protocol.session_busy(str(e)) from None


def truncate(ids: list[int], req) -> list[int]:
  """`ids` cut to the request's last `truncate_prompt_tokens` (a plain left cut), if given."""
  k = req.truncate_prompt_tokens
  return list(ids) if k is None else list(ids)[-k:]


def session_plan(sessions: SessionRegistry, turn: SessionTurn,
                 req: protocol.ChatCompletionRequest, max_model_len: int | None = None,
                 stage: StageFn | None = None) -> TurnPlan:
  """The turn's plan by the one session-turn flow (`kvjax.sessions.run_turn`, as `LLM.chat`):
  the prompt by the extension rule, truncated to its limit (`truncate_prompt_tokens`, or with a
  truncation policy the context minus the output limit) and, with `session_rerotate`, its kept
  KV staged re-rotated (`stage`: blocking store reads and writes, call this off the event loop).

  Raises:
    ApiError: 400 when the chat template rejects the messages.
  """
  def staged(*args, **kwargs) -> int:  # its failures are the store's, not the messages'
    try:
      return stage(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - re-raised as is below
      raise _StageFailed() from e

  try:
    last_reply = turn.last.output_text if turn.last is not None else None
    return run_turn(sessions, turn, tool_calls.render_conversation(req, last_reply),
                    max_model_len=max_model_len,
                    max_tokens=req.output_limit,
                    truncate_prompt_tokens=req.truncate_prompt_tokens,
                    stage=staged if stage is not None else None)
  except _StageFailed as e:
    raise e.__cause__ from None
  except Exception as e:  # noqa: BLE001 - a template that rejects the messages is a 400
    raise bad_request(f"messages cannot be rendered with the model's chat template: {e}",
                      "messages") from None


class _StageFailed(Exception):
  """Carries (as `__cause__`) an error of re-rotation staging through `session_plan`."""


class SessionTurnState:
  """A chat turn under a session between its lease and its end: records the finished turn once,
  or releases the lease unrecorded (`end`); both idempotent.

  Args:
    sessions: the registry.
    turn: the lease.
    plan: the turn's plan (`session_plan`).
    close: close the session after this turn (`close_session`).
  """

  def __init__(self, sessions: SessionRegistry, turn: SessionTurn, plan: TurnPlan, *,
               close: bool):
    self.sessions, self.turn, self.plan, self.close = sessions, turn, plan, close
    self.prompt = plan.prompt
    self.ended = False
    self.closed = close  # the session does not hold this turn afterwards (set by `record`)

  def record(self, out: RequestOutput) -> None:
    if not self.ended:
      self.ended = True
      # Not kept: closed by this request, by a DELETE while it ran, or dropped over the caps.
      self.closed = not self.sessions.finish(self.turn, self.prompt, out.token_ids, out.text,
                                             close=self.close)

  def end(self) -> None:
    if not self.ended:
      self.ended = True
      self.sessions.release(self.turn)

  def extension(self) -> dict:
    return protocol.session_extension(self.turn.session_id, self.turn.number, self.prompt,
                                      closed=self.closed)


def sampling_params(req: protocol.CompletionRequest | protocol.ChatCompletionRequest,
                    n_prompt: int, max_model_len: int, *, chat: bool,
                    vocab_size: int | None = None) -> SamplingParams:
  """The engine's `SamplingParams`; checks the prompt and output against the context, and
  `logit_bias` ids against `vocab_size` (when given).

  Raises:
    ApiError: 400 `context_length_exceeded`, or a parameter the engine rejects (named by the
      request's field, e.g. `top_p`, `max_completion_tokens`, `top_logprobs`).
  """
  what = "messages" if chat else "prompt"
  room = max_model_len - n_prompt
  if room < 1:
    raise bad_request(
        f"This model's maximum context length is {max_model_len} tokens. However, your {what} "
        f"resulted in {n_prompt} tokens. Please reduce the length of the {what}.", what,
        "context_length_exceeded")
  limit = req.output_limit if chat else req.max_tokens
  param = ("max_completion_tokens" if chat and req.max_completion_tokens is not None
           else "max_tokens")
  if limit is None:
    limit = room if chat else min(DEFAULT_COMPLETION_TOKENS, room)
  elif limit > room:
    raise bad_request(
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{n_prompt + limit} tokens ({n_prompt} in the {what}, {limit} in the completion). "
        f"Please reduce the length of the {what} or completion.", param,
        "context_length_exceeded")
  if chat:
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
  else:
    logprobs = req.logprobs
  bias = protocol.logit_bias_pairs(req.logit_bias, vocab_size)
  try:
    return SamplingParams(
        max_tokens=limit, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
        seed=None if req.seed is None else req.seed % 2**63, stop=req.stop,
        ignore_eos=req.ignore_eos, logprobs=logprobs, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty, logit_bias=bias, n=req.n)
  except SamplingParamsError as e:
    raise params_error(e, param if e.param == "max_tokens" else
                       "top_logprobs" if chat and e.param == "logprobs" else e.param) from None


def params_error(e: SamplingParamsError, field: str) -> ApiError:
  """A `SamplingParams` rejection as a 400 naming the request's `field` (its message begins
  with the engine's field name, which the request may spell differently)."""
  message = str(e)
  if message.startswith(e.param):
    message = field + message[len(e.param):]
  return bad_request(message + ".", field, "invalid_value")


# ------------------------------------------------------------------------------- logprobs
def _token_text(tokenizer: Any, token_id: int) -> str:
  return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tokenizer, token_ids, logprobs, text_offset0: int = 0) -> dict:
  """OpenAI legacy completions `logprobs`: tokens, token_logprobs, top_logprobs, text_offset."""
  tokens, lps, tops, offsets, pos = [], [], [], [], text_offset0
  for tid, d in zip(token_ids, logprobs):
    s = _token_text(tokenizer, tid)
    tokens.append(s)
    lps.append(d.get(tid))
    tops.append({_token_text(tokenizer, t): lp for t, lp in
                 sorted(d.items(), key=lambda kv: -kv[1])})
    offsets.append(pos)
    pos += len(s)
  return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer, token_ids, logprobs, top_n: int) -> dict:
  """OpenAI chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]}."""
  def entry(tid, lp):
    s = _token_text(tokenizer, tid)
    return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

  content = []
  for tid, d in zip(token_ids, logprobs):
    top = sorted(d.items(), key=lambda kv: -kv[1])[:top_n]
    content.append({**entry(tid, d.get(tid)), "top_logprobs": [entry(t, lp) for t, lp in top]})
  return {"content": content}


# ------------------------------------------------------------------------------- running
class Generation:
  """One request between submission and its last output.

  Args:
    backend: the server's `Backend` (engine loop, tokenizer, metrics).
    endpoint: "completions" or "chat".
    request: the HTTP request (for disconnects).
    req: the parsed body.
    prompt_ids: prompt token ids.
    params: sampling parameters.
    session: the session turn this request is (chat with `session_id`), or None; `run` ends it
      (recorded when the last output arrives, released otherwise).
  """

  def __init__(self, backend, endpoint: str, request: Request, req, prompt_ids: list[int],
               params: SamplingParams, session: SessionTurnState | None = None):
    self.b, self.endpoint, self.request, self.req = backend, endpoint, request, req
    self.session = session
    self.chat = endpoint == "chat"
    self.prompt_ids, self.params = prompt_ids, params
    self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
    self.created = int(time.time())
    self.ttft_s: float | None = None
    self.elapsed_s: float | None = None
    self.finished = False

  # -- engine side --------------------------------------------------------------------------
  async def _disconnected(self) -> None:
    while (await self.request.receive())["type"] != "http.disconnect":
      pass

  def _take(self, item: Any) -> RequestOutput:
    """Unpacks a queue item (raising its fault) and notes timing."""
    if isinstance(item, EngineFault):
      self.finished = True
      raise ApiError(item.status, str(item), type="invalid_request_error"
                     if item.status < 500 else "server_error")
    out, ttft, elapsed = item
    if ttft is not None:
      self.ttft_s = ttft
    self.elapsed_s = elapsed
    self.finished = out.finished
    return out

  def _latest(self, queue: asyncio.Queue, out: RequestOutput) -> RequestOutput:
    """Coalesces outputs that queued up meanwhile (each holds every token so far)."""
    while not out.finished and not queue.empty():
      out = self._take(queue.get_nowait())
    return out

  async def _first(self, queue: asyncio.Queue) -> RequestOutput | None:
    """The first output, or None if the client left first (the request is then aborted)."""
    gone = asyncio.ensure_future(self._disconnected())
    get = asyncio.ensure_future(queue.get())
    try:
      done, _ = await asyncio.wait({gone, get}, return_when=asyncio.FIRST_COMPLETED)
    finally:
      gone.cancel()
    if get not in done:
      get.cancel()
      self.b.engine.abort(self.id)
      return None
    return self._latest(queue, self._take(get.result()))

  def _end_session(self) -> None:
    """Releases the session turn unless it was recorded (any ending but a finished turn)."""
    if self.session is not None:
      self.session.end()

  async def run(self) -> Response:
    streaming = False
    try:
      salt = self.session.plan.kv_salt if self.session is not None else self.req.cache_salt
      # A session turn stores its tail and finds the last turn's.
      turn = {} if self.session is None else self.session.plan.request_options()
      queue = self.b.engine.submit(self.id, self.prompt_ids, self.params, salt, **turn)
      out = await self._first(queue)
      if out is None:
        return Response(status_code=499)
      if self.req.stream:
        streaming = True
        return _EventStream(self._stream(queue, out), on_close=self._end_session,
                            media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
      gone = asyncio.ensure_future(self._disconnected())
      try:
        while not out.finished:
          get = asyncio.ensure_future(queue.get())
          done, _ = await asyncio.wait({gone, get}, return_when=asyncio.FIRST_COMPLETED)
          if get not in done:
            get.cancel()
            self.b.engine.abort(self.id)
            return Response(status_code=499)
          out = self._latest(queue, self._take(get.result()))
      finally:
        gone.cancel()
      self._record_session(out)
      self.b.count(self.endpoint, out.finish_reason)
      return JSONResponse(self._body(out))
    finally:
      if not streaming:
        self._end_session()

  def _record_session(self, out: RequestOutput) -> None:
    if self.session is not None:
      self.session.record(out)

  # -- bodies -------------------------------------------------------------------------------
  def _usage(self, out: RequestOutput) -> dict:
    return protocol.usage(len(self.prompt_ids), len(out.token_ids), out.num_cached_tokens)

  def _extension(self, out: RequestOutput) -> dict:
    return protocol.kvjax_extension(
        self.id, out.metrics, ttft_s=self.ttft_s, prompt_tokens=len(self.prompt_ids),
        cached_tokens=out.num_cached_tokens, e2e_s=self.elapsed_s,
        session=self.session.extension() if self.session is not None else None)

  def _logprobs(self, token_ids, logprobs) -> dict | None:
    if logprobs is None:
      return None
    if self.chat:
      return chat_logprobs(self.b.tokenizer, token_ids, logprobs, self.params.logprobs or 0)
    return completion_logprobs(self.b.tokenizer, token_ids, logprobs)

  def _tool_names(self) -> tuple[str, ...] | None:
    """The functions the reply may call, or None when it is not read for calls."""
    if not self.chat or not tool_calls.parses_calls(self.req):
      return None
    return tuple(t.function.name for t in self.req.tools)

  def _finish_reason(self, out: RequestOutput, calls: bool) -> str | None:
    return "tool_calls" if calls and out.finish_reason == "stop" else out.finish_reason

  def _body(self, out: RequestOutput) -> dict:
    lp = self._logprobs(out.token_ids, out.logprobs)
    if self.chat:
      message = {"role": "assistant", "content": out.text, "refusal": None}
      names = self._tool_names()
      parsed = (tool_calls.parse_reply(out.text, names,
                                       parallel=self.req.parallel_tool_calls is not False)
                if names is not None else None)
      if parsed is not None and parsed.calls:
        message["content"] = parsed.content
        message["tool_calls"] = tool_calls.message_calls(parsed.calls)
      choice = {"index": 0, "message": message, "logprobs": lp,
                "finish_reason": self._finish_reason(out, bool(message.get("tool_calls")))}
      obj = "chat.completion"
    else:
      choice = {"index": 0, "text": out.text, "logprobs": lp, "finish_reason": out.finish_reason}
      obj = "text_completion"
    return {"id": self.id, "object": obj, "created": self.created, "model": self.b.model_name,
            "system_fingerprint": self.b.system_fingerprint, "choices": [choice],
            "usage": self._usage(out), "kvjax": self._extension(out)}

  def _chunk(self, text: str | None, lp: dict | None, finish: str | None, *,
             role: bool = False, calls: list | None = None) -> dict:
    if self.chat:
      delta = {"role": "assistant", "content": ""} if role else (
          {"content": text} if text else {})
      if calls:
        delta["tool_calls"] = calls
      choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
      obj = "chat.completion.chunk"
    else:
      choice = {"index": 0, "text": text or "", "logprobs": lp, "finish_reason": finish}
      obj = "text_completion"
    chunk = {"id": self.id, "object": obj, "created": self.created, "model": self.b.model_name,
             "system_fingerprint": self.b.system_fingerprint, "choices": [choice]}
    if self._include_usage:
      chunk["usage"] = None
    return chunk

  @property
  def _include_usage(self) -> bool:
    return bool(self.req.stream_options and self.req.stream_options.include_usage)

  async def _stream(self, queue: asyncio.Queue, out: RequestOutput) -> AsyncIterator[str]:
    """SSE events: (chat: a role chunk), text deltas, the finish chunk, (usage), [DONE].

    The last event before [DONE] carries the `kvjax` object."""
    detok = IncrementalDetokenizer(self.b.tokenizer, self.params.stop)
    names = self._tool_names()
    calls = (tool_calls.CallStream(names, self.req.parallel_tool_calls is not False)
             if names is not None else None)
    sent_tokens = 0
    try:
      if self.chat:
        yield _sse(self._chunk(None, None, None, role=True))
      while True:
        if out.finished:
          text = detok.finish(out.text)
        else:
          text = detok.update(out.token_ids)
        new_ids = out.token_ids[sent_tokens:]
        lp = self._logprobs(new_ids, out.logprobs[sent_tokens:]) if out.logprobs else None
        sent_tokens = len(out.token_ids)
        if out.finished:
          self._record_session(out)  # before the client can read the end and send a turn
          found = []
          if calls is not None:
            text, found = calls.finish(text)
          last = self._chunk(text, lp, self._finish_reason(out, bool(found)), calls=found)
          if self._include_usage:
            yield _sse(last)
            last = {**self._chunk(None, None, None), "choices": [], "usage": self._usage(out)}
          last["kvjax"] = self._extension(out)
          yield _sse(last)
          break
        if calls is not None:
          text = calls.update(text)
        if text or lp:
          yield _sse(self._chunk(text, lp, None))
        try:
          out = self._latest(queue, self._take(await queue.get()))
        except ApiError as e:
          yield _sse(e.body())
          break
      self.b.count(self.endpoint, out.finish_reason if out.finished else "error")
      yield "data: [DONE]\n\n"
    finally:
      if not self.finished:
        self.b.engine.abort(self.id)


class _EventStream(StreamingResponse):
  """A `StreamingResponse` that calls `on_close` however it ends (finished, client gone,
  cancelled), even when its body iterator never started."""

  def __init__(self, content, *, on_close, **kwargs):
    super().__init__(content, **kwargs)
    self._on_close = on_close

  async def __call__(self, scope, receive, send) -> None:
    try:
      await super().__call__(scope, receive, send)
    finally:
      self._on_close()


def _sse(obj: dict) -> str:
  return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"

