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

Options: every flag below; the options reference (docs/usage/options.md) says what each does.
Ctrl-C (or SIGTERM) stops the server cleanly at any moment: during start-up it cancels the
start-up; while serving it ends running requests with an error (HTTP 503 or a stream error
event), writes pending KV saves and exits 0; a second Ctrl-C exits at once (code 130).
"""

from __future__ import annotations

# How it runs. Thin entry point: absl flags (one per option field: `kvjax.config.EngineOptions`'s
# and `ServerConfig`'s) -> `ServerConfig` -> bind the socket -> uvicorn on a thread (GET /health
# answers 503 until the model is ready) -> load and warm up the model on a loader thread, one log
# line per step ("kvjax: compiled k/N: ...") -> serve. Start and stop: the main thread owns SIGINT
# and SIGTERM (`StopRequest`, installed before JAX and uvicorn are imported) and sleeps until a
# signal, the loader or uvicorn wakes it. A signal while loading cancels the start-up at the
# loader's next step (between programs); a step that cannot be interrupted (a weight conversion,
# one long compile) gets `CANCEL_GRACE_S`, then the process ends with `os._exit` after flushing its
# output: the interpreter never tears XLA down under a thread inside it (that aborted the process:
# "terminate called ...", exit 134). A signal while serving fails what is still running (503),
# stops uvicorn (it stops accepting, answers requests still arriving on connections it accepted:
# `HttpServer.stop`), writes pending KV saves and exits 0. A second signal exits at once (130).

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

import dataclasses  # noqa: E402
import json  # noqa: E402

from absl import app, flags, logging  # noqa: E402

from kvjax.config import all_option_fields, flag_default, option_fields, spec  # noqa: E402
from kvjax.serve.app import ServeState, create_app  # noqa: E402
from kvjax.serve.server import (  # noqa: E402
    HttpServer, ServerConfig, StartupEvent, build_follower, close_backend, load_backend,
    server_engine_options)

_DEFINE = {"string": flags.DEFINE_string, "integer": flags.DEFINE_integer,
           "float": flags.DEFINE_float, "bool": flags.DEFINE_bool, "list": flags.DEFINE_list}


# Every engine option (`kvjax.config.EngineOptions`), then the server's own (`ServerConfig`).
_ENGINE_FIELDS = [f for _, f in all_option_fields()]
_SERVER_FIELDS = option_fields(ServerConfig)


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """Defines the server's flags in `flag_values`: one per option field (`kvjax.config.option`:
  its name, kind, default and help), then the S3 endpoint and region (set in this process's
  environment, where the store spec reads them: `kvjax.storage.backends.specs.kvstore_spec`; no option
  of the engine or the server).

  `python -m kvjax.serve` defines them in absl's global `FLAGS` before parsing; importing this
  module defines nothing, so a process that also holds other absl programs' flags (a test run)
  can build the server's flags in a `FlagValues` of its own.

  Raises:
    absl.flags.DuplicateFlagError: a flag of the same name is already in `flag_values`.
  """
  for field in _ENGINE_FIELDS + _SERVER_FIELDS:
    s = spec(field)
    if s.flag == "enum":
      flags.DEFINE_enum(s.name, flag_default(field), list(s.choices), s.help,
                        flag_values=flag_values)
    else:
      _DEFINE[s.flag](s.name, flag_default(field), s.help, flag_values=flag_values)
  flags.DEFINE_string(
      "s3_endpoint_url", None,
      "S3-compatible endpoint of an s3:// --kv_store (MinIO, Ceph RGW, ...); sets "
      "AWS_ENDPOINT_URL for this process. Default: $AWS_ENDPOINT_URL, else AWS. Credentials "
      "come from the usual AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY environment or AWS config, "
      "never from flags.", flag_values=flag_values)
  flags.DEFINE_string("s3_region", None,
                      "Region of an s3:// --kv_store; sets AWS_REGION. Default: $AWS_REGION, "
                      "else $AWS_DEFAULT_REGION.", flag_values=flag_values)


def _flag_values(fields: list[dataclasses.Field], flag_values: flags.FlagValues) -> dict:
  """{field name: the parsed flag's value, through the field's `parse`}; UsageError on a bad
  one."""
  out = {}
  for field in fields:
    s = spec(field)
    value = flag_values[s.name].value
    if s.parse is not None:
      try:
        value = s.parse(value)
      except ValueError as e:
        raise app.UsageError(f"--{s.name} {e}") from e
    out[s.name] = value
  return out


def config_from_flags(flag_values: flags.FlagValues = flags.FLAGS) -> ServerConfig:
  """The `ServerConfig` of the parsed flags (`define_flags`' flags in `flag_values`);
  `app.UsageError` on bad values."""
  engine = _flag_values(_ENGINE_FIELDS, flag_values)
  server = _flag_values(_SERVER_FIELDS, flag_values)
  if engine["kv_tiers"] is not None and flag_values["kv_store"].present:
    raise app.UsageError("give --kv_store or --kv_tiers, not both")
  if server["api_key"] is None:
    server["api_key"] = os.environ.get("KVJAX_API_KEY") or None
  if server["auth_health_and_metrics"] and not server["api_key"]:
    raise app.UsageError("--auth_health_and_metrics needs --api_key (or KVJAX_API_KEY)")
  for name, var in (("s3_endpoint_url", "AWS_ENDPOINT_URL"), ("s3_region", "AWS_REGION")):
    value = flag_values[name].value
    if value:
      os.environ[var] = value
  try:
    return ServerConfig(engine=server_engine_options(**engine), **server)
  except ValueError as e:
    raise app.UsageError(str(e)) from e


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


#: Help flags -> short help (this program's flags) or full help (every module's flags).
_HELP_FLAGS = {"-h": True, "-?": True, "--help": True, "-help": True, "--helpshort": True,
               "-helpshort": True, "--helpfull": False, "-helpfull": False}


def parse_flags(argv: list[str]) -> list[str]:
  """absl's parser, accepting `--no_enable_prefix_caching` (vLLM's negation) as well; a help
  flag prints the help and exits 0 (absl's own exits 1)."""
  for arg in argv[1:]:
    if arg == "--":
      break
    if arg in _HELP_FLAGS:
      app.usage(shorthelp=_HELP_FLAGS[arg], writeto_stdout=True, exitcode=0)
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
    parallel = config.engine.parallel
    print(f"kvjax: process {parallel.process_id} of {parallel.num_processes} follows process 0",
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
  define_flags()
  app.run(main, flags_parser=parse_flags)
