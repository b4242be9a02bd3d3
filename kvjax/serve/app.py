"""The FastAPI app: OpenAI-compatible routes over one `AsyncEngine`.

    POST /v1/completions        POST /v1/chat/completions     (both: `"stream": true` for SSE)
    GET  /v1/models             GET  /v1/models/{model}
    DELETE /v1/sessions/{session_id}[?cache_salt=...]   closes a chat session (404 if unknown)
    GET  /health                200 once the model is loaded and compiled, 503 before
    GET  /metrics               Prometheus text format
    POST /admin/flush_kv        (only with `enable_admin`) waits until queued KV saves are written
    POST /reset_prefix_cache    (only with `enable_admin`) empties the device prefix cache

Every request first passes `guard` (ASGI middleware, before FastAPI parses anything): `Host`
check, CORS only for `allowed_origins`, API key, JSON-only bodies, body size limit. Handlers run
on uvicorn's event loop; tokenization and chat-template rendering run in worker threads (the
tokenizer releases the GIL) after a text-length cap, so one large prompt cannot stall `/health`
or other clients.

The app exists before the model: `ServeState.attach` hands it the backend once loading and
warmup are done; until then every route but /health and /metrics answers 503. Errors are
OpenAI-style bodies `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import threading
import time
from typing import Any, Callable

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvjax.serve import choices, completions, protocol, structured, tool_calls
from kvjax.serve.async_engine import AsyncEngine, EngineFault
from kvjax.serve.guard import HostGuard, HttpPolicy, RequestGuard
from kvjax.serve.metrics import ServeMetrics
from kvjax.serve.protocol import ApiError
from kvjax.sessions import SessionRegistry, StageFn

_log = logging.getLogger(__name__)


@dataclasses.dataclass
class Backend:
  """What the routes serve with, once the model is ready.

  Attributes:
    engine: the engine thread's front.
    tokenizer: the model's tokenizer (`encode`, `decode`, `encode_chat`, `max_token_chars`).
    model_name: the name clients pass as `model`.
    max_model_len: tokens per sequence (prompt plus output).
    vocab_size: V, for checking token-id prompts.
    metrics: the server's metrics.
    flush: blocks until queued KV saves are written (None without a store).
    system_fingerprint: reported in responses (model fingerprint prefix).
    sessions: the chat sessions (the served `LLM`'s registry); None: `session_id` is refused.
    kv_event_publisher: publishes KV cache events (`kv_events.ZmqKVEventPublisher`); None: off.
    stage_rerotated: stages a session truncation's kept KV re-rotated (`LLM.rerotation_stage`:
      the store client's reads and writes, never the engine; run off the event loop), or None
      without a store.
  """

  engine: AsyncEngine
  tokenizer: Any
  model_name: str
  max_model_len: int
  vocab_size: int
  metrics: ServeMetrics
  flush: Callable[[], None] | None = None
  system_fingerprint: str | None = None
  sessions: SessionRegistry | None = None
  kv_event_publisher: Any = None
  stage_rerotated: StageFn | None = None

  def count(self, endpoint: str, finish_reason: str | None) -> None:
    self.metrics.requests.labels(endpoint=endpoint, finish_reason=str(finish_reason)).inc()


class ServeState:
  """The app's mutable state: the backend (None while loading) and the readiness flag."""

  def __init__(self, *, enable_admin: bool = False):
    self.enable_admin = enable_admin
    self.backend: Backend | None = None
    self.ready = threading.Event()
    self.load_error: str | None = None
    self.created = int(time.time())

  def attach(self, backend: Backend) -> None:
    self.backend = backend
    self.ready.set()

  def require(self) -> Backend:
    if self.backend is None:
      raise protocol.server_error(self.load_error or "the server is starting: the model is "
                                  "loading and compiling; retry when GET /health returns 200",
                                  status=503)
    return self.backend


def _generation(params) -> type[completions.Generation]:
  """The request's runner: one choice, or `n` > 1 forked from one prefill (`choices`)."""
  return choices.ForkedGeneration if params.n > 1 else completions.Generation


def create_app(state: ServeState, policy: HttpPolicy | None = None, *,
               allow_special_tokens_in_prompt: bool = False) -> FastAPI:
  """Builds the app over `state` (attach the backend before or after).

  Args:
    state: readiness and the backend.
    policy: hosts, origins, API key and body limit (`guard.HttpPolicy`); None: its defaults
      (loopback hosts only, no CORS, no key, 4 MiB).
    allow_special_tokens_in_prompt: parse special-token text ("<|im_start|>") in completion
      string prompts into control tokens; by default it is plain text. Chat message content is
      always plain text.
  """
  policy = policy or HttpPolicy()
  app = FastAPI(title="kvjax", summary="OpenAI-compatible server for kvjax",
                docs_url="/docs", redoc_url=None)
  app.state.kvjax = state

  def count_error(e: ApiError) -> None:
    if state.backend is not None:
      state.backend.metrics.errors.labels(status=str(e.status), type=e.type).inc()

  def error_response(e: ApiError) -> JSONResponse:
    count_error(e)
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

  # Added innermost first: HostGuard runs first, then CORS, then RequestGuard.
  app.add_middleware(RequestGuard, policy=policy, on_error=count_error)
  if policy.allowed_origins:
    app.add_middleware(CORSMiddleware, allow_origins=list(policy.allowed_origins),
                       allow_methods=["GET", "POST", "DELETE"],
                       allow_headers=["Authorization", "Content-Type"])
  app.add_middleware(HostGuard, policy=policy, on_error=count_error)

  async def off_loop(fn, *args, **kwargs):
    """`fn(*args, **kwargs)` in a worker thread (tokenization, template rendering)."""
    return await asyncio.get_running_loop().run_in_executor(
        None, functools.partial(fn, *args, **kwargs))

  @app.exception_handler(ApiError)
  async def _api_error(request: Request, e: ApiError):
    del request
    return error_response(e)

  @app.exception_handler(EngineFault)
  async def _engine_fault(request: Request, e: EngineFault):
    del request
    if e.status == 429:
      return error_response(protocol.too_many_requests(str(e)))
    return error_response(ApiError(e.status, str(e), type="server_error"))

  @app.exception_handler(StarletteHTTPException)
  async def _http_error(request: Request, e: StarletteHTTPException):
    del request
    code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
    return error_response(ApiError(e.status_code, str(e.detail), code=code))

  @app.exception_handler(Exception)
  async def _internal(request: Request, e: Exception):
    _log.exception("unhandled error on %s", request.url.path)
    return error_response(protocol.server_error(f"internal error: {e!r}"))

  def check_model(backend: Backend, model: str) -> None:
    if model != backend.model_name:
      raise protocol.model_not_found(model)

  @app.post("/v1/completions")
  async def create_completion(request: Request) -> Response:
    backend = state.require()
    req = protocol.parse(protocol.CompletionRequest, await request.body())
    check_model(backend, req.model)
    req.check_supported()
    prompt = completions.completion_prompt(req, backend.vocab_size)
    if isinstance(prompt, str):
      completions.check_prompt_chars(len(prompt), backend.max_model_len,
                                     backend.tokenizer.max_token_chars, "prompt")
      ids = await off_loop(completions.encode_prompt, prompt, backend.tokenizer,
                           parse_special=allow_special_tokens_in_prompt)
    else:
      ids = prompt
    ids = completions.truncate(ids, req)
    params = completions.sampling_params(req, len(ids), backend.max_model_len, chat=False,
                                         vocab_size=backend.vocab_size)
    return await _generation(params)(backend, "completions", request, req, ids, params).run()

  @app.post("/v1/chat/completions")
  async def create_chat_completion(request: Request) -> Response:
    backend = state.require()
    req = protocol.parse(protocol.ChatCompletionRequest, await request.body())
    check_model(backend, req.model)
    req.check_supported()
    tool_calls.check_request(req)
    grammar = structured.structured_output(req)  # 400 before anything runs
    completions.check_prompt_chars(tool_calls.text_chars(req),
                                   backend.max_model_len, backend.tokenizer.max_token_chars,
                                   "messages")
    if req.session_id is None:
      ids = await off_loop(completions.prompt_ids_for_chat, req, backend.tokenizer)
      ids = completions.truncate(ids, req)
      params = completions.sampling_params(req, len(ids), backend.max_model_len, chat=True,
                                           vocab_size=backend.vocab_size)
      params = dataclasses.replace(params, structured=grammar)
      return await _generation(params)(backend, "chat", request, req, ids, params).run()
    turn = completions.begin_session_turn(backend.sessions, req)  # 409 while it is leased
    try:
      plan = await off_loop(completions.session_plan, backend.sessions, turn, req,
                            backend.max_model_len, backend.stage_rerotated)
      params = completions.sampling_params(req, len(plan.token_ids), backend.max_model_len,
                                           chat=True, vocab_size=backend.vocab_size)
      params = dataclasses.replace(params, structured=grammar)
    except BaseException:
      backend.sessions.release(turn)
      raise
    session = completions.SessionTurnState(backend.sessions, turn, plan,
                                           close=req.close_session)
    return await completions.Generation(backend, "chat", request, req, list(plan.token_ids),
                                        params, session=session).run()

  @app.delete("/v1/sessions/{session_id}")
  async def delete_session(session_id: str, request: Request) -> dict:
    """Closes a chat session; `?cache_salt=` names the salt it was opened under."""
    backend = state.require()
    unknown = sorted(set(request.query_params) - {"cache_salt"})
    if unknown:
      raise protocol.bad_request(f"Unrecognized request argument supplied: {unknown[0]}",
                                 unknown[0])
    salt = request.query_params.get("cache_salt")
    protocol.check_session_params(session_id, salt)
    if backend.sessions is None or not backend.sessions.close(session_id, salt):
      raise protocol.session_not_found(session_id)
    return {"id": session_id, "object": "session.deleted", "deleted": True}

  def model_card(backend: Backend) -> dict:
    return {"id": backend.model_name, "object": "model", "created": state.created,
            "owned_by": "kvjax", "max_model_len": backend.max_model_len}

  @app.get("/v1/models")
  async def list_models() -> dict:
    return {"object": "list", "data": [model_card(state.require())]}

  @app.get("/v1/models/{model:path}")
  async def retrieve_model(model: str) -> dict:
    backend = state.require()
    check_model(backend, model)
    return model_card(backend)

  @app.get("/health")
  async def health() -> Response:
    backend = state.backend
    if backend is None or not state.ready.is_set():
      return JSONResponse({"status": "error" if state.load_error else "loading",
                           "detail": state.load_error}, status_code=503)
    if not backend.engine.alive:
      return JSONResponse({"status": "error", "detail": "the engine thread ended"},
                          status_code=503)
    return JSONResponse({"status": "ok", "model": backend.model_name})

  @app.get("/metrics")
  async def metrics() -> Response:
    backend = state.backend
    body = backend.metrics.render() if backend is not None else b""
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

  if state.enable_admin:
    @app.post("/admin/flush_kv")
    async def flush_kv() -> dict:
      """Waits until every KV save queued so far is written (tests, benchmarks)."""
      backend = state.require()
      await backend.engine.call(lambda engine: None)  # saves of finished steps are queued
      if backend.flush is not None:
        await asyncio.to_thread(backend.flush)
      return {"status": "flushed"}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict:
      """Empties the device prefix cache (vLLM's route; an `AllBlocksCleared` KV event)."""
      backend = state.require()
      blocks = await backend.engine.call(lambda engine: engine.reset_prefix_cache())
      return {"status": "reset", "blocks_unindexed": blocks}

  return app
