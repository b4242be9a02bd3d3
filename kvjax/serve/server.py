"""From options to a listening server: `ServerConfig` -> `LLM` -> warmup -> `Backend` -> uvicorn.

    state = ServeState(); app = create_app(state)
    http = HttpServer(app, "127.0.0.1", 0)        # binds now; http.port is the chosen port
    http.start()                                  # uvicorn in a thread (or http.run() blocking)
    backend, llm = load_backend(ServerConfig.from_flat(model="tiny"))
    state.attach(backend)                         # /health turns 200

The socket is bound before uvicorn starts, so port 0 yields a known free port at once, and the
server listens (answering 503) while the model loads and compiles.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
from typing import Any, Callable

import uvicorn

from kvjax.config import EngineOptions, option, server_defaults
from kvjax.entrypoints import LLM, builder
from kvjax.entrypoints.llm import StartupEvent
from kvjax.serve import kv_events
from kvjax.serve.app import Backend
from kvjax.serve.async_engine import AsyncEngine
from kvjax.serve.guard import DEFAULT_MAX_REQUEST_BYTES, HttpPolicy
from kvjax.serve.metrics import ServeMetrics

#: Default `max_waiting_requests`: requests queued beyond the decode slots before 429s.
DEFAULT_MAX_WAITING_REQUESTS = 256


def server_engine_options(**flat: Any) -> EngineOptions:
  """The server's engine options: `LLM`'s defaults but the server's own (`server_defaults()`:
  the "default" store), with `flat` applied.

  Raises:
    TypeError, ValueError: as `EngineOptions.from_flat`.
  """
  return EngineOptions.from_flat(**{**server_defaults(), **flat})


def _none_if(value: Any, none: Any) -> Any:
  return None if value == none else value


@dataclasses.dataclass(frozen=True)
class ServerConfig:
  """Options of `python -m kvjax.serve`: the engine's options (`engine`, an `EngineOptions`, the
  store's tiers and capacity among them) plus the HTTP side here.

  Each field is a flag of the same name (`--name`), as is each field of the engine's options
  (`kvjax.config.EngineOptions`; docs/usage/options.md). `from_flat` takes both by their flat
  names: `ServerConfig.from_flat(model="tiny", port=0, kv_codec="int8")`.

  Attributes:
    engine: the engine's options (`LLM(...)`'s); default `server_engine_options()`: `LLM`'s
      defaults but the "default" store (`builder.default_kv_store_url()`).
    (the other fields): see each one's text (`kvjax.config.spec(field).doc`).

  Raises:
    ValueError: a bad port, limit, host, origin or key, or KV events asked for without the
      prefix cache (the engine's options raise their own when built).
  """

  engine: EngineOptions = dataclasses.field(default_factory=server_engine_options)
  served_model_name: str | None = option(
      None, "Name clients pass as `model` (default: the model's name).")
  host: str = option("127.0.0.1", "Interface to listen on.")
  port: int = option(8000, "TCP port; 0 picks a free port (printed).")
  enable_admin: bool = option(
      False,
      "Serve the admin endpoints: POST /admin/flush_kv (waits for queued KV saves) and POST "
      "/reset_prefix_cache (drops the device prefix cache).")
  log_level: str = option("warning", "uvicorn's log level.",
                          choices=("critical", "error", "warning", "info", "debug"))
  max_request_bytes: int = option(
      DEFAULT_MAX_REQUEST_BYTES,
      "Largest request body in bytes; larger ones get 413 before any parsing (also chunked "
      "bodies without Content-Length).")
  max_waiting_requests: int | None = option(
      DEFAULT_MAX_WAITING_REQUESTS,
      "Requests that may wait beyond the --max_num_seqs running ones; more get 429. -1: "
      "unbounded.", flag="integer", parse=lambda v: _none_if(v, -1))
  allow_special_tokens_in_prompt: bool = option(
      False,
      "Parse special-token text (e.g. '<|im_start|>') in completion string prompts into "
      "control tokens; by default it is plain text. Chat message content is always plain "
      "text.")
  allowed_hosts: tuple[str, ...] | None = option(
      None,
      "Host header names served besides the loopback ones (exact, '*.example.com', or '*' "
      "for any). Default: loopback names when --host is loopback, any name otherwise; given "
      "with another --host, only these.",
      flag="list", parse=lambda v: tuple(v) if v else None)
  allowed_origins: tuple[str, ...] = option(
      (),
      "Origins granted CORS (e.g. https://app.example.com, or '*'); default none: no CORS "
      "headers, so web pages cannot read answers.", flag="list", parse=tuple)
  api_key: str | None = option(  # never in logs
      None,
      "Require 'Authorization: Bearer <key>' on /v1/*, admin and every other path but "
      "/health and /metrics (401 otherwise). Default: $KVJAX_API_KEY, else no key.",
      flag="string", repr=False)
  auth_health_and_metrics: bool = option(
      False, "With an API key, require it on /health and /metrics too.")
  kv_events_endpoint: str | None = option(
      None,
      "Publish KV cache events (blocks stored, removed, all cleared) of the device prefix "
      "cache in vLLM's schema on this ZMQ address, e.g. tcp://*:5557 (bound; an address "
      "without '*' is connected to). Needs prefix caching. Default: off.",
      flag="string", parse=lambda v: v or None)
  kv_events_topic: str = option(
      "", "Topic frame of every event message; llm-d's indexer reads 'kv@<pod>@<model>'.")
  kv_events_replay_endpoint: str | None = option(
      None,
      "ZMQ ROUTER address (bound) answering replay requests: send an 8-byte big-endian "
      "start sequence number, get the buffered (seq, payload) frames from there, then (-1, "
      "'').", flag="string", parse=lambda v: v or None)
  kv_events_hash_algo: str = option(
      "sha256_cbor",
      "vLLM's block hash for the events (its --prefix-caching-hash-algo): sha256_cbor (what "
      "llm-d's indexer recomputes) or sha256 (pickle). Blocks are --block_size tokens.",
      choices=kv_events.HASH_ALGOS)
  kv_events_hash_seed: str | None = option(
      None,
      "vLLM's NONE_HASH seed (its PYTHONHASHSEED; llm-d's hashSeed). Default: "
      "$PYTHONHASHSEED, else '0'.", flag="string")
  kv_events_int_hashes: bool = option(
      True,
      "Block hashes as 64-bit ints (the low 8 bytes; vLLM's default) rather than 32 raw "
      "bytes.")

  @classmethod
  def from_flat(cls, **options: Any) -> ServerConfig:
    """A `ServerConfig` of flat names: its own fields, and the engine's options (applied to
    `server_engine_options()`).

    Raises:
      TypeError: a name that is neither.
      ValueError: a bad value.
    """
    own = {f.name for f in dataclasses.fields(cls)} - {"engine"}
    engine = {k: v for k, v in options.items() if k not in own}
    return cls(engine=server_engine_options(**engine),
               **{k: v for k, v in options.items() if k in own})

  @property
  def model(self) -> str:
    """The model's name or path (`engine.model.model`)."""
    return self.engine.model.model

  @property
  def is_follower(self) -> bool:
    """A multi-host process other than 0: no HTTP, it follows process 0's device calls."""
    return self.engine.parallel.multihost and self.engine.parallel.process_id != 0

  def __post_init__(self):
    if not isinstance(self.engine, EngineOptions):
      raise TypeError(f"engine must be a kvjax.config.EngineOptions, got "
                      f"{type(self.engine).__name__}")
    if not 0 <= self.port < 65536:
      raise ValueError(f"port={self.port} is not in [0, 65535]")
    if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
      raise ValueError(f"max_waiting_requests={self.max_waiting_requests} must be >= 0")
    if self.kv_events_hash_algo not in kv_events.HASH_ALGOS:
      raise ValueError(f"kv_events_hash_algo={self.kv_events_hash_algo!r}; use one of "
                       f"{kv_events.HASH_ALGOS}")
    if self.kv_events_endpoint is not None and not self.engine.cache.enable_prefix_caching:
      raise ValueError("kv_events_endpoint publishes the device prefix cache's blocks: it needs "
                       "enable_prefix_caching")
    self.http_policy()  # validates hosts, origins, key and body limit

  def http_policy(self) -> HttpPolicy:
    """The `guard.HttpPolicy` of these options."""
    return HttpPolicy(bind_host=self.host, max_request_bytes=self.max_request_bytes,
                      allowed_hosts=self.allowed_hosts, allowed_origins=self.allowed_origins,
                      api_key=self.api_key, auth_health_and_metrics=self.auth_health_and_metrics)

  @property
  def kv_store_url(self) -> str | None:
    """`kv_store` as a URL ("default": `builder.default_kv_store_url()`), or None
    (`KVStoreOptions.store_url`)."""
    return self.engine.kv.store_url

  def llm_options(self) -> dict[str, Any]:
    """The engine's options by their flat names, without the model (`LLM(config.model,
    **config.llm_options())` builds what `LLM(options=config.engine)` builds)."""
    opts = self.engine.flat()
    del opts["model"]
    if opts["compile_on_init"]:
      del opts["compile_on_init"]  # LLM's default; callers may pass their own
    return opts


def kv_event_publisher(config: ServerConfig) -> kv_events.ZmqKVEventPublisher | None:
  """The KV event publisher of `config` (bound now), or None when events are off.

  Raises:
    ImportError: pyzmq, msgpack or cbor2 missing.
    zmq.ZMQError: the endpoint cannot be bound.
  """
  if config.kv_events_endpoint is None:
    return None
  return kv_events.ZmqKVEventPublisher(
      config.kv_events_endpoint, topic=config.kv_events_topic,
      replay_endpoint=config.kv_events_replay_endpoint,
      hasher=kv_events.VllmBlockHasher(config.kv_events_hash_algo, config.kv_events_hash_seed),
      int_hashes=config.kv_events_int_hashes)


def backend_from_llm(llm: LLM, *, served_model_name: str | None = None, warm: bool = True,
                     max_waiting_requests: int | None = DEFAULT_MAX_WAITING_REQUESTS,
                     kv_event_publisher: kv_events.ZmqKVEventPublisher | None = None
                     ) -> Backend:
  """Warms `llm` up and starts its engine thread; the result is ready to `ServeState.attach`.

  Args:
    llm: the model and engine to serve (from here on the engine thread owns its engine).
    served_model_name: the `model` clients send; default `llm.model_name`.
    warm: compile every program first (`builder.warmup`).
    max_waiting_requests: requests admitted beyond the engine's decode slots; more get 429.
      None: unbounded.
    kv_event_publisher: publishes the device prefix cache's index changes (KV events in vLLM's
      schema) drained after every step; the backend closes it. None: no events.

  Raises:
    ValueError: a model without a tokenizer (the server speaks text).
  """
  tokenizer = llm.get_tokenizer()
  if tokenizer is None:
    raise ValueError(f"model {llm.model_name!r} has no tokenizer; the server needs one")
  # Built lazily by the tokenizer: build them now rather than on the first request.
  if tokenizer.max_token_chars < 1:
    raise ValueError(f"model {llm.model_name!r}: its tokenizer has an empty vocabulary")
  tokenizer.encode("<", parse_special=False)
  if warm:
    builder.warmup(llm)
  max_unfinished = (None if max_waiting_requests is None else
                    llm.engine.runner.config.num_slots + max_waiting_requests)
  loop = AsyncEngine(llm.engine, max_unfinished=max_unfinished)
  metrics = ServeMetrics(engine_stats=llm.engine.stats, loop_stats=loop.stats,
                         session_stats=llm.sessions.stats)
  loop.on_output = metrics.on_output
  if kv_event_publisher is not None:
    # Subscribers start from an empty view: drop warmup's blocks before recording starts.
    llm.engine.reset_prefix_cache()
    llm.engine.set_kv_events(True)
    loop.on_kv_events = kv_event_publisher.publish
  loop.start()
  fingerprint = llm.fingerprint
  return Backend(engine=loop, tokenizer=tokenizer,
                 model_name=served_model_name or llm.model_name,
                 max_model_len=llm.max_model_len, vocab_size=llm.model_config.vocab_size,
                 metrics=metrics, flush=llm.flush,
                 system_fingerprint=f"kvjax-{fingerprint[:12]}" if fingerprint else None,
                 sessions=llm.sessions, kv_event_publisher=kv_event_publisher,
                 stage_rerotated=llm.rerotation_stage)


def _size(nbytes: int | None) -> str:
  if nbytes is None:
    return "unbounded"
  for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if nbytes >= scale:
      return f"{nbytes / scale:.1f} {unit}"
  return f"{nbytes} B"


def store_startup_line(config: ServerConfig, llm: LLM) -> str | None:
  """The start-up line about the KV store: where it is, what it holds, how large it may grow,
  and whether chat sessions survive a restart (the `LLM` brought the store under its capacity
  when it opened it). None without a store.

  Lists every tier's records (blocking): called once, before serving.
  """
  kv = llm.kv_store
  if kv is None:
    return None
  try:
    tiers = "; ".join(f"{u.name}: {_size(u.nbytes)} in {u.chunks} chunks, capacity "
                      f"{_size(u.capacity_bytes)}" for u in kv.usage())
  except Exception as e:  # noqa: BLE001 - an unreachable store degrades to compute, as loads do
    tiers = f"its contents could not be listed: {e!r}"
  where = config.kv_store_url or "--kv_tiers"
  flag = "--kv_store_capacity_bytes" if config.kv_store_url else "capacity_bytes per tier"
  sessions = llm.sessions.persistence_dir
  return (f"kvjax: KV store {where} ({tiers}; {flag} sets it, least recently used chunks are "
          "evicted beyond); chat sessions " + (
              f"persist across restarts in {sessions}" if sessions is not None else
              "live in memory only (no local store folder): lost on restart"))


def load_backend(config: ServerConfig,
                 startup_progress: Callable[[StartupEvent], None] | None = None
                 ) -> tuple[Backend, LLM]:
  """Builds the `LLM` of `config`, warms it up, and starts its engine thread; prints the store's
  start-up line (`store_startup_line`).

  Args:
    config: the server's options.
    startup_progress: `LLM(startup_progress=...)`: called at each step of the start-up (weights,
      calibration, store, each compiled program); what it raises cancels the start-up (the
      partly built `LLM` is closed) and propagates. None (default): nothing reported.

  Raises:
    ValueError, FileNotFoundError: as `LLM`.
  """
  llm = builder.build_llm(options=config.engine, startup_progress=startup_progress)
  try:
    line = store_startup_line(config, llm)
    if line is not None:
      print(line, flush=True)
    publisher = kv_event_publisher(config)
  except Exception:
    llm.close()
    raise
  return backend_from_llm(llm, served_model_name=config.served_model_name,
                          max_waiting_requests=config.max_waiting_requests,
                          kv_event_publisher=publisher), llm


def build_follower(config: ServerConfig) -> LLM:
  """The `LLM` of a multi-host process other than 0 (`LLM.follow()` then serves process 0)."""
  return builder.build_llm(options=config.engine)


def close_backend(backend: Backend | None, llm: LLM | None) -> None:
  """Stops the engine thread, writes pending saves, detaches the metrics' log handlers."""
  if backend is not None:
    backend.engine.shutdown()
    backend.metrics.close()
    if backend.kv_event_publisher is not None:
      backend.kv_event_publisher.close()
  if llm is not None:
    llm.close()


#: Seconds a stopping server waits for the request of a connection it accepted before the stop
#: (and that has sent none yet) before closing it.
DRAIN_S = 5.0


class _Uvicorn(uvicorn.Server):
  """uvicorn that says when its sockets accept connections, and whose stop answers every
  connection it accepted.

  uvicorn's own shutdown closes at once each connection without a request in progress, and so
  also one whose request is on its way (connected before the stop, its bytes not yet read): the
  client saw a dropped connection where the stopping server would have answered 503. Here the
  stop first stops accepting (`draining` is set), then waits until every open connection has
  sent its first request (answered as any request then is: 503 once the engine is stopped), at
  most `drain_s`, and only then runs uvicorn's shutdown (responses in progress finish within
  `timeout_graceful_shutdown`, idle connections close).
  """

  def __init__(self, config: uvicorn.Config, drain_s: float = DRAIN_S):
    super().__init__(config)
    self.listening = threading.Event()
    self.draining = threading.Event()
    self.drain_s = drain_s

  async def startup(self, sockets=None):
    await super().startup(sockets)
    self.listening.set()

  def _awaiting_first_request(self) -> int:
    # uvicorn's HTTP protocols (h11, httptools) hold a connection's request in progress as
    # `cycle`: None until its first request's head is parsed.
    return sum(1 for c in self.server_state.connections if c.cycle is None)

  async def shutdown(self, sockets=None):
    for server in self.servers:  # stop accepting; connections already accepted stay open
      server.close()
    self.draining.set()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + self.drain_s
    while self._awaiting_first_request() and loop.time() < deadline:
      await asyncio.sleep(0.01)  # as uvicorn's own shutdown polls its connections (0.1 s)
    await super().shutdown(sockets)


class HttpServer:
  """uvicorn on a socket bound at construction.

  Args:
    app: the ASGI app.
    host: interface.
    port: TCP port; 0 picks a free one (read `port`).
    log_level: uvicorn's log level.
    drain_s: seconds `stop()` waits for the first request of connections accepted before it
      (then answered: 503 once the engine is stopped) before closing them.

  Raises:
    OSError: the address cannot be bound (in use, no such interface).
  """

  def __init__(self, app, host: str = "127.0.0.1", port: int = 0, *,
               log_level: str = "warning", drain_s: float = DRAIN_S):
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    self.sock = socket.socket(family, socket.SOCK_STREAM)
    self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
      self.sock.bind((host, port))
    except OSError:
      self.sock.close()
      raise
    self.host, self.port = host, self.sock.getsockname()[1]
    self.server = _Uvicorn(uvicorn.Config(app, log_level=log_level, lifespan="off",
                                          access_log=False, timeout_graceful_shutdown=5),
                           drain_s=drain_s)
    self._thread: threading.Thread | None = None

  @property
  def draining(self) -> threading.Event:
    """Set once a stop has closed the listening socket: from then on no connection is accepted,
    and those already accepted get their requests answered before they close."""
    return self.server.draining

  @property
  def url(self) -> str:
    host = f"[{self.host}]" if ":" in self.host else self.host
    return f"http://{host}:{self.port}"

  def run(self) -> None:
    """Serves until `stop()` or SIGINT/SIGTERM (when on the main thread); blocking."""
    self.server.run(sockets=[self.sock])

  def start(self, timeout_s: float = 60.0, *,
            on_exit: Callable[[], None] | None = None) -> None:
    """Serves on a daemon thread; returns once the socket accepts connections. `on_exit` is
    called on that thread when uvicorn returns (stopped, or failed).

    Raises:
      RuntimeError: uvicorn did not start within `timeout_s`.
    """
    def run():
      try:
        self.run()
      finally:
        self.server.listening.set()  # also when uvicorn gave up starting
        if on_exit is not None:
          on_exit()

    self._thread = threading.Thread(target=run, name="kvjax-http", daemon=True)
    self._thread.start()
    if not self.server.listening.wait(timeout_s) or not self.server.started:
      raise RuntimeError(f"uvicorn did not start within {timeout_s} s")

  def stop(self, timeout_s: float = 30.0) -> None:
    """Stops accepting, answers the connections already accepted (at most `drain_s` for a
    request still on its way, then uvicorn's 5 s graceful shutdown for responses in progress),
    and returns once uvicorn has ended or `timeout_s` passed."""
    self.server.should_exit = True
    if self._thread is not None:
      self._thread.join(timeout_s)
    self.sock.close()
