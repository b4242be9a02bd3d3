"""The layer-wise step of the paged runner: a ragged step run layer group by layer group, and the
batched insert of some layers of stored chunks between the groups (layer-wise pre-loading,
CachedAttention arXiv 2403.19708 section 3.2.1; docs/design/layerwise.md).

`LayerwisePrograms` holds the jit'd programs and each group's parameter slices; it owns no pool:
every call takes the runner's pool and returns the new one, and
`kvjax.models.runner.paged_runner.PagedModelRunner` (which owns the pool and the model state) delegates
`step_begin` / `step_layers` / `step_finish` / `insert_chunks_layers` to it.

Axes: L layers, G layers of a group, T tokens of a step, S sequences of a step, C tokens of a
chunk, K key/value heads, H head width, B tokens of a block, D model width.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.models.nn.config import LlamaConfig
from kvjax.models.nn.kv_cache import write_layer_blocks
from kvjax.models.nn.layers import apply_rope
from kvjax.models.nn.llama import ragged_embed, ragged_layers, ragged_logits
from kvjax.models.runner.runner_api import RunnerGeometry, layer_groups
from kvjax.models.runner.step_inputs import PackedStep, padding_step

#: Chunks one layer-wise insert call writes at most (`PagedModelRunner.insert_chunks_layers`);
#: batches are padded to powers of two up to it.
LAYERWISE_INSERT_BATCH = 8


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


class LayerwisePrograms:
  """The layer-group programs of one model (one device: no tensor parallelism).

  Args:
    graphdef: the model's `nnx` graph (the runner's `nnx.split`).
    attention_impl: the `paged_attention` implementation (None: the platform's).
    inv_freq: f32[H / 2] RoPE inverse frequencies.
    platform: the platform the programs are built for ("cpu" | "tpu" | "cuda").
    layer_names: the model's stacked layer parameters (`kvjax.models.nn.llama.layer_param_names`).
  """

  def __init__(self, graphdef, *, attention_impl: str | None, inv_freq, platform: str | None,
               layer_names: Sequence[str]):
    self._graphdef = graphdef
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
  def begin(self, state, packed: PackedStep,
            groups: tuple[tuple[int, int], ...]) -> LayerwiseStep:
    """Embeds a packed step's tokens; the step then runs `groups` in order."""
    x = self.begin_program(state, packed.arrays[0])
    return LayerwiseStep(groups=groups, n_seqs=int(packed.arrays[6]), n_tokens=packed.n_tokens,
                         offsets=packed.offsets, arrays=packed.arrays, x=x, rows=packed.rows,
                         bucket=packed.bucket)

  def run_group(self, state, pool, st: LayerwiseStep):
    """Runs the step's next layer group: `(new pool, (l0, l1))`.

    Raises:
      ValueError: every group has run already.
    """
    if st.next_group >= len(st.groups):
      raise ValueError(f"all {len(st.groups)} layer groups of this step have run")
    l0, l1 = st.groups[st.next_group]
    st.x, pool, k_pre, v = self.layers_program(l1 - l0)(
        state, self.group_params(state, l0, l1), pool, st.x, *st.arrays[1:], np.int32(l0))
    st.k_pre.append(k_pre)
    st.v.append(v)
    st.next_group += 1
    return pool, (l0, l1)

  def finish(self, state, st: LayerwiseStep, xp=jnp):
    """Final norm and logits after the last group: `(logits, k_pre, v)` untrimmed, the groups'
    K and V concatenated with `xp` (numpy for host outputs).

    Raises:
      ValueError: some layer group has not run.
    """
    if st.next_group != len(st.groups):
      raise ValueError(f"{st.next_group} of {len(st.groups)} layer groups have run")
    logits = self.finish_program(state, st.x, st.rows)
    k_pre = xp.concatenate(st.k_pre, axis=0) if len(st.k_pre) > 1 else st.k_pre[0]
    v = xp.concatenate(st.v, axis=0) if len(st.v) > 1 else st.v[0]
    return logits, k_pre, v

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
