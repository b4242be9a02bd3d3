"""The engine's options, one frozen dataclass per concern, each option declared once.

    opts = EngineOptions.from_flat(model="tiny", kv_store="memory://", kv_codec="int8")
    opts.kv.kv_codec                  # "int8"; opts.flat()["kv_codec"] too
    LLM(options=opts)                 # the same as LLM("tiny", kv_store=..., kv_codec="int8")

The sections: `ModelOptions` (which model, its dtype and context, caching of its artefacts),
`CacheOptions` (the device KV pool), `SchedulerOptions` (slots, step budget, prefill policy),
`KVStoreOptions` (the prefix-cache store, its codec, links and tiers), `SessionOptions` (chat
sessions) and `ParallelOptions` (tensor parallelism, multi-host). A field's name is the flat
`LLM(...)` keyword and the server's flag (`python -m kvjax.serve --name=...`); its text and
flag details sit in its metadata (`kvjax.config.fields.option`). `EngineOptions.validate` holds
every check that needs no model: a bad value is a ValueError naming the option before any
weights load. Checks that need the model (its context, layers, heads) stay where it is loaded
(`kvjax.entrypoints.llm.LLM`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Sequence

from kvjax import codecs
from kvjax.block_hash import blocks_per_chunk
from kvjax.config.fields import option, option_fields, spec
from kvjax.merge_mode import MERGE_MODES, parse_merge_mode
from kvjax.models.runner.runner_api import DEFAULT_CHUNK_SIZES
from kvjax.models.loading.registry import DEFAULT_MODEL
from kvjax.scheduler.config import LAYER_SPLITS, LoadConfig, SchedulerConfig
from kvjax.scheduler.prefill_policy import PREFILL_ORDERS, SHORTEST_FIRST
from kvjax.sessions import (DEFAULT_MAX_PINNED_SESSIONS, DEFAULT_MAX_SESSION_TOKENS,
                            DEFAULT_MAX_SESSIONS, DEFAULT_REROTATE_BOUNDARY_CHUNKS,
                            DEFAULT_SESSION_TTL_S, SessionConfig)
from kvjax.storage.backends import specs
from kvjax.storage.tiering.store_config import (DEFAULT_STORE_CAPACITY_BYTES, PLACEMENTS,
                                                StoreConfig, TierConfig, url_kind)

#: `max_num_seqs`, for `LLM` and the server alike: sequences reserve no memory up front (the KV
#: pool is shared; a full pool preempts), so many can run at once.
DEFAULT_MAX_NUM_SEQS = 64
#: Dtype names `ModelOptions.dtype` takes besides "auto".
DTYPES = ("bf16", "bfloat16", "f32", "float32")
_CANONICAL_DTYPE = {"bf16": "bfloat16", "bfloat16": "bfloat16", "f32": "float32",
                    "float32": "float32"}
#: What `dtype="auto"` means on each platform (`jax.default_backend()`'s names, and "cuda" /
#: "rocm" for the GPU backends): float32 on the CPU (no bf16 arithmetic units there, so f32 is
#: faster and exact); bfloat16 weights and KV on an accelerator (half the HBM bytes a decode
#: step reads, and the matrix units' native type).
AUTO_DTYPE = {"cpu": "float32", "gpu": "bfloat16", "cuda": "bfloat16", "rocm": "bfloat16",
              "tpu": "bfloat16"}


def resolve_dtype(dtype: str, platform: str) -> str:
  """The weights' and KV cache's dtype name ("float32" or "bfloat16") for `dtype` on `platform`.

  The one place "auto" is resolved (`AUTO_DTYPE`): float32 on "cpu", bfloat16 on "gpu", "cuda",
  "rocm" and "tpu". An explicit name wins on every platform ("bf16"/"f32" are aliases).

  Args:
    dtype: "auto" or a name of `DTYPES`.
    platform: the backend the engine runs on, as `jax.default_backend()` names it.

  Raises:
    ValueError: an unknown dtype name, or "auto" on an unknown platform.
  """
  if dtype == "auto":
    if platform not in AUTO_DTYPE:
      raise ValueError(f"dtype 'auto': unknown platform {platform!r} (one of "
                       f"{sorted(AUTO_DTYPE)}); pass dtype='float32' or 'bfloat16'")
    return AUTO_DTYPE[platform]
  if dtype not in _CANONICAL_DTYPE:
    raise ValueError(f"dtype {dtype!r} is not one of 'auto', {sorted(DTYPES)}")
  return _CANONICAL_DTYPE[dtype]
SESSION_TRUNCATIONS = ("none", "drop_oldest_turns")
#: Latency priors of a store link, seconds, for the bandwidth-delay product of loads in flight
#: (`LoadConfig.link_latency_s`): a local or memory store, and one with a remote (s3) tier.
LOCAL_LINK_LATENCY_S = 1e-3
REMOTE_LINK_LATENCY_S = 30e-3
#: `kv_store`'s value naming kvjax's own store, `file://<cache root>/store` (the server's default).
DEFAULT_STORE = "default"
_TIER_KEYS = tuple(f.name for f in dataclasses.fields(TierConfig))
_CONSISTENT_FLAG = {"auto": None, "true": True, "false": False}


def _ints(values):
  """A list flag's strings -> a tuple of ints (None stays None)."""
  if not values:
    return None
  try:
    return tuple(int(v) for v in values)
  except ValueError as e:
    raise ValueError(f"must be integers: {e}") from e


@dataclasses.dataclass(frozen=True)
class ModelOptions:
  """Which model runs, in which dtype, and where its converted weights and programs are cached."""

  model: str = option(
      DEFAULT_MODEL,
      '`"SmolLM2-135M-Instruct"` (default), a `.gguf` path, a Hugging Face safetensors '
      'directory, a Hugging Face hub id `"org/name"` (fetched into huggingface_hub\'s cache: '
      "`HF_HOME`, `HF_TOKEN`, `HF_HUB_OFFLINE`; docs/usage/models.md), or `\"tiny\"` (random, "
      "for tests).",
      flag_help="Model name, .gguf path, Hugging Face safetensors dir, hub id org/name, or "
                "'tiny'.")
  model_revision: str | None = option(
      None,
      'a hub id\'s branch, tag or commit (default: "main"); only with a hub id `model`.',
      flag_help="Branch, tag or commit of a hub id --model (default: main).")
  dtype: str = option(
      "auto", 'compute and KV cache dtype: "auto", "float32" or "bfloat16".',
      choices=("auto", "float32", "bfloat16"),
      flag_help="Compute and KV cache dtype ('auto': float32 on CPU, bf16 otherwise).")
  max_model_len: int | None = option(
      None, "tokens per sequence (prompt plus output); default the model's context.",
      flag="integer",
      flag_help="Tokens per sequence, prompt plus output (default: the model's context).")
  seed: int = option(
      0, "seeds requests that carry no seed.", flag_help="Seeds requests that give no seed.")
  cache_dir: str | None = option(
      None,
      "kvjax's cache root (converted params, compiled programs); default `$KVJAX_CACHE_DIR` "
      'or `~/.cache/kvjax`. Pass "" to cache nothing on disk.',
      flag_help="kvjax cache root (params, compiled programs); '' disables.")
  compile_on_init: bool = option(
      True,
      "compile (or load from JAX's persistent cache) every program a request can run before "
      "returning (`warmup`), so no request's TTFT includes a compile.",
      flag_help="Compile every program a request can run before serving (the server warms up "
                "before it answers /health with 200 either way).")


@dataclasses.dataclass(frozen=True)
class CacheOptions:
  """The device KV pool (docs/design/paged-memory.md)."""

  block_size: int = option(
      16,
      "tokens per block of the KV pool, B (one block pool shared by all sequences, one "
      "ragged jit call per step, a device prefix cache, preemption when the pool is full); "
      "`kv_chunk_size` must be a multiple.",
      flag_help="Tokens per block of the KV pool (--kv_chunk_size must be a multiple).")
  kv_cache_memory_bytes: int | None = option(
      None,
      "the pool's size, bytes; default on CPU the smaller of 2 GiB and what `max_num_seqs` "
      "sequences of `max_model_len` tokens need, on an accelerator what the compiled step "
      "leaves of the device's memory (`pool_memory.fit_num_blocks`; 80% of free memory "
      "where the device reports no memory analysis).",
      flag="integer",
      flag_help="Paged: the block pool's size in bytes (default: on CPU 2 GiB or less, see "
                "LLM; on an accelerator 80% of free memory).")
  enable_prefix_caching: bool = option(
      True,
      "keep finished prefixes' full blocks on the device and share them with later requests "
      "(namespace + `cache_salt`); `reset_prefix_cache()` empties it.",
      flag_help="Paged: keep finished prefixes' blocks on the device and share them with "
                "later requests; --no_enable_prefix_caching (or --noenable_prefix_caching) "
                "turns it off.")


@dataclasses.dataclass(frozen=True)
class SchedulerOptions:
  """Decode slots, the step's token budget and which prefills take it (`SchedulerConfig`)."""

  max_num_seqs: int = option(
      DEFAULT_MAX_NUM_SEQS, "requests running at once (decode slots); the KV pool, not this "
      "number, bounds memory: sequences reserve no blocks up front and a full pool preempts.",
      flag="integer")
  max_num_batched_tokens: int | None = option(
      None, "token budget of one engine step.", flag="integer",
      flag_help="Token budget of one engine step (default: the largest chunk).")
  long_prefill_token_threshold: int = option(
      0,
      "vLLM's option: one request's prefill (a Cake merge's compute side too) takes at most "
      "this many tokens of a step, so a long prompt shares the step budget with other "
      "requests' prefills (a store hit's short tail among them) instead of filling it; at "
      "least the smallest chunk size, or 0 (default): off. With `kv_codec_consistent` a "
      "smaller value is raised to `kv_chunk_size`.",
      flag_help="One request's prefill tokens per engine step at most (vLLM's option), so a "
                "long prompt shares the step with other requests' prefills; at least the "
                "smallest chunk size, or 0 (default): off.")
  prefill_order: str = option(
      SHORTEST_FIRST,
      "which prefills take a step's budget first (`SchedulerConfig`, one of "
      '`PREFILL_ORDERS`): "shortest_first" (default): the one with the fewest tokens left, '
      "among them a store hit whose loaded chunks are all inserted (only its new tokens "
      "left) and a queued request with fewer tokens left past its device-resident prefix "
      "than a prefill under way (admitted ahead of it), so a hit's TTFT does not wait "
      "behind a long cold prompt; \"fcfs\": admission order, every store hit's compute after "
      "the ordinary prefills (Cake's adaptive mode, arXiv 2410.03065, section 4 Part 3, "
      "applied to the whole merge). A merge still loading takes what is left in both.",
      choices=PREFILL_ORDERS,
      flag_help="Which prefills take a step's token budget first: 'shortest_first' "
                "(default), the one with the fewest tokens left (a store hit whose loaded "
                "chunks are all inserted, and a queued request with fewer tokens left past "
                "its device prefix than a prefill under way, among them, so a hit's TTFT "
                "does not wait behind a long cold prompt), or 'fcfs' (admission order; "
                "store hits' compute after every ordinary prefill).")
  short_first_token_steps: bool = option(
      True,
      "with \"shortest_first\", keep a step short when it carries a prefill's first token "
      "(the prefills after it take at most as many tokens again, at least the smallest "
      "chunk size) or when a store hit with fewer tokens left than a prefill under way has "
      "loads in flight (the step takes what the cost model says it computes before they "
      "land), so the hit's first token waits for a short step, not a full one; and when a "
      "hit's loads are predicted to land within half a step, the step computes nothing and "
      "waits for them (at most half a step), so the hit's tail joins the next step. True "
      '(default); no effect with "fcfs".',
      flag_help="With --prefill_order=shortest_first: keep a step short when it carries a "
                "prefill's first token (the prefills after it take at most as many tokens "
                "again) or a store hit's last loads (the step ends about when they land), "
                "and let a step wait for a hit's loads that land within half a step (it "
                "computes nothing meanwhile), so a hit's first token waits for a short step "
                "instead of a full one. --noshort_first_token_steps: every step takes the "
                "budget.")
  chunk_sizes: tuple[int, ...] = option(
      DEFAULT_CHUNK_SIZES, "compiled prefill chunk sizes, ascending.", flag="list",
      flag_default=None, parse=lambda v: _ints(v) or DEFAULT_CHUNK_SIZES,
      flag_help="Compiled prefill chunk sizes, ascending (default 16..512).")

  @property
  def token_budget(self) -> int:
    """`max_num_batched_tokens`, or the largest chunk size."""
    return self.max_num_batched_tokens or tuple(self.chunk_sizes)[-1]


_MULTIHOST = (
    "multi-host as one program: `jax.distributed.initialize` with these (host:port of "
    "process 0; CPU collectives through gloo) before anything else; every process "
    "constructs the same `LLM`, and `tensor_parallel_size` must then be the global device "
    "count. Process 0 runs the engine (`generate`, the server); every other process calls "
    "`follow()`, which runs each device call process 0 sends it until process 0 closes "
    "(`kvjax.models.runner.multihost`). A store (raw codec only) is read and written by process "
    "0. None (default): one process.")


@dataclasses.dataclass(frozen=True)
class KVStoreOptions:
  """The prefix-cache store: where, which codec, how a stored prefix becomes resident."""

  kv_store: str | StoreConfig | None = option(
      None,
      "the prefix-cache store: a URL (`file:///path` or a plain path, `memory://`, "
      "`ocdbt+file:///path`, `s3://bucket/prefix`) or a `kvjax.storage.StoreConfig` of "
      "tiers; None (default) stores nothing.",
      flag="string", server_default=DEFAULT_STORE,
      parse=lambda v: None if v is None or v.lower() in ("none", "") else v,
      flag_help="Prefix-cache store URL: file:///path or a path, memory://, "
                "ocdbt+file:///path, s3://bucket/prefix; 'default' is <cache root>/store; "
                "'none' disables the store.")
  kv_chunk_size: int = option(256, "tokens per stored chunk, C.",
                              flag_help="Tokens per stored KV chunk.")
  kv_link_bytes_per_s: float | None = option(
      None,
      "emulated read bandwidth of the store's link, bytes/s (None: unlimited); with a URL "
      "store only.", flag="float",
      flag_help="Emulated store link bandwidth, bytes/s (default unlimited).")
  kv_link_trace: str | None = option(
      None, 'a trace file of "seconds bytes_per_s" steps instead of a constant.',
      flag_help="File of 'seconds bytes_per_s' lines: a varying emulated link.")
  kv_tiers: str | None = option(
      None,
      "a tier list instead of `kv_store`: JSON, or the path of a JSON file, a list of tiers "
      "top first, each an object with `kvjax.storage.TierConfig`'s fields (each tier its own "
      'capacity and link), e.g. `[{"kind": "host", "capacity_bytes": 1073741824}, {"kind": '
      '"disk", "url": "/data/kv"}]`; `kv_store` must then be None or "default".',
      flag_help='Tier list as JSON or a JSON file, instead of --kv_store, e.g. \'[{"kind": '
                '"host", "capacity_bytes": 1073741824}, {"kind": "disk", "url": "/data/kv"}]\'.')
  kv_store_capacity_bytes: int | None = option(
      None,
      "byte limit of a URL `kv_store`: least recently used chunks (suffixes before their "
      "prefixes) are evicted beyond it. None (default): 4 GiB "
      "(`kvjax.storage.DEFAULT_STORE_CAPACITY_BYTES`) for a local or memory store, unbounded "
      "for s3:// (the bucket's lifecycle rules govern it). With `kv_tiers` or a "
      "`StoreConfig`, give each tier its `capacity_bytes`.",
      flag="integer",
      flag_help="Byte limit of --kv_store: least recently used chunks (suffixes before their "
                "prefixes) are evicted beyond it. Default: 4 GiB for a local or memory store, "
                "unbounded for s3://. With --kv_tiers, give each tier its capacity_bytes.")
  kv_codec: str = option(
      "raw",
      'the encoding new chunks are stored with: "raw" (default; the KV dtype, lossless), '
      '"int8", "int4", "cachegen" (CacheGen, arXiv 2310.07240: anchor deltas, layer-wise '
      'bins, entropy coding on the host) or "kvtc" (KV transform coding: a per-model PCA '
      "per layer over all KV heads, calibrated at construction from a text shipped in the "
      "package and cached with the model fingerprint in the params cache). Loads read any "
      "encoding a chunk has (kvtc only with this model's transform).",
      choices=tuple(codecs.CODECS), flag_help="Stored KV chunk encoding.")
  kv_codec_levels: tuple[int, ...] | None = option(
      None,
      "levels stored side by side (cachegen, kvtc: 0 finest .. 3 coarsest); default one "
      "level, `kvjax.codecs.DEFAULT_LEVELS` (cachegen 1, kvtc 0); each load picks one of "
      "the stored levels for the bandwidth and deadline of the moment.",
      flag="list", parse=_ints,
      flag_help="Codec levels stored side by side (cachegen, kvtc: 0 finest .. 3 coarsest; "
                "default: the codec's one default level); each load picks one.")
  kv_merge_mode: str = option(
      "cake",
      'how a stored prefix becomes resident: "cake" (default: compute from the front while '
      'loading from the back, Cake arXiv 2410.03065), "load_only" or "compute_only" (the '
      "baselines; compute_only still saves).",
      choices=MERGE_MODES,
      flag_help="How a stored prefix becomes resident: compute the front while loading the "
                "back (cake), or one side only (the baselines).")
  kv_max_loads_in_flight: int | None = option(
      None,
      "background chunk loads issued ahead per request (and its reads at once); None "
      "(default) derives them from the link's bandwidth-delay product, so the link stays "
      "busy through long engine steps.", flag="integer",
      flag_help="Background chunk loads issued ahead per request (default: from the link's "
                "bandwidth-delay product).")
  kv_ttft_target_s: float | None = option(
      None,
      "pick loaded chunks' encoding levels for this TTFT target, seconds (CacheGen section "
      "5.3); default: for the time compute would finish each chunk (a later landing is "
      "useless).", flag="float",
      flag_help="TTFT target, seconds, for which loaded chunks' encoding levels are picked "
                "(CacheGen section 5.3; default: the time compute would finish each chunk).")
  kv_codec_consistent: bool | None = option(
      None,
      "make outputs independent of the Cake meeting point with a lossy codec: every request "
      "reads only the first level of `kv_codec_levels`, and each chunk it computes passes "
      "through that same encode/decode, in prefill steps of one store chunk "
      "(`kv_chunk_size` must be a compiled chunk size and at most the token budget). None "
      "(default): on for lossy codecs with a store. Costs one encode/decode per computed "
      "chunk and smaller prefill steps; identical requests then get identical answers.",
      choices=tuple(_CONSISTENT_FLAG), flag_default="auto", parse=_CONSISTENT_FLAG.get,
      flag_help="Lossy codecs: make outputs independent of which chunks were loaded (a "
                "fixed encoding per request, computed chunks pass through it); auto: on "
                "where kv_chunk_size is a compiled chunk size within the token budget.")
  kv_layerwise_groups: int = option(
      1,
      "paged, with a store: layer-wise pre-loading (CachedAttention, arXiv 2403.19708, "
      "section 3.2.1): a step that inserts stored raw chunks runs its compute as this many "
      "layer groups, moving each chunk to the device group by group and inserting group g "
      "just before the step's tokens run through it, so the transfer overlaps the compute. "
      "1 (default): off (chunks are inserted whole, then the step runs in one call).",
      flag_help="With a store: layer groups a step that inserts stored raw chunks runs in, "
                "so their transfer overlaps the compute (CachedAttention layer-wise "
                "pre-loading); 1: off.")
  kv_layer_split: str = option(
      "off",
      "with a store: the layer axis of Cake (CacheFlow, arXiv 2604.25080): \"auto\" lets a "
      "merge compute layers [0, k) of its meeting chunk and load only layers [k, L) of that "
      "stored raw chunk, k from the measured rates; \"off\" (default): token-only Cake. The "
      "paged runner runs the low layers only, k at its layer-group boundaries "
      "(`kv_layerwise_groups` when above 1, else any layer). Only a prompt restoring alone "
      "splits: several restoring at once are planned jointly, token-only. Off by default: "
      "measured on the real engine at 0.88-1.04x token-only (benchmarks/README.md, Cake).",
      choices=LAYER_SPLITS,
      flag_help="With a store: 'auto' lets a Cake merge split its meeting chunk along layers "
                "(compute the low layers, load the high ones of a raw chunk); 'off' "
                "(default): token-only Cake.")
  kv_device_link_bytes_per_s: float | None = option(
      None,
      "emulated host -> device bandwidth, bytes/s, that every stored chunk pays on its way "
      "into the KV cache (a `LinkLimiter`; the CPU has no such link); None (default): not "
      "emulated.", flag="float",
      flag_help="Emulated host -> device bandwidth, bytes/s, every stored chunk pays on its "
                "way into the KV cache (default: not emulated).")
  kv_lookahead_window: int = option(
      8,
      "with a store, the look-ahead window (CachedAttention, arXiv 2403.19708, section "
      "3.3): the stored chunks of the requests about to run (those prefilling from the "
      "store, then this many waiting ones) are never evicted from any tier, and the ones "
      "only a lower tier (disk, remote) holds are prefetched into the host tier off the "
      "step path; 0: off (plain LRU eviction, no prefetch). Default 8.",
      flag_help="With a store: waiting requests whose stored chunks are kept from eviction "
                "and prefetched from disk/remote into the host tier ahead of scheduling "
                "(CachedAttention look-ahead); 0: off (plain LRU, no prefetch).")
  kv_placement: str | None = option(
      None,
      "with a store, how chunks are placed in its tiers (`StoreConfig.placement`): "
      '"write_through" (every save goes to the host tier and the disk) or "write_back" '
      "(saves go to the host tier; what it evicts is demoted to the disk, and disk victims "
      "to a remote tier); None (default): the `StoreConfig`'s own (write-through for a "
      "URL).",
      choices=PLACEMENTS,
      flag_help="With a store: write_through (default: saves go to the host tier and the "
                "disk) or write_back (saves go to the host tier; its victims are demoted to "
                "the disk, the disk's to a remote tier). Matters with a host tier "
                "(--kv_tiers).")


  @property
  def has_store(self) -> bool:
    """A store is configured (`kv_store` or `kv_tiers`)."""
    return self.kv_store is not None or self.kv_tiers is not None

  def store_config(self) -> StoreConfig | None:
    """The store's `StoreConfig`: the one place options become one (`LLM`, the server and the
    test factories all build their store from it). None without a store.

    `kv_tiers` parsed (`tiers_from_json`); a `StoreConfig` as given; a URL (`DEFAULT_STORE`:
    `default_store_url()`) one tier of its kind with `kv_store_capacity_bytes` (None:
    `DEFAULT_STORE_CAPACITY_BYTES` for a local or memory store, unbounded for s3://) and the
    emulated link (`kv_link_bytes_per_s` or `kv_link_trace`); then `kv_placement`, when set.

    Raises:
      ValueError: an unknown URL scheme, a bad tier list, capacity or link.
    """
    if self.kv_tiers is not None:
      config = tiers_from_json(self.kv_tiers)
    elif self.kv_store is None:
      return None
    elif isinstance(self.kv_store, StoreConfig):
      config = self.kv_store
    else:
      url = default_store_url() if self.kv_store == DEFAULT_STORE else self.kv_store
      kind = url_kind(url)
      capacity = self.kv_store_capacity_bytes
      if capacity is None and kind == "disk":
        capacity = DEFAULT_STORE_CAPACITY_BYTES
      config = StoreConfig((TierConfig(kind, url=url, capacity_bytes=capacity,
                                       link_bytes_per_s=self.kv_link_bytes_per_s,
                                       link_trace=self.kv_link_trace),))
    if self.kv_placement is not None:
      config = dataclasses.replace(config, placement=self.kv_placement)
    return config

  @property
  def store_url(self) -> str | None:
    """`kv_store` as a URL (`DEFAULT_STORE` resolved); None with `kv_tiers`, a `StoreConfig` or
    no store."""
    if self.kv_tiers is not None or not isinstance(self.kv_store, str):
      return None
    return default_store_url() if self.kv_store == DEFAULT_STORE else self.kv_store


def default_store_url() -> str:
  """`file://<cache root>/store`: `$KVJAX_CACHE_DIR/store` or `~/.cache/kvjax/store` (the
  default of `python -m kvjax.store` too)."""
  return "file://" + specs.default_root()


def tiers_from_json(text: str) -> StoreConfig:
  """Parses a tier list (`kv_tiers`) into a `StoreConfig`.

  Args:
    text: JSON, or the path of a JSON file: a list of tiers, top first, each an object with the
      `TierConfig` fields, e.g. `[{"kind": "host", "capacity_bytes": 1073741824},
      {"kind": "disk", "url": "/data/kv", "link_bytes_per_s": 3.125e9}]`.

  Raises:
    ValueError: not JSON, not a list of objects, unknown keys, or invalid tiers.
  """
  if os.path.isfile(text):
    with open(text, encoding="utf-8") as f:
      text = f.read()
  try:
    tiers = json.loads(text)
  except json.JSONDecodeError as e:
    if not text.lstrip().startswith(("[", "{")):  # meant as a path
      raise ValueError(f"tier config {text!r} is not JSON, and no such file exists") from e
    raise ValueError(f"tier config is not JSON (nor a file): {e}") from e
  if not isinstance(tiers, list) or not all(isinstance(t, dict) for t in tiers):
    raise ValueError("tier config must be a JSON list of objects, e.g. "
                     '[{"kind": "disk", "url": "/data/kv"}]')
  for i, t in enumerate(tiers):
    unknown = set(t) - set(_TIER_KEYS)
    if unknown:
      raise ValueError(f"tier {i}: unknown keys {sorted(unknown)}; known: {sorted(_TIER_KEYS)}")
    if "kind" not in t:
      raise ValueError(f"tier {i} has no 'kind'")
  return StoreConfig(tuple(TierConfig(**t) for t in tiers))

@dataclasses.dataclass(frozen=True)
class SessionOptions:
  """Chat sessions (`LLM.chat(..., session_id=...)`, `kvjax.sessions.SessionConfig`)."""

  session_ttl_s: float | None = option(
      DEFAULT_SESSION_TTL_S,
      "chat sessions (`chat(..., session_id=...)`, `kvjax.sessions`): seconds a session may "
      "stay idle before it expires; None: never.",
      parse=lambda v: None if v == -1 else v,
      flag_help="Chat sessions (session_id): seconds a session may stay idle before it "
                "expires (dropped on the next access); -1: never.")
  max_sessions: int = option(
      DEFAULT_MAX_SESSIONS,
      "sessions held at once (the least recently used idle one is dropped beyond).",
      flag_help="Chat sessions held at once; beyond, the least recently used idle one is "
                "dropped.")
  max_session_tokens: int = option(
      DEFAULT_MAX_SESSION_TOKENS,
      "token ids held over all sessions (idle sessions dropped, least recently used first, "
      "beyond).",
      flag_help="Token ids held over all chat sessions (each: its last turn's prompt and "
                "output); beyond, least recently used idle sessions are dropped.")
  session_truncation: str = option(
      "none",
      "a session turn whose prompt passes the context (minus `max_tokens`) or its "
      '`truncate_prompt_tokens`: "none" (an error, or a plain left cut when '
      '`truncate_prompt_tokens` is set) or "drop_oldest_turns" (keep the system prompt and '
      "the last turn, drop whole oldest turns; CachedAttention section 3.4; when that "
      "cannot fit, an error, or a left cut when `truncate_prompt_tokens` is set).",
      choices=SESSION_TRUNCATIONS,
      flag_help="A chat session turn whose prompt passes the context (minus max_tokens) or "
                "its truncate_prompt_tokens: 'none' (400, or a plain left cut with "
                "truncate_prompt_tokens) or 'drop_oldest_turns' (keep the system prompt and "
                "the last turn, drop whole oldest turns; 400 when even that does not fit, "
                "or a left cut with truncate_prompt_tokens).")
  session_rerotate: bool = option(
      False,
      "with \"drop_oldest_turns\" and a store, the kept turns' stored KV is re-rotated to its "
      "new positions instead of recomputed (approximate: it was computed with the dropped "
      "turns in context; kept in a private namespace, never an ordinary prefix hit).",
      flag_help="With --session_truncation=drop_oldest_turns and a store: re-rotate the "
                "kept turns' stored KV to their new positions instead of recomputing them "
                "(approximate; a private namespace, never an ordinary prefix hit).")
  session_rerotate_boundary_chunks: int = option(
      DEFAULT_REROTATE_BOUNDARY_CHUNKS,
      "with `session_rerotate`, the truncated prompt's first store chunks (the system "
      "prompt and the seam after the dropped turns) computed exactly instead of re-rotated. "
      "Default 1 (`scripts/bench_truncation.py`: pooled perplexity difference to a "
      "recompute +0.034 instead of +0.081, for one chunk of compute more); 0: every stored "
      "kept chunk re-rotated.",
      flag_help="With --session_rerotate: the truncated prompt's first store chunks (the "
                "system prompt and the seam after the dropped turns) computed exactly "
                "instead of re-rotated; 0: none.")
  max_pinned_sessions: int = option(
      DEFAULT_MAX_PINNED_SESSIONS,
      "with a store, open chat sessions whose last turn's stored chunks are pinned in the "
      "host tier (kept against eviction; the most recently used first, unpinned when closed "
      "or expired); 0: none. Pins never take more than half the host tier.",
      flag_help="With a store: open chat sessions whose last turn's stored chunks are "
                "pinned in the host tier (most recently used first; unpinned when closed or "
                "expired); 0: none.")
  max_pinned_session_bytes: int | None = option(
      None, "bytes of pinned sessions' chunks at most (None: half the host tier bounds them).",
      flag="integer",
      flag_help="Bytes of pinned sessions' chunks at most (default: half the host tier).")

  def session_config(self) -> SessionConfig:
    """The sessions room's `SessionConfig` of these options (ValueError on a bad limit)."""
    return SessionConfig(ttl_s=self.session_ttl_s, max_sessions=self.max_sessions,
                         max_tokens=self.max_session_tokens, truncation=self.session_truncation,
                         rerotate=self.session_rerotate,
                         rerotate_boundary_chunks=self.session_rerotate_boundary_chunks,
                         max_pinned_sessions=self.max_pinned_sessions,
                         max_pinned_bytes=self.max_pinned_session_bytes)


@dataclasses.dataclass(frozen=True)
class ParallelOptions:
  """Tensor parallelism and multi-host runs (docs/design/scale-out.md)."""

  tensor_parallel_size: int = option(
      1,
      "N, devices the model is split over: a `tp` mesh over the first N devices, parameters "
      "sharded Megatron-style, the pool by KV head (`kvjax.models.runner.sharding`). N must divide "
      "the attention heads and the MLP width, and the KV heads must be a multiple of N or N "
      "a multiple of them (vLLM's rule). The pool keeps the blocks `kv_cache_memory_bytes` "
      "gives one device, so plans do not depend on N; each device holds its heads of them. "
      "The store is unchanged: chunks stay `[L, 2, C, K, H]` whole, so replicas of any N "
      "share one store. 1 (default): no mesh, the single-device program.",
      flag_help="Devices the model is split over (a tp mesh).")
  coordinator_address: str | None = option(
      None, _MULTIHOST, flag_help="Multi-host: host:port of process 0 (jax.distributed).")
  num_processes: int | None = option(
      None, _MULTIHOST, flag="integer",
      flag_help="Multi-host: processes in the run (jax.distributed).")
  process_id: int | None = option(
      None, _MULTIHOST, flag="integer",
      flag_help="Multi-host: this process; 0 serves HTTP, the others follow it.")

  @property
  def multihost(self) -> bool:
    """More than one process (`num_processes` > 1)."""
    return (self.num_processes or 1) > 1


#: EngineOptions' sections: attribute name -> options class, in the page's order.
SECTIONS: dict[str, type] = {"model": ModelOptions, "cache": CacheOptions,
                             "scheduler": SchedulerOptions, "kv": KVStoreOptions,
                             "sessions": SessionOptions, "parallel": ParallelOptions}


def _section_of() -> dict[str, str]:
  return {f.name: section for section, cls in SECTIONS.items() for f in option_fields(cls)}


def all_option_fields() -> list[tuple[str, dataclasses.Field]]:
  """(section, field) of every engine option, sections in `SECTIONS` order."""
  return [(section, f) for section, cls in SECTIONS.items() for f in option_fields(cls)]


@dataclasses.dataclass(frozen=True)
class EngineOptions:
  """Every option of `LLM(...)`, by concern; checked at construction (`validate`).

  Build one from the flat keyword names with `from_flat`; `flat()` gives them back.

  Raises:
    ValueError: a bad value, named by its flat name (as `LLM(...)` raises it).
  """

  model: ModelOptions = dataclasses.field(default_factory=ModelOptions)
  cache: CacheOptions = dataclasses.field(default_factory=CacheOptions)
  scheduler: SchedulerOptions = dataclasses.field(default_factory=SchedulerOptions)
  kv: KVStoreOptions = dataclasses.field(default_factory=KVStoreOptions)
  sessions: SessionOptions = dataclasses.field(default_factory=SessionOptions)
  parallel: ParallelOptions = dataclasses.field(default_factory=ParallelOptions)

  def __post_init__(self):
    self.validate()

  @classmethod
  def from_flat(cls, **options: Any) -> EngineOptions:
    """The options of flat `LLM(...)` keyword names (e.g. `kv_codec="int8"`); the rest default.

    Raises:
      TypeError: a name that is no option.
      ValueError: a bad value (`validate`).
    """
    where = _section_of()
    unknown = sorted(set(options) - set(where))
    if unknown:
      raise TypeError(f"unexpected keyword argument{'s' * (len(unknown) > 1)} "
                      f"{', '.join(repr(u) for u in unknown)}: not an engine option "
                      "(kvjax.config.EngineOptions; docs/usage/options.md)")
    parts: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
    for name, value in options.items():
      parts[where[name]][name] = value
    return cls(**{section: SECTIONS[section](**kw) for section, kw in parts.items()})

  def flat(self) -> dict[str, Any]:
    """Every option by its flat `LLM(...)` keyword name."""
    return {f.name: getattr(getattr(self, section), f.name)
            for section, f in all_option_fields()}

  def replace(self, **options: Any) -> EngineOptions:
    """A copy with the given flat options changed (TypeError, ValueError as `from_flat`)."""
    return EngineOptions.from_flat(**{**self.flat(), **options})

  @property
  def has_store(self) -> bool:
    """A store is configured (`kv_store` or `kv_tiers`)."""
    return self.kv.has_store

  @property
  def codec_levels(self) -> tuple[int, ...]:
    """The codec levels stored: `kv_codec_levels`, or the codec's default level."""
    if self.kv.kv_codec_levels is None:
      return (codecs.DEFAULT_LEVELS[self.kv.kv_codec],)
    return tuple(self.kv.kv_codec_levels)

  @property
  def consistent(self) -> bool:
    """`kv_codec_consistent` resolved: None is on for lossy codecs where the chunk size is a
    compiled size within the token budget (else off)."""
    kv, sched = self.kv, self.scheduler
    feasible = (kv.kv_chunk_size in tuple(sched.chunk_sizes)
                and kv.kv_chunk_size <= sched.token_budget)
    if kv.kv_codec_consistent is None:
      return not codecs.CODECS[kv.kv_codec].lossless and feasible
    return bool(kv.kv_codec_consistent)

  def scheduler_config(self) -> SchedulerConfig:
    """The scheduler's `SchedulerConfig` of these options."""
    s = self.scheduler
    sizes = tuple(s.chunk_sizes)
    return SchedulerConfig(num_slots=s.max_num_seqs, chunk_sizes=sizes,
                           token_budget=s.token_budget,
                           long_prefill_token_threshold=s.long_prefill_token_threshold,
                           prefill_order=s.prefill_order,
                           short_first_token_steps=s.short_first_token_steps,
                           enable_prefix_caching=self.cache.enable_prefix_caching)

  def load_config(self) -> LoadConfig:
    """The scheduler's `LoadConfig` of these options (the one place it is derived): the merge
    mode, loads in flight, TTFT target, layer groups, the look-ahead window (0 without a store),
    `consistent` resolved, and the link's latency prior (`REMOTE_LINK_LATENCY_S` when a tier is
    remote, else `LOCAL_LINK_LATENCY_S`). The engine fits it to its runner and store client
    (`Engine`: layer groups capped at the model's layers, the client's staging bytes).

    Raises:
      ValueError: as `KVStoreOptions.store_config`.
    """
    kv = self.kv
    store = kv.store_config()
    remote = store is not None and any(t.kind == "remote" for t in store.tiers)
    return LoadConfig(merge_mode=kv.kv_merge_mode, max_loads_in_flight=kv.kv_max_loads_in_flight,
                      link_latency_s=REMOTE_LINK_LATENCY_S if remote else LOCAL_LINK_LATENCY_S,
                      kv_ttft_target_s=kv.kv_ttft_target_s,
                      layerwise_groups=kv.kv_layerwise_groups,
                      layer_split=kv.kv_layer_split,
                      lookahead_window=kv.kv_lookahead_window if store is not None else 0,
                      consistent=self.consistent and store is not None)

  def validate(self) -> None:
    """Every check that needs no model, by the options' flat names (the one place for them).

    Raises:
      ValueError: naming the option and the limit it breaks.
    """
    m, c, s, kv, se = self.model, self.cache, self.scheduler, self.kv, self.sessions
    with_store = kv.has_store
    se.session_config()  # the sessions room's own checks
    rev = m.model_revision
    if rev is not None and (not isinstance(rev, str) or not rev.strip()):
      raise ValueError(f"model_revision={rev!r} must be a branch, tag or commit name, or None")
    w = kv.kv_lookahead_window
    if isinstance(w, bool) or not isinstance(w, int) or w < 0:
      raise ValueError(f"kv_lookahead_window={w!r} must be an int >= 0")
    if se.session_rerotate and not with_store:
      raise ValueError("session_rerotate=True needs a kv_store (the kept turns' KV is read "
                       "from it)")
    _positive_int("max_num_seqs", s.max_num_seqs)
    if kv.kv_max_loads_in_flight is not None:
      _positive_int("kv_max_loads_in_flight", kv.kv_max_loads_in_flight)
    for name, value in (("max_model_len", m.max_model_len),
                        ("max_num_batched_tokens", s.max_num_batched_tokens)):
      if value is not None:
        _positive_int(name, value)
    sizes = s.chunk_sizes
    if not isinstance(sizes, (list, tuple)) or not sizes:
      raise ValueError(f"chunk_sizes={sizes!r} must be a non-empty list of ints")
    for size in sizes:
      _positive_int("chunk_sizes", size)
    if list(sizes) != sorted(set(sizes)):
      raise ValueError(f"chunk_sizes={sizes!r} must be ascending and distinct")
    budget = s.max_num_batched_tokens
    if budget is not None and budget < sizes[0]:
      raise ValueError(f"max_num_batched_tokens={budget} is below the smallest chunk size "
                       f"{sizes[0]}: long prompts could never be scheduled")
    if isinstance(m.seed, bool) or not isinstance(m.seed, int):
      raise ValueError(f"seed={m.seed!r} must be an int")
    check_scheduling_options(s.long_prefill_token_threshold, sizes, s.prefill_order,
                             s.short_first_token_steps)
    self._check_codec(with_store)
    parse_merge_mode(kv.kv_merge_mode, "kv_merge_mode")
    _positive_number_or_none("kv_ttft_target_s", kv.kv_ttft_target_s,
                             "must be a positive number of seconds or None")
    for name, v in (("block_size", c.block_size),
                    ("kv_cache_memory_bytes", c.kv_cache_memory_bytes)):
      if v is not None:
        _positive_int(name, v)
    if with_store and isinstance(kv.kv_chunk_size, int) and kv.kv_chunk_size > 0:
      blocks_per_chunk(c.block_size, kv.kv_chunk_size)  # a chunk is whole blocks
    if m.dtype != "auto" and m.dtype not in DTYPES:
      raise ValueError(f"dtype {m.dtype!r} is not one of 'auto', {sorted(DTYPES)}")
    g = kv.kv_layerwise_groups
    if isinstance(g, bool) or not isinstance(g, int) or g < 1:
      raise ValueError(f"kv_layerwise_groups={g!r} must be an int >= 1")
    _positive_number_or_none("kv_device_link_bytes_per_s", kv.kv_device_link_bytes_per_s,
                             "must be a positive number of bytes/s or None")
    if kv.kv_codec_consistent and not self._consistent_feasible():
      raise ValueError(f"kv_codec_consistent=True needs kv_chunk_size={kv.kv_chunk_size} "
                       f"among the compiled chunk_sizes {tuple(sizes)} and <= "
                       f"max_num_batched_tokens ({s.token_budget})")
    if with_store:
      self._check_store()

  def _consistent_feasible(self) -> bool:
    size = self.kv.kv_chunk_size
    return size in tuple(self.scheduler.chunk_sizes) and size <= self.scheduler.token_budget

  def _check_codec(self, with_store: bool) -> None:
    """The codec options against the registry (`kvjax.codecs`). With a store, the chunk size
    too, so a size the codec cannot take is this ValueError, never a failing save later."""
    kv = self.kv
    codec, levels = kv.kv_codec, kv.kv_codec_levels
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
        codecs.check_chunk_size(codec, levels, kv.kv_chunk_size)
      except ValueError as e:
        raise ValueError(f"kv_chunk_size={kv.kv_chunk_size!r} with kv_codec={codec!r}: "
                         f"{e}") from e

  def _check_store(self) -> None:
    """The store's options that need no model (the chunk size's upper bound, the model's
    context, is `LLM`'s)."""
    kv = self.kv
    size = kv.kv_chunk_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
      raise ValueError(f"kv_chunk_size={size!r} must be a positive int")
    _positive_number_or_none("kv_link_bytes_per_s", kv.kv_link_bytes_per_s,
                             "must be a positive number of bytes/s (or None for an unlimited "
                             "link)")
    if kv.kv_link_trace is not None and not isinstance(kv.kv_link_trace, str):
      raise ValueError(f"kv_link_trace must be a file path, got "
                       f"{type(kv.kv_link_trace).__name__}")
    placement = kv.kv_placement
    if placement is not None and (not isinstance(placement, str) or placement not in PLACEMENTS):
      raise ValueError(f"kv_placement={placement!r}; use one of {PLACEMENTS} or None")
    store = kv.kv_store
    cap = kv.kv_store_capacity_bytes
    if cap is not None:
      _positive_int("kv_store_capacity_bytes", cap)
    if kv.kv_tiers is not None:
      if not isinstance(kv.kv_tiers, str):
        raise ValueError(f"kv_tiers must be JSON or a file path, got {type(kv.kv_tiers).__name__}")
      if store not in (None, DEFAULT_STORE):
        raise ValueError("give kv_store or kv_tiers, not both")
      if cap is not None:
        raise ValueError("kv_store_capacity_bytes bounds kv_store; with kv_tiers, give each "
                         "tier its capacity_bytes")
      if kv.kv_link_bytes_per_s is not None or kv.kv_link_trace is not None:
        raise ValueError("with kv_tiers, set links per tier (link_bytes_per_s, link_trace)")
      try:
        kv.store_config()
      except ValueError as e:
        raise ValueError(f"kv_tiers: {e}") from e
    elif isinstance(store, str):
      if not store:
        raise ValueError("kv_store is empty: give a URL such as file:///path or memory://")
      try:
        kv.store_config()
      except ValueError as e:
        raise ValueError(f"kv_store: {e}") from e
    elif isinstance(store, StoreConfig):
      if kv.kv_link_bytes_per_s is not None or kv.kv_link_trace is not None:
        raise ValueError("with a StoreConfig, set links per tier (TierConfig.link_*)")
      if cap is not None:
        raise ValueError("kv_store_capacity_bytes bounds a URL kv_store; with a StoreConfig, "
                         "give each tier its capacity_bytes")
    else:
      raise ValueError(f"kv_store must be a URL string or a StoreConfig, got "
                       f"{type(store).__name__}")


def _positive_int(name: str, value: Any) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
    raise ValueError(f"{name}={value!r} must be a positive int")


def _positive_number_or_none(name: str, value: Any, what: str) -> None:
  if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                            or not value > 0):
    raise ValueError(f"{name}={value!r} {what}")


def check_scheduling_options(long_prefill_token_threshold: int,
                             chunk_sizes: Sequence[int] | None = None,
                             prefill_order: str = SHORTEST_FIRST,
                             short_first_token_steps: bool = True) -> None:
  """Rejects bad scheduling options by the scheduler's own rules (`SchedulerConfig`):
  `long_prefill_token_threshold` an int >= 0 (0: off) and, when > 0, at least the smallest
  compiled chunk size (`chunk_sizes` or the default), or a long prompt could never advance;
  `prefill_order` one of `PREFILL_ORDERS`; `short_first_token_steps` a bool.

  Raises:
    ValueError: naming the option.
  """
  sizes = tuple(sorted(chunk_sizes or DEFAULT_CHUNK_SIZES))
  SchedulerConfig(chunk_sizes=sizes, token_budget=sizes[-1],
                  long_prefill_token_threshold=long_prefill_token_threshold,
                  prefill_order=prefill_order, short_first_token_steps=short_first_token_steps)


def server_defaults() -> dict[str, Any]:
  """The flat options whose server default differs from `LLM`'s (`python -m kvjax.serve`)."""
  return {f.name: spec(f).server_default for _, f in all_option_fields()
          if spec(f).has_server_default}
