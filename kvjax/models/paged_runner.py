"""The JIT boundary of the paged KV layout: a model plus its block pool behind ONE jit'd step.

Issue 11. The pool `[L, P, B, F]` (`kvjax.models.kv_cache.PagedKVCache`, heads folded into F) is
shared by every sequence; the scheduler's `KVCacheManager` owns which block belongs to whom and
hands the engine plain block tables each step. A step runs every decode and every planned prefill
chunk in one call (`Llama.ragged_step`): their tokens are flattened and padded to the smallest
compiled token count (`token_buckets`), the sequences to a fixed count per bucket, so compiles
stay few:

    step([SeqChunk(tokens, start, block_ids), ...])   ->  StepOutput(logits per sequence,
                                                                     pre-RoPE K and V per token)

Stored chunks (a whole number of blocks, `kv_chunk_size % block_size == 0`) are written into
their blocks by `insert_chunk` (raw) and `insert_payload` (any codec: `kv_codec.kv_decode`;
kvtc, `kvtc.dequantize_reference`).
Only the engine thread calls a runner (the pool is donated on every call).
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax import codecs as codec_registry
from kvjax.kernels import kv_codec, kvtc
from kvjax.kernels.platform import platform_of, resolve_platform
from kvjax.models.kv_cache import (PagedKVCache, PoolLayout, init_paged_kv_cache,
                                   paged_block_nbytes, paged_pool_shape, pool_lane_multiple,
                                   read_pool_blocks, write_chunk_blocks, write_layer_blocks)
from kvjax.models.layers import apply_rope, rope_inv_freq
from kvjax.models.llama import (LAYER_PARAMS, Llama, ragged_embed, ragged_layers,
                                ragged_logits)
from kvjax.models.codec_programs import level_encoder
from kvjax.models import multihost
from kvjax.models.sharding import TensorParallel, put

#: Compiled prefill chunk sizes by default, tokens, ascending.
DEFAULT_CHUNK_SIZES = (16, 32, 64, 128, 256, 512)
#: Default pool size on CPU, bytes; accelerators size it from the compiled step
#: (`fit_num_blocks`).
DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30
#: Fraction of an accelerator's free memory the pool takes by default when the device reports
#: its memory but the step's needs cannot be measured (vLLM's `gpu_memory_utilization`).
DEFAULT_ACCELERATOR_MEMORY_FRACTION = 0.8
#: Share of an accelerator's memory the default pool size leaves unused beyond what the compiled
#: step needs (allocator fragmentation, host transfers, programs other than the step).
DEFAULT_ACCELERATOR_MEMORY_MARGIN = 0.05
#: Pool sizes (blocks) of the two step compiles `fit_num_blocks` measures (multiples of 128, so
#: the block axis never changes the pool's tiled layout between them).
PROBE_NUM_BLOCKS = (128, 256)
#: Smallest compiled token count of a step.
MIN_TOKEN_BUCKET = 8
#: Chunks one layer-wise insert call writes at most (`PagedModelRunner.insert_chunks_layers`);
#: batches are padded to powers of two up to it.
LAYERWISE_INSERT_BATCH = 8


def token_buckets(max_tokens: int) -> tuple[int, ...]:
  """Compiled token counts of a step: powers of two from `MIN_TOKEN_BUCKET`, and `max_tokens`.

  Raises:
    ValueError: `max_tokens` < 1.
  """
  if max_tokens < 1:
    raise ValueError(f"max_tokens={max_tokens} must be >= 1")
  out, b = [], MIN_TOKEN_BUCKET
  while b < max_tokens:
    out.append(b)
    b *= 2
  out.append(max_tokens)
  return tuple(out)


def default_kv_cache_bytes(cpu_need_bytes: int | None = None) -> int:
  """The pool size when none is given, bytes: on CPU `min(2 GiB, cpu_need_bytes)`, else 80% of
  the device's free memory.

  `cpu_need_bytes` is what every sequence at full length needs (`build_paged_runner`:
  `max_num_seqs` x `max_model_len`): on CPU the pool is host memory that each `LLM` zero-fills
  at construction, so a small configuration (the tiny test model, a short `max_model_len`) gets
  no more than its sequences can use, and a process with several
  engines (the test suite) is not charged 2 GiB each. Falls back to the CPU default when the
  device reports no memory statistics.
  """
  if jax.default_backend() == "cpu":
    if cpu_need_bytes is not None:
      return min(DEFAULT_CPU_KV_CACHE_BYTES, cpu_need_bytes)
    return DEFAULT_CPU_KV_CACHE_BYTES
  stats = jax.devices()[0].memory_stats() or {}
  limit, used = stats.get("bytes_limit"), stats.get("bytes_in_use", 0)
  if not limit:
    return DEFAULT_CPU_KV_CACHE_BYTES
  return int((limit - used) * DEFAULT_ACCELERATOR_MEMORY_FRACTION)


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
  """A compiled program's memory, bytes per device (XLA's `memory_analysis()`), at a pool of
  `num_blocks` blocks.

  Attributes:
    num_blocks: the pool's blocks in the program measured.
    argument_bytes, output_bytes, alias_bytes, temp_bytes, generated_code_bytes: as XLA
      reports them (alias: outputs sharing a donated argument's buffer).
  """

  num_blocks: int
  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int
  generated_code_bytes: int = 0

  @property
  def peak_bytes(self) -> int:
    """Live at once: arguments, outputs not aliased to a donated argument, temporaries, code."""
    return (self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes
            + self.generated_code_bytes)

  @classmethod
  def of(cls, compiled, num_blocks: int) -> "ProgramMemory":
    """From a `jax.stages.Compiled`.

    Raises:
      ValueError: the backend reports no memory analysis.
    """
    ma = compiled.memory_analysis()
    if ma is None:
      raise ValueError("this backend reports no memory analysis")
    return cls(num_blocks, int(ma.argument_size_in_bytes), int(ma.output_size_in_bytes),
               int(ma.alias_size_in_bytes), int(ma.temp_size_in_bytes),
               int(ma.generated_code_size_in_bytes))


def pool_blocks_for_memory(device_bytes: int, small: ProgramMemory, large: ProgramMemory, *,
                           in_use_bytes: int = 0,
                           margin: float = DEFAULT_ACCELERATOR_MEMORY_MARGIN) -> int:
  """The most pool blocks with which the step fits a device, from the step compiled at two
  pool sizes: its peak is `fixed + per_block * num_blocks` (weights, activations, code; the
  pool and whatever scales with it), fitted through the two measurements, and must stay under
  `device_bytes * (1 - margin) - in_use_bytes`.

  Args:
    device_bytes: the device's memory (per device: every figure is per device).
    small, large: the step's memory at two pool sizes (`large.num_blocks > small.num_blocks`).
    in_use_bytes: memory the step's arguments do not account for (other buffers, other
      programs' weights).
    margin: share of `device_bytes` left unused.

  Raises:
    ValueError: bad probes, or not even one block fits.
  """
  if large.num_blocks <= small.num_blocks:
    raise ValueError(f"probes at {small.num_blocks} and {large.num_blocks} blocks: want two "
                     "sizes, the second larger")
  per_block = (large.peak_bytes - small.peak_bytes) / (large.num_blocks - small.num_blocks)
  if per_block <= 0:
    raise ValueError(f"the step's memory does not grow with the pool ({small.peak_bytes} bytes "
                     f"at {small.num_blocks} blocks, {large.peak_bytes} at {large.num_blocks})")
  fixed = small.peak_bytes - per_block * small.num_blocks
  budget = device_bytes * (1.0 - margin) - in_use_bytes - fixed
  blocks = int(budget // per_block)
  if blocks < 1:
    raise ValueError(f"the step needs {fixed / 2**30:.2f} GiB besides the pool and "
                     f"{per_block / 2**20:.2f} MiB per block; the device has "
                     f"{device_bytes / 2**30:.2f} GiB ({in_use_bytes / 2**30:.2f} GiB in use, "
                     f"{margin:.0%} margin): no room for a pool")
  return blocks


@dataclasses.dataclass(frozen=True)
class PagedRunnerConfig:
  """Device-side sizes of the paged layout.

  Attributes:
    num_blocks: P, blocks in the pool.
    block_size: B, tokens per block.
    max_num_seqs: running sequences at most (decodes per step).
    max_num_batched_tokens: tokens per step at most (decodes count one each).
    max_seq_len: tokens per sequence; None means the model's context.
    chunk_sizes: the scheduler's prefill chunk sizes, ascending (they bound how many chunks a
      step can hold).
    cache_dtype: pool dtype; None means the compute dtype.
    attention_impl: `paged_attention` implementation; None picks the backend's (jnp reference
      on CPU, Pallas kernels on GPU and TPU).
  """

  num_blocks: int
  block_size: int = 16
  max_num_seqs: int = 4
  max_num_batched_tokens: int = 512
  max_seq_len: int | None = None
  chunk_sizes: tuple[int, ...] = DEFAULT_CHUNK_SIZES
  cache_dtype: object = None
  attention_impl: str | None = None

  def __post_init__(self):
    for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{name}={v!r} must be a positive int")
    if not self.chunk_sizes or list(self.chunk_sizes) != sorted(set(self.chunk_sizes)) or (
        self.chunk_sizes[0] <= 0):
      raise ValueError(f"chunk_sizes must be ascending positive ints, got {self.chunk_sizes}")

  @property
  def num_slots(self) -> int:
    """Running sequences at most (the scheduler's `SchedulerConfig.num_slots`)."""
    return self.max_num_seqs


@dataclasses.dataclass(frozen=True)
class SeqChunk:
  """One sequence's tokens in a step: `token_ids` at positions `[start, start + n)`.

  Attributes:
    token_ids: the tokens (1 for a decode).
    start: position of the first.
    block_ids: the sequence's block table, covering at least `start + n` positions.
  """

  token_ids: Sequence[int]
  start: int
  block_ids: Sequence[int]


def layer_groups(num_layers: int, groups: int) -> tuple[tuple[int, int], ...]:
  """Splits layers `[0, num_layers)` into `groups` contiguous ranges `(l0, l1)`, in order, of
  at most two sizes (`ceil(L / G)` first, then one smaller), so at most two group programs
  compile per token bucket.

  Raises:
    ValueError: `groups` outside [1, num_layers].
  """
  if isinstance(groups, bool) or not isinstance(groups, int) or not 1 <= groups <= num_layers:
    raise ValueError(f"layer groups={groups!r} must be an int in [1, {num_layers}]")
  size = -(-num_layers // groups)
  big = num_layers - groups * (size - 1)  # groups of `size`; the rest have size - 1
  out, l0 = [], 0
  for g in range(groups):
    n = size if g < big else size - 1
    out.append((l0, l0 + n))
    l0 += n
  return tuple(out)


@dataclasses.dataclass
class LayerwiseStep:
  """A ragged step in progress, run layer group by layer group (`PagedModelRunner.step_begin`).

  Attributes:
    groups: the layer ranges `(l0, l1)`, in order.
    next_group: the index of the group `step_layers` runs next.
    n_seqs: the step's sequences; n_tokens: its real tokens; offsets: first row of each.
  """

  groups: tuple[tuple[int, int], ...]
  n_seqs: int
  n_tokens: int
  offsets: tuple[int, ...]
  arrays: tuple = ()
  x: object = None
  rows: object = None
  k_pre: list = dataclasses.field(default_factory=list)
  v: list = dataclasses.field(default_factory=list)
  next_group: int = 0
  bucket: int = 0


@dataclasses.dataclass(frozen=True)
class StepOutput:
  """What one ragged step returns: device arrays, or numpy arrays on the CPU backend
  (`PagedModelRunner.host_outputs`).

  Attributes:
    logits_SV: f32[S, V] next-token logits at each sequence's last token, in input order.
    k_pre_rope_LTKH: [L, T, K, H] keys BEFORE RoPE of the step's tokens, sequences in input
      order (padding trimmed); `offsets[s]` is sequence s's first row.
    v_LTKH: [L, T, K, H] values, same rows.
    offsets: first row of each sequence in T.
  """

  logits_SV: jax.Array
  k_pre_rope_LTKH: jax.Array
  v_LTKH: jax.Array
  offsets: tuple[int, ...]


class PagedModelRunner:
  """Holds the model state and the paged pool on the device; runs one ragged step.

  Args:
    model: the model.
    config: pool and step sizes.
    tensor_parallel: a `tp` mesh (`kvjax.models.sharding`; docs/design/scale-out.md): parameters sharded
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
    max_seq_len = config.max_seq_len or model.cfg.max_seq_len
    if max_seq_len > model.cfg.max_seq_len:
      raise ValueError(f"max_seq_len={max_seq_len} exceeds the model's context "
                       f"{model.cfg.max_seq_len}")
    self.max_seq_len = max_seq_len
    self.block_size = config.block_size
    self.max_blocks_per_seq = -(-max_seq_len // config.block_size)
    self.buckets = token_buckets(config.max_num_batched_tokens)
    # A step holds each running decode plus the prefill chunks the budget allows: every chunk
    # but a request's last is at least the smallest chunk size.
    self.max_step_seqs = (2 * config.max_num_seqs
                          + config.max_num_batched_tokens // config.chunk_sizes[0] + 1)
    graphdef, self.state = nnx.split(model)
    self._graphdef = graphdef  # for the layer-group programs (`_layerwise_jits`)
    self._lw_jits: dict | None = None
    self._lw_params: dict[tuple[int, int], dict] = {}
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
    #: Where the heads live in the pool's last axis: each device's heads padded to whole TPU
    #: lanes on TPU, a plain fold elsewhere (`kvjax.models.kv_cache.PoolLayout`).
    self.pool_layout = PoolLayout(model.cfg.n_kv_heads * r, model.cfg.head_dim,
                                  shards=1 if tp is None else tp.size,
                                  lane_multiple=pool_lane_multiple(platform))
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
    use_pallas = self.use_pallas_codecs

    def insert_raw(pool, kv_L2CKH, block_ids, start):
      c = kv_L2CKH.shape[2]
      positions_1C = (start + jnp.arange(c, dtype=jnp.int32))[None]
      k_LCKH = apply_rope(kv_L2CKH[:, 0], positions_1C, self._inv_freq)
      return write_chunk_blocks(pool, k_LCKH, kv_L2CKH[:, 1], block_ids)

    def insert_payload(pool, payload, block_ids, cos_CH, sin_CH):
      cfg = self.model_config
      c = cos_CH.shape[0]
      scratch = jnp.zeros((cfg.n_layers, 1, c, cfg.n_kv_heads, cfg.head_dim), jnp.float32)
      k, v = kv_codec.kv_decode(payload, scratch, scratch, 0, 0, cos_CH, sin_CH,
                                use_pallas=use_pallas, platform=platform)
      return write_chunk_blocks(pool, k[:, 0], v[:, 0], block_ids)

    def read_pre_rope(pool, block_ids, start):
      # One copy of each KV head (a pool repeating heads r times keeps every r-th).
      k, v = read_pool_blocks(pool, block_ids, r)
      n = k.shape[1]
      positions_1N = (start + jnp.arange(n, dtype=jnp.int32))[None]
      return apply_rope(k, positions_1N, self._inv_freq, inverse=True), v

    def insert_payload_sharded(pool, payload, block_ids, cos_CH, sin_CH):
      # The codec kernel per shard: each device decodes its own heads of the payload (placed
      # by head, repeated r times on the host when the pool repeats heads).
      from jax.sharding import PartitionSpec as P  # noqa: PLC0415
      heads5, heads4 = P(None, None, None, "tp", None), P(None, None, "tp", None)

      def per_shard(payload, cos_CH, sin_CH):
        l_, k_ = payload[0].shape[0], payload[0].shape[3]  # every payload's [L, 2, *, K, *]
        c, h_ = cos_CH.shape
        scratch = jnp.zeros((l_, 1, c, k_, h_), jnp.float32)
        k, v = kv_codec.kv_decode(payload, scratch, scratch, 0, 0, cos_CH, sin_CH,
                                  use_pallas=use_pallas, platform=platform)
        return k[:, 0], v[:, 0]

      specs = type(payload)(*(heads5 if x.ndim == 5 else heads4 for x in payload))
      k, v = jax.shard_map(per_shard, mesh=tp.mesh, in_specs=(specs, P(), P()),
                           out_specs=(heads4, heads4), check_vma=False)(payload, cos_CH, sin_CH)
      return write_chunk_blocks(pool, k, v, block_ids)

    if tp is None:
      self._read_pre_rope = jax.jit(read_pre_rope)
      self._insert = jax.jit(insert_raw, donate_argnums=(0,))
      self._insert_payload = jax.jit(insert_payload, donate_argnums=(0,))
    else:
      rep_, pool_sh, kv_sh = tp.replicated, self._pool_shardings(), tp.kv_out_sharding
      self._read_pre_rope = jax.jit(read_pre_rope, out_shardings=(kv_sh, kv_sh))
      self._insert = jax.jit(insert_raw, donate_argnums=(0,),
                             in_shardings=(pool_sh, tp.chunk_sharding, rep_, rep_),
                             out_shardings=pool_sh)
      self._insert_payload = jax.jit(insert_payload_sharded, donate_argnums=(0,),
                                     out_shardings=pool_sh)
    self._compiled: set[int] = set()
    #: The kvtc codec's transform and its device copy and insert program (`set_kvtc_transform`).
    self.kvtc_transform: kvtc.KVTCTransform | None = None
    self._kvtc_device: kvtc.KVTCDeviceTransform | None = None
    self._kvtc_insert = None

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
    return self.config.chunk_sizes

  @property
  def max_chunk_size(self) -> int:
    return self.config.chunk_sizes[-1]

  @property
  def num_blocks(self) -> int:
    return self.config.num_blocks

  @property
  def kv_dtype(self):
    return jnp.dtype(self._cache_dtype)

  @staticmethod
  def blocks_for_bytes(model_config, block_size: int, nbytes: int, dtype,
                       layout: PoolLayout | None = None) -> int:
    """Pool blocks that fit in `nbytes` (K and V of every layer, in `layout`: its padding
    counts), at least 1."""
    return max(1, int(nbytes) // paged_block_nbytes(model_config, block_size, dtype, layout))

  def bucket_for(self, num_tokens: int) -> int:
    """Smallest compiled token count holding `num_tokens`.

    Raises:
      ValueError: `num_tokens` outside [1, max_num_batched_tokens].
    """
    if not 1 <= num_tokens <= self.buckets[-1]:
      raise ValueError(f"a step of {num_tokens} tokens; compiled sizes go from 1 to "
                       f"{self.buckets[-1]} (max_num_batched_tokens)")
    return self.buckets[bisect.bisect_left(self.buckets, num_tokens)]

  def is_compiled(self, num_tokens: int) -> bool:
    """Whether a step of `num_tokens` tokens runs an already compiled program."""
    return self.bucket_for(num_tokens) in self._compiled

  # ----------------------------------------------------------------------------- compute
  def step(self, seqs: Sequence[SeqChunk]) -> StepOutput:
    """Runs every sequence's tokens in one jit call; writes their K/V into their blocks.

    A sequence may appear more than once (two chunks of one prompt); a later entry sees the
    earlier entries' tokens, since every layer writes all tokens before attending.

    Args:
      seqs: the step's sequences, decodes and prefill chunks, at least one.

    Returns:
      `StepOutput` (device arrays, padding trimmed). The runner keeps the updated pool.

    Raises:
      ValueError: no sequences, too many tokens or sequences for the compiled sizes, or a block
        table that does not cover a sequence's positions.
    """
    t, n_tokens, arrays, (rows, offsets) = self._pack(seqs)
    logits, k_pre, v = self._device_step(*arrays, rows)
    self._compiled.add(t)
    return self._output(logits, k_pre, v, len(seqs), n_tokens, offsets)

  def step_all_logits(self, seqs: Sequence[SeqChunk]) -> StepOutput:
    """`step`, with the logits of EVERY token instead of each sequence's last: `logits_SV` is
    f32[T, V], rows as `k_pre_rope_LTKH`'s (`offsets[s]` is sequence s's first). For scoring a
    text (teacher-forced perplexity in benchmarks, tests); compiles its own program per token
    bucket (the step's program with T logit rows).

    Raises:
      ValueError: as `step`.
    """
    t, n_tokens, arrays, (_, offsets) = self._pack(seqs)
    logits, k_pre, v = self._device_step(*arrays, np.arange(t, dtype=np.int32))
    return self._output(logits, k_pre, v, n_tokens, n_tokens, offsets)

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
      elif op == multihost.RESET:
        self.pool = self._new_pool()
      elif op == multihost.CLOSE:
        self._close_local()
        return
      else:
        raise RuntimeError(f"unknown multi-host opcode {op}")

  # ----------------------------------------------------------------------------- layer groups
  def _pack(self, seqs: Sequence[SeqChunk]):
    """The step's padded arrays (as `step` builds them): (bucket, arrays, rows, offsets)."""
    if not seqs:
      raise ValueError("a step needs at least one sequence")
    b = self.block_size
    n_tokens = sum(len(s.token_ids) for s in seqs)
    t = self.bucket_for(n_tokens)
    s_max = min(t, self.max_step_seqs)
    if len(seqs) > s_max:
      raise ValueError(f"{len(seqs)} sequences in a step of {t} tokens; at most {s_max}")
    m = self.max_blocks_per_seq
    tokens = np.zeros(t, np.int32)
    positions = np.zeros(t, np.int32)
    slots = np.full(t, -1, np.int32)
    tables = np.zeros((s_max, m), np.int32)
    lens = np.zeros(s_max, np.int32)
    qsl = np.zeros(s_max + 1, np.int32)
    rows = np.zeros(s_max, np.int32)
    offsets = []
    o = 0
    for i, s in enumerate(seqs):
      n = len(s.token_ids)
      end = s.start + n
      ids = np.asarray(s.block_ids, np.int32)
      if n < 1 or s.start < 0 or end > self.max_seq_len or -(-end // b) > len(ids):
        raise ValueError(f"sequence {i}: positions [{s.start}, {end}) with {len(ids)} blocks of "
                         f"{b} (max_seq_len {self.max_seq_len})")
      pos = np.arange(s.start, end, dtype=np.int32)
      tokens[o:o + n] = s.token_ids
      positions[o:o + n] = pos
      slots[o:o + n] = ids[pos // b] * b + pos % b
      tables[i, :len(ids)] = ids
      lens[i] = end
      offsets.append(o)
      o += n
      qsl[i + 1] = o
      rows[i] = o - 1
    qsl[len(seqs) + 1:] = o
    return t, n_tokens, (tokens, positions, slots, tables, lens, qsl, np.int32(len(seqs))), (
        rows, tuple(offsets))

  def step_begin(self, seqs: Sequence[SeqChunk], groups: int) -> LayerwiseStep:
    """Starts a step run as `groups` layer-group calls (layer-wise pre-loading, CachedAttention
    arXiv 2403.19708 section 3.2.1): embeds the tokens. Then call `step_layers` once per group
    (inserting a stored chunk's layers `[l0, l1)` before group `(l0, l1)` runs, with
    `insert_chunk_layers`), then `step_finish`. The result equals `step(seqs)`'s (same
    per-layer computation; within float rounding of a different XLA fusion).

    Args:
      seqs: as `step`.
      groups: layer groups, 1 to L (`layer_groups`).

    Raises:
      ValueError: as `step`, or a bad `groups`.
    """
    fns = self._layerwise_jits()
    t, n_tokens, arrays, (rows, offsets) = self._pack(seqs)
    x = fns["begin"](self.state, arrays[0])
    return LayerwiseStep(groups=layer_groups(self.model_config.n_layers, groups),
                         n_seqs=len(seqs), n_tokens=n_tokens, offsets=offsets, arrays=arrays,
                         x=x, rows=rows, bucket=t)

  def step_layers(self, st: LayerwiseStep) -> tuple[int, int]:
    """Runs the step's next layer group (one jit'd scan over its layers); returns its range.

    Raises:
      ValueError: every group has run already.
    """
    if st.next_group >= len(st.groups):
      raise ValueError(f"all {len(st.groups)} layer groups of this step have run")
    l0, l1 = st.groups[st.next_group]
    fn = self._layerwise_jits()["layers"](l1 - l0)
    st.x, self.pool, k_pre, v = fn(self.state, self._group_params(l0, l1), self.pool, st.x,
                                   *st.arrays[1:], np.int32(l0))
    st.k_pre.append(k_pre)
    st.v.append(v)
    st.next_group += 1
    return l0, l1

  def step_finish(self, st: LayerwiseStep) -> StepOutput:
    """Final norm and logits after the last group: the step's `StepOutput`.

    Raises:
      ValueError: some layer group has not run.
    """
    if st.next_group != len(st.groups):
      raise ValueError(f"{st.next_group} of {len(st.groups)} layer groups have run")
    logits = self._layerwise_jits()["finish"](self.state, st.x, st.rows)
    xp = np if self.host_outputs else jnp
    k_pre = xp.concatenate(st.k_pre, axis=0) if len(st.k_pre) > 1 else st.k_pre[0]
    v = xp.concatenate(st.v, axis=0) if len(st.v) > 1 else st.v[0]
    return self._output(logits, k_pre, v, st.n_seqs, st.n_tokens, st.offsets)

  def step_grouped(self, seqs: Sequence[SeqChunk], groups: int) -> StepOutput:
    """`step_begin`, every `step_layers`, `step_finish`: a step in `groups` calls (tests,
    benchmarks of the split's cost)."""
    st = self.step_begin(seqs, groups)
    while st.next_group < len(st.groups):
      self.step_layers(st)
    return self.step_finish(st)

  def _layerwise_jits(self) -> dict:
    if self._lw_jits is not None:
      return self._lw_jits
    graphdef = self._graphdef
    impl = self.config.attention_impl
    inv_freq = self._inv_freq
    platform = self.platform

    def begin(state, tokens):
      return ragged_embed(nnx.merge(graphdef, state), tokens)

    def finish(state, x, rows):
      return ragged_logits(nnx.merge(graphdef, state), x, rows)

    per_size: dict[int, object] = {}

    def layers(n: int):
      if n not in per_size:
        def run(state, params, pool, x, positions, slots, tables, lens, qsl, num_seqs, l0):
          return ragged_layers(nnx.merge(graphdef, state), pool, x, positions, slots, tables,
                               lens, qsl, num_seqs, l0, num_layers=n, attention_impl=impl,
                               group_params=params, platform=platform)
        per_size[n] = jax.jit(run, donate_argnums=(2,))
      return per_size[n]

    def insert_layers(pool, pieces, block_ids_nR, starts_n, l0):
      kv_nG2CKH = jnp.stack(pieces)
      n, g, _, c = kv_nG2CKH.shape[:4]
      positions_nC = starts_n[:, None] + jnp.arange(c, dtype=jnp.int32)[None]
      k = jax.vmap(lambda x, p: apply_rope(x, p[None], inv_freq))(kv_nG2CKH[:, :, 0],
                                                                  positions_nC)
      return write_layer_blocks(pool, k, kv_nG2CKH[:, :, 1], block_ids_nR, l0)

    jits = {"begin": jax.jit(begin), "finish": jax.jit(finish), "layers": layers,
            "insert": jax.jit(insert_layers, donate_argnums=(0,))}
    self._lw_jits = jits
    return jits

  def _group_params(self, l0: int, l1: int) -> dict:
    """Layers `[l0, l1)`'s stacked parameters as their own device arrays (sliced once, then
    kept: a group's copy of the weights; the whole model's for every group)."""
    key = (l0, l1)
    if key not in self._lw_params:
      layers_state = self.state["layers"]
      self._lw_params[key] = {name: jnp.asarray(layers_state[name][...][l0:l1])
                              for name in LAYER_PARAMS}
    return self._lw_params[key]

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
    cfg = self.model_config
    n = len(kvs_G2CKH)
    if not n or len(block_ids) != n or len(starts) != n:
      raise ValueError(f"{n} chunks, {len(block_ids)} block lists and {len(starts)} starts: "
                       "want one of each per chunk, at least one")
    shape = tuple(kvs_G2CKH[0].shape)
    g = shape[0]
    want = (g, 2, shape[2], cfg.n_kv_heads, cfg.head_dim)
    if shape != want or not 0 <= layer_start <= cfg.n_layers - g or g < 1:
      raise ValueError(f"layers [{layer_start}, {layer_start + g}) of shape {shape}; the model "
                       f"wants {want} within {cfg.n_layers} layers")
    if any(tuple(kv.shape) != shape for kv in kvs_G2CKH):
      raise ValueError(f"chunks of shapes {sorted({tuple(kv.shape) for kv in kvs_G2CKH})}: "
                       "one call inserts chunks of one shape")
    ids = [self._check_chunk(shape[2], b, s) for b, s in zip(block_ids, starts)]
    fn = self._layerwise_jits()["insert"]
    for lo in range(0, n, LAYERWISE_INSERT_BATCH):
      hi = min(lo + LAYERWISE_INSERT_BATCH, n)
      pad = (1 << (hi - lo - 1).bit_length()) - (hi - lo)
      idx = list(range(lo, hi)) + [hi - 1] * pad
      self.pool = fn(self.pool, tuple(kvs_G2CKH[i] for i in idx),
                     np.stack([ids[i] for i in idx]),
                     np.asarray([starts[i] for i in idx], np.int32), np.int32(layer_start))

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

  def _check_chunk(self, c: int, block_ids: Sequence[int], start: int) -> np.ndarray:
    b = self.block_size
    ids = np.asarray(block_ids, np.int32)
    if c % b or start % b or len(ids) != c // b or start + c > self.max_seq_len or (
        np.any((ids < 0) | (ids >= self.num_blocks))):
      raise ValueError(f"a chunk of {c} tokens at position {start} needs {c // b} whole blocks "
                       f"of {b} inside the pool of {self.num_blocks}, got {ids.tolist()}")
    return ids

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
    ids = self._check_chunk(kv_L2CKH.shape[2], block_ids, start)
    if self.tp is None:
      self.pool = self._insert(self.pool, kv_L2CKH, ids, np.int32(start))
    else:
      self._device_insert(kv_L2CKH, ids, np.int32(start))

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
    if codec == codec_registry.KVTC:
      self._insert_kvtc(arrays, block_ids, start)
      return
    payload = kv_codec.payload_from_arrays(codec, arrays)
    n_layers, c, n_kv_heads, head_dim = kv_codec.validate_payload(payload)
    cfg = self.model_config
    if (n_layers, n_kv_heads, head_dim) != (cfg.n_layers, cfg.n_kv_heads, cfg.head_dim):
      raise ValueError(f"payload for L={n_layers}, K={n_kv_heads}, H={head_dim}; the model has "
                       f"L={cfg.n_layers}, K={cfg.n_kv_heads}, H={cfg.head_dim}")
    ids = self._check_chunk(c, block_ids, start)
    angles = (start + np.arange(c, dtype=np.float32))[:, None] * np.asarray(self._inv_freq)
    angles = np.concatenate([angles, angles], axis=-1)  # [C, H], HF rotate_half layout
    if self.tp is not None:  # each device receives its heads of every payload array
      r, heads5 = self.kv_head_repeat, self.tp.chunk_sharding
      heads4 = self.tp.sharding(jax.sharding.PartitionSpec(None, None, "tp", None))
      payload = type(payload)(*(
          put(np.repeat(np.asarray(x), r, axis=x.ndim - 2) if r > 1 else x,
              heads5 if x.ndim == 5 else heads4) for x in payload))
    self.pool = self._insert_payload(self.pool, payload, ids, np.cos(angles), np.sin(angles))

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
    ids = np.asarray(block_ids, np.int32)
    if start % b or not 1 <= n <= len(ids) * b or np.any((ids < 0) | (ids >= self.num_blocks)):
      raise ValueError(f"positions [{start}, {start + n}) from blocks {ids.tolist()} of {b} "
                       "tokens: start must be block-aligned and the blocks must cover them")
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
    t = None
    if codec == codec_registry.KVTC:
      t = self._need_kvtc()
      for level in levels:
        codec_registry.check_codec(codec, (level,))
    fn = level_encoder(codec, tuple(levels), self.use_pallas_codecs, self.platform)
    return [(codec, level, arrays, finite)
            for level, (arrays, finite) in zip(levels, fn(kv_L2CKH, t, np.int32(start)))]

  # ----------------------------------------------------------------------------- kvtc
  def set_kvtc_transform(self, transform: kvtc.KVTCTransform) -> None:
    """Sets the model's kvtc transform (`kvjax.models.kv_calibration`), used by the "kvtc"
    codec's encode (`encode_levels`) and payload insert (`insert_payload`). One device only
    (no `tensor_parallel`, no multi-host).

    Raises:
      ValueError: a transform of another model shape, or a tensor-parallel runner.
    """
    cfg = self.model_config
    if self.tp is not None:
      raise ValueError("kv_codec='kvtc' runs on one device (no tensor parallelism)")
    if (transform.num_layers, transform.num_kv_heads, transform.head_dim) != (
        cfg.n_layers, cfg.n_kv_heads, cfg.head_dim):
      raise ValueError(f"kvtc transform for L={transform.num_layers}, K={transform.num_kv_heads},"
                       f" H={transform.head_dim}; the model has L={cfg.n_layers}, "
                       f"K={cfg.n_kv_heads}, H={cfg.head_dim}")
    self.kvtc_transform = transform
    self._kvtc_device = transform.device_arrays()
    if self._kvtc_insert is None:
      inv_freq, n_kv_heads, head_dim = self._inv_freq, cfg.n_kv_heads, cfg.head_dim

      def insert_kvtc(pool, payload, t, block_ids, start):
        # Dequantize and inverse-transform at the encoder's position, RoPE K at the chunk's
        # positions (as a raw insert does), write whole blocks.
        kv = kvtc.dequantize_reference(payload, t, n_kv_heads, head_dim, start=start)
        positions_1C = (start + jnp.arange(kv.shape[2], dtype=jnp.int32))[None]
        k_LCKH = apply_rope(kv[:, 0], positions_1C, inv_freq)
        return write_chunk_blocks(pool, k_LCKH, kv[:, 1], block_ids)

      self._kvtc_insert = jax.jit(insert_kvtc, donate_argnums=(0,))

  def _need_kvtc(self) -> kvtc.KVTCDeviceTransform:
    if self._kvtc_device is None:
      raise ValueError("kv_codec 'kvtc' needs a calibrated transform (set_kvtc_transform)")
    return self._kvtc_device

  def _insert_kvtc(self, arrays, block_ids: Sequence[int], start: int) -> None:
    """`insert_payload` of a kvtc chunk: one jit'd call (dequantize, inverse transform, RoPE K,
    block write) with the pool donated.

    Raises:
      ValueError: no transform, a payload of another transform or shape, or blocks that do not
        fit the chunk.
    """
    t = self._need_kvtc()
    payload = kvtc.payload_from_arrays(arrays)
    if bytes(np.asarray(payload.transform_id)) != self.kvtc_transform.transform_id:
      raise ValueError("kvtc chunk coded with another transform than this runner's")
    _, c, _ = kvtc.validate_payload(payload, t)
    ids = self._check_chunk(c, block_ids, start)
    self.pool = self._kvtc_insert(self.pool, payload, t, ids, np.int32(start))

  # ----------------------------------------------------------------------------- AOT
  def _sds(self, shape, dtype=jnp.int32, sharding=None) -> jax.ShapeDtypeStruct:
    """An argument's ShapeDtypeStruct placed as the runner places host inputs (replicated)."""
    if sharding is None:
      sharding = self._single if self.tp is None else self.tp.replicated
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sharding)

  def _abstract(self, tree):
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)

  def _step_args(self, t: int) -> tuple:
    s_max, m = min(t, self.max_step_seqs), self.max_blocks_per_seq
    i = self._sds
    return (i((t,)), i((t,)), i((t,)), i((s_max, m)), i((s_max,)), i((s_max + 1,)), i(()),
            i((s_max,)))

  def _payload_args(self, codec: str, c: int):
    """A chunk's payload of `codec` as ShapeDtypeStructs, placed as `insert_payload` places
    it (by head under `tp`, each KV head repeated r times)."""
    cfg = self.model_config
    chunk = jax.ShapeDtypeStruct((cfg.n_layers, 2, c, cfg.n_kv_heads, cfg.head_dim),
                                 jnp.float32)
    payload = jax.eval_shape(
        lambda x: kv_codec.kv_encode(x, codec, use_pallas=False, platform="cpu")[0], chunk)
    if self.tp is None:
      return type(payload)(*(self._sds(x.shape, x.dtype) for x in payload))
    r = self.kv_head_repeat
    heads5, heads4 = self.tp.chunk_sharding, self.tp.sharding(
        jax.sharding.PartitionSpec(None, None, "tp", None))
    out = []
    for x in payload:
      shape = list(x.shape)
      shape[x.ndim - 2] *= r
      out.append(self._sds(shape, x.dtype, heads5 if x.ndim == 5 else heads4))
    return type(payload)(*out)

  def aot_programs(self, *, chunk_tokens: int | None = None, codecs: Sequence[str] = (
      "raw", "int8", "int4", "cachegen"), buckets: Sequence[int] | None = None,
                   groups: int | None = None) -> list[tuple[str, object, tuple]]:
    """Every program the engine runs on this runner, as `(name, jitted function, abstract
    arguments)`: `fn.lower(*args).compile()` compiles it for the runner's devices (a real or
    an abstract runner; for TPU topology devices, trace inside
    `jax.sharding.use_abstract_mesh` of their mesh so Pallas TPU kernels see the target chip).

    Programs: the step at each token bucket; the raw chunk insert; per codec the payload
    insert (`kv_codec.kv_decode` + block write) and the encode of every level; the pre-RoPE
    read; with `groups` (one device only), the layer-group programs of layer-wise loading.

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
    chunk_sh = None if self.tp is None else self.tp.chunk_sharding
    out = []
    for t in (buckets or self.buckets):
      out.append((f"step[T={t}]", self._step, (state, pool) + self._step_args(t)))
    out.append((f"insert_raw[C={c}]", self._insert,
                (pool, i((cfg.n_layers, 2, c, kh * r, cfg.head_dim), self.dtype, chunk_sh),
                 i((c // b,)), i(()))))
    out.append((f"read_pre_rope[C={c}]", self._read_pre_rope, (pool, i((c // b,)), i(()))))
    chunk = i((cfg.n_layers, 2, c, kh, cfg.head_dim), self.dtype)
    for codec in codecs:
      if codec != "raw" or self.tp is None:
        out.append((f"insert_payload[{codec},C={c}]", self._insert_payload,
                    (pool, self._payload_args(codec, c), i((c // b,)),
                     i((c, cfg.head_dim), jnp.float32), i((c, cfg.head_dim), jnp.float32))))
      levels = tuple(codec_registry.CODEC_LEVELS[codec])
      fn = level_encoder(codec, levels, self.use_pallas_codecs, self.platform)
      out.append((f"encode[{codec},levels={len(levels)},C={c}]", fn, (chunk, None, i(()))))
    if groups is not None and self.tp is None:
      jits = self._layerwise_jits()
      layers_state = state["layers"]
      for t in (buckets or self.buckets):
        s_max = min(t, self.max_step_seqs)
        x = i((1, t, cfg.d_model), self.dtype)
        out.append((f"layers_begin[T={t}]", jits["begin"], (state, i((t,)))))
        for n in sorted({l1 - l0 for l0, l1 in layer_groups(cfg.n_layers, groups)}):
          params = {name: i((n,) + tuple(layers_state[name].shape[1:]),
                            layers_state[name].dtype) for name in LAYER_PARAMS}
          out.append((f"layers[G={n},T={t}]", jits["layers"](n),
                      (state, params, pool, x) + self._step_args(t)[1:7] + (i(()),)))
        out.append((f"layers_finish[T={t}]", jits["finish"], (state, x, i((s_max,)))))
      g = -(-cfg.n_layers // groups)
      piece = i((g, 2, c, kh, cfg.head_dim), self.dtype)
      out.append((f"insert_layers[G={g},n={LAYERWISE_INSERT_BATCH},C={c}]", jits["insert"],
                  (pool, (piece,) * LAYERWISE_INSERT_BATCH,
                   i((LAYERWISE_INSERT_BATCH, c // b)), i((LAYERWISE_INSERT_BATCH,)), i(()))))
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

  def warmup_layerwise(self, groups: int) -> None:
    """Compiles the layer-group programs of every token bucket (`step_begin`, each group size
    of `layer_groups(L, groups)`, `step_finish`). Writes nothing (every slot is padding)."""
    fns = self._layerwise_jits()
    sizes = sorted({l1 - l0 for l0, l1 in layer_groups(self.model_config.n_layers, groups)})
    for t in self.buckets:
      s_max = min(t, self.max_step_seqs)
      arrays = (np.zeros(t, np.int32), np.zeros(t, np.int32), np.full(t, -1, np.int32),
                np.zeros((s_max, self.max_blocks_per_seq), np.int32),
                np.zeros(s_max, np.int32), np.zeros(s_max + 1, np.int32), np.int32(0))
      x = fns["begin"](self.state, arrays[0])
      todo = list(sizes)
      for l0, l1 in layer_groups(self.model_config.n_layers, groups):
        if l1 - l0 in todo:
          todo.remove(l1 - l0)
          _, self.pool, _, _ = fns["layers"](l1 - l0)(
              self.state, self._group_params(l0, l1), self.pool, x, *arrays[1:], np.int32(l0))
      jax.block_until_ready(fns["finish"](self.state, x, np.zeros(s_max, np.int32)))

  def warmup(self, buckets: Sequence[int] | None = None) -> None:
    """Compiles every token bucket of the step (`buckets`: these only). Writes nothing (every
    slot is padding)."""
    for t in self.buckets if buckets is None else buckets:
      # No real sequence (num_seqs = 0, every slot -1): compiles the bucket, writes nothing.
      s_max = min(t, self.max_step_seqs)
      logits, _, _ = self._device_step(
          np.zeros(t, np.int32), np.zeros(t, np.int32),
          np.full(t, -1, np.int32), np.zeros((s_max, self.max_blocks_per_seq), np.int32),
          np.zeros(s_max, np.int32), np.zeros(s_max + 1, np.int32), np.int32(0),
          np.zeros(s_max, np.int32))
      jax.block_until_ready(logits)
      self._compiled.add(t)


def measure_step_memory(model: Llama, config: PagedRunnerConfig,
                        tensor_parallel: TensorParallel | None = None, *, device=None,
                        num_blocks: int) -> ProgramMemory:
  """The largest step bucket's memory on the runner's devices with a pool of `num_blocks`
  blocks: compiled ahead of time (an abstract runner: nothing allocated), per device.

  Raises:
    ValueError: the backend reports no memory analysis; what compiling raises.
  """
  runner = PagedModelRunner(model, dataclasses.replace(config, num_blocks=num_blocks),
                            tensor_parallel, device=device, abstract=True)
  name, fn, args = runner.aot_programs(buckets=(runner.buckets[-1],), codecs=())[0]
  assert name.startswith("step"), name
  mesh = jax.sharding.Mesh(np.asarray(runner.devices), ("tp",))
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # the kernels see the target chip
    lowered = fn.lower(*args)
  return ProgramMemory.of(lowered.compile(), num_blocks)


def fit_num_blocks(model: Llama, config: PagedRunnerConfig,
                   tensor_parallel: TensorParallel | None = None, *, device=None,
                   device_bytes: int, in_use_bytes: int = 0,
                   margin: float = DEFAULT_ACCELERATOR_MEMORY_MARGIN) -> int:
  """The default pool size on an accelerator, in blocks: the largest step bucket compiled at
  `PROBE_NUM_BLOCKS` pool sizes (`measure_step_memory`), its peak fitted linearly in the pool
  size and held under the device's memory (`pool_blocks_for_memory`). What the compiled step
  really needs (weights, activations, the pool in its tiled layout, anything XLA copies), so
  the runner's step fits the chip it targets.

  Raises:
    ValueError: as `pool_blocks_for_memory` and `measure_step_memory`.
  """
  small, large = (measure_step_memory(model, config, tensor_parallel, device=device,
                                      num_blocks=n) for n in PROBE_NUM_BLOCKS)
  return pool_blocks_for_memory(device_bytes, small, large, in_use_bytes=in_use_bytes,
                                margin=margin)


def _state_nbytes(model: Llama) -> int:
  return sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(nnx.state(model))
             if hasattr(x, "nbytes"))


def build_paged_runner(model: Llama, *, block_size: int, kv_cache_memory_bytes: int | None,
                       max_num_seqs: int, max_num_batched_tokens: int,
                       max_seq_len: int | None, chunk_sizes: tuple[int, ...],
                       tensor_parallel: TensorParallel | None = None) -> PagedModelRunner:
  """A `PagedModelRunner` whose pool fills `kv_cache_memory_bytes` in the model's dtype
  (`bytes // block bytes` blocks in the pool's layout, at least one). Default: on CPU
  `default_kv_cache_bytes(max_num_seqs x max_seq_len tokens)`; on an accelerator what the
  compiled step leaves of the device's memory (`fit_num_blocks`), or 80% of its free memory
  when it reports no memory analysis. A request that can never fit is refused at admission.

  Raises:
    ValueError: a non-positive size.
  """
  for name, v in (("block_size", block_size), ("kv_cache_memory_bytes", kv_cache_memory_bytes)):
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
      raise ValueError(f"{name}={v!r} must be a positive int")
  config = PagedRunnerConfig(
      num_blocks=1, block_size=block_size, max_num_seqs=max_num_seqs,
      max_num_batched_tokens=max_num_batched_tokens, max_seq_len=max_seq_len,
      chunk_sizes=tuple(chunk_sizes))
  devices = (list(tensor_parallel.mesh.devices.flat) if tensor_parallel is not None
             else [jax.devices()[0]])
  platform = platform_of(devices)
  layout = PoolLayout(model.cfg.n_kv_heads * (1 if tensor_parallel is None
                                              else tensor_parallel.kv_head_repeat),
                      model.cfg.head_dim,
                      shards=1 if tensor_parallel is None else tensor_parallel.size,
                      lane_multiple=pool_lane_multiple(platform))
  nbytes, num_blocks = kv_cache_memory_bytes, None
  if nbytes is None and platform != "cpu":
    stats = devices[0].memory_stats() or {}
    if stats.get("bytes_limit"):
      # The weights already on the device are the step's arguments (counted in its peak).
      other = max(0, stats.get("bytes_in_use", 0) - _state_nbytes(model))
      try:
        num_blocks = fit_num_blocks(model, config, tensor_parallel, device=devices[0],
                                    device_bytes=int(stats["bytes_limit"]),
                                    in_use_bytes=other)
      except ValueError:
        num_blocks = None  # no memory analysis here: a share of free memory instead
  if num_blocks is None:
    if nbytes is None:
      seq_blocks = -(-(max_seq_len or model.cfg.max_seq_len) // block_size)
      nbytes = default_kv_cache_bytes(
          max_num_seqs * seq_blocks * paged_block_nbytes(model.cfg, block_size, model.dtype,
                                                         layout))
    num_blocks = PagedModelRunner.blocks_for_bytes(model.cfg, block_size, nbytes, model.dtype,
                                                   layout)
  return PagedModelRunner(model, dataclasses.replace(config, num_blocks=num_blocks),
                          tensor_parallel)
