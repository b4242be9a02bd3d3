"""An in-process server for tests: uvicorn on a free port in a thread, over a given `LLM`.

    with serving(LLM("tiny", cache_dir="", kv_store="memory://")) as srv:
      client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")

Readiness is event-driven: `HttpServer.start` returns once uvicorn's socket accepts connections,
and the backend is attached (warmed up, engine thread running) before the context yields.
Helpers to wait on the engine thread (`engine_call`) and to read `/metrics` (`scrape`) live here
too.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
from typing import Any, Callable, Iterator

import httpx
import openai
from absl.testing import parameterized
from prometheus_client.parser import text_string_to_metric_families

from kvjax.serve import (Backend, HttpServer, ServeState, backend_from_llm, close_backend,
                         create_app)
from kvjax.serve.guard import HttpPolicy
from kvjax.serve.server import DEFAULT_MAX_WAITING_REQUESTS


@dataclasses.dataclass
class RunningServer:
  url: str
  state: ServeState
  backend: Backend
  http: HttpServer
  policy: HttpPolicy = HttpPolicy()

  @property
  def auth_headers(self) -> dict[str, str]:
    """`Authorization` for the server's API key (empty without one)."""
    key = self.policy.api_key
    return {"Authorization": f"Bearer {key}"} if key else {}

  def engine_call(self, fn: Callable[[Any], Any]) -> Any:
    """Runs `fn(engine)` on the engine thread after every command queued so far."""
    return asyncio.run(self.backend.engine.call(fn))

  def flush(self) -> None:
    """Waits until the KV saves of finished requests are written (POST /admin/flush_kv)."""
    r = httpx.post(self.url + "/admin/flush_kv", timeout=120, headers=self.auth_headers)
    r.raise_for_status()

  def scrape(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """GET /metrics parsed by prometheus_client: {(sample name, sorted labels): value}."""
    text = httpx.get(self.url + "/metrics", timeout=30, headers=self.auth_headers).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


@contextlib.contextmanager
def serving(llm, *, served_model_name: str | None = None, enable_admin: bool = True,
            policy: HttpPolicy | None = None, allow_special_tokens_in_prompt: bool = False,
            max_waiting_requests: int | None = DEFAULT_MAX_WAITING_REQUESTS,
            kv_event_publisher: Any = None) -> Iterator[RunningServer]:
  """Serves `llm` on 127.0.0.1 at a free port until the context exits (the LLM stays open).

  `policy`, `allow_special_tokens_in_prompt` go to `create_app`, `max_waiting_requests` and
  `kv_event_publisher` (closed at exit) to `backend_from_llm`.
  """
  policy = policy or HttpPolicy()
  state = ServeState(enable_admin=enable_admin)
  http = HttpServer(create_app(state, policy,
                               allow_special_tokens_in_prompt=allow_special_tokens_in_prompt),
                    "127.0.0.1", 0)
  http.start()
  backend = None
  try:
    backend = backend_from_llm(llm, served_model_name=served_model_name,
                               max_waiting_requests=max_waiting_requests,
                               kv_event_publisher=kv_event_publisher)
    state.attach(backend)
    yield RunningServer(http.url, state, backend, http, policy)
  finally:
    http.stop()
    close_backend(backend, None)


class ServedLLMTestCase(parameterized.TestCase):
  """Serves `make_llm()` for the whole class: `cls.llm`, `cls.srv` and an `openai` `cls.client`.

  `serve_options` (a class attribute) holds keyword arguments of `serving`; the client sends the
  policy's API key.
  """

  serve_options: dict[str, Any] = {}

  @classmethod
  def make_llm(cls):
    raise NotImplementedError

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.llm = cls.make_llm()
    cls._ctx = serving(cls.llm, **cls.serve_options)
    cls.srv = cls._ctx.__enter__()
    cls.client = openai.OpenAI(base_url=cls.srv.url + "/v1", max_retries=0,
                               api_key=cls.srv.policy.api_key or "unused")

  @classmethod
  def tearDownClass(cls):
    cls._ctx.__exit__(None, None, None)
    cls.llm.close()
    super().tearDownClass()

  def leave_chat_stream_after_first_event(self, body: dict) -> None:
    """Posts a streamed chat request, checks its 200, reads its first SSE event and leaves (the
    connection closes)."""
    with httpx.stream("POST", self.srv.url + "/v1/chat/completions", json=body,
                      timeout=60) as r:
      self.assertEqual(r.status_code, 200)
      next(line for line in r.iter_lines() if line.startswith("data:"))

  def hold_after_first_output(self, aborts: int = 1
                              ) -> tuple[threading.Event, threading.Event, threading.Event]:
    """Holds every engine step after the first one that emitted outputs until `proceed` is set
    (also at cleanup), and notes the server's aborts (their request ids in
    `self.aborted_request_ids`, in order). Returns (emitted: set once outputs came, proceed,
    aborted: set once `aborts` requests were aborted)."""
    engine, backend = self.llm.engine, self.srv.backend.engine
    step, abort = engine.step, backend.abort
    emitted, proceed, aborted = threading.Event(), threading.Event(), threading.Event()
    self.aborted_request_ids = []

    def gated_step():
      if emitted.is_set():
        proceed.wait(60)
      outs = step()
      if outs:
        emitted.set()
      return outs

    def noted_abort(rid):
      abort(rid)
      self.aborted_request_ids.append(rid)
      if len(self.aborted_request_ids) >= aborts:
        aborted.set()

    engine.step, backend.abort = gated_step, noted_abort

    def restore():
      proceed.set()
      engine.__dict__.pop("step", None)
      backend.__dict__.pop("abort", None)
    self.addCleanup(restore)
    return emitted, proceed, aborted
