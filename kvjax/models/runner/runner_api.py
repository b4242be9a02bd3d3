"""The model runner interface the engine executes plans on (`kvjax.engine.engine.Engine`).

Like JetStream's engine API, a runner is a device behind plain calls on plain records: the
scheduler's `KVCacheManager` owns which pool block belongs to whom and hands the engine block
tables; the engine hands a runner sequences and chunks, and gets back numbers:

    step([SeqChunk(tokens, start, block_ids), ...])  ->  StepOutput(logits per sequence,
                                                                    K before RoPE and V per token)
    step_begin / step_layers / step_finish           the same step, layer group by layer group
                                                     (a `num_layers` piece stops at a boundary)
    insert_chunk(kv_L2CKH, block_ids, start)         a stored raw chunk (K before RoPE) -> blocks
    insert_chunks_layers(kvs, block_ids, starts, l0) some layers of several raw chunks -> blocks
    insert_payload(codec, arrays, block_ids, start)  a stored encoded chunk -> blocks
    read_pre_rope(block_ids, start, n)               blocks -> K before RoPE and V (for saving)
    copy_blocks(src_ids, dst_ids)                    whole blocks -> other blocks (a fork)
    encode_levels(kv_L2CKH, codec, levels, start)    a chunk -> its payload at each level

Two runners implement it: `kvjax.models.runner.paged_runner.PagedModelRunner` (the model, jit'd) and
`kvjax.testing.fake_runner.FakeRunner` (numpy, deterministic, for tests of everything above the
model). Both take the records defined here (`PagedRunnerConfig`, `SeqChunk`, `StepOutput`) and
derive their sizes and argument checks from one `RunnerGeometry`.

Axes: L layers, T tokens of a step, S sequences of a step, V vocabulary, C tokens of a chunk,
K key/value heads, H head width, B tokens of a block.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Any, Protocol, Sequence, runtime_checkable

import jax
import numpy as np

from kvjax.models.nn.config import LlamaConfig

__all__ = ["DEFAULT_CHUNK_SIZES", "LayerCounts", "LayerwiseHandle", "PagedRunnerConfig", "Runner",
           "RunnerGeometry", "SeqChunk", "StepOutput", "layer_groups", "token_buckets"]


#: Compiled prefill chunk sizes by default, tokens, ascending.
DEFAULT_CHUNK_SIZES = (16, 32, 64, 128, 256, 512)

#: Smallest compiled token count of a step.
MIN_TOKEN_BUCKET = 8


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
    num_layers: None: the full forward. k: a piece of a chunk split along layers (the layer axis
      of Cake, `kvjax/scheduler/layer_split.py`): its forward may stop after layer k - 1; it
      must write layers `[0, k)` of its KV and must not overwrite layers `[k, L)` (the chunk's
      load writes them, before or after the step) with anything but the same values. Its
      logits and its returned K and V above layer k - 1 are unspecified. Where it stops is the
      runner's (`Runner.layer_split_points`): the fake runner after layer k - 1 in any call;
      `PagedModelRunner` in a layer-wise step (`step_begin`) whose group boundaries include
      k, while its one-call `step` runs it to full depth (exact, only not faster).
  """

  token_ids: Sequence[int]
  start: int
  block_ids: Sequence[int]
  num_layers: int | None = None


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


@dataclasses.dataclass(frozen=True)
class LayerCounts:
  """Token-layers a runner has run since it was built: plain counts, so a test can assert that
  a piece split along layers (`SeqChunk.num_layers`) ran k of L layers (exact, not timed).

  Attributes:
    token_layers_run: the sum over steps of each real token's layers run (a full-depth token
      counts L; padding rows count nothing).
    token_layers_skipped: the sum over `num_layers` pieces of their tokens times the layers
      they did not run (L - k where the runner stopped them; 0 where it ran them whole).
  """

  token_layers_run: int = 0
  token_layers_skipped: int = 0


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


@dataclasses.dataclass(frozen=True)
class RunnerGeometry:
  """The sizes a runner derives from its `PagedRunnerConfig` and the model's architecture, and
  the argument checks that only need them: one record both runners build (`RunnerGeometry.of`),
  so the paged runner and the fake agree on every size and every refusal.

  Attributes:
    num_blocks: P, blocks in the pool.
    block_size: B, tokens per block.
    max_seq_len: tokens per sequence at most (the config's, else the model's context).
    max_blocks_per_seq: blocks of a sequence of `max_seq_len` tokens (a block table's width).
    buckets: the step's compiled token counts, ascending (`token_buckets`).
    max_step_seqs: sequences a step holds at most: each running decode plus the prefill chunks
      the token budget allows (every chunk but a request's last is at least the smallest chunk
      size).
    chunk_sizes: the scheduler's prefill chunk sizes, ascending.
  """

  num_blocks: int
  block_size: int
  max_seq_len: int
  max_blocks_per_seq: int
  buckets: tuple[int, ...]
  max_step_seqs: int
  chunk_sizes: tuple[int, ...]

  @classmethod
  def of(cls, config: PagedRunnerConfig, model_config: LlamaConfig) -> "RunnerGeometry":
    """The geometry of `config` on a model of `model_config`.

    Raises:
      ValueError: `config.max_seq_len` beyond the model's context.
    """
    max_seq_len = config.max_seq_len or model_config.max_seq_len
    if max_seq_len > model_config.max_seq_len:
      raise ValueError(f"max_seq_len={max_seq_len} exceeds the model's context "
                       f"{model_config.max_seq_len}")
    return cls(num_blocks=config.num_blocks, block_size=config.block_size,
               max_seq_len=max_seq_len,
               max_blocks_per_seq=-(-max_seq_len // config.block_size),
               buckets=token_buckets(config.max_num_batched_tokens),
               max_step_seqs=(2 * config.max_num_seqs
                              + config.max_num_batched_tokens // config.chunk_sizes[0] + 1),
               chunk_sizes=tuple(config.chunk_sizes))

  @property
  def max_chunk_size(self) -> int:
    return self.chunk_sizes[-1]

  def bucket_for(self, num_tokens: int) -> int:
    """Smallest compiled token count holding `num_tokens`.

    Raises:
      ValueError: `num_tokens` outside [1, max_num_batched_tokens].
    """
    if not 1 <= num_tokens <= self.buckets[-1]:
      raise ValueError(f"a step of {num_tokens} tokens; compiled sizes go from 1 to "
                       f"{self.buckets[-1]} (max_num_batched_tokens)")
    return self.buckets[bisect.bisect_left(self.buckets, num_tokens)]

  def step_seqs(self, bucket: int) -> int:
    """S, the sequence rows of a step of `bucket` tokens (`min(bucket, max_step_seqs)`)."""
    return min(bucket, self.max_step_seqs)

  def check_step(self, seqs: Sequence[SeqChunk]) -> tuple[int, int]:
    """A step's sequence count against its compiled sizes: `(real tokens, bucket)`. Each
    sequence's positions and block table are checked by the runner.

    Raises:
      ValueError: no sequences, too many tokens, or too many sequences for the bucket.
    """
    if not seqs:
      raise ValueError("a step needs at least one sequence")
    n_tokens = sum(len(s.token_ids) for s in seqs)
    t = self.bucket_for(n_tokens)
    s_max = self.step_seqs(t)
    if len(seqs) > s_max:
      raise ValueError(f"{len(seqs)} sequences in a step of {t} tokens; at most {s_max}")
    return n_tokens, t

  def check_chunk(self, c: int, block_ids: Sequence[int], start: int) -> np.ndarray:
    """A stored chunk of `c` tokens at position `start` against its blocks: int32[c / B] ids.

    Raises:
      ValueError: `c` or `start` not a whole number of blocks, the wrong number of blocks, a
        chunk past `max_seq_len`, or a block outside the pool.
    """
    b = self.block_size
    ids = np.asarray(block_ids, np.int32)
    if c % b or start % b or len(ids) != c // b or start + c > self.max_seq_len or (
        np.any((ids < 0) | (ids >= self.num_blocks))):
      raise ValueError(f"a chunk of {c} tokens at position {start} needs {c // b} whole blocks "
                       f"of {b} inside the pool of {self.num_blocks}, got {ids.tolist()}")
    return ids

  def check_layer_chunks(self, model_config: LlamaConfig, shapes: Sequence[tuple[int, ...]],
                         block_ids: Sequence[Sequence[int]], starts: Sequence[int],
                         layer_start: int) -> list[np.ndarray]:
    """The arguments of `Runner.insert_chunks_layers` (chunks given by their shapes
    [G, 2, C, K, H]): each chunk's int32 block ids.

    Raises:
      ValueError: no chunks, lists of different lengths, chunks of different shapes, a shape
        that does not match the model, or blocks that do not fit a chunk.
    """
    n = len(shapes)
    if not n or len(block_ids) != n or len(starts) != n:
      raise ValueError(f"{n} chunks, {len(block_ids)} block lists and {len(starts)} starts: "
                       "want one of each per chunk, at least one")
    shape = tuple(shapes[0])
    g = shape[0]
    want = (g, 2, shape[2], model_config.n_kv_heads, model_config.head_dim)
    if shape != want or g < 1 or not 0 <= layer_start <= model_config.n_layers - g:
      raise ValueError(f"layers [{layer_start}, {layer_start + g}) of shape {shape}; the model "
                       f"wants {want} within {model_config.n_layers} layers")
    if any(tuple(s) != shape for s in shapes):
      raise ValueError(f"chunks of shapes {sorted({tuple(s) for s in shapes})}: "
                       "one call inserts chunks of one shape")
    return [self.check_chunk(shape[2], b, s) for b, s in zip(block_ids, starts)]

  def check_copy(self, src_ids: Sequence[int], dst_ids: Sequence[int]
                 ) -> tuple[np.ndarray, np.ndarray]:
    """`Runner.copy_blocks`' arguments: (int32 sources, int32 destinations).

    Raises:
      ValueError: lists of different lengths, a block outside the pool, or a destination that
        is also a source or given twice.
    """
    src, dst = np.asarray(src_ids, np.int32), np.asarray(dst_ids, np.int32)
    both = np.concatenate([src, dst])
    if src.shape != dst.shape or src.ndim != 1 or np.any((both < 0) | (both >= self.num_blocks)) \
        or len(set(dst.tolist())) != len(dst) or set(dst.tolist()) & set(src.tolist()):
      raise ValueError(f"copying blocks {src.tolist()} -> {dst.tolist()}: want equal lengths, "
                       f"blocks inside the pool of {self.num_blocks}, distinct destinations "
                       "that are not sources")
    return src, dst

  def check_read(self, block_ids: Sequence[int], start: int, n: int) -> np.ndarray:
    """`Runner.read_pre_rope`'s positions against its blocks: int32 ids.

    Raises:
      ValueError: `start` not block-aligned, `n` outside the blocks given, or a block outside
        the pool.
    """
    b = self.block_size
    ids = np.asarray(block_ids, np.int32)
    if start % b or not 1 <= n <= len(ids) * b or np.any((ids < 0) | (ids >= self.num_blocks)):
      raise ValueError(f"positions [{start}, {start + n}) from blocks {ids.tolist()} of {b} "
                       "tokens: start must be block-aligned and the blocks must cover them")
    return ids


class LayerwiseHandle(Protocol):
  """A step in progress, run layer group by layer group (`Runner.step_begin`).

  Attributes:
    groups: the layer ranges `(l0, l1)`, in order (`layer_groups`).
    next_group: the index of the group `step_layers` runs next.
  """

  groups: tuple[tuple[int, int], ...]
  next_group: int


@runtime_checkable
class Runner(Protocol):
  """A device that holds a paged KV pool `[L, P, B, K, H]` and runs ragged steps on it.

  Only the engine thread calls a runner. K is stored in the pool after RoPE at its position;
  every call that takes or returns K outside the pool (`StepOutput.k_pre_rope_LTKH`,
  `insert_chunk`, `insert_chunks_layers`, `read_pre_rope`, `encode_levels`) takes or returns K
  BEFORE RoPE, so a stored chunk is independent of where it is inserted.

  Attributes:
    model_config: the model's architecture (`n_layers`, `n_kv_heads`, `head_dim`,
      `vocab_size` are read).
    config: the pool and step sizes (`PagedRunnerConfig`; `num_slots`,
      `max_num_batched_tokens` are read).
    max_seq_len: tokens per sequence at most.
    block_size: B, tokens per pool block.
    num_blocks: P, blocks in the pool.
    chunk_sizes: the scheduler's prefill chunk sizes, ascending.
    max_chunk_size: the largest of them.
    buckets: the step's compiled token counts, ascending.
    platform: the platform the programs are built for ("cpu" | "tpu" | "cuda",
      `kvjax.kernels.platform`); its `device_seam()` decodes for it.
  """

  model_config: LlamaConfig
  config: PagedRunnerConfig
  max_seq_len: int
  block_size: int
  buckets: tuple[int, ...]
  platform: str

  @property
  def num_blocks(self) -> int: ...

  @property
  def chunk_sizes(self) -> tuple[int, ...]: ...

  @property
  def max_chunk_size(self) -> int: ...

  # --------------------------------------------------------------------------- sizes
  def bucket_for(self, num_tokens: int) -> int:
    """The smallest compiled token count holding `num_tokens` (ValueError outside
    [1, max_num_batched_tokens])."""
    ...

  def is_compiled(self, num_tokens: int) -> bool:
    """Whether a step of `num_tokens` tokens runs an already compiled program."""
    ...

  def kv_cache_nbytes(self) -> int:
    """Bytes the pool's K and V buffers take."""
    ...

  def kv_block_nbytes(self) -> int:
    """Bytes of one pool block over all layers, K and V."""
    ...

  def cache_ok(self) -> bool:
    """The pool's buffers are alive (a failed donated call can leave them deleted)."""
    ...

  # --------------------------------------------------------------------------- compute
  def step(self, seqs: Sequence[SeqChunk]) -> StepOutput:
    """Runs every sequence's tokens; writes their K (after RoPE) and V into their blocks.

    Returns:
      `StepOutput`: f32[S, V] logits at each sequence's last token, [L, T, K, H] K before RoPE
      and V of every token (sequences in order, `offsets[s]` the first row of sequence s).

    Raises:
      ValueError: no sequences, too many tokens or sequences, or a block table that does not
        cover a sequence's positions.
    """
    ...

  def step_begin(self, seqs: Sequence[SeqChunk], groups: int) -> LayerwiseHandle:
    """Starts `step(seqs)` as `groups` layer-group calls (layer-wise pre-loading, CachedAttention
    arXiv 2403.19708 section 3.2.1)."""
    ...

  def step_layers(self, st: LayerwiseHandle) -> tuple[int, int]:
    """Runs the step's next layer group; returns its range `(l0, l1)`."""
    ...

  def step_finish(self, st: LayerwiseHandle) -> StepOutput:
    """The step's `StepOutput` once every group has run."""
    ...

  def step_grouped(self, seqs: Sequence[SeqChunk], groups: int) -> StepOutput:
    """`step_begin`, every `step_layers`, `step_finish`: a step in `groups` layer-group calls
    with nothing between them (a step holding a layer-split piece)."""
    ...

  def layer_split_points(self, groups: int) -> tuple[int, ...]:
    """The layer counts k in `[1, L)` at which a step begun with `groups` layer groups
    (`step_begin`) stops a `SeqChunk.num_layers` piece (the layer axis of Cake; the engine
    offers the planner these, `LoadConfig.layer_split_points`); () where it stops none."""
    ...

  # --------------------------------------------------------------------------- KV in and out
  def insert_chunk(self, kv_L2CKH: Any, block_ids: Sequence[int], start: int) -> None:
    """Writes a raw chunk [L, 2, C, K, H] (K before RoPE) into its C / B blocks, K rotated to
    positions `[start, start + C)` (`start` a multiple of B)."""
    ...

  def insert_chunks_layers(self, kvs_G2CKH: Sequence[Any], block_ids: Sequence[Sequence[int]],
                           starts: Sequence[int], layer_start: int) -> None:
    """Writes layers `[layer_start, layer_start + G)` of several raw chunks of one shape
    [G, 2, C, K, H] into their blocks (other layers untouched)."""
    ...

  def insert_payload(self, codec: str, arrays: Any, block_ids: Sequence[int],
                     start: int) -> None:
    """Decodes a stored chunk's payload of `codec` (arrays by name, `kvjax.storage.format.codecs`)
    and writes it into its blocks, K rotated to `[start, start + C)`."""
    ...

  def read_pre_rope(self, block_ids: Sequence[int], start: int, n: int) -> tuple[Any, Any]:
    """([L, n, K, H] K before RoPE, [L, n, K, H] V) of positions `[start, start + n)` held in
    `block_ids` (`start` a multiple of B)."""
    ...

  def encode_levels(self, kv_L2CKH: Any, codec: str, levels: tuple[int, ...],
                    start: int) -> list:
    """A chunk's payload at every level: `[(codec, level, {name: array}, finite flag)]`."""
    ...

  def copy_blocks(self, src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
    """Copies whole blocks, every layer's K and V as stored (no RoPE round trip: bit for bit),
    `src_ids[i]` -> `dst_ids[i]`: a sequence forked from another gets its own copy of the
    partly filled last block (`SchedulerOutput.forks`)."""
    ...

  def device_seam(self) -> Any:
    """The KV connector's way to this runner's device (`kvjax.connector.device.DeviceSeam`:
    host -> device puts, device -> host gets, entropy decode, device bytes), built for
    `platform`; the store client is given it (`KVStoreClient(device=)`)."""
    ...

  # --------------------------------------------------------------------------- lifetime
  def warmup(self, buckets: Sequence[int] | None = None) -> None:
    """Compiles the step at every token bucket (`buckets`: these only); writes nothing."""
    ...

  def block_until_ready(self) -> None:
    """Waits for the device work queued so far."""
    ...

  def reset(self) -> None:
    """Zeroes the pool (the scheduler must forget its blocks)."""
    ...

  def close(self) -> None:
    """Frees the device state; the runner is unusable afterwards."""
    ...
