r"""`python -m kvjax.serve`: the OpenAI-compatible server.

    python -m kvjax.serve                                   # SmolLM2-135M-Instruct on :8000
    python -m kvjax.serve --port=0 --kv_store=memory://     # a free port, a store in memory
    python -m kvjax.serve --kv_link_bytes_per_s=1e8 --kv_chunk_size=256 --max_num_seqs=8
    python -m kvjax.serve --kv_cache_memory_bytes=1073741824 \
        --no_enable_prefix_caching                          # a 1 GiB pool, no device cache
    python -m kvjax.serve --kv_store=s3://kv/llm --s3_endpoint_url=http://rgw:7480 \
        --kv_events_endpoint='tcp://*:5557' \
        --kv_events_topic=kv@pod-a@SmolLM2-135M-Instruct    # a replica for llm-d's router
    KVJAX_API_KEY=secret python -m kvjax.serve --host=0.0.0.0 --allowed_hosts=llm.example.com
    python -m kvjax.serve --tensor_parallel_size=8 --num_processes=2 --process_id=$RANK \
        --coordinator_address=host0:1234             # 2 hosts x 4 devices; HTTP on process 0

Thin entry point: absl flags -> `ServerConfig` -> bind the socket -> uvicorn on a thread (GET
/health answers 503 until the model is ready) -> load and warm up the model on a loader thread,
one log line per step ("kvjax: compiled 3/8: ...") -> serve.

Start and stop: the main thread owns SIGINT and SIGTERM (`StopRequest`, installed before JAX and
uvicorn are imported) and sleeps until a signal, the loader or uvicorn wakes it. A signal while
loading cancels the start-up at the loader's next step (between programs); a step that cannot be
interrupted (a weight conversion, one long compile) gets `CANCEL_GRACE_S`, then the process ends
with `os._exit` after flushing its output: the interpreter never tears XLA down under a thread
inside it (that aborted the process: "terminate called ...", exit 134). A signal while serving
stops uvicorn, fails what is still running (503), writes pending KV saves and exits 0. A second
signal exits at once (130).
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time


class StopRequest:
  """SIGINT/SIGTERM for the main thread: the first asks to stop, a second exits at once.

  The handler only counts and writes one byte to a pipe (no lock, so it cannot deadlock with
  the thread it interrupts); the main thread sleeps in `wait()` on that pipe, which `wake()`
  (the loader, uvicorn's thread) also writes to. The pipe is also the interpreter's wake-up fd
  (`signal.set_wakeup_fd`): a signal the kernel delivers to another thread leaves the main
  thread's `read` running, and only that byte wakes it so that the handler can run.
  """

  def __init__(self):
    self._r, self._w = os.pipe()
    os.set_blocking(self._w, False)
    self.signals = 0

  def install(self) -> None:
    """Installs the handlers and the wake-up fd (call on the main thread)."""
    signal.set_wakeup_fd(self._w)
    for sig in (signal.SIGINT, signal.SIGTERM):
      signal.signal(sig, self._on_signal)

  @property
  def requested(self) -> bool:
    return self.signals > 0

  def _on_signal(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
    self.signals += 1
    if self.signals > 1:
      os.write(2, b"kvjax: second signal: exiting now\n")
      os._exit(128 + signal.SIGINT)  # 130: what a shell reports for an interrupted program
    self.wake()

  def wake(self) -> None:
    try:
      os.write(self._w, b"x")
    except BlockingIOError:  # the pipe is full: the main thread has wake-ups queued anyway
      pass

  def wait(self, timeout_s: float | None = None) -> None:
    """Sleeps until a signal or a `wake()` (one wake-up each), or `timeout_s` passed."""
    if select.select([self._r], [], [], timeout_s)[0]:
      os.read(self._r, 1)


#: Seconds a cancelled start-up may take to reach its next step before the process exits anyway.
CANCEL_GRACE_S = 5.0

STOP = StopRequest()
if __name__ == "__main__":
  STOP.install()  # before the heavy imports below: a Ctrl-C during them is not lost

import json  # noqa: E402

from absl import app, flags, logging  # noqa: E402

from kvjax.serve.app import ServeState, create_app  # noqa: E402
from kvjax.serve.guard import DEFAULT_MAX_REQUEST_BYTES  # noqa: E402
from kvjax.serve.server import (DEFAULT_MAX_NUM_SEQS, DEFAULT_MAX_WAITING_REQUESTS, KV_CODECS,  # noqa: E402
                                PREFILL_ORDERS, HttpServer, ServerConfig, StartupEvent,
                                build_follower, close_backend, load_backend)
from kvjax.sessions import (DEFAULT_MAX_PINNED_SESSIONS, DEFAULT_MAX_SESSION_TOKENS,  # noqa: E402
                            DEFAULT_MAX_SESSIONS, DEFAULT_REROTATE_BOUNDARY_CHUNKS,
                            DEFAULT_SESSION_TTL_S)

_MODEL = flags.DEFINE_string("model", "SmolLM2-135M-Instruct",
                             "Model name, .gguf path, Hugging Face safetensors dir, or 'tiny'.")
_SERVED = flags.DEFINE_string("served_model_name", None,
                              "Name clients pass as `model` (default: the model's name).")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Interface to listen on.")
_PORT = flags.DEFINE_integer("port", 8000, "TCP port; 0 picks a free port (printed).")
_DTYPE = flags.DEFINE_enum("dtype", "auto", ["auto", "float32", "bfloat16"],
                           "Compute and KV cache dtype ('auto': float32 on CPU, bf16 otherwise).")
_MAX_MODEL_LEN = flags.DEFINE_integer("max_model_len", None,
                                      "Tokens per sequence, prompt plus output (default: the "
                                      "model's context).")
_MAX_NUM_SEQS = flags.DEFINE_integer(
    "max_num_seqs", None, f"Requests running at once (default: {DEFAULT_MAX_NUM_SEQS}; the "
    "KV pool, not this number, bounds memory).")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "Tokens per block of the KV pool "
                                   "(--kv_chunk_size must be a multiple).")
_KV_BYTES = flags.DEFINE_integer(
    "kv_cache_memory_bytes", None, "Paged: the block pool's size in bytes (default: on CPU "
    "2 GiB or less, see LLM; on an accelerator 80% of free memory).")
_PREFIX_CACHING = flags.DEFINE_bool(
    "enable_prefix_caching", True, "Paged: keep finished prefixes' blocks on the device and "
    "share them with later requests; --no_enable_prefix_caching (or --noenable_prefix_caching) "
    "turns it off.")
_BUDGET = flags.DEFINE_integer("max_num_batched_tokens", None,
                               "Token budget of one engine step (default: the largest chunk).")
_LONG_PREFILL = flags.DEFINE_integer(
    "long_prefill_token_threshold", 0,
    "One request's prefill tokens per engine step at most (vLLM's option), so a long prompt "
    "shares the step with other requests' prefills; at least the smallest chunk size, or 0 "
    "(default): off.")
_PREFILL_ORDER = flags.DEFINE_enum(
    "prefill_order", ServerConfig.prefill_order, list(PREFILL_ORDERS),
    "Which prefills take a step's token budget first: 'shortest_first' (default), the one "
    "with the fewest tokens left (a store hit whose loaded chunks are all inserted, and a "
    "queued request with fewer tokens left past its device prefix than a prefill under way, "
    "among them, so a hit's TTFT does not wait behind a long cold prompt), or 'fcfs' "
    "(admission order; store hits' compute after every ordinary prefill).")
_SHORT_STEPS = flags.DEFINE_bool(
    "short_first_token_steps", ServerConfig.short_first_token_steps,
    "With --prefill_order=shortest_first: keep a step short when it carries a prefill's first "
    "token (the prefills after it take at most as many tokens again) or a store hit's last "
    "loads (the step ends about when they land), and let a step wait for a hit's loads that "
    "land within half a step (it computes nothing meanwhile), so a hit's first token waits for "
    "a short step instead of a full one. --noshort_first_token_steps: every step takes the "
    "budget.")
_CHUNK_SIZES = flags.DEFINE_list("chunk_sizes", None,
                                 "Compiled prefill chunk sizes, ascending (default 16..512).")
_SEED = flags.DEFINE_integer("seed", 0, "Seeds requests that give no seed.")
_CACHE_DIR = flags.DEFINE_string("cache_dir", None,
                                 "kvjax cache root (params, compiled programs); '' disables.")
_KV_STORE = flags.DEFINE_string(
    "kv_store", "default",
    "Prefix-cache store URL: file:///path or a path, memory://, ocdbt+file:///path, "
    "s3://bucket/prefix; 'default' is <cache root>/store; 'none' disables the store.")
_KV_TIERS = flags.DEFINE_string(
    "kv_tiers", None,
    'Tier list as JSON or a JSON file, instead of --kv_store, e.g. '
    '\'[{"kind": "host", "capacity_bytes": 1073741824}, {"kind": "disk", "url": "/data/kv"}]\'.')
_KV_CHUNK = flags.DEFINE_integer("kv_chunk_size", 256, "Tokens per stored KV chunk.")
_KV_CODEC = flags.DEFINE_enum("kv_codec", "raw", list(KV_CODECS), "Stored KV chunk encoding.")
_MERGE = flags.DEFINE_enum("kv_merge_mode", "cake", ["cake", "load_only", "compute_only"],
                           "How a stored prefix becomes resident: compute the front while loading "
                           "the back (cake), or one side only (the baselines).")
_CONSISTENT = flags.DEFINE_enum(
    "kv_codec_consistent", "auto", ["auto", "true", "false"],
    "Lossy codecs: make outputs independent of which chunks were loaded (a fixed encoding per "
    "request, computed chunks pass through it); auto: on where kv_chunk_size is a compiled "
    "chunk size within the token budget.")
_LINK = flags.DEFINE_float("kv_link_bytes_per_s", None,
                           "Emulated store link bandwidth, bytes/s (default unlimited).")
_TRACE = flags.DEFINE_string("kv_link_trace", None,
                             "File of 'seconds bytes_per_s' lines: a varying emulated link.")
_ADMIN = flags.DEFINE_bool("enable_admin", False,
                           "Serve the admin endpoints: POST /admin/flush_kv (waits for "
                           "queued KV saves) and POST /reset_prefix_cache (drops the device "
                           "prefix cache).")
_MAX_BYTES = flags.DEFINE_integer("max_request_bytes", DEFAULT_MAX_REQUEST_BYTES,
                                  "Largest request body in bytes; larger ones get 413 before any "
                                  "parsing (also chunked bodies without Content-Length).")
_MAX_WAITING = flags.DEFINE_integer("max_waiting_requests", DEFAULT_MAX_WAITING_REQUESTS,
                                    "Requests that may wait beyond the --max_num_seqs running "
                                    "ones; more get 429. -1: unbounded.")
_ALLOW_SPECIAL = flags.DEFINE_bool(
    "allow_special_tokens_in_prompt", False,
    "Parse special-token text (e.g. '<|im_start|>') in completion string prompts into control "
    "tokens; by default it is plain text. Chat message content is always plain text.")
_ALLOWED_HOSTS = flags.DEFINE_list(
    "allowed_hosts", None,
    "Host header names served besides the loopback ones (exact, '*.example.com', or '*' for "
    "any). Default: loopback names when --host is loopback, any name otherwise; given with "
    "another --host, only these.")
_ALLOWED_ORIGINS = flags.DEFINE_list(
    "allowed_origins", [],
    "Origins granted CORS (e.g. https://app.example.com, or '*'); default none: no CORS "
    "headers, so web pages cannot read answers.")
_API_KEY = flags.DEFINE_string(
    "api_key", None,
    "Require 'Authorization: Bearer <key>' on /v1/*, admin and every other path but /health and "
    "/metrics (401 otherwise). Default: $KVJAX_API_KEY, else no key.")
_AUTH_OPEN = flags.DEFINE_bool("auth_health_and_metrics", False,
                               "With an API key, require it on /health and /metrics too.")
_SESSION_TTL = flags.DEFINE_float(
    "session_ttl_s", DEFAULT_SESSION_TTL_S,
    "Chat sessions (session_id): seconds a session may stay idle before it expires (dropped on "
    "the next access); -1: never.")
_MAX_SESSIONS = flags.DEFINE_integer(
    "max_sessions", DEFAULT_MAX_SESSIONS,
    "Chat sessions held at once; beyond, the least recently used idle one is dropped.")
_MAX_SESSION_TOKENS = flags.DEFINE_integer(
    "max_session_tokens", DEFAULT_MAX_SESSION_TOKENS,
    "Token ids held over all chat sessions (each: its last turn's prompt and output); beyond, "
    "least recently used idle sessions are dropped.")
# -- Scale out: a shared S3 store, KV cache events for llm-d's precise prefix-cache routing ----
_S3_ENDPOINT = flags.DEFINE_string(
    "s3_endpoint_url", None,
    "S3-compatible endpoint of an s3:// --kv_store (MinIO, Ceph RGW, ...); sets AWS_ENDPOINT_URL "
    "for this process. Default: $AWS_ENDPOINT_URL, else AWS. Credentials come from the usual "
    "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY environment or AWS config, never from flags.")
_S3_REGION = flags.DEFINE_string("s3_region", None,
                                 "Region of an s3:// --kv_store; sets AWS_REGION. Default: "
                                 "$AWS_REGION, else $AWS_DEFAULT_REGION.")
_EVENTS = flags.DEFINE_string(
    "kv_events_endpoint", None,
    "Publish KV cache events (blocks stored, removed, all cleared) of the device prefix cache in "
    "vLLM's schema on this ZMQ address, e.g. tcp://*:5557 (bound; an address without '*' is "
    "connected to). Needs prefix caching. Default: off.")
_EVENTS_TOPIC = flags.DEFINE_string("kv_events_topic", "",
                                    "Topic frame of every event message; llm-d's indexer reads "
                                    "'kv@<pod>@<model>'.")
_EVENTS_REPLAY = flags.DEFINE_string(
    "kv_events_replay_endpoint", None,
    "ZMQ ROUTER address (bound) answering replay requests: send an 8-byte big-endian start "
    "sequence number, get the buffered (seq, payload) frames from there, then (-1, '').")
_EVENTS_ALGO = flags.DEFINE_enum(
    "kv_events_hash_algo", "sha256_cbor", ["sha256_cbor", "sha256"],
    "vLLM's block hash for the events (its --prefix-caching-hash-algo): sha256_cbor (what "
    "llm-d's indexer recomputes) or sha256 (pickle). Blocks are --block_size tokens.")
_EVENTS_SEED = flags.DEFINE_string(
    "kv_events_hash_seed", None,
    "vLLM's NONE_HASH seed (its PYTHONHASHSEED; llm-d's hashSeed). Default: $PYTHONHASHSEED, "
    "else '0'.")
_EVENTS_INT = flags.DEFINE_bool(
    "kv_events_int_hashes", True,
    "Block hashes as 64-bit ints (the low 8 bytes; vLLM's default) rather than 32 raw bytes.")
_TP = flags.DEFINE_integer(
    "tensor_parallel_size", 1, "Devices the model is split over (a tp mesh).")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "Multi-host: host:port of process 0 (jax.distributed).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None,
                                      "Multi-host: processes in the run (jax.distributed).")
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "Multi-host: this process; 0 serves HTTP, the others follow it.")
_SESSION_TRUNCATION = flags.DEFINE_enum(
    "session_truncation", "none", ["none", "drop_oldest_turns"],
    "A chat session turn whose prompt passes the context (minus max_tokens) or its "
    "truncate_prompt_tokens: 'none' (400, or a plain left cut with truncate_prompt_tokens) or "
    "'drop_oldest_turns' (keep the system prompt and the last turn, drop whole oldest turns; "
    "400 when even that does not fit, or a left cut with truncate_prompt_tokens).")
_SESSION_REROTATE = flags.DEFINE_bool(
    "session_rerotate", False,
    "With --session_truncation=drop_oldest_turns and a store: re-rotate the kept turns' stored "
    "KV to their new positions instead of recomputing them (approximate; a private namespace, "
    "never an ordinary prefix hit).")
_SESSION_REROTATE_BOUNDARY = flags.DEFINE_integer(
    "session_rerotate_boundary_chunks", DEFAULT_REROTATE_BOUNDARY_CHUNKS,
    "With --session_rerotate: the truncated prompt's first store chunks (the system prompt and "
    "the seam after the dropped turns) computed exactly instead of re-rotated; 0: none.")
_LOOKAHEAD = flags.DEFINE_integer(
    "kv_lookahead_window", 8,
    "With a store: waiting requests whose stored chunks are kept from eviction and prefetched "
    "from disk/remote into the host tier ahead of scheduling (CachedAttention look-ahead); 0: "
    "off (plain LRU, no prefetch).")
_MAX_PINNED = flags.DEFINE_integer(
    "max_pinned_sessions", DEFAULT_MAX_PINNED_SESSIONS,
    "With a store: open chat sessions whose last turn's stored chunks are pinned in the host "
    "tier (most recently used first; unpinned when closed or expired); 0: none.")
_MAX_PINNED_BYTES = flags.DEFINE_integer(
    "max_pinned_session_bytes", None,
    "Bytes of pinned sessions' chunks at most (default: half the host tier).")
_PLACEMENT = flags.DEFINE_enum(
    "kv_placement", None, ["write_through", "write_back"],
    "With a store: write_through (default: saves go to the host tier and the disk) or "
    "write_back (saves go to the host tier; its victims are demoted to the disk, the disk's to "
    "a remote tier). Matters with a host tier (--kv_tiers).")
# -- the KV store's size (kvjax.serve.server.ServerConfig.kv_store_capacity_bytes) -------------
_KV_STORE_CAPACITY = flags.DEFINE_integer(
    "kv_store_capacity_bytes", None,
    "Byte limit of --kv_store: least recently used chunks (suffixes before their prefixes) are "
    "evicted beyond it. Default: 4 GiB for a local or memory store, unbounded for s3://. With "
    "--kv_tiers, give each tier its capacity_bytes.")


def _store_options() -> dict:
  """ServerConfig fields of the store-size flag."""
  return dict(kv_store_capacity_bytes=_KV_STORE_CAPACITY.value)


_LOG_LEVEL = flags.DEFINE_enum("log_level", "warning",
                               ["critical", "error", "warning", "info", "debug"],
                               "uvicorn's log level.")


def config_from_flags() -> ServerConfig:
  """The `ServerConfig` of the parsed flags; `app.UsageError` on bad values."""
  try:
    sizes = tuple(int(s) for s in _CHUNK_SIZES.value) if _CHUNK_SIZES.value else None
  except ValueError as e:
    raise app.UsageError(f"--chunk_sizes must be integers: {e}") from e
  store = _KV_STORE.value
  if store.lower() in ("none", ""):
    store = None
  if _KV_TIERS.value is not None and flags.FLAGS["kv_store"].present:
    raise app.UsageError("give --kv_store or --kv_tiers, not both")
  api_key = _API_KEY.value
  if api_key is None:
    api_key = os.environ.get("KVJAX_API_KEY") or None
  if _AUTH_OPEN.value and not api_key:
    raise app.UsageError("--auth_health_and_metrics needs --api_key (or KVJAX_API_KEY)")
  try:
    return ServerConfig(
        model=_MODEL.value, served_model_name=_SERVED.value, host=_HOST.value, port=_PORT.value,
        dtype=_DTYPE.value, max_model_len=_MAX_MODEL_LEN.value, max_num_seqs=_MAX_NUM_SEQS.value,
        max_num_batched_tokens=_BUDGET.value,
        long_prefill_token_threshold=_LONG_PREFILL.value, prefill_order=_PREFILL_ORDER.value,
        short_first_token_steps=_SHORT_STEPS.value,
        chunk_sizes=sizes, seed=_SEED.value,
        cache_dir=_CACHE_DIR.value, kv_store=store, kv_tiers=_KV_TIERS.value,
        kv_chunk_size=_KV_CHUNK.value, kv_codec=_KV_CODEC.value, kv_merge_mode=_MERGE.value,
        kv_codec_consistent={"auto": None, "true": True, "false": False}[_CONSISTENT.value],
        kv_link_bytes_per_s=_LINK.value,
        kv_link_trace=_TRACE.value,
        block_size=_BLOCK_SIZE.value, kv_cache_memory_bytes=_KV_BYTES.value,
        enable_prefix_caching=_PREFIX_CACHING.value, enable_admin=_ADMIN.value, log_level=_LOG_LEVEL.value,
        max_request_bytes=_MAX_BYTES.value,
        max_waiting_requests=None if _MAX_WAITING.value == -1 else _MAX_WAITING.value,
        allow_special_tokens_in_prompt=_ALLOW_SPECIAL.value,
        allowed_hosts=tuple(_ALLOWED_HOSTS.value) if _ALLOWED_HOSTS.value else None,
        allowed_origins=tuple(_ALLOWED_ORIGINS.value), api_key=api_key,
        auth_health_and_metrics=_AUTH_OPEN.value,
        session_ttl_s=None if _SESSION_TTL.value == -1 else _SESSION_TTL.value,
        max_sessions=_MAX_SESSIONS.value, max_session_tokens=_MAX_SESSION_TOKENS.value,
        tensor_parallel_size=_TP.value, coordinator_address=_COORDINATOR.value,
        num_processes=_NUM_PROCESSES.value, process_id=_PROCESS_ID.value,
        session_truncation=_SESSION_TRUNCATION.value, session_rerotate=_SESSION_REROTATE.value,
        session_rerotate_boundary_chunks=_SESSION_REROTATE_BOUNDARY.value,
        kv_lookahead_window=_LOOKAHEAD.value, max_pinned_sessions=_MAX_PINNED.value,
        max_pinned_session_bytes=_MAX_PINNED_BYTES.value, kv_placement=_PLACEMENT.value,
        **_scale_out_options(), **_store_options())
  except ValueError as e:
    raise app.UsageError(str(e)) from e


def _scale_out_options() -> dict:
  """ServerConfig fields of the KV-event flags; the S3 flags go to the environment (read where
  the store spec is built, `kvjax.storage.specs.kvstore_spec`)."""
  for value, var in ((_S3_ENDPOINT.value, "AWS_ENDPOINT_URL"), (_S3_REGION.value, "AWS_REGION")):
    if value:
      os.environ[var] = value
  return dict(kv_events_endpoint=_EVENTS.value or None, kv_events_topic=_EVENTS_TOPIC.value,
              kv_events_replay_endpoint=_EVENTS_REPLAY.value or None,
              kv_events_hash_algo=_EVENTS_ALGO.value, kv_events_hash_seed=_EVENTS_SEED.value,
              kv_events_int_hashes=_EVENTS_INT.value)


def curl_example(url: str, model: str, *, api_key: bool = False) -> str:
  # temperature 0: greedy. At the OpenAI default (1.0) a 135M model's samples ramble.
  body = json.dumps({"model": model, "max_tokens": 32, "temperature": 0,
                     "messages": [{"role": "user", "content": "What is the capital of France?"}]})
  # The key itself is never printed: the example names a variable the user sets to it.
  auth = ' -H "Authorization: Bearer $KVJAX_API_KEY"' if api_key else ""
  return (f"curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
          f"  -d '{body}'")


#: vLLM's spelling of a negated bool flag, rewritten to absl's (`--noNAME`) before parsing.
_VLLM_NEGATIONS = {"--no_enable_prefix_caching": "--noenable_prefix_caching",
                   "--no-enable-prefix-caching": "--noenable_prefix_caching"}


def parse_flags(argv: list[str]) -> list[str]:
  """absl's parser, accepting `--no_enable_prefix_caching` (vLLM's negation) as well."""
  return app.parse_flags_with_usage([_VLLM_NEGATIONS.get(a, a) for a in argv])


class StartupCancelled(Exception):
  """Raised on the loader thread at its next step after a stop was requested."""


def _out(line: str, err: bool = False) -> None:
  print(line, file=sys.stderr if err else sys.stdout, flush=True)


def _exit_now(code: int) -> None:
  """Ends the process without the interpreter's teardown (a loader thread may be inside XLA)."""
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


def main(argv):
  logging.set_verbosity(logging.WARNING)  # orbax logs every save and restore at INFO
  if STOP.requested:  # a signal during the imports
    _out("kvjax: stopping (before start-up)")
    return
  try:
    if len(argv) > 1:
      raise app.UsageError(f"unexpected arguments {argv[1:]}")
    config = config_from_flags()
  except app.UsageError as e:  # one line, not absl's usage text (every flag of this module)
    print(f"error: {e} (python -m kvjax.serve --help lists the flags)", file=sys.stderr)
    sys.exit(1)  # absl's code for flag errors
  if config.is_follower:
    # Multi-host, not process 0: no HTTP; run process 0's device calls until it stops. Nothing
    # here is saved, so a signal ends the process at once.
    for sig in (signal.SIGINT, signal.SIGTERM):
      signal.signal(sig, lambda *_: _exit_now(0))
    llm = build_follower(config)
    print(f"kvjax: process {config.process_id} of {config.num_processes} follows process 0",
          flush=True)
    llm.follow()
    return
  state = ServeState(enable_admin=config.enable_admin)
  app_ = create_app(state, config.http_policy(),
                    allow_special_tokens_in_prompt=config.allow_special_tokens_in_prompt)
  try:
    http = HttpServer(app_, config.host, config.port, log_level=config.log_level)
  except OSError as e:
    print(f"error: cannot listen on {config.host}:{config.port}: {e}", file=sys.stderr)
    sys.exit(2)
  http_done = threading.Event()

  def http_exited():
    http_done.set()
    STOP.wake()

  try:
    http.start(on_exit=http_exited)
  except RuntimeError as e:
    _out(f"error: {e}", err=True)
    sys.exit(2)
  _out(f"kvjax: listening on {http.url} (port {http.port}); loading {config.model}, "
       "GET /health answers 503 until the model is compiled")
  loaded: dict = {}

  def progress(event: StartupEvent) -> None:
    _out(f"kvjax: {event.message}")
    if STOP.requested:
      raise StartupCancelled()

  load_done = threading.Event()  # set before the loader's wake-up (is_alive() lags it)

  def load():
    try:
      loaded["backend"], loaded["llm"] = load_backend(config, startup_progress=progress)
    except StartupCancelled:
      pass
    except Exception as e:  # noqa: BLE001 - reported, and the server stops
      state.load_error = f"loading {config.model!r} failed: {e}"
      _out(f"error: {state.load_error}", err=True)
    finally:
      load_done.set()
      STOP.wake()

  loader = threading.Thread(target=load, name="kvjax-load", daemon=True)
  loader.start()
  while not load_done.is_set() and not STOP.requested:
    STOP.wait()
  if not load_done.is_set():  # stop requested while loading: cancel at the loader's next step
    _out("kvjax: stopping: cancelling the start-up")
    deadline = time.monotonic() + CANCEL_GRACE_S
    while not load_done.is_set() and time.monotonic() < deadline:
      STOP.wait(max(0.0, deadline - time.monotonic()))  # a second signal exits in there
    if not load_done.is_set():
      _out(f"kvjax: the start-up did not reach its next step within {CANCEL_GRACE_S:.0f} s "
           "(a weight conversion or one long compile); exiting without waiting for it")
      _exit_now(0)
  backend = loaded.get("backend")
  if backend is not None and not STOP.requested:
    state.attach(backend)
    publisher = backend.kv_event_publisher
    if publisher is not None:
      replay = publisher.bound_replay_endpoint()
      _out(f"kvjax: KV cache events on {publisher.bound_endpoint()} (topic "
           f"{publisher.topic!r})" + (f", replays on {replay}" if replay else ""))
    _out(f"kvjax: ready: {backend.model_name} at {http.url}\n"
         f"{curl_example(http.url, backend.model_name, api_key=config.api_key is not None)}")
    while not STOP.requested and not http_done.is_set():
      STOP.wait()
  _out("kvjax: stopping" + (" (writing pending KV saves)" if backend is not None else ""))
  if backend is not None:
    # Fail what is still running first (503: a stream ends with an error event and [DONE]), so
    # uvicorn's graceful shutdown finds no open response to cancel.
    backend.engine.shutdown()
  http.stop()
  close_backend(backend, loaded.get("llm"))
  _out("kvjax: stopped")
  if state.load_error or (backend is None and not STOP.requested):
    sys.exit(2)


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
