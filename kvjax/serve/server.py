"""From options to a listening server: `ServerConfig` -> `LLM` -> warmup -> `Backend` -> uvicorn.

    state = ServeState(); app = create_app(state)
    http = HttpServer(app, "127.0.0.1", 0)        # binds now; http.port is the chosen port
    http.start()                                  # uvicorn in a thread (or http.run() blocking)
    backend, llm = load_backend(ServerConfig(model="tiny"))
    state.attach(backend)                         # /health turns 200

The socket is bound before uvicorn starts, so port 0 yields a known free port at once, and the
server listens (answering 503) while the model loads and compiles.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
from typing import Any, Callable

import uvicorn

from kvjax import codecs
from kvjax.engine import LLM, builder
from kvjax.engine.llm import StartupEvent
from kvjax.serve import kv_events
from kvjax.serve.app import Backend
from kvjax.serve.async_engine import AsyncEngine
from kvjax.serve.guard import DEFAULT_MAX_REQUEST_BYTES, HttpPolicy
from kvjax.serve.metrics import ServeMetrics
from kvjax.sessions import (DEFAULT_MAX_PINNED_SESSIONS, DEFAULT_MAX_SESSION_TOKENS,
                            DEFAULT_MAX_SESSIONS, DEFAULT_REROTATE_BOUNDARY_CHUNKS,
                            DEFAULT_SESSION_TTL_S, SessionConfig)

#: The codecs `--kv_codec` offers: every codec of the registry (`kvjax.codecs`).
KV_CODECS = tuple(codecs.CODECS)
PREFILL_ORDERS = builder.PREFILL_ORDERS
#: Default `max_waiting_requests`: requests queued beyond the decode slots before 429s.
DEFAULT_MAX_WAITING_REQUESTS = 256
#: Default `max_num_seqs`: sequences reserve no memory up front (the KV pool is shared; a full
#: pool preempts).
DEFAULT_MAX_NUM_SEQS = 64


@dataclasses.dataclass(frozen=True)
class ServerConfig:
  """Options of `python -m kvjax.serve` (flags of the same names).

  Attributes:
    model: model name or path (see `LLM`).
    served_model_name: the `model` clients send; default the loaded model's name.
    host: interface to listen on.
    port: TCP port; 0 picks a free one.
    dtype: compute and KV dtype ("auto", "float32", "bfloat16").
    max_model_len: tokens per sequence; None: the model's context.
    max_num_seqs: requests running at once; None: `DEFAULT_MAX_NUM_SEQS` (the KV pool, not
      this number, bounds memory; preemption handles a full pool).
    max_num_batched_tokens: token budget of one engine step; None: the largest chunk size.
    long_prefill_token_threshold: one request's prefill tokens per step at most (vLLM's option;
      see `LLM`), so a long prompt shares the step with other requests' prefills; 0: off.
    prefill_order: one of `PREFILL_ORDERS`, "shortest_first" (default) or "fcfs": which
      prefills take a step's budget first (see `LLM`).
    short_first_token_steps: with "shortest_first", keep a step short when it carries a
      prefill's first token or a store hit's last loads, or wait for a hit's loads that land
      within half a step (see `LLM`); True (default).
    chunk_sizes: compiled prefill chunk sizes; None: `LLM`'s default.
    seed: seeds requests that give no seed.
    cache_dir: kvjax's cache root (params, compiled programs); None: the default.
    kv_store: store URL; "default" is `builder.default_kv_store_url()`; None: no store.
    kv_tiers: a tier list as JSON (or a JSON file), instead of `kv_store`.
    kv_store_capacity_bytes: byte limit of the `kv_store` (least recently used chunks, suffixes
      before their prefixes, are evicted beyond; `kvjax.storage.eviction.LRUPolicy`); None:
      `DEFAULT_STORE_CAPACITY_BYTES` (4 GiB) for a local or memory store, unbounded for s3://.
      With `kv_tiers`, set each tier's `capacity_bytes` instead.
    kv_chunk_size: tokens per stored chunk.
    kv_codec: stored chunk encoding, one of `KV_CODECS` ("raw", "int8", "int4", "cachegen").
    kv_merge_mode: "cake" (compute the front, load the back), "load_only" or "compute_only".
    kv_codec_consistent: outputs independent of the meeting point with a lossy codec (None: on
      where feasible; see `LLM`).
    kv_link_bytes_per_s: emulated store link, bytes/s; None: unlimited.
    kv_link_trace: file of "seconds bytes_per_s" lines instead of a constant link.
    block_size: tokens per block of the KV pool (`kv_chunk_size` must be a multiple).
    kv_cache_memory_bytes: the pool's size, bytes; None: `LLM`'s default.
    enable_prefix_caching: keep finished prefixes' blocks on the device for later requests.
    enable_admin: serve POST /admin/flush_kv.
    log_level: uvicorn's log level.
    max_request_bytes: largest request body, bytes (413 beyond, before any parsing).
    max_waiting_requests: requests that may wait beyond the `max_num_seqs` running ones (429
      beyond); None: unbounded.
    allow_special_tokens_in_prompt: parse special-token text in completion string prompts
      (chat content is always plain text).
    allowed_hosts: extra `Host` names (see `guard.HttpPolicy`); None: the default for `host`.
    allowed_origins: origins granted CORS; empty: no CORS headers.
    api_key: required as `Authorization: Bearer` on all but /health and /metrics; None: open.
    auth_health_and_metrics: require `api_key` on /health and /metrics too.
    session_ttl_s: chat sessions (`session_id`): seconds a session may stay idle before it
      expires; None: never.
    max_sessions: sessions held at once (least recently used idle ones dropped beyond).
    max_session_tokens: token ids held over all sessions (idle sessions dropped beyond).
    kv_events_endpoint: publish the device prefix cache's KV events in vLLM's schema on this
      ZMQ address (e.g. "tcp://*:5557"; `kv_events.ZmqKVEventPublisher`); None: off. Needs
      prefix caching.
    kv_events_topic: the events' topic frame (llm-d reads "kv@<pod>@<model>").
    kv_events_replay_endpoint: a ZMQ ROUTER address serving replays of buffered batches.
    kv_events_hash_algo: vLLM's block hash: "sha256_cbor" (default) or "sha256".
    kv_events_hash_seed: vLLM's NONE_HASH seed (its PYTHONHASHSEED); None: $PYTHONHASHSEED,
      else "0".
    kv_events_int_hashes: hashes as 64-bit ints (vLLM's default) or 32 raw bytes.
    tensor_parallel_size: devices the model is split over (`LLM`; docs/design/scale-out.md).
    coordinator_address, num_processes, process_id: multi-host as one program
      (`jax.distributed`, see `LLM`): process 0 serves HTTP, the others follow it.
    session_truncation, session_rerotate, session_rerotate_boundary_chunks: as `LLM(...)` (a
      session turn over the context drops its oldest turns; re-rotate the kept turns' stored
      KV, the first chunks computed).
    kv_lookahead_window, max_pinned_sessions, max_pinned_session_bytes: as `LLM(...)` (the
      look-ahead window of prefetch and eviction; sessions' KV pinned in the host tier).
    kv_placement: as `LLM(...)`: "write_through", "write_back" or None (the tiers' default).

  Raises:
    ValueError: a bad port, codec, limit, host, origin, key or session limit, or KV events
      asked for without the prefix cache.
  """

  model: str = "SmolLM2-135M-Instruct"
  served_model_name: str | None = None
  host: str = "127.0.0.1"
  port: int = 8000
  dtype: str = "auto"
  max_model_len: int | None = None
  max_num_seqs: int | None = None
  max_num_batched_tokens: int | None = None
  long_prefill_token_threshold: int = 0
  prefill_order: str = builder.SHORTEST_FIRST
  short_first_token_steps: bool = True
  chunk_sizes: tuple[int, ...] | None = None
  seed: int = 0
  cache_dir: str | None = None
  kv_store: str | None = "default"
  kv_tiers: str | None = None
  kv_store_capacity_bytes: int | None = None
  kv_chunk_size: int = 256
  kv_codec: str = "raw"
  kv_merge_mode: str = "cake"
  kv_codec_consistent: bool | None = None
  kv_link_bytes_per_s: float | None = None
  kv_link_trace: str | None = None
  block_size: int = 16
  kv_cache_memory_bytes: int | None = None
  enable_prefix_caching: bool = True
  enable_admin: bool = False
  log_level: str = "warning"
  max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
  max_waiting_requests: int | None = DEFAULT_MAX_WAITING_REQUESTS
  allow_special_tokens_in_prompt: bool = False
  allowed_hosts: tuple[str, ...] | None = None
  allowed_origins: tuple[str, ...] = ()
  api_key: str | None = dataclasses.field(default=None, repr=False)  # never in logs
  auth_health_and_metrics: bool = False
  session_ttl_s: float | None = DEFAULT_SESSION_TTL_S
  max_sessions: int = DEFAULT_MAX_SESSIONS
  max_session_tokens: int = DEFAULT_MAX_SESSION_TOKENS
  kv_events_endpoint: str | None = None
  kv_events_topic: str = ""
  kv_events_replay_endpoint: str | None = None
  kv_events_hash_algo: str = "sha256_cbor"
  kv_events_hash_seed: str | None = None
  kv_events_int_hashes: bool = True
  tensor_parallel_size: int = 1
  coordinator_address: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  session_truncation: str = "none"
  session_rerotate: bool = False
  session_rerotate_boundary_chunks: int = DEFAULT_REROTATE_BOUNDARY_CHUNKS
  kv_lookahead_window: int = 8
  max_pinned_sessions: int = DEFAULT_MAX_PINNED_SESSIONS
  max_pinned_session_bytes: int | None = None
  kv_placement: str | None = None

  @property
  def is_follower(self) -> bool:
    """A multi-host process other than 0: no HTTP, it follows process 0's device calls."""
    return (self.num_processes or 1) > 1 and self.process_id != 0

  def __post_init__(self):
    if self.kv_codec not in KV_CODECS:
      raise ValueError(f"kv_codec={self.kv_codec!r} is not one of {KV_CODECS}")
    try:
      codecs.check_chunk_size(self.kv_codec, None, self.kv_chunk_size)
    except ValueError as e:
      raise ValueError(f"kv_chunk_size={self.kv_chunk_size!r}: {e}") from e
    builder.check_scheduling_options(self.long_prefill_token_threshold, self.chunk_sizes,
                                     self.prefill_order, self.short_first_token_steps)
    if self.kv_store_capacity_bytes is not None and self.kv_tiers is not None:
      raise ValueError("kv_store_capacity_bytes bounds --kv_store; with kv_tiers, give each "
                       "tier its capacity_bytes")
    for name in ("max_num_seqs", "block_size", "kv_cache_memory_bytes",
                 "kv_store_capacity_bytes"):
      v = getattr(self, name)
      if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
        raise ValueError(f"{name}={v!r} must be a positive int")
    if not 0 <= self.port < 65536:
      raise ValueError(f"port={self.port} is not in [0, 65535]")
    if self.kv_tiers is not None and self.kv_store not in (None, "default"):
      raise ValueError("give kv_store or kv_tiers, not both")
    if self.kv_tiers is not None:
      try:
        builder.store_config_from_json(self.kv_tiers)  # before the port is bound
      except ValueError as e:
        raise ValueError(f"kv_tiers: {e}") from e
    try:
      self.store_config()  # a bad URL, link or capacity: refused before the port is bound
    except ValueError as e:
      raise ValueError(f"kv_store: {e}") from e
    if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
      raise ValueError(f"max_waiting_requests={self.max_waiting_requests} must be >= 0")
    if self.kv_events_hash_algo not in kv_events.HASH_ALGOS:
      raise ValueError(f"kv_events_hash_algo={self.kv_events_hash_algo!r}; use one of "
                       f"{kv_events.HASH_ALGOS}")
    if self.kv_events_endpoint is not None and not self.enable_prefix_caching:
      raise ValueError("kv_events_endpoint publishes the device prefix cache's blocks: it needs "
                       "enable_prefix_caching")
    self.http_policy()  # validates hosts, origins, key and body limit
    SessionConfig(ttl_s=self.session_ttl_s, max_sessions=self.max_sessions,
                  max_tokens=self.max_session_tokens, truncation=self.session_truncation,
                  rerotate=self.session_rerotate,
                  rerotate_boundary_chunks=self.session_rerotate_boundary_chunks,
                  max_pinned_sessions=self.max_pinned_sessions,
                  max_pinned_bytes=self.max_pinned_session_bytes)  # validates the session limits
    w = self.kv_lookahead_window
    if isinstance(w, bool) or not isinstance(w, int) or w < 0:
      raise ValueError(f"kv_lookahead_window={w!r} must be an int >= 0")
    if self.kv_placement not in (None, "write_through", "write_back"):
      raise ValueError(f"kv_placement={self.kv_placement!r}; use 'write_through' or "
                       "'write_back'")

  def http_policy(self) -> HttpPolicy:
    """The `guard.HttpPolicy` of these options."""
    return HttpPolicy(bind_host=self.host, max_request_bytes=self.max_request_bytes,
                      allowed_hosts=self.allowed_hosts, allowed_origins=self.allowed_origins,
                      api_key=self.api_key, auth_health_and_metrics=self.auth_health_and_metrics)

  @property
  def resolved_max_num_seqs(self) -> int:
    """`max_num_seqs`, or `DEFAULT_MAX_NUM_SEQS`."""
    if self.max_num_seqs is not None:
      return self.max_num_seqs
    return DEFAULT_MAX_NUM_SEQS

  @property
  def kv_store_url(self) -> str | None:
    """`kv_store` resolved ("default": `builder.default_kv_store_url()`), or None."""
    if self.kv_store is None or self.kv_tiers is not None:
      return None
    return builder.default_kv_store_url() if self.kv_store == "default" else self.kv_store

  def store_config(self):
    """The one-tier `StoreConfig` of `kv_store` (its capacity and link); None without one.

    This is where the server's store is defined (`store_startup_line` says where it is and how
    large it may grow).
    """
    url = self.kv_store_url
    if url is None:
      return None
    return builder.store_config_from_url(url, capacity_bytes=self.kv_store_capacity_bytes,
                                         link_bytes_per_s=self.kv_link_bytes_per_s,
                                         link_trace=self.kv_link_trace)

  def llm_options(self) -> dict[str, Any]:
    """Keyword arguments of `builder.build_llm` (and so of `LLM`)."""
    opts: dict[str, Any] = dict(
        dtype=self.dtype, max_num_seqs=self.resolved_max_num_seqs,
        max_model_len=self.max_model_len,
        max_num_batched_tokens=self.max_num_batched_tokens,
        long_prefill_token_threshold=self.long_prefill_token_threshold,
        prefill_order=self.prefill_order,
        short_first_token_steps=self.short_first_token_steps, seed=self.seed,
        cache_dir=self.cache_dir, kv_codec=self.kv_codec,
        session_ttl_s=self.session_ttl_s,
        max_sessions=self.max_sessions, max_session_tokens=self.max_session_tokens,
        session_truncation=self.session_truncation, session_rerotate=self.session_rerotate,
        session_rerotate_boundary_chunks=self.session_rerotate_boundary_chunks,
        kv_lookahead_window=self.kv_lookahead_window,
        max_pinned_sessions=self.max_pinned_sessions,
        max_pinned_session_bytes=self.max_pinned_session_bytes,
        block_size=self.block_size, kv_cache_memory_bytes=self.kv_cache_memory_bytes,
        enable_prefix_caching=self.enable_prefix_caching)
    if self.tensor_parallel_size != 1:
      opts["tensor_parallel_size"] = self.tensor_parallel_size
    if (self.num_processes or 1) > 1:
      opts.update(coordinator_address=self.coordinator_address,
                  num_processes=self.num_processes, process_id=self.process_id)
    if self.chunk_sizes is not None:
      opts["chunk_sizes"] = tuple(self.chunk_sizes)
    if self.kv_tiers is not None:
      opts["kv_store"] = builder.store_config_from_json(self.kv_tiers)
      opts.update(kv_link_bytes_per_s=self.kv_link_bytes_per_s, kv_link_trace=self.kv_link_trace)
    elif self.kv_store is not None:
      opts["kv_store"] = self.store_config()
    if "kv_store" in opts:
      opts.update(kv_chunk_size=self.kv_chunk_size, kv_merge_mode=self.kv_merge_mode,
                  kv_codec_consistent=self.kv_codec_consistent)
      if self.kv_placement is not None:
        opts["kv_placement"] = self.kv_placement
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
      partly built `LLM` is closed) and propagates.

  Raises:
    ValueError, FileNotFoundError: as `LLM`.
  """
  llm = builder.build_llm(config.model, startup_progress=startup_progress,
                          **config.llm_options())
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
  return builder.build_llm(config.model, **config.llm_options())


def close_backend(backend: Backend | None, llm: LLM | None) -> None:
  """Stops the engine thread, writes pending saves, detaches the metrics' log handlers."""
  if backend is not None:
    backend.engine.shutdown()
    backend.metrics.close()
    if backend.kv_event_publisher is not None:
      backend.kv_event_publisher.close()
  if llm is not None:
    llm.close()


class _Uvicorn(uvicorn.Server):
  """uvicorn that says when its sockets accept connections."""

  def __init__(self, config: uvicorn.Config):
    super().__init__(config)
    self.listening = threading.Event()

  async def startup(self, sockets=None):
    await super().startup(sockets)
    self.listening.set()


class HttpServer:
  """uvicorn on a socket bound at construction.

  Args:
    app: the ASGI app.
    host: interface.
    port: TCP port; 0 picks a free one (read `port`).
    log_level: uvicorn's log level.

  Raises:
    OSError: the address cannot be bound (in use, no such interface).
  """

  def __init__(self, app, host: str = "127.0.0.1", port: int = 0, *,
               log_level: str = "warning"):
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
                                          access_log=False, timeout_graceful_shutdown=5))
    self._thread: threading.Thread | None = None

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
    self.server.should_exit = True
    if self._thread is not None:
      self._thread.join(timeout_s)
    self.sock.close()
