"""The JIT boundary of the paged KV layout: a model plus its block pool behind ONE jit'd step.

Issue 11. The pool `[L, P, B, F]` (`kvjax.models.nn.kv_cache.PagedKVCache`, heads folded into F) is
shared by every sequence; the scheduler's `KVCacheManager` owns which block belongs to whom and
hands the engine plain block tables each step. A step runs every decode and every planned prefill
chunk in one call (`Llama.ragged_step`): their tokens are flattened and padded to the smallest
compiled token count (`runner_api.token_buckets`), the sequences to a fixed count per bucket, so
compiles stay few:

    step([SeqChunk(tokens, start, block_ids), ...])   ->  StepOutput(logits per sequence,
                                                                     pre-RoPE K and V per token)

Stored chunks (a whole number of blocks, `kv_chunk_size % block_size == 0`) are written into
their blocks by `insert_chunk` (raw) and `insert_payload` (any codec: `kv_codec.kv_decode`;
kvtc, `kvtc.dequantize_reference`).
Only the engine thread calls a runner (the pool is donated on every call).

The runner owns the pool and the model state; its parts by concept live beside it: the records
and the sizes both runners derive (`kvjax.models.runner.runner_api`), the layer-wise step
(`kvjax.models.runner.layerwise_runner`), the codec programs (`kvjax.models.runner.codec_programs`) and the
pool's sizing from device memory (`kvjax.models.runner.pool_memory`).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.kernels import kvtc
from kvjax.kernels.platform import platform_of, resolve_platform
from kvjax.models.runner import multihost
from kvjax.models.runner.codec_programs import RunnerCodecs
from kvjax.models.runner.device_seam import JaxDeviceSeam
from kvjax.models.nn.kv_cache import (PagedKVCache, PoolLayout, init_paged_kv_cache,
                                      paged_pool_shape, pool_lane_multiple, read_pool_blocks,
                                      write_chunk_blocks)
from kvjax.models.nn.layers import apply_rope, rope_inv_freq
from kvjax.models.runner.layerwise_runner import (LAYERWISE_INSERT_BATCH, LayerwisePrograms,
                                                  LayerwiseStep)
from kvjax.models.nn.llama import Llama, layer_param_names
from kvjax.models.runner.runner_api import (LayerCounts, PagedRunnerConfig, RunnerGeometry,
                                            SeqChunk, StepOutput, layer_groups)
from kvjax.models.runner.sharding import TensorParallel, put
from kvjax.models.runner.step_inputs import pack_step, padding_step, step_arg_specs


def pool_layout(model_config, tensor_parallel: TensorParallel | None,
                platform: str | None) -> PoolLayout:
  """Where the heads live in the pool's last axis for a run on `platform` (each device's heads
  padded to whole TPU lanes on TPU, a plain fold elsewhere; `kvjax.models.nn.kv_cache.PoolLayout`);
  under tensor parallelism each KV head is held `kv_head_repeat` times."""
  tp = tensor_parallel
  return PoolLayout(model_config.n_kv_heads * (1 if tp is None else tp.kv_head_repeat),
                    model_config.head_dim, shards=1 if tp is None else tp.size,
                    lane_multiple=pool_lane_multiple(platform))


class PagedModelRunner:
  """Holds the model state and the paged pool on the device; runs one ragged step.

  Args:
    model: the model.
    config: pool and step sizes.
    tensor_parallel: a `tp` mesh (`kvjax.models.runner.sharding`; docs/design/scale-out.md): parameters sharded
      Megatron-style, the pool by KV head, the step one GSPMD program with attention per shard.
      None (default): one device, no mesh (the program of a single-device run).
    device: with no `tensor_parallel`, the one device (default `jax.devices()[0]`).
    abstract: build the programs only, for devices this process may not have (TPU topology
      devices from `jax.experimental.topologies`, `scripts/compile_check.py`): the model may be
      abstract (`nnx.eval_shape`), no array is placed or allocated, and only `aot_programs`
      is usable.
    platform: the target platform ("cpu" | "tpu" | "cuda"); None (default): the devices'.
      Given, it must be theirs, except for an abstract runner, whose programs are then lowered
      for that platform with `jax.export` (CUDA programs built on a machine with no GPU).

  The kernels are chosen for the platform of the devices the programs compile for
  (`platform`: "cpu", "tpu" or "cuda"), not for the host: Pallas kernels for TPU and CUDA, the
  jnp references for CPU.

  Raises:
    ValueError: `max_seq_len` beyond the model's context.
  """

  def __init__(self, model: Llama, config: PagedRunnerConfig,
               tensor_parallel: TensorParallel | None = None, *, device=None,
               abstract: bool = False, platform: str | None = None):
    kwarg_platform = platform if platform is None else resolve_platform(platform)
    self.model_config = model.cfg
    self.config = config
    self.dtype = model.dtype
    #: The sizes and argument checks shared with the fake runner.
    self.geometry = geo = RunnerGeometry.of(config, model.cfg)
    self.max_seq_len, self.block_size, self.buckets = (geo.max_seq_len, geo.block_size,
                                                       geo.buckets)
    graphdef, self.state = nnx.split(model)
    self._graphdef = graphdef  # for the layer-group programs (`_layerwise`)
    self._lw: LayerwisePrograms | None = None
    self._cache_dtype = config.cache_dtype or model.dtype
    self.tp = tp = tensor_parallel
    self.abstract = bool(abstract)
    #: The devices the programs compile for, and their platform ("cpu" | "tpu" | "cuda"): it
    #: picks every kernel (attention, codecs), whatever the host is.
    self.devices = (list(tp.mesh.devices.flat) if tp is not None
                    else [device if device is not None else jax.devices()[0]])
    self.platform = platform = platform_of(self.devices)
    if platform is not None and kwarg_platform not in (None, platform):
      if not self.abstract:
        raise ValueError(f"platform={kwarg_platform!r} for {platform} devices: only an "
                         "abstract runner lowers for another platform")
      self.platform = platform = kwarg_platform
    self._device = None if tp is not None else device
    #: Multi-host (docs/design/scale-out.md): process 0 sends every device call to the other processes.
    self._channel = (multihost.Channel() if tp is not None and jax.process_count() > 1
                     and not self.abstract else None)
    #: r: copies of each KV head in the pool (tensor parallelism over more devices than heads).
    self.kv_head_repeat = r = 1 if tp is None else tp.kv_head_repeat
    self.pool_layout = pool_layout(model.cfg, tp, platform)
    if self.abstract:
      shardings = (tp.state_shardings(self.state) if tp is not None else
                   jax.tree_util.tree_map(lambda _: self._single, self.state))
      self.state = jax.tree_util.tree_map(
          lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), self.state,
          shardings)
    elif tp is not None:
      self.state = jax.tree_util.tree_map(put, self.state, tp.state_shardings(self.state))
    elif device is not None:
      self.state = jax.device_put(self.state, device)
    self.pool = self._new_pool()
    impl = config.attention_impl
    mesh = None if tp is None else tp.mesh

    def step(state, pool, tokens, positions, slots, tables, lens, qsl, num_seqs, logit_rows):
      if tp is None:
        return nnx.merge(graphdef, state).ragged_step(
            pool, tokens, positions, slots, tables, lens, qsl, num_seqs, logit_rows,
            attention_impl=impl, platform=platform)
      return nnx.merge(graphdef, state).ragged_step(
          pool, tokens, positions, slots, tables, lens, qsl, num_seqs, logit_rows,
          attention_impl=impl, kv_head_repeat=r, tp_mesh=mesh, platform=platform)

    if tp is None:
      self._step = jax.jit(step, donate_argnums=(1,))
    else:
      rep_, pool_sh, kv_sh = tp.replicated, self._pool_shardings(), tp.kv_out_sharding
      self._step = jax.jit(
          step, donate_argnums=(1,),
          in_shardings=(tp.state_shardings(self.state), pool_sh) + (rep_,) * 8,
          out_shardings=(rep_, pool_sh, kv_sh, kv_sh))
    self._inv_freq = (jnp.asarray(rope_inv_freq(model.cfg)) if self.abstract
                      else model.inv_freq[...])
    self.use_pallas_codecs = platform != "cpu"
    #: On the CPU backend a step's outputs are returned as numpy arrays (device memory is host
    #: memory there): trimming the padding and cutting each request's rows out of jax arrays
    #: ran one eager XLA op per new shape, and nearly every step has new shapes (its token
    #: count), so each compiled a few small programs first (50-150 ms each on the 2-core VM; a
    #: session hit's one-step prefill paid several). Numpy slices compile nothing.
    self.host_outputs = platform == "cpu"

    def insert_raw(pool, kv_L2CKH, block_ids, start):
      c = kv_L2CKH.shape[2]
      positions_1C = (start + jnp.arange(c, dtype=jnp.int32))[None]
      k_LCKH = apply_rope(kv_L2CKH[:, 0], positions_1C, self._inv_freq)
      return write_chunk_blocks(pool, k_LCKH, kv_L2CKH[:, 1], block_ids)

    def read_pre_rope(pool, block_ids, start):
      # One copy of each KV head (a pool repeating heads r times keeps every r-th).
      k, v = read_pool_blocks(pool, block_ids, r)
      n = k.shape[1]
      positions_1N = (start + jnp.arange(n, dtype=jnp.int32))[None]
      return apply_rope(k, positions_1N, self._inv_freq, inverse=True), v

    def copy_blocks(pool, src_R, dst_R):
      return dataclasses.replace(pool, k_LPBF=pool.k_LPBF.at[:, dst_R].set(pool.k_LPBF[:, src_R]),
                                 v_LPBF=pool.v_LPBF.at[:, dst_R].set(pool.v_LPBF[:, src_R]))

    if tp is None:
      self._read_pre_rope = jax.jit(read_pre_rope)
      self._insert = jax.jit(insert_raw, donate_argnums=(0,))
      self._copy = jax.jit(copy_blocks, donate_argnums=(0,))
    else:
      rep_, pool_sh, kv_sh = tp.replicated, self._pool_shardings(), tp.kv_out_sharding
      self._read_pre_rope = jax.jit(read_pre_rope, out_shardings=(kv_sh, kv_sh))
      self._insert = jax.jit(insert_raw, donate_argnums=(0,),
                             in_shardings=(pool_sh, tp.chunk_sharding, rep_, rep_),
                             out_shardings=pool_sh)
      self._copy = jax.jit(copy_blocks, donate_argnums=(0,),
                           in_shardings=(pool_sh, rep_, rep_), out_shardings=pool_sh)
    #: The codec programs and the kvtc transform (`kvjax.models.runner.codec_programs`).
    self._codecs = RunnerCodecs(model.cfg, self._inv_freq, platform=platform, tp=tp,
                                kv_head_repeat=r,
                                pool_shardings=None if tp is None else self._pool_shardings())
    self._compiled: set[int] = set()
    #: Token-layers run and skipped (`layer_counts`); replaced, never mutated.
    self._counts = LayerCounts()

  def _pool_shardings(self):
    sh = self.tp.pool_sharding
    return PagedKVCache(sh, sh, self.pool_layout)

  @property
  def _single(self):
    """The one device's sharding (no `tp`)."""
    return jax.sharding.SingleDeviceSharding(self.devices[0])

  def _new_pool(self) -> PagedKVCache:
    """A zeroed pool `[L, P, B, F]` (`pool_layout`): on one device, or sharded by head group
    over `tp` (each device zero-fills its own heads; no host copy). Abstract runner: the pool's
    ShapeDtypeStructs."""
    cfg, cdt, layout = self.model_config, self._cache_dtype, self.pool_layout
    if self.abstract:
      shape = paged_pool_shape(cfg.n_layers, self.config.num_blocks, self.block_size, layout)
      sh = self._single if self.tp is None else self.tp.pool_sharding
      sds = jax.ShapeDtypeStruct(shape, cdt, sharding=sh)
      return PagedKVCache(sds, sds, layout)
    new = lambda: init_paged_kv_cache(cfg, self.config.num_blocks, self.block_size, cdt, layout)
    if self.tp is None:
      if self._device is not None:
        return jax.jit(new, out_shardings=self._single)()
      return new()
    return jax.jit(new, out_shardings=self._pool_shardings())()

  @property
  def tensor_parallel_size(self) -> int:
    return 1 if self.tp is None else self.tp.size

  # ----------------------------------------------------------------------------- sizes
  @property
  def chunk_sizes(self) -> tuple[int, ...]:
    return self.geometry.chunk_sizes

  @property
  def max_chunk_size(self) -> int:
    return self.geometry.max_chunk_size

  @property
  def num_blocks(self) -> int:
    return self.geometry.num_blocks

  @property
  def max_blocks_per_seq(self) -> int:
    return self.geometry.max_blocks_per_seq

  @property
  def kv_dtype(self):
    return jnp.dtype(self._cache_dtype)

  def bucket_for(self, num_tokens: int) -> int:
    """Smallest compiled token count holding `num_tokens`.

    Raises:
      ValueError: `num_tokens` outside [1, max_num_batched_tokens].
    """
    return self.geometry.bucket_for(num_tokens)

  def is_compiled(self, num_tokens: int) -> bool:
    """Whether a step of `num_tokens` tokens runs an already compiled program."""
    return self.bucket_for(num_tokens) in self._compiled

  # ----------------------------------------------------------------------------- compute
  def step(self, seqs: Sequence[SeqChunk]) -> StepOutput:
    """Runs every sequence's tokens in one jit call; writes their K/V into their blocks.

    A sequence may appear more than once (two chunks of one prompt); a later entry sees the
    earlier entries' tokens, since every layer writes all tokens before attending. A piece with
    `num_layers` runs to full depth in this one call (exact: its layers `[k, L)` equal the
    stored ones within float rounding; `step_begin` stops it at k).

    Args:
      seqs: the step's sequences, decodes and prefill chunks, at least one.

    Returns:
      `StepOutput` (device arrays, padding trimmed). The runner keeps the updated pool.

    Raises:
      ValueError: no sequences, too many tokens or sequences for the compiled sizes, or a block
        table that does not cover a sequence's positions.
    """
    p = pack_step(self.geometry, seqs)
    logits, k_pre, v = self._device_step(*p.arrays, p.rows)
    self._compiled.add(p.bucket)
    self._count(p.n_tokens * self.model_config.n_layers)
    return self._output(logits, k_pre, v, len(seqs), p.n_tokens, p.offsets)

  def step_all_logits(self, seqs: Sequence[SeqChunk]) -> StepOutput:
    """`step`, with the logits of EVERY token instead of each sequence's last: `logits_SV` is
    f32[T, V], rows as `k_pre_rope_LTKH`'s (`offsets[s]` is sequence s's first). For scoring a
    text (teacher-forced perplexity in benchmarks, tests); compiles its own program per token
    bucket (the step's program with T logit rows).

    Raises:
      ValueError: as `step`.
    """
    p = pack_step(self.geometry, seqs)
    logits, k_pre, v = self._device_step(*p.arrays, np.arange(p.bucket, dtype=np.int32))
    self._count(p.n_tokens * self.model_config.n_layers)
    return self._output(logits, k_pre, v, p.n_tokens, p.n_tokens, p.offsets)

  def _output(self, logits, k_pre, v, n_seqs: int, n_tokens: int, offsets) -> StepOutput:
    """The step's `StepOutput`, padding trimmed (numpy views with `host_outputs`)."""
    if self.host_outputs:
      logits, k_pre, v = np.asarray(logits), np.asarray(k_pre), np.asarray(v)
    return StepOutput(logits_SV=logits[:n_seqs], k_pre_rope_LTKH=k_pre[:, :n_tokens],
                      v_LTKH=v[:, :n_tokens], offsets=offsets)

  def _device_step(self, *host):
    """The jit'd step on host inputs (sent to every process first when multi-host); outputs
    host arrays when multi-host (process 0 reads them without another collective)."""
    if self._channel is not None:
      host = self._channel.send(multihost.STEP, *host)
    logits, self.pool, k_pre, v = self._step(self.state, self.pool, *host)
    if self._channel is not None:
      return np.asarray(logits), np.asarray(k_pre), np.asarray(v)
    return logits, k_pre, v

  def _device_insert(self, kv_L2CKH, ids, start) -> None:
    if self._channel is not None:
      kv_L2CKH, ids, start = self._channel.send(multihost.INSERT, kv_L2CKH, ids, start)
    if self.tp is not None:
      kv_L2CKH = self._place_chunk(kv_L2CKH)
    self.pool = self._insert(self.pool, kv_L2CKH, ids, start)

  def _place_chunk(self, kv_L2CKH) -> jax.Array:
    """Tensor parallel: a whole stored chunk placed by head. The chunk stays whole in the
    store; each device receives only its pool heads (a KV head repeated r times on the host
    first when the pool repeats heads)."""
    host = np.asarray(kv_L2CKH)
    if self.kv_head_repeat > 1:
      host = np.repeat(host, self.kv_head_repeat, axis=3)
    return put(host, self.tp.chunk_sharding)

  def _device_read(self, ids, start):
    if self._channel is not None:
      ids, start = self._channel.send(multihost.READ, ids, start)
    k, v = self._read_pre_rope(self.pool, ids, start)
    if self._channel is not None:
      return np.asarray(k), np.asarray(v)
    return k, v

  def device_seam(self) -> JaxDeviceSeam:
    """The KV connector's way to this runner's device: puts, gets and the rANS entropy decoder
    built for `platform` (`kvjax.models.runner.device_seam.JaxDeviceSeam`)."""
    return JaxDeviceSeam(self.platform)

  @property
  def is_follower(self) -> bool:
    """Multi-host, a process other than 0: it runs `follow()`, not the engine."""
    return self._channel is not None and not self._channel.is_leader

  def follow(self) -> None:
    """A process other than 0 (multi-host): runs every device call process 0 sends, in order,
    until process 0 closes its runner; then closes this one.

    Raises:
      RuntimeError: on process 0 or in a single-process run.
    """
    if not self.is_follower:
      raise RuntimeError("follow() runs on processes other than 0 of a multi-host run")
    ch = self._channel
    while True:
      op, arrays = ch.receive()
      if op == multihost.STEP:
        _, self.pool, _, _ = self._step(self.state, self.pool, *arrays)
      elif op == multihost.INSERT:
        kv, ids, start = arrays
        self.pool = self._insert(self.pool, self._place_chunk(kv), ids, start)
      elif op == multihost.READ:
        self._read_pre_rope(self.pool, *arrays)
      elif op == multihost.COPY:
        self.pool = self._copy(self.pool, *arrays)
      elif op == multihost.RESET:
        self.pool = self._new_pool()
      elif op == multihost.CLOSE:
        self._close_local()
        return
      else:
        raise RuntimeError(f"unknown multi-host opcode {op}")

  # ----------------------------------------------------------------------------- layer groups
  def _layerwise(self) -> LayerwisePrograms:
    """The layer-group programs (`kvjax.models.runner.layerwise_runner`), built at first use."""
    if self._lw is None:
      self._lw = LayerwisePrograms(self._graphdef, attention_impl=self.config.attention_impl,
                                   inv_freq=self._inv_freq, platform=self.platform,
                                   layer_names=layer_param_names(self.model_config),
                                   vocab_size=self.model_config.vocab_size)
    return self._lw

  def step_begin(self, seqs: Sequence[SeqChunk], groups: int) -> LayerwiseStep:
    """Starts a step run as `groups` layer-group calls (layer-wise pre-loading, CachedAttention
    arXiv 2403.19708 section 3.2.1): embeds the tokens. Then call `step_layers` once per group
    (inserting a stored chunk's layers `[l0, l1)` before group `(l0, l1)` runs, with
    `insert_chunk_layers`), then `step_finish`. The result equals `step(seqs)`'s (same
    per-layer computation; within float rounding of a different XLA fusion).

    A piece with `num_layers` k < L (the layer axis of Cake; k one of `layer_split_points
    (groups)`) runs groups below k only: after the group that ends at layer k the step is
    re-packed without it into the smallest token bucket holding the rest (`LayerwiseStep`),
    so the groups from k on run on fewer tokens and write none of its KV (its blocks' layers
    `[k, L)` are untouched); its logits, and its K and V from layer k on, are zeros. The other
    sequences' outputs equal those of the step without the piece (within float rounding of
    another bucket's program). Programs: those of the step's first bucket and of the re-packed
    one (the same begin / group / finish programs), no other kind.

    Args:
      seqs: as `step`.
      groups: layer groups, 1 to L (`layer_groups`).

    Raises:
      ValueError: as `step`, a bad `groups`, or a `num_layers` outside [1, L] or not a
        boundary of the groups.
    """
    n_layers = self.model_config.n_layers
    group_ranges = layer_groups(n_layers, groups)
    points = self.layer_split_points(groups)
    stops = []
    for i, s in enumerate(seqs):
      k = n_layers if s.num_layers is None else s.num_layers
      if k != n_layers and k not in points:
        raise ValueError(f"sequence {i}: num_layers={s.num_layers!r}; a step of {groups} layer "
                         f"groups stops a piece at {points} or runs all {n_layers} layers")
      stops.append(k)
    lw = self._layerwise()
    packed = pack_step(self.geometry, seqs)
    return lw.begin(self.state, packed, group_ranges, seqs=seqs, stops=stops,
                    geometry=self.geometry)

  def step_layers(self, st: LayerwiseStep) -> tuple[int, int]:
    """Runs the step's next layer group (one jit'd scan over its layers); returns its range.
    After it, the pieces that stop at its last layer leave the step (`step_begin`).

    Raises:
      ValueError: every group has run already.
    """
    self.pool, group = self._layerwise().run_group(self.state, self.pool, st,
                                                   np if self.host_outputs else jnp)
    return group

  def step_finish(self, st: LayerwiseStep) -> StepOutput:
    """Final norm and logits after the last group: the step's `StepOutput`.

    Raises:
      ValueError: some layer group has not run.
    """
    logits, k_pre, v = self._layerwise().finish(self.state, st,
                                                np if self.host_outputs else jnp)
    n_layers = self.model_config.n_layers
    skipped = sum(len(s.token_ids) * (n_layers - k) for s, k in zip(st.seqs, st.stops))
    self._count(sum(n * (l1 - l0) for l0, l1, n in st.group_rows), skipped)
    return self._output(logits, k_pre, v, st.n_seqs, st.n_tokens, st.offsets)

  def layer_split_points(self, groups: int) -> tuple[int, ...]:
    """The k at which a step of `groups` layer groups (`step_begin`) stops a `num_layers`
    piece: the groups' inner boundaries, `l0` of every group but the first (`layer_groups`).
    () under tensor parallelism, where the layer-group programs do not run. The one-call
    `step` runs every piece to full depth.

    Raises:
      ValueError: `groups` outside [1, L].
    """
    bounds = tuple(l0 for l0, _ in layer_groups(self.model_config.n_layers, groups)[1:])
    return () if self.tp is not None else bounds

  def layer_counts(self) -> LayerCounts:
    """Token-layers run and skipped by this runner's steps so far (`LayerCounts`)."""
    return self._counts

  def _count(self, run: int, skipped: int = 0) -> None:
    c = self._counts
    self._counts = LayerCounts(c.token_layers_run + run, c.token_layers_skipped + skipped)

  def step_grouped(self, seqs: Sequence[SeqChunk], groups: int) -> StepOutput:
    """`step_begin`, every `step_layers`, `step_finish`: a step in `groups` calls (a step
    holding a layer-split piece, which stops at a group boundary)."""
    st = self.step_begin(seqs, groups)
    while st.next_group < len(st.groups):
      self.step_layers(st)
    return self.step_finish(st)

  def insert_chunk_layers(self, kv_G2CKH, block_ids: Sequence[int], start: int,
                          layer_start: int) -> None:
    """Writes layers `[layer_start, layer_start + G)` of a stored chunk (K before RoPE, and V)
    into its blocks, rotating K to positions `[start, start + C)`; other layers are untouched.
    Inserting every group of a chunk writes what `insert_chunk` writes. One chunk of
    `insert_chunks_layers`.

    Args:
      kv_G2CKH: [G, 2, C, K, H] those layers of the chunk, host or device, any float dtype.
      block_ids: the C / B blocks holding those positions, in order.
      start: position of the chunk's first token, a multiple of B.
      layer_start: the first layer, `layer_start + G <= L`.

    Raises:
      ValueError: a shape that does not match the model, or blocks that do not fit the chunk.
    """
    self.insert_chunks_layers([kv_G2CKH], [block_ids], [start], layer_start)

  def insert_chunks_layers(self, kvs_G2CKH: Sequence, block_ids: Sequence[Sequence[int]],
                           starts: Sequence[int], layer_start: int) -> None:
    """`insert_chunk_layers` of several chunks of one shape, in one jit'd call per
    `LAYERWISE_INSERT_BATCH` of them (a layer group of a layer-wise step: one call instead of
    one per chunk). A batch is padded to a power of two by repeating its last chunk (the same
    rows written twice with the same values), so the programs are the powers of two up to the
    batch per shape, which `warmup_layer_inserts` compiles.

    Args:
      kvs_G2CKH: chunks, each [G, 2, C, K, H], one shape, host or device, any float dtype.
      block_ids: per chunk, the C / B blocks holding its positions, in order.
      starts: per chunk, the position of its first token, a multiple of B.
      layer_start: the first layer, `layer_start + G <= L`.

    Raises:
      ValueError: no chunks, lists of different lengths, chunks of different shapes, a shape
        that does not match the model, or blocks that do not fit a chunk.
    """
    ids = self.geometry.check_layer_chunks(self.model_config,
                                           [tuple(kv.shape) for kv in kvs_G2CKH], block_ids,
                                           starts, layer_start)
    self.pool = self._layerwise().insert(self.pool, kvs_G2CKH, ids, starts, layer_start)

  def warmup_layer_inserts(self, kv_L2CKH, block_ids: Sequence[int], groups: int) -> None:
    """Compiles `insert_chunks_layers`' programs for chunks of `kv_L2CKH`'s shape: every group
    size of `layer_groups(L, groups)` and every padded batch size. Writes `kv_L2CKH`'s first
    layers into `block_ids` at position 0 (free blocks, at warmup)."""
    sizes = {l1 - l0 for l0, l1 in layer_groups(self.model_config.n_layers, groups)}
    for g in sorted(sizes):
      n = 1
      while n <= LAYERWISE_INSERT_BATCH:
        self.insert_chunks_layers([kv_L2CKH[:g]] * n, [block_ids] * n, [0] * n, 0)
        n *= 2

  def warmup_layerwise(self, groups: int) -> None:
    """Compiles the layer-group programs of every token bucket (`step_begin`, each group size
    of `layer_groups(L, groups)`, `step_finish`). Writes nothing (every slot is padding)."""
    self.pool = self._layerwise().warmup(self.state, self.pool, self.geometry,
                                         self.model_config.n_layers, groups)

  # ----------------------------------------------------------------------------- KV in and out
  def insert_chunk(self, kv_L2CKH, block_ids: Sequence[int], start: int) -> None:
    """Writes a stored chunk (K before RoPE, and V) into its blocks, rotating K to positions
    `[start, start + C)`.

    Args:
      kv_L2CKH: [L, 2, C, K, H] host or device array, any float dtype; C a multiple of B.
      block_ids: the C / B blocks holding those positions, in order.
      start: position of the chunk's first token, a multiple of B.

    Raises:
      ValueError: a shape that does not match the model, or blocks that do not fit the chunk.
    """
    cfg = self.model_config
    want = (cfg.n_layers, 2, kv_L2CKH.shape[2], cfg.n_kv_heads, cfg.head_dim)
    if tuple(kv_L2CKH.shape) != want:
      raise ValueError(f"chunk of shape {tuple(kv_L2CKH.shape)}, model wants {want}")
    ids = self.geometry.check_chunk(kv_L2CKH.shape[2], block_ids, start)
    if self.tp is None:
      self.pool = self._insert(self.pool, kv_L2CKH, ids, np.int32(start))
    else:
      self._device_insert(kv_L2CKH, ids, np.int32(start))

  def copy_blocks(self, src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
    """Copies whole pool blocks `src_ids[i]` -> `dst_ids[i]` (every layer's K after RoPE and V,
    as stored: bit for bit), in one jit'd call. The lists are padded to a power of two by
    repeating the last pair (the same block written twice with the same values), so the
    programs are the powers of two up to the longest list.

    Raises:
      ValueError: see `RunnerGeometry.check_copy`.
    """
    src, dst = self.geometry.check_copy(src_ids, dst_ids)
    if not len(src):
      return
    pad = (1 << (len(src) - 1).bit_length()) - len(src)
    src, dst = np.pad(src, (0, pad), mode="edge"), np.pad(dst, (0, pad), mode="edge")
    if self._channel is not None:
      src, dst = self._channel.send(multihost.COPY, src, dst)
    self.pool = self._copy(self.pool, src, dst)

  def insert_payload(self, codec: str, arrays, block_ids: Sequence[int], start: int) -> None:
    """Decodes a stored chunk's payload (`kv_codec.kv_decode`: dequantize, RoPE K at
    `[start, start + C)`) and writes it into its blocks, in one jit'd call.

    Args:
      codec: "raw", "int8", "int4", "cachegen" or "kvtc" (needs `set_kvtc_transform`; the
        payload's `transform_id` must be this runner's transform).
      arrays: the payload's arrays by name (`kv_codec.payload_from_arrays`,
        `kvtc.payload_from_arrays`).
      block_ids: the C / B blocks of the chunk, in order.
      start: position of the chunk's first token, a multiple of B.

    Raises:
      ValueError: a payload that does not match the model, or blocks that do not fit it, or a
        kvtc payload without this runner's transform.
    """
    if self._channel is not None:
      raise ValueError("multi-host runs store raw chunks only (kv_codec='raw')")
    self.pool = self._codecs.insert(self.pool, codec, arrays, self.geometry, block_ids, start)

  def read_pre_rope(self, block_ids: Sequence[int], start: int, n: int) -> tuple[jax.Array,
                                                                                 jax.Array]:
    """K before RoPE and V of positions `[start, start + n)` held in the pool (a sequence's
    device-resident prefix, e.g. a device hit the request never computed itself), for saving
    them to the store. K is recovered by the inverse rotation, so it equals the K before RoPE
    the model computed within float32 rounding (about 1e-7 relative), not bit for bit.

    Args:
      block_ids: the blocks holding those positions, in order (the first holds `start`).
      start: the first position, a multiple of the block size.
      n: how many positions, 1 to `len(block_ids) * B`.

    Returns:
      ([L, n, K, H] K before RoPE, [L, n, K, H] V) in the pool's dtype: device arrays, numpy
      arrays with `host_outputs` (the CPU backend).

    Raises:
      ValueError: `start` not block-aligned, or `n` outside the blocks given.
    """
    b = self.block_size
    ids = self.geometry.check_read(block_ids, start, n)
    # One program per whole chunk's worth of blocks, not one per block count: a session
    # tail's read-back (1 to C / B blocks) would otherwise compile on the engine thread at
    # its first turn of each length. The padding blocks repeat the last one; their rows are
    # read and dropped.
    per_chunk = max(1, self.max_chunk_size // b)
    padded = -(-len(ids) // per_chunk) * per_chunk
    ids = np.concatenate([ids, np.full(padded - len(ids), ids[-1], np.int32)])
    k, v = self._device_read(ids, np.int32(start))
    if self.host_outputs:
      k, v = np.asarray(k), np.asarray(v)
    return k[:, :n], v[:, :n]

  def read_blocks(self, block_ids: Sequence[int]) -> tuple[jax.Array, jax.Array]:
    """The K (after RoPE) and V of some blocks: ([L, n * B, K, H], [L, n * B, K, H]) (tests)."""
    return read_pool_blocks(self.pool, np.asarray(block_ids, np.int32), self.kv_head_repeat)

  def encode_levels(self, kv_L2CKH, codec: str, levels: tuple[int, ...], start: int) -> list:
    """Quantizes one device chunk (K before RoPE) at every level in one jit'd device call.

    Thread-safe (no pool access). Dispatches asynchronously: the arrays stay on the device
    until the saver copies them to the host (once, for all levels).

    Args:
      kv_L2CKH: [L, 2, C, K, H] device (or host) array.
      codec: a codec other than "raw"; "kvtc" needs `set_kvtc_transform`.
      levels: the levels to store side by side.
      start: position of the chunk's first token (kvtc codes the first tokens of a sequence
        finer; the chunk must be decoded at the same position).

    Returns:
      [(codec, level, {name: device array}, finite flag)] per level; store a level only when its
      flag is True (no NaN/inf).

    Raises:
      ValueError: an unknown codec or level, kvtc without a transform, or a multi-host run.
    """
    if self._channel is not None:
      raise ValueError("multi-host runs store raw chunks only (kv_codec='raw')")
    return self._codecs.encode_levels(kv_L2CKH, codec, levels, start)

  # ----------------------------------------------------------------------------- kvtc
  def set_kvtc_transform(self, transform: kvtc.KVTCTransform) -> None:
    """Sets the model's kvtc transform (`kvjax.models.loading.kv_calibration`), used by the "kvtc"
    codec's encode (`encode_levels`) and payload insert (`insert_payload`). One device only
    (no `tensor_parallel`, no multi-host).

    Raises:
      ValueError: a transform of another model shape, or a tensor-parallel runner.
    """
    self._codecs.set_kvtc_transform(transform)

  @property
  def kvtc_transform(self) -> kvtc.KVTCTransform | None:
    """The kvtc transform set by `set_kvtc_transform`, or None."""
    return self._codecs.kvtc_transform

  # ----------------------------------------------------------------------------- AOT
  def _sds(self, shape, dtype=jnp.int32, sharding=None) -> jax.ShapeDtypeStruct:
    """An argument's ShapeDtypeStruct placed as the runner places host inputs (replicated)."""
    if sharding is None:
      sharding = self._single if self.tp is None else self.tp.replicated
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sharding)

  def _abstract(self, tree):
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)

  def aot_programs(self, *, chunk_tokens: int | None = None, codecs: Sequence[str] = (
      "raw", "int8", "int4", "cachegen"), buckets: Sequence[int] | None = None,
                   groups: int | None = None) -> list[tuple[str, object, tuple]]:
    """Every program the engine runs on this runner, as `(name, jitted function, abstract
    arguments)`: `fn.lower(*args).compile()` compiles it for the runner's devices (a real or
    an abstract runner; for TPU topology devices, trace inside
    `jax.sharding.use_abstract_mesh` of their mesh so Pallas TPU kernels see the target chip).

    Programs: the step at each token bucket; the raw chunk insert; per codec the payload
    insert (`kv_codec.kv_decode` + block write; kvtc's `kvtc_insert_program`, one device only)
    and the encode of every level; the pre-RoPE read; with `groups` (one device only), the
    layer-group programs of layer-wise loading.

    Args:
      chunk_tokens: the stored chunk's tokens C (default the largest chunk size).
      codecs: the codecs whose insert and encode programs to include.
      buckets: the token buckets of the step (default all of `buckets`).
      groups: layer groups of the layer-wise step; None: none of its programs.
    """
    cfg, b = self.model_config, self.block_size
    c = chunk_tokens or self.max_chunk_size
    r, kh = self.kv_head_repeat, cfg.n_kv_heads
    state, pool = self._abstract(self.state), self._abstract(self.pool)
    i = self._sds
    step_args = lambda t: step_arg_specs(self.geometry, t, i(()).sharding)  # noqa: E731
    chunk_sh = None if self.tp is None else self.tp.chunk_sharding
    out = []
    for t in (buckets or self.buckets):
      out.append((f"step[T={t}]", self._step, (state, pool) + step_args(t)))
    out.append((f"insert_raw[C={c}]", self._insert,
                (pool, i((cfg.n_layers, 2, c, kh * r, cfg.head_dim), self.dtype, chunk_sh),
                 i((c // b,)), i(()))))
    out.append((f"read_pre_rope[C={c}]", self._read_pre_rope, (pool, i((c // b,)), i(()))))
    out += self._codecs.aot_programs(pool, chunk_tokens=c, block_size=b, codec_names=codecs,
                                     dtype=self.dtype, sds=i)
    if groups is not None and self.tp is None:
      out += self._layerwise().aot_programs(
          state, pool, model_config=cfg, geometry=self.geometry, dtype=self.dtype,
          buckets=buckets or self.buckets, groups=groups, chunk_tokens=c, sds=i,
          step_args=step_args)
    return out

  # ----------------------------------------------------------------------------- lifetime
  def reset(self) -> None:
    """Zeroes the pool, keeping the compiled programs (the scheduler must forget its blocks)."""
    if self._channel is not None:
      self._channel.send(multihost.RESET)
    self.pool = self._new_pool()

  def block_until_ready(self) -> None:
    jax.block_until_ready(self.pool)

  def kv_cache_nbytes(self) -> int:
    """Device bytes the pool's K and V buffers take (reserved whole at construction), over all
    devices of the mesh (a repeated KV head counts once per copy)."""
    return int(self.pool.nbytes)

  def kv_block_nbytes(self) -> int:
    """Device bytes of one pool block over all layers, K and V."""
    return self.kv_cache_nbytes() // self.num_blocks

  def cache_ok(self) -> bool:
    """The pool's buffers are alive (a failed donated call can leave them deleted)."""
    return not self.pool.k_LPBF.is_deleted()

  def close(self) -> None:
    """Frees the parameters and the pool on the device; the runner is unusable afterwards.
    Multi-host: process 0's close also ends the other processes' `follow()`."""
    if self._channel is not None and self._channel.is_leader:
      self._channel.send(multihost.CLOSE)
    self._close_local()

  def _close_local(self) -> None:
    for leaf in jax.tree_util.tree_leaves((self.state, self.pool)):
      if isinstance(leaf, jax.Array) and not leaf.is_deleted():
        leaf.delete()

  def warmup(self, buckets: Sequence[int] | None = None) -> None:
    """Compiles every token bucket of the step (`buckets`: these only). Writes nothing (every
    slot is padding)."""
    for t in self.buckets if buckets is None else buckets:
      # No real sequence (num_seqs = 0, every slot -1): compiles the bucket, writes nothing.
      arrays, rows = padding_step(self.geometry, t)
      logits, _, _ = self._device_step(*arrays, rows)
      jax.block_until_ready(logits)
      self._compiled.add(t)
