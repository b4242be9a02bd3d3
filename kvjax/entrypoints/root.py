"""The composition root: every part of a serving engine built from the options, in one place.

    parts = build_engine_parts(EngineOptions.from_flat(model="tiny", kv_store="memory://"))
    parts.engine.add_request(...)        # or LLM.from_parts(parts), as LLM(...) does

`LLM(...)`, the server (through `LLM`) and the test factories (`kvjax/testing/engines.py`, with
a fake runner as one argument) all build here; nothing else turns options into objects:

    EngineOptions ──> model (LoadedModel: config, weights, tokenizer, fingerprint)
                  ──> runner (PagedModelRunner, or the caller's `make_runner`)
                  ──> store (KVStoreOptions.store_config() -> build_tiers -> KVStoreClient)
                  ──> sessions (SessionRegistry; pins, persistence and tails wired to the client)
                  ──> engine (Engine(runner, tokenizer, scheduler_config(), load_config(), ...))

The records each room reads come from the options tree (`EngineOptions.scheduler_config`,
`load_config`, `KVStoreOptions.store_config`, `SessionOptions.session_config`); this module only
wires them. Checks that need the loaded model (its context, heads, layers) are here; every other
check is `EngineOptions.validate`'s.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from kvjax import codecs
from kvjax.config import EngineOptions
from kvjax.config import options as options_lib
from kvjax.connector import KVStoreClient
from kvjax.engine.engine import Engine
from kvjax.models.loading import kv_calibration
from kvjax.models.nn.calibration_model import CalibrationModel
from kvjax.models.runner.compilation_cache import (default_cache_root,
                                                   enable_persistent_compilation_cache)
from kvjax.models.nn.kv_cache import KV_LAYOUT_VERSION
from kvjax.models.nn.llama import Llama
from kvjax.models.runner.pool_memory import build_paged_runner
from kvjax.models.loading.registry import LoadedModel, load_config, load_model
from kvjax.models.runner.runner_api import Runner
from kvjax.models.runner.sharding import (TensorParallel, check_tensor_parallel_size,
                                          initialize_distributed)
from kvjax.models.runner.weights_memory import check_weights_fit, device_free_bytes
from kvjax.scheduler.cost_model import CostModel
from kvjax.sessions import SessionRegistry
from kvjax.storage.backends.chunk_store import ChunkStore
from kvjax.storage.backends.link import LinkLimiter
from kvjax.storage.backends.specs import kvstore_spec
from kvjax.storage.tiering.store_config import DEFAULT_DISK_CAPACITY_BYTES
from kvjax.storage.tiering.tiers import StoreConfig, build_tiers
from kvjax.storage.format.types import KVLayout

_log = logging.getLogger("kvjax.entrypoints.llm")  # the start-up's warnings, as `LLM`'s

#: Builds the runner of a loaded model for the options (a test's fake runner); the default
#: places the weights (`Llama.from_params`) and sizes a `PagedModelRunner`.
RunnerFactory = Callable[[LoadedModel, EngineOptions], Runner]

_DTYPES = {"float32": jnp.float32, "f32": jnp.float32, "bfloat16": jnp.bfloat16,
           "bf16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class StartupEvent:
  """One step of building an engine (`LLM(startup_progress=...)`): plain data for a log line.

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


def quiet(event: StartupEvent) -> None:
  """A `startup_progress` that reports nothing."""
  del event


@dataclasses.dataclass
class EngineParts:
  """What `build_engine_parts` builds: the object graph of one engine, as plain fields.

  The engine owns the runner and the store client from here on (it executes on them); the
  sessions registry is the front end's (`LLM`, the server). `close_parts` closes what is open.

  Attributes:
    options: the options everything was built from.
    model_name, model_config, fingerprint, tokenizer: the loaded model's (`LoadedModel`).
    dtype: the jnp dtype of the weights and the KV cache.
    runner: the model runner (the device KV cache).
    store_config: the store's tiers (`KVStoreOptions.store_config`), or None.
    store_description: one line naming the store's tiers (`describe_store`), or None.
    kv_store: the store client, or None (no store, or a multi-host follower).
    kvtc_transform: kvtc's calibrated transform (with `kv_codec="kvtc"`), or None.
    sessions: the chat-session registry, wired to the store client (pins, persistence, tails).
    engine: the `Engine` (on a multi-host follower it runs no request: its runner follows
      process 0's device calls).
    is_follower: a multi-host process other than 0.
  """

  options: EngineOptions
  model_name: str
  model_config: Any
  fingerprint: str
  tokenizer: Any
  dtype: Any
  runner: Runner
  store_config: StoreConfig | None
  store_description: str | None
  kv_store: KVStoreClient | None
  kvtc_transform: Any
  sessions: SessionRegistry
  engine: Engine
  is_follower: bool


def resolve_dtype(dtype: str, platform: str | None = None):
  """The jnp dtype of the weights and KV cache: `kvjax.config.options.resolve_dtype` (the one
  place "auto" is resolved: float32 on CPU, bfloat16 on accelerators) on `platform` (None: this
  process's `jax.default_backend()`).

  Raises:
    ValueError: for an unknown dtype name.
  """
  return _DTYPES[options_lib.resolve_dtype(dtype, platform or jax.default_backend())]


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


def check_model_fit(options: EngineOptions, loaded: LoadedModel, multihost_run: bool) -> None:
  """The checks of the options against the loaded model (its context, heads, layers) and
  the devices (`EngineOptions.validate` did every other one).

  Raises:
    ValueError: naming the option.
  """
  max_model_len, kv = options.model.max_model_len, options.kv
  tp = options.parallel.tensor_parallel_size
  if max_model_len is not None and max_model_len > loaded.config.max_seq_len:
    raise ValueError(f"max_model_len={max_model_len} exceeds {loaded.name}'s context of "
                     f"{loaded.config.max_seq_len} tokens")
  check_tensor_parallel_size(loaded.config, tp)
  with_store = options.has_store
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


def make_store_client(options: EngineOptions, config: StoreConfig, runner: Runner,
                      loaded: LoadedModel, dtype, kvtc_transform_id: str | None = None,
                      settle_loads: bool = False) -> KVStoreClient:
  """The store client of `config` for the model's KV layout, brought under its capacity.

  Raises:
    ValueError: `kv_chunk_size` not shorter than the runner's context; a local store that
      cannot be created or written.
  """
  kv = options.kv
  chunk_size = kv.kv_chunk_size
  if not chunk_size < runner.max_seq_len:
    raise ValueError(f"kv_chunk_size={chunk_size!r} must be an int in [1, "
                     f"{runner.max_seq_len}): a stored chunk must be shorter than the "
                     f"context ({runner.max_seq_len} tokens: the model's, its sliding window, "
                     "or max_model_len); set a smaller kv_chunk_size (--kv_chunk_size)")
  for tier in config.tiers:
    if tier.url is not None:
      _check_local_store_writable(tier.url)
  store = build_tiers(config, make_chunk_store=lambda url, name, limiter: ChunkStore(
      url, name=name, limiter=limiter))
  cfg = loaded.config
  layout = KVLayout(num_layers=cfg.n_layers, chunk_size=chunk_size,
                    num_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                    dtype=jnp.dtype(dtype).name)
  client = KVStoreClient(store, model_fingerprint=loaded.fingerprint, layout=layout,
                         kv_layout_version=KV_LAYOUT_VERSION, codec=kv.kv_codec,
                         codec_levels=options.codec_levels, kvtc_transform_id=kvtc_transform_id,
                         device_link=(LinkLimiter(kv.kv_device_link_bytes_per_s)
                                      if kv.kv_device_link_bytes_per_s is not None else None),
                         consistent=options.consistent, device=runner.device_seam(),
                         settle_loads=settle_loads)
  try:  # a store a larger capacity filled is brought under this one now, not at a write
    client.enforce_capacity()
  except Exception as e:  # noqa: BLE001 - an unreachable store degrades to compute, as loads do
    _log.warning("the KV store could not be brought under its capacity: %r", e)
  return client


def _load(options: EngineOptions, dtype, params_dir: str | None,
          progress: Callable[[StartupEvent], None]) -> LoadedModel:
  """Loads the model's weights, after checking they fit the device's free memory."""
  m, par = options.model, options.parallel
  device = jax.local_devices()[0]
  free_bytes = device_free_bytes(device)
  if free_bytes is not None:  # shapes from the checkpoint's header, before any weight is read
    check_weights_fit(load_config(m.model, cache_dir=params_dir, revision=m.model_revision),
                      dtype, free_bytes, tensor_parallel_size=par.tensor_parallel_size,
                      where=str(device), model=m.model)
  progress(StartupEvent("weights", f"loading {m.model} weights" + (
      f" (converted once, cached in {params_dir})" if params_dir else "")))
  t0 = time.perf_counter()
  loaded = load_model(m.model, cache_dir=params_dir, revision=m.model_revision)
  secs = time.perf_counter() - t0
  progress(StartupEvent("weights", f"loaded {loaded.name} weights in {secs:.1f} s",
                        seconds=secs))
  return loaded


def _calibrate_kvtc(options: EngineOptions, model_obj, loaded: LoadedModel,
                    params_dir: str | None, runner,
                    progress: Callable[[StartupEvent], None]):
  """Loads this model's kvtc transform, or calibrates it (first use), into the runner."""
  progress(StartupEvent("calibrate", "kvtc: loading this model's transform, or "
                        "calibrating it on the packaged text (first use only)"))
  t0 = time.perf_counter()
  transform = kv_calibration.load_or_calibrate(
      CalibrationModel(model_obj, options.model.max_model_len), loaded.tokenizer,
      loaded.fingerprint, params_dir,
      progress=lambda done, total: progress(StartupEvent(
          "calibrate", f"kvtc calibration {done}/{total} "
          f"({time.perf_counter() - t0:.0f} s)", done, total, time.perf_counter() - t0)))
  runner.set_kvtc_transform(transform)
  secs = time.perf_counter() - t0
  progress(StartupEvent("calibrate", f"kvtc: transform ready in {secs:.1f} s", seconds=secs))
  return transform


def build_engine_parts(options: EngineOptions, *,
                       progress: Callable[[StartupEvent], None] | None = None,
                       model: LoadedModel | None = None,
                       make_runner: RunnerFactory | None = None,
                       clock: Callable[[], float] = time.perf_counter,
                       check_writes: bool = False,
                       cost_model: CostModel | None = None,
                       settle_loads: bool = False) -> EngineParts:
  """Builds the model, runner, store, sessions and engine of `options` (the composition root).

  Args:
    options: every option (`EngineOptions`, already validated).
    progress: called with a `StartupEvent` at each step (weights, KV cache, calibration,
      store); None: nothing. What it raises propagates.
    model: the loaded model (a test's fake); None: `load_model(options.model.model)` after
      checking the weights fit the device's free memory.
    make_runner: builds the runner (a test's `FakeRunner`); None: the model's weights placed
      (`Llama.from_params`) and a `PagedModelRunner` sized by the options.
    clock: the engine's clock, seconds (tests may pass a fake).
    check_writes: keep each merge's per-position writer map and raise on a double write
      (`LoadConfig.check_writes`; the test factories keep it on).
    cost_model: the planner's cost model (tests pass a frozen one); None: a fresh, learning one.
    settle_loads: the store client's `settle_loads` (tests on a fake clock).

  Returns:
    The parts (`EngineParts`); the caller owns them (`close_parts`).

  Raises:
    ValueError: options that do not fit the loaded model or the devices, weights that do not
      fit the device's free memory, kvtc with a `make_runner` (its calibration needs the
      model), a store that cannot be opened.
    FileNotFoundError, PermissionError: as `load_model`.
  """
  progress = progress or quiet
  m, kv, par = options.model, options.kv, options.parallel
  multihost_run = initialize_distributed(par.coordinator_address, par.num_processes,
                                         par.process_id)
  if not options.has_store and kv.kv_codec != codecs.RAW:
    _log.warning("kv_codec=%r does nothing without a kv_store (it codes stored chunks only)",
                 kv.kv_codec)
  cache_root = default_cache_root() if m.cache_dir is None else m.cache_dir
  if cache_root:
    enable_persistent_compilation_cache(os.path.join(cache_root, "jax"))
  platform = jax.default_backend()
  dtype = resolve_dtype(m.dtype, platform)
  params_dir = os.path.join(cache_root, "params") if cache_root else None
  loaded = model if model is not None else _load(options, dtype, params_dir, progress)
  sessions = SessionRegistry(loaded.tokenizer, options.sessions.session_config())
  check_model_fit(options, loaded, multihost_run)
  is_follower = multihost_run and jax.process_index() != 0
  with_kvtc = options.has_store and kv.kv_codec == codecs.KVTC
  if with_kvtc and make_runner is not None:
    raise ValueError("kv_codec='kvtc' calibrates on the model itself; a runner factory "
                     "(a fake runner) has no calibration")
  progress(StartupEvent("cache", "placing the weights and allocating the KV pool"))
  t0 = time.perf_counter()
  sched = options.scheduler_config()
  model_obj = None
  if make_runner is not None:
    runner = make_runner(loaded, options)
  else:
    tp = par.tensor_parallel_size
    model_obj = Llama.from_params(loaded.config, loaded.params, dtype=dtype, param_dtype=dtype)
    runner = build_paged_runner(
        model_obj, block_size=options.cache.block_size,
        kv_cache_memory_bytes=options.cache.kv_cache_memory_bytes, max_num_seqs=sched.num_slots,
        max_seq_len=m.max_model_len, chunk_sizes=sched.chunk_sizes,
        max_num_batched_tokens=sched.token_budget,
        tensor_parallel=None if tp == 1 else TensorParallel.build(loaded.config, tp))
  client = None
  try:  # a failure (or a cancelled start-up: `progress` raised) leaves nothing open
    secs = time.perf_counter() - t0
    what = (f"{jnp.dtype(dtype).name} weights and KV (dtype={m.dtype!r} on {platform}), "
            f"{runner.num_blocks} blocks of {options.cache.block_size} tokens "
            f"({_fmt_bytes(runner.kv_cache_nbytes())}), up to {sched.num_slots} sequences")
    progress(StartupEvent("cache", f"KV cache: {what} ({secs:.1f} s)", seconds=secs))
    kvtc_transform = None
    if with_kvtc and not is_follower:
      kvtc_transform = _calibrate_kvtc(options, model_obj, loaded, params_dir, runner, progress)
    store_config = kv.store_config() if not is_follower else None  # process 0 alone stores
    description = None
    if store_config is not None:
      description = describe_store(store_config)
      client = make_store_client(
          options, store_config, runner, loaded, dtype,
          kvtc_transform.transform_id if kvtc_transform is not None else None,
          settle_loads=settle_loads)
    load_config = dataclasses.replace(options.load_config(), check_writes=check_writes)
    engine = Engine(runner, loaded.tokenizer, sched, load_config, kv_store=client, seed=m.seed,
                    clock=clock, cost_model=cost_model)
    if client is not None:  # the registry says which sessions are pinned; the client pins
      sessions.set_pin_sink(client.set_pins, chunk_size=client.chunk_size,
                            chunk_nbytes=client.layout.nbytes)
      # Sessions persist beside a local store, so a restarted server continues them.
      sessions.set_persistence(client.session_dir(), scope=loaded.fingerprint)
      sessions.set_tail_sink(client.drop_tail)  # superseded tails are deleted
      mode = ", consistent (outputs independent of what is loaded)" if options.consistent else ""
      progress(StartupEvent("store", f"KV store: {description}; codec {kv.kv_codec} levels "
                            f"{list(options.codec_levels)}{mode}"))
  except BaseException:
    if client is not None:
      client.close()
    runner.close()
    raise
  return EngineParts(options=options, model_name=loaded.name, model_config=loaded.config,
                     fingerprint=loaded.fingerprint, tokenizer=loaded.tokenizer, dtype=dtype,
                     runner=runner, store_config=store_config, store_description=description,
                     kv_store=client, kvtc_transform=kvtc_transform, sessions=sessions,
                     engine=engine, is_follower=is_follower)


def close_parts(parts: EngineParts) -> None:
  """Writes pending saves, stops the store client's threads, and closes the runner."""
  if parts.kv_store is not None:
    parts.kv_store.close()
  parts.runner.close()
