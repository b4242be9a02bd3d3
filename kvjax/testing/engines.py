"""Test engines: the one factory for an `Engine` (and its store client) on the fake runner (no
model, no jit, a byte tokenizer: `kvjax.testing.fake_runner`), for an `LLM` front end (sessions,
chat, option checks) over one, and for an `LLM` on the real (jit'd) model.

    engine = fake_engine(kv_store="memory://t1", kv_chunk_size=32)
    outs = generate(engine, [prompt_ids], SamplingParams(max_tokens=4, temperature=0))
    llm = fake_llm(kv_store="memory://", kv_chunk_size=32)   # LLM("tiny", ...) on a FakeRunner
    llm = real_llm("tiny", cache_dir="", kv_store="memory://")  # LLM(...), compiled on demand

Both fake factories build through the composition root (`kvjax.entrypoints.root.
build_engine_parts`), as `LLM(...)` does, with the fake's model record (`fake_model`, or "tiny"
under a fingerprint of the fake's own) and a fake runner factory (`fake_runner_factory`) as their
arguments: the same option checks, store client, sessions wiring and engine records.

Defaults follow `LLM`'s (chunk sizes 16 .. 512, blocks of 16, 4 sequences, Cake merges), sized
for the fake's 512 positions; options are `LLM`'s names where they mean the same.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import time
from typing import Any, Callable, Iterator, Sequence

from kvjax._typing import ModelFingerprint
from kvjax.config import EngineOptions
from kvjax.engine.engine import Engine
from kvjax.engine.outputs import RequestOutput
from kvjax.entrypoints import root
from kvjax.entrypoints.llm import LLM, resolve_options
from kvjax.entrypoints.root import RunnerFactory, build_engine_parts
from kvjax.models.loading.byte_tokenizer import ByteTokenizer
from kvjax.models.nn.kv_cache import paged_block_nbytes
from kvjax.models.loading.registry import LoadedModel, load_model
from kvjax.models.runner.runner_api import PagedRunnerConfig
from kvjax.scheduler.cost_model import CostModel
from kvjax.scheduler.request import SamplingParams
from kvjax.storage.tiering.tiers import StoreConfig
from kvjax.testing.fake_runner import FakeRunner, fake_model_config

#: `LLM`'s default chunk sizes, capped at the fake's context.
FAKE_CHUNK_SIZES = (16, 32, 64, 128, 256)
#: The fingerprint the fake's store keys are seeded with (one "model").
FAKE_FINGERPRINT = "fake-runner/v1"

_ids = itertools.count()


def memory_store_url(name: str = "fake") -> str:
  """A fresh in-process store URL (`memory://<name>-<n>`), unique per call."""
  return f"memory://{name}-{next(_ids)}"


def fake_runner_factory(runner_seed: int = 0, num_blocks: int | None = None) -> RunnerFactory:
  """A `build_engine_parts(make_runner=...)` that builds a `FakeRunner` of the options' sizes.

  Blocks: `num_blocks`, else what `kv_cache_memory_bytes` holds (float32 blocks), else enough
  for `max_num_seqs` sequences of the full context (`LLM`'s rule on the CPU).

  Raises (when called):
    ValueError: `tensor_parallel_size` > 1 (the fake runs on one device).
  """

  def make(loaded: LoadedModel, options: EngineOptions) -> FakeRunner:
    if options.parallel.tensor_parallel_size != 1:
      raise ValueError("the fake runner runs on one device (tensor_parallel_size=1)")
    cfg, cache, sched = loaded.config, options.cache, options.scheduler
    max_seq_len = options.model.max_model_len
    blocks = num_blocks
    if blocks is None and cache.kv_cache_memory_bytes is not None:
      blocks = max(1, cache.kv_cache_memory_bytes
                   // paged_block_nbytes(cfg, cache.block_size, "float32"))
    elif blocks is None:
      blocks = sched.max_num_seqs * -(-(max_seq_len or cfg.max_seq_len) // cache.block_size)
    return FakeRunner(PagedRunnerConfig(
        num_blocks=blocks, block_size=cache.block_size, max_num_seqs=sched.max_num_seqs,
        max_num_batched_tokens=sched.token_budget, max_seq_len=max_seq_len,
        chunk_sizes=tuple(sched.chunk_sizes)), cfg, seed=runner_seed)

  return make


def fake_model() -> LoadedModel:
  """The fake's model record: `fake_model_config()`, no weights, a `ByteTokenizer`, and
  `FAKE_FINGERPRINT` (its stored chunks' keys)."""
  return LoadedModel(name="fake", config=fake_model_config(), params={},
                     tokenizer=ByteTokenizer(), fingerprint=ModelFingerprint(FAKE_FINGERPRINT))


def fake_engine(*, kv_store: str | StoreConfig | None = None,
                kv_chunk_size: int = 32, kv_codec: str = "raw",
                kv_codec_levels: Sequence[int] | None = None,
                kv_codec_consistent: bool = False, max_num_seqs: int = 4,
                max_num_batched_tokens: int | None = None,
                chunk_sizes: Sequence[int] = FAKE_CHUNK_SIZES, block_size: int = 16,
                num_blocks: int | None = None, max_model_len: int | None = None,
                long_prefill_token_threshold: int = 0, prefill_order: str | None = None,
                runner_seed: int = 0, check_writes: bool = True,
                kv_device_link_bytes_per_s: float | None = None, lookahead_window: int = 8,
                merge_mode: str = "cake", layerwise_groups: int = 1,
                enable_prefix_caching: bool = True, max_loads_in_flight: int | None = None,
                kv_ttft_target_s: float | None = None, seed: int = 0,
                clock: Callable[[], float] = time.perf_counter, layer_split: str = "off",
                cost_model: CostModel | None = None, settle_loads: bool = False) -> Engine:
  """An `Engine` on a `FakeRunner` with a `ByteTokenizer` (the test engine factory): the
  composition root (`kvjax.entrypoints.root.build_engine_parts`) with the fake as its runner.

  Args:
    kv_store: a store URL (`memory_store_url()` for a fresh one), a `StoreConfig`, or None.
    kv_chunk_size, kv_codec, kv_codec_levels, kv_codec_consistent, kv_device_link_bytes_per_s:
      the store's options (as `LLM`'s).
    max_num_seqs, max_num_batched_tokens, chunk_sizes, block_size, max_model_len,
      long_prefill_token_threshold, prefill_order, enable_prefix_caching, seed: `LLM`'s.
    num_blocks: the fake's block pool (default: `max_num_seqs` full contexts).
    runner_seed: the fake model's weights.
    check_writes: keep the merge's writer map (tests keep it on).
    lookahead_window, merge_mode, layerwise_groups, max_loads_in_flight, kv_ttft_target_s:
      `LLM`'s `kv_lookahead_window` (default 8, as `LLM`'s), `kv_merge_mode`,
      `kv_layerwise_groups`, `kv_max_loads_in_flight`, `kv_ttft_target_s`.
    clock: the engine's clock.
    layer_split: `LLM`'s `kv_layer_split`.
    cost_model: the planner's cost model (a frozen one makes plans timing-free); None: fresh.
    settle_loads: every step's load reports wait for every load in flight
      (`KVStoreClient(settle_loads=)`): with a fake clock, plans that never hinge on how fast
      the loader thread runs.

  Closing: `close_engine(engine)` closes its store client and runner.
  """
  flat: dict[str, Any] = dict(
      model="tiny", cache_dir="", dtype="float32", max_num_seqs=max_num_seqs,
      max_num_batched_tokens=max_num_batched_tokens, chunk_sizes=tuple(chunk_sizes),
      block_size=block_size, max_model_len=max_model_len,
      long_prefill_token_threshold=long_prefill_token_threshold,
      enable_prefix_caching=enable_prefix_caching, seed=seed, kv_store=kv_store,
      kv_chunk_size=kv_chunk_size, kv_codec=kv_codec, kv_codec_levels=kv_codec_levels,
      kv_codec_consistent=kv_codec_consistent,
      kv_device_link_bytes_per_s=kv_device_link_bytes_per_s,
      kv_lookahead_window=lookahead_window, kv_merge_mode=merge_mode,
      kv_layerwise_groups=layerwise_groups, kv_max_loads_in_flight=max_loads_in_flight,
      kv_ttft_target_s=kv_ttft_target_s, kv_layer_split=layer_split)
  if prefill_order is not None:
    flat["prefill_order"] = prefill_order
  parts = build_engine_parts(EngineOptions.from_flat(**flat), model=fake_model(),
                             make_runner=fake_runner_factory(runner_seed, num_blocks),
                             clock=clock, check_writes=check_writes, cost_model=cost_model,
                             settle_loads=settle_loads)
  return parts.engine


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


def _fake_loaded(model: str, runner_seed: int, max_seq_len: int | None,
                 load: Callable[..., LoadedModel], **load_options: Any) -> LoadedModel:
  """`model` loaded, with a fingerprint of the fake's own (stored KV of the fake never hits the
  real model's, nor the other way) and, when given, `max_seq_len` as its context."""
  loaded = load(model, **load_options)
  fp = hashlib.sha256(f"{FAKE_FINGERPRINT}/{runner_seed}\0{loaded.fingerprint}".encode())
  if max_seq_len is not None:
    loaded = dataclasses.replace(
        loaded, config=dataclasses.replace(loaded.config, max_seq_len=max_seq_len))
  return dataclasses.replace(loaded, fingerprint=ModelFingerprint(fp.hexdigest()))


@contextlib.contextmanager
def fake_runner_seam(runner_seed: int = 0,
                     max_seq_len: int | None = None) -> Iterator[list[FakeRunner]]:
  """While open, every `LLM(...)` built runs on a `FakeRunner` of its options' sizes instead of
  the jit'd `PagedModelRunner`, and its store keys are seeded from a fingerprint of its own.
  Yields the list of runners built. For tests of `LLM(...)` itself (its start-up, its weights
  check); `fake_llm` passes the fake to the composition root instead.

  Swaps the two module-level functions the root (`kvjax/entrypoints/root.py`) builds the
  runner and loads the model with (`build_paged_runner`, `load_model`) for the block only.
  `max_seq_len` overrides the model's context (tokens), for prompts longer than tiny's 512.
  """
  built: list[FakeRunner] = []
  real_load = root.load_model

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
    return _fake_loaded(model, runner_seed, max_seq_len, real_load, cache_dir=cache_dir,
                        revision=revision)

  saved = root.build_paged_runner, root.load_model
  root.build_paged_runner, root.load_model = build, load
  try:
    yield built
  finally:
    root.build_paged_runner, root.load_model = saved


def fake_llm(model: str = "tiny", *, runner_seed: int = 0, max_seq_len: int | None = None,
             **options: Any) -> LLM:
  """`LLM(model, **options)` on a `FakeRunner`: the composition root
  (`kvjax.entrypoints.root.build_engine_parts`) with the fake as its runner, then
  `LLM.from_parts`: the real front end (generate, chat, sessions, option checks, the store
  client) over the numpy fake model.

  Defaults differ from `LLM`'s where the fake needs it: `cache_dir=""` (nothing cached on
  disk), `compile_on_init=False` and `startup_progress=None` (as `real_llm`). "tiny" (default):
  `kvjax.models.nn.config.tiny`'s sizes and a `ByteTokenizer`; `max_seq_len` overrides its
  context of 512 tokens. Stored keys are seeded from a fingerprint of the fake's own.

  Raises:
    ValueError: as `LLM`; `tensor_parallel_size` > 1; kvtc (the fake has no calibration).
  """
  options.setdefault("cache_dir", "")
  options.setdefault("compile_on_init", False)
  progress = options.pop("startup_progress", None)
  opts = resolve_options(model, options.pop("options", None), options)
  loaded = _fake_loaded(model, runner_seed, max_seq_len, load_model,
                        revision=opts.model.model_revision)
  parts = build_engine_parts(opts, progress=progress, model=loaded,
                             make_runner=fake_runner_factory(runner_seed))
  return LLM.from_parts(parts, startup_progress=progress)


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
