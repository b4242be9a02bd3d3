"""The layer-wise step of the paged runner: a ragged step run layer group by layer group, and the
batched insert of some layers of stored chunks between the groups (layer-wise pre-loading,
CachedAttention arXiv 2403.19708 section 3.2.1; docs/design/layerwise.md). A piece of a chunk
split along layers (Cake's layer axis, CacheFlow arXiv 2604.25080; docs/design/cake.md) leaves
the step after the group that ends at its layer k (`LayerwiseStep`: partial depth).

`LayerwisePrograms` holds the jit'd programs and each group's parameter slices; it owns no pool:
every call takes the runner's pool and returns the new one, and
`kvjax.models.runner.paged_runner.PagedModelRunner` (which owns the pool and the model state) delegates
`step_begin` / `step_layers` / `step_finish` / `insert_chunks_layers` to it.

Axes: L layers, G layers of a group, T tokens of a step, S sequences of a step, C tokens of a
chunk, K key/value heads, H head width, B tokens of a block, D model width.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.models.nn.config import LlamaConfig
from kvjax.models.nn.kv_cache import write_layer_blocks
from kvjax.models.nn.layers import apply_rope
from kvjax.models.nn.llama import ragged_embed, ragged_layers, ragged_logits
from kvjax.models.runner.runner_api import RunnerGeometry, SeqChunk, layer_groups
from kvjax.models.runner.step_inputs import PackedStep, pack_step, padding_step

#: Chunks one layer-wise insert call writes at most (`PagedModelRunner.insert_chunks_layers`);
#: batches are padded to powers of two up to it.
LAYERWISE_INSERT_BATCH = 8


def _take_rows(a, rows, *, axis: int, xp=np):
  """`a`'s entries `rows` along `axis`, zeros where a row is -1 (a re-pack's gather), with
  `xp` numpy or jax.numpy.

  Args:
    a: an array; rows: int32[R], rows of `a` along `axis`, or -1.

  Returns:
    `a` with R rows along `axis`.
  """
  got = xp.take(a, xp.maximum(rows, 0), axis=axis)
  shape = [1] * a.ndim
  shape[axis] = -1
  return xp.where(xp.reshape(rows >= 0, shape), got, xp.zeros((), a.dtype))


#: `_take_rows` on the device: one compiled program per shape, not an eager op per step.
_take_rows_jit = jax.jit(functools.partial(_take_rows, xp=jnp), static_argnames=("axis",))


def gather_rows(a, rows: np.ndarray, axis: int, xp):
  """`_take_rows` in numpy (host outputs, the CPU backend: nothing compiles) or on the device."""
  if xp is np:
    return _take_rows(np.asarray(a), rows, axis=axis)
  return _take_rows_jit(a, rows, axis=axis)


@dataclasses.dataclass
class LayerwiseStep:
  """A ragged step in progress, run layer group by layer group (`PagedModelRunner.step_begin`).

  A sequence that stops early (`SeqChunk.num_layers` k, a boundary of `groups`) leaves the step
  after the group that ends at layer k: the others are re-packed into the smallest token bucket
  that holds them (their hidden states gathered, their rows and logit rows remapped), so the
  groups from k on run on fewer rows and write no KV of the stopped piece:

      rows (bucket T0)        group (0, k)        re-pack          group (k, L)   (bucket T1)
      [ a a a | s s s s | d ] ------------> gather a, d ------> [ a a a | d | pad ]
                                            (s stopped at k)

  Attributes:
    groups: the layer ranges `(l0, l1)`, in order.
    next_group: the index of the group `step_layers` runs next.
    n_seqs: the step's sequences; n_tokens: its real tokens; offsets: first row of each, all
      as packed at `step_begin` (the outputs keep that order).
    bucket: the current packing's token bucket (T0 until a re-pack).
    seqs: the step's sequences; stops: the layer each stops at (L: the full forward).
    live: the sequences the current packing holds, in order (() once every one has stopped).
    token_rows: int32[T0], each first-packing row's row in the current packing (-1: stopped
      or padding); None while the packing is the first.
    group_token_rows: per group run, the `token_rows` its K and V rows are in.
    group_rows: per group run, `(l0, l1, real tokens it ran)`.
    geometry: the runner's sizes (a re-pack packs with them).
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
  seqs: tuple = ()
  stops: tuple[int, ...] = ()
  live: tuple[int, ...] = ()
  token_rows: np.ndarray | None = None
  group_token_rows: list = dataclasses.field(default_factory=list)
  group_rows: list = dataclasses.field(default_factory=list)
  geometry: RunnerGeometry | None = None


class LayerwisePrograms:
  """The layer-group programs of one model (one device: no tensor parallelism).

  Args:
    graphdef: the model's `nnx` graph (the runner's `nnx.split`).
    attention_impl: the `paged_attention` implementation (None: the platform's).
    inv_freq: f32[H / 2] RoPE inverse frequencies.
    platform: the platform the programs are built for ("cpu" | "tpu" | "cuda").
    layer_names: the model's stacked layer parameters (`kvjax.models.nn.llama.layer_param_names`).
    vocab_size: V, the logits' width.
  """

  def __init__(self, graphdef, *, attention_impl: str | None, inv_freq, platform: str | None,
               layer_names: Sequence[str], vocab_size: int):
    self._graphdef = graphdef
    self._vocab_size = vocab_size
    self._layer_names = tuple(layer_names)
    self._attention_impl = attention_impl
    self._platform = platform
    self._per_size: dict[int, Callable] = {}
    self._params: dict[tuple[int, int], dict] = {}

    def begin(state, tokens):
      return ragged_embed(nnx.merge(graphdef, state), tokens)

    def finish(state, x, rows):
      return ragged_logits(nnx.merge(graphdef, state), x, rows)

    def insert_layers(pool, pieces, block_ids_nR, starts_n, l0):
      kv_nG2CKH = jnp.stack(pieces)
      _, _, _, c = kv_nG2CKH.shape[:4]
      positions_nC = starts_n[:, None] + jnp.arange(c, dtype=jnp.int32)[None]
      k = jax.vmap(lambda x, p: apply_rope(x, p[None], inv_freq))(kv_nG2CKH[:, :, 0],
                                                                  positions_nC)
      return write_layer_blocks(pool, k, kv_nG2CKH[:, :, 1], block_ids_nR, l0)

    self.begin_program = jax.jit(begin)
    self.finish_program = jax.jit(finish)
    self.insert_program = jax.jit(insert_layers, donate_argnums=(0,))

  def layers_program(self, n: int):
    """The jit'd scan over a group of `n` layers (one program per group size)."""
    if n not in self._per_size:
      graphdef, impl, platform = self._graphdef, self._attention_impl, self._platform

      def run(state, params, pool, x, positions, slots, tables, lens, qsl, num_seqs, l0):
        return ragged_layers(nnx.merge(graphdef, state), pool, x, positions, slots, tables,
                             lens, qsl, num_seqs, l0, num_layers=n, attention_impl=impl,
                             group_params=params, platform=platform)
      self._per_size[n] = jax.jit(run, donate_argnums=(2,))
    return self._per_size[n]

  def group_params(self, state, l0: int, l1: int) -> dict:
    """Layers `[l0, l1)`'s stacked parameters as their own device arrays (sliced once, then
    kept: a group's copy of the weights; the whole model's for every group)."""
    key = (l0, l1)
    if key not in self._params:
      layers_state = state["layers"]
      self._params[key] = {name: jnp.asarray(layers_state[name][...][l0:l1])
                           for name in self._layer_names}
    return self._params[key]

  # ----------------------------------------------------------------------------- the step
  def begin(self, state, packed: PackedStep, groups: tuple[tuple[int, int], ...], *,
            seqs: Sequence[SeqChunk], stops: Sequence[int],
            geometry: RunnerGeometry) -> LayerwiseStep:
    """Embeds a packed step's tokens; the step then runs `groups` in order, each sequence up to
    its `stops` layer (a group boundary, or the last layer)."""
    x = self.begin_program(state, packed.arrays[0])
    return LayerwiseStep(groups=groups, n_seqs=int(packed.arrays[6]), n_tokens=packed.n_tokens,
                         offsets=packed.offsets, arrays=packed.arrays, x=x, rows=packed.rows,
                         bucket=packed.bucket, seqs=tuple(seqs), stops=tuple(stops),
                         live=tuple(range(len(seqs))), geometry=geometry)

  def run_group(self, state, pool, st: LayerwiseStep, xp=jnp):
    """Runs the step's next layer group: `(new pool, (l0, l1))`. After the group, the sequences
    that stop at `l1` leave the step (a re-pack, gathered with `xp`); once none is left, the
    remaining groups run nothing.

    Raises:
      ValueError: every group has run already.
    """
    if st.next_group >= len(st.groups):
      raise ValueError(f"all {len(st.groups)} layer groups of this step have run")
    l0, l1 = st.groups[st.next_group]
    if st.live:
      st.x, pool, k_pre, v = self.layers_program(l1 - l0)(
          state, self.group_params(state, l0, l1), pool, st.x, *st.arrays[1:], np.int32(l0))
      tokens = sum(len(st.seqs[i].token_ids) for i in st.live)
    else:
      k_pre = v = None
      tokens = 0
    st.k_pre.append(k_pre)
    st.v.append(v)
    st.group_token_rows.append(st.token_rows)
    st.group_rows.append((l0, l1, tokens))
    st.next_group += 1
    if st.next_group < len(st.groups) and any(st.stops[i] == l1 for i in st.live):
      self._repack(st, l1, xp)
    return pool, (l0, l1)

  @staticmethod
  def _repack(st: LayerwiseStep, layer: int, xp) -> None:
    """Drops the sequences that stop at `layer` from the step: the others are packed into the
    smallest bucket holding them, their hidden states gathered from their current rows."""
    keep = tuple(i for i in st.live if st.stops[i] > layer)
    t0 = len(st.arrays[0]) if st.token_rows is None else len(st.token_rows)
    now = np.arange(t0, dtype=np.int32) if st.token_rows is None else st.token_rows
    rows = np.full(t0, -1, np.int32)
    st.live = keep
    if not keep:
      st.x, st.token_rows = None, rows
      return
    packed = pack_step(st.geometry, [st.seqs[i] for i in keep])
    src = np.zeros(packed.bucket, np.int32)  # each new row's current row (padding: row 0)
    for j, i in enumerate(keep):
      n, o, o_new = len(st.seqs[i].token_ids), st.offsets[i], packed.offsets[j]
      src[o_new:o_new + n] = now[o:o + n]
      rows[o:o + n] = np.arange(o_new, o_new + n, dtype=np.int32)
    st.x = gather_rows(st.x, src, 1, xp)
    st.arrays, st.rows, st.bucket, st.token_rows = (packed.arrays, packed.rows, packed.bucket,
                                                    rows)

  def finish(self, state, st: LayerwiseStep, xp=jnp):
    """Final norm and logits after the last group: `(logits, k_pre, v)` untrimmed, in the
    first packing's rows, the groups' K and V concatenated with `xp` (numpy for host outputs).
    A stopped sequence's logits, and its K and V in the groups it did not run, are zeros.

    Raises:
      ValueError: some layer group has not run.
    """
    if st.next_group != len(st.groups):
      raise ValueError(f"{st.next_group} of {len(st.groups)} layer groups have run")
    if st.token_rows is None:  # no sequence stopped early: the first packing throughout
      logits = self.finish_program(state, st.x, st.rows)
      k_pre = xp.concatenate(st.k_pre, axis=0) if len(st.k_pre) > 1 else st.k_pre[0]
      v = xp.concatenate(st.v, axis=0) if len(st.v) > 1 else st.v[0]
      return logits, k_pre, v
    first_k, first_v = st.k_pre[0], st.v[0]  # the first group always runs every sequence

    def unpack(a, rows, group, like):
      if a is None:  # every sequence had stopped: nothing ran
        return xp.zeros((group[1] - group[0],) + tuple(like.shape[1:]), like.dtype)
      return a if rows is None else gather_rows(a, rows, 1, xp)

    k_pre = xp.concatenate([unpack(a, r, g, first_k)
                            for a, r, g in zip(st.k_pre, st.group_token_rows, st.groups)], axis=0)
    v = xp.concatenate([unpack(a, r, g, first_v)
                        for a, r, g in zip(st.v, st.group_token_rows, st.groups)], axis=0)
    if not st.live:
      return xp.zeros((st.n_seqs, self._vocab_size), xp.float32), k_pre, v
    where = np.full(st.n_seqs, -1, np.int32)  # each sequence's row of the live logits
    where[list(st.live)] = np.arange(len(st.live), dtype=np.int32)
    return gather_rows(self.finish_program(state, st.x, st.rows), where, 0, xp), k_pre, v

  # ----------------------------------------------------------------------------- inserts
  def insert(self, pool, kvs_G2CKH: Sequence, ids: Sequence[np.ndarray],
             starts: Sequence[int], layer_start: int):
    """Writes layers `[layer_start, layer_start + G)` of checked chunks into `pool` in one
    call per `LAYERWISE_INSERT_BATCH` of them, each batch padded to a power of two by
    repeating its last chunk (the same rows written twice with the same values); returns the
    new pool."""
    n = len(kvs_G2CKH)
    for lo in range(0, n, LAYERWISE_INSERT_BATCH):
      hi = min(lo + LAYERWISE_INSERT_BATCH, n)
      pad = (1 << (hi - lo - 1).bit_length()) - (hi - lo)
      idx = list(range(lo, hi)) + [hi - 1] * pad
      pool = self.insert_program(pool, tuple(kvs_G2CKH[i] for i in idx),
                                 np.stack([ids[i] for i in idx]),
                                 np.asarray([starts[i] for i in idx], np.int32),
                                 np.int32(layer_start))
    return pool

  # ----------------------------------------------------------------------------- compiles
  def warmup(self, state, pool, geometry: RunnerGeometry, n_layers: int, groups: int):
    """Compiles the layer-group programs of every token bucket (begin, each group size of
    `layer_groups(L, groups)`, finish); returns the pool. Writes nothing (every slot is
    padding)."""
    sizes = sorted({l1 - l0 for l0, l1 in layer_groups(n_layers, groups)})
    for t in geometry.buckets:
      arrays, rows = padding_step(geometry, t)
      x = self.begin_program(state, arrays[0])
      todo = list(sizes)
      for l0, l1 in layer_groups(n_layers, groups):
        if l1 - l0 in todo:
          todo.remove(l1 - l0)
          _, pool, _, _ = self.layers_program(l1 - l0)(
              state, self.group_params(state, l0, l1), pool, x, *arrays[1:], np.int32(l0))
      jax.block_until_ready(self.finish_program(state, x, rows))
    return pool

  def aot_programs(self, state, pool, *, model_config: LlamaConfig, geometry: RunnerGeometry,
                   dtype, buckets: Sequence[int], groups: int, chunk_tokens: int,
                   sds: Callable, step_args: Callable) -> list[tuple[str, object, tuple]]:
    """The layer-group programs as `(name, jitted function, abstract arguments)` (see
    `PagedModelRunner.aot_programs`): begin, each group size and finish per token bucket, and
    the batched layer insert of chunks of `chunk_tokens`.

    Args:
      state, pool: the runner's abstract model state and pool.
      sds: `(shape, dtype) -> ShapeDtypeStruct` placed as the runner places host inputs.
      step_args: `t -> the step's abstract host arguments` at bucket t.
    """
    cfg, c, b = model_config, chunk_tokens, geometry.block_size
    out = []
    layers_state = state["layers"]
    for t in buckets:
      x = sds((1, t, cfg.d_model), dtype)
      out.append((f"layers_begin[T={t}]", self.begin_program, (state, sds((t,)))))
      for n in sorted({l1 - l0 for l0, l1 in layer_groups(cfg.n_layers, groups)}):
        params = {name: sds((n,) + tuple(layers_state[name].shape[1:]),
                            layers_state[name].dtype) for name in self._layer_names}
        out.append((f"layers[G={n},T={t}]", self.layers_program(n),
                    (state, params, pool, x) + step_args(t)[1:7] + (sds(()),)))
      out.append((f"layers_finish[T={t}]", self.finish_program,
                  (state, x, sds((geometry.step_seqs(t),)))))
    g = -(-cfg.n_layers // groups)
    piece = sds((g, 2, c, cfg.n_kv_heads, cfg.head_dim), dtype)
    out.append((f"insert_layers[G={g},n={LAYERWISE_INSERT_BATCH},C={c}]", self.insert_program,
                (pool, (piece,) * LAYERWISE_INSERT_BATCH,
                 sds((LAYERWISE_INSERT_BATCH, c // b)), sds((LAYERWISE_INSERT_BATCH,)),
                 sds(()))))
    return out
