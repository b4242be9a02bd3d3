"""Test engines: the one factory for an `Engine` (and its store client) on the fake runner (no
model, no jit, a byte tokenizer: `kvjax.testing.fake_runner`), for an `LLM` front end (sessions,
chat, option checks) over one, and for an `LLM` on the real (jit'd) model.

    engine = fake_engine(kv_store="memory://t1", kv_chunk_size=32)
    outs = generate(engine, [prompt_ids], SamplingParams(max_tokens=4, temperature=0))
    llm = fake_llm(kv_store="memory://", kv_chunk_size=32)   # LLM("tiny", ...) on a FakeRunner
    llm = real_llm("tiny", cache_dir="", kv_store="memory://")  # LLM(...), compiled on demand

Defaults follow `LLM`'s (chunk sizes 16 .. 512, blocks of 16, 4 sequences, Cake merges), sized
for the fake's 512 positions; options are `LLM`'s names where they mean the same.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
from typing import Any, Iterator, Sequence

from kvjax import codecs
from kvjax._typing import ModelFingerprint
from kvjax.entrypoints import llm as llm_module
from kvjax.engine.engine import Engine
from kvjax.engine.outputs import RequestOutput
from kvjax.entrypoints.llm import LLM
from kvjax.connector import KVStoreClient
from kvjax.models.byte_tokenizer import ByteTokenizer
from kvjax.models.kv_cache import KV_LAYOUT_VERSION, paged_block_nbytes
from kvjax.models.runner_api import PagedRunnerConfig
from kvjax.scheduler.request import SamplingParams
from kvjax.scheduler.config import SchedulerConfig
from kvjax.storage.chunk_store import ChunkStore
from kvjax.storage.link import LinkLimiter
from kvjax.storage.tiers import StoreConfig, build_tiers
from kvjax.storage.types import KVLayout
from kvjax.testing.fake_runner import FakeRunner, fake_model_config

#: `LLM`'s default chunk sizes, capped at the fake's context.
FAKE_CHUNK_SIZES = (16, 32, 64, 128, 256)
#: The fingerprint the fake's store keys are seeded with (one "model").
FAKE_FINGERPRINT = "fake-runner/v1"

_ids = itertools.count()


def memory_store_url(name: str = "fake") -> str:
  """A fresh in-process store URL (`memory://<name>-<n>`), unique per call."""
  return f"memory://{name}-{next(_ids)}"


def fake_runner(*, max_num_seqs: int = 4, max_num_batched_tokens: int | None = None,
                chunk_sizes: Sequence[int] = FAKE_CHUNK_SIZES, block_size: int = 16,
                num_blocks: int | None = None, max_model_len: int | None = None,
                seed: int = 0) -> FakeRunner:
  """A `FakeRunner` with `LLM`'s sizing rules: a token budget of the largest chunk size and
  (default) enough blocks for `max_num_seqs` sequences of the full context."""
  cfg = fake_model_config()
  max_len = max_model_len or cfg.max_seq_len
  if num_blocks is None:
    num_blocks = max_num_seqs * -(-max_len // block_size)
  return FakeRunner(PagedRunnerConfig(
      num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
      max_num_batched_tokens=max_num_batched_tokens or chunk_sizes[-1], max_seq_len=max_len,
      chunk_sizes=tuple(chunk_sizes)), cfg, seed=seed)


def fake_store_client(kv_store: str | StoreConfig, runner: FakeRunner, *,
                      kv_chunk_size: int = 32, kv_codec: str = "raw",
                      kv_codec_levels: Sequence[int] | None = None, consistent: bool = False,
                      kv_device_link_bytes_per_s: float | None = None,
                      fingerprint: str = FAKE_FINGERPRINT, **client_options: Any
                      ) -> KVStoreClient:
  """A `KVStoreClient` over a store URL or tier list, for the fake's KV layout (float32).

  `client_options` go to `KVStoreClient` (e.g. `max_pending_saves`, `timeout_s`).
  """
  config = (StoreConfig.from_url(kv_store) if isinstance(kv_store, str) else kv_store)
  store = build_tiers(config, make_chunk_store=lambda url, name, limiter: ChunkStore(
      url, name=name, limiter=limiter))
  cfg = runner.model_config
  levels = tuple(kv_codec_levels) if kv_codec_levels is not None else (
      codecs.DEFAULT_LEVELS[kv_codec],)
  layout = KVLayout(num_layers=cfg.n_layers, chunk_size=kv_chunk_size,
                    num_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, dtype="float32")
  return KVStoreClient(store, model_fingerprint=fingerprint, layout=layout,
                       kv_layout_version=KV_LAYOUT_VERSION, codec=kv_codec,
                       codec_levels=levels,
                       device_link=(LinkLimiter(kv_device_link_bytes_per_s)
                                    if kv_device_link_bytes_per_s is not None else None),
                       consistent=consistent, device=runner.device_seam(), **client_options)


def fake_engine(*, kv_store: str | StoreConfig | KVStoreClient | None = None,
                kv_chunk_size: int = 32, kv_codec: str = "raw",
                kv_codec_levels: Sequence[int] | None = None,
                kv_codec_consistent: bool = False, max_num_seqs: int = 4,
                max_num_batched_tokens: int | None = None,
                chunk_sizes: Sequence[int] = FAKE_CHUNK_SIZES, block_size: int = 16,
                num_blocks: int | None = None, max_model_len: int | None = None,
                long_prefill_token_threshold: int = 0, prefill_order: str | None = None,
                runner_seed: int = 0, check_writes: bool = True,
                kv_device_link_bytes_per_s: float | None = None, lookahead_window: int = 8,
                **engine_options: Any) -> Engine:
  """An `Engine` on a `FakeRunner` with a `ByteTokenizer` (the test engine factory).

  Args:
    kv_store: a store URL (`memory_store_url()` for a fresh one), a `StoreConfig`, a ready
      `KVStoreClient` (built by `fake_store_client` for this layout), or None.
    kv_chunk_size, kv_codec, kv_codec_levels: the store client's (as `LLM`'s).
    kv_codec_consistent: `Engine(consistent=...)` (its client is keyed by the fixed encoding).
    max_num_seqs, max_num_batched_tokens, chunk_sizes, block_size, num_blocks, max_model_len:
      the runner's and the scheduler's sizes.
    long_prefill_token_threshold, prefill_order: `SchedulerConfig`'s.
    runner_seed: the fake model's weights.
    check_writes: keep the merge's writer map (tests keep it on).
    kv_device_link_bytes_per_s: the store client's emulated host -> device link.
    lookahead_window: `LLM`'s default (8), not `Engine`'s (0).
    engine_options: `Engine`'s other keywords (`merge_mode`, `seed`, `clock`,
      `enable_prefix_caching`, `layerwise_groups`, `lookahead_window`, ...).

  Closing: `close_engine(engine)` closes its store client and runner.
  """
  runner = fake_runner(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                       chunk_sizes=chunk_sizes, block_size=block_size, num_blocks=num_blocks,
                       max_model_len=max_model_len, seed=runner_seed)
  client = kv_store
  if kv_store is not None and not isinstance(kv_store, KVStoreClient):
    client = fake_store_client(kv_store, runner, kv_chunk_size=kv_chunk_size, kv_codec=kv_codec,
                               kv_codec_levels=kv_codec_levels,
                               consistent=kv_codec_consistent,
                               kv_device_link_bytes_per_s=kv_device_link_bytes_per_s)
  sched_options = {}
  if prefill_order is not None:
    sched_options["prefill_order"] = prefill_order
  sched = SchedulerConfig(num_slots=max_num_seqs, chunk_sizes=runner.chunk_sizes,
                          token_budget=runner.config.max_num_batched_tokens,
                          long_prefill_token_threshold=long_prefill_token_threshold,
                          **sched_options)
  return Engine(runner, ByteTokenizer(), sched, kv_store=client, check_writes=check_writes,
                consistent=kv_codec_consistent, lookahead_window=lookahead_window,
                **engine_options)


def close_engine(engine: Engine) -> None:
  """Writes pending saves and stops the store client's threads; closes the runner."""
  if engine.kv_store is not None:
    engine.kv_store.close()
  engine.runner.close()


def generate(engine: Engine, prompts: Sequence[Sequence[int] | str],
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             **add_options: Any) -> list[RequestOutput]:
  """Queues every prompt (token ids, or text through the engine's tokenizer) and steps the
  engine until all finish, as `LLM.generate` does; `add_options` go to every
  `Engine.add_request` (`cache_salt`, `merge_mode`, ...).

  Returns:
    One finished `RequestOutput` per prompt, in input order.

  Raises:
    RuntimeError: the engine ran out of work with a request unfinished.
  """
  params = params or SamplingParams(max_tokens=4, temperature=0.0)
  if isinstance(params, SamplingParams):
    params = [params] * len(prompts)
  rids = []
  for p, sp in zip(prompts, params):
    ids = engine.tokenizer.encode(p) if isinstance(p, str) else list(p)
    rids.append(engine.add_request(ids, sp, prompt=p if isinstance(p, str) else None,
                                   **add_options))
  done: dict[str, RequestOutput] = {}
  while len(done) < len(rids):
    outs = engine.step()
    for out in outs:
      if out.finished:
        done[out.request_id] = out
    if not outs and not engine.has_unfinished_requests() and len(done) < len(rids):
      raise RuntimeError("the engine finished without completing every request")
  return [done[r] for r in rids]


@contextlib.contextmanager
def fake_runner_seam(runner_seed: int = 0,
                     max_seq_len: int | None = None) -> Iterator[list[FakeRunner]]:
  """While open, every `LLM` built (paged layout) runs on a `FakeRunner` of its options' sizes
  instead of the jit'd `PagedModelRunner`, and its store keys are seeded from a fingerprint of
  its own (stored KV of the fake never hits the real model's, nor the other way). Yields the
  list of runners built. Everything else is `LLM`'s own construction (option checks, store
  client, sessions, engine, warmup).

  `LLM.__init__` has no runner parameter; this swaps the two module-level functions it builds
  the runner and loads the model with (`build_paged_runner`, `load_model`) for the block only.
  `max_seq_len` overrides the model's context (tokens), for prompts longer than tiny's 512.
  """
  built: list[FakeRunner] = []
  real_load = llm_module.load_model

  def build(model, *, block_size, kv_cache_memory_bytes, max_num_seqs, max_num_batched_tokens,
            max_seq_len, chunk_sizes, tensor_parallel=None):
    if tensor_parallel is not None:
      raise ValueError("the fake runner runs on one device (tensor_parallel_size=1)")
    cfg = model.cfg
    max_len = max_seq_len or cfg.max_seq_len
    if kv_cache_memory_bytes is None:
      num_blocks = max_num_seqs * -(-max_len // block_size)
    else:
      num_blocks = max(1, kv_cache_memory_bytes // paged_block_nbytes(cfg, block_size, "float32"))
    runner = FakeRunner(PagedRunnerConfig(
        num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, max_seq_len=max_seq_len,
        chunk_sizes=tuple(chunk_sizes)), cfg, seed=runner_seed)
    built.append(runner)
    return runner

  def load(model, *, cache_dir=None, revision=None):
    loaded = real_load(model, cache_dir=cache_dir, revision=revision)
    fp = hashlib.sha256(f"{FAKE_FINGERPRINT}/{runner_seed}\0{loaded.fingerprint}".encode())
    if max_seq_len is not None:
      loaded = dataclasses.replace(
          loaded, config=dataclasses.replace(loaded.config, max_seq_len=max_seq_len))
    return dataclasses.replace(loaded, fingerprint=ModelFingerprint(fp.hexdigest()))

  saved = llm_module.build_paged_runner, llm_module.load_model
  llm_module.build_paged_runner, llm_module.load_model = build, load
  try:
    yield built
  finally:
    llm_module.build_paged_runner, llm_module.load_model = saved


def fake_llm(model: str = "tiny", *, runner_seed: int = 0, max_seq_len: int | None = None,
             **options: Any) -> LLM:
  """`LLM(model, **options)` on a `FakeRunner` (`fake_runner_seam`): the real front end
  (generate, chat, sessions, option checks, the store client) over the numpy fake model.

  Defaults differ from `LLM`'s where the fake needs it: `cache_dir=""` (nothing cached on
  disk), `compile_on_init=False` and `startup_progress=None` (as `real_llm`). "tiny" (default):
  `kvjax.models.config.tiny`'s sizes and a `ByteTokenizer`; `max_seq_len` overrides its
  context of 512 tokens.

  Raises:
    ValueError: as `LLM`; `tensor_parallel_size` > 1; kvtc (the fake has no calibration).
  """
  options.setdefault("cache_dir", "")
  options.setdefault("compile_on_init", False)
  options.setdefault("startup_progress", None)
  with fake_runner_seam(runner_seed, max_seq_len):
    return LLM(model, **options)


def real_llm(model: str = "tiny", **options: Any) -> LLM:
  """`LLM(model, **options)` on the real (jit'd) model: the factory every test that builds a real
  `LLM` uses.

  Two defaults differ from `LLM`'s. `startup_progress=None`: a suite builds hundreds of `LLM`s,
  so none prints its start-up (a test of the start-up passes its own callback).
  `compile_on_init=False`: `LLM`'s serving default compiles every program a request could run
  (each chunk size, decode, insertion, the codec's encode) so no TTFT pays a compile; a test runs
  a few of them, and compiles (or loads from JAX's persistent cache) only those. Outputs do not
  depend on it; a test of the warm-up itself passes `compile_on_init=True` or calls `warmup()`.
  An in-process server (`kvjax.testing.serve`) warms the `LLM` up as the server does.

  Raises:
    ValueError: as `LLM`.
  """
  options.setdefault("compile_on_init", False)
  options.setdefault("startup_progress", None)
  return LLM(model, **options)
