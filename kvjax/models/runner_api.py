"""The model runner interface the engine executes plans on (`kvjax.engine.engine.Engine`).

Like JetStream's engine API, a runner is a device behind plain calls on plain records: the
scheduler's `KVCacheManager` owns which pool block belongs to whom and hands the engine block
tables; the engine hands a runner sequences and chunks, and gets back numbers:

    step([SeqChunk(tokens, start, block_ids), ...])  ->  StepOutput(logits per sequence,
                                                                    K before RoPE and V per token)
    step_begin / step_layers / step_finish           the same step, layer group by layer group
    insert_chunk(kv_L2CKH, block_ids, start)         a stored raw chunk (K before RoPE) -> blocks
    insert_chunks_layers(kvs, block_ids, starts, l0) some layers of several raw chunks -> blocks
    insert_payload(codec, arrays, block_ids, start)  a stored encoded chunk -> blocks
    read_pre_rope(block_ids, start, n)               blocks -> K before RoPE and V (for saving)
    encode_levels(kv_L2CKH, codec, levels, start)    a chunk -> its payload at each level

Two runners implement it: `kvjax.models.paged_runner.PagedModelRunner` (the model, jit'd) and
`kvjax.testing.fake_runner.FakeRunner` (numpy, deterministic, for tests of everything above the
model). The records (`SeqChunk`, `StepOutput`, `PagedRunnerConfig`) are the paged runner's.

Axes: L layers, T tokens of a step, S sequences of a step, V vocabulary, C tokens of a chunk,
K key/value heads, H head width, B tokens of a block.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

from kvjax.models.config import LlamaConfig
from kvjax.models.paged_runner import PagedRunnerConfig, SeqChunk, StepOutput

__all__ = ["LayerwiseHandle", "PagedRunnerConfig", "Runner", "SeqChunk", "StepOutput"]


class LayerwiseHandle(Protocol):
  """A step in progress, run layer group by layer group (`Runner.step_begin`).

  Attributes:
    groups: the layer ranges `(l0, l1)`, in order (`kvjax.models.paged_runner.layer_groups`).
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
      `kvjax.kernels.platform`); the store client builds its device decoders for it.
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
    """Decodes a stored chunk's payload of `codec` (arrays by name, `kvjax.storage.codecs`)
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
