"""LLaMA-family decoder in Flax NNX with stacked, scanned layers over a paged KV pool.

Parameters use the canonical layout below (the contract with the weight loaders); layers are
stacked on a leading L axis and run under one `lax.scan`, so compile time does not grow with
depth. The cache is carried through the scan whole and updated in place (scatter with
`mode="drop"`), so a step's padding tokens never write it.

    embed      [V, D]        layers.wq  [L, D, N, H]   layers.w_gate [L, D, F]
    final_norm [D]           layers.wk  [L, D, K, H]   layers.w_up   [L, D, F]
    lm_head    [D, V]        layers.wv  [L, D, K, H]   layers.w_down [L, F, D]
    (untied only)            layers.wo  [L, N, H, D]   layers.attn_norm, layers.mlp_norm [L, D]

The families differ by two switches of `LlamaConfig`, each adding layer parameters:

    attention_bias (Qwen2/Qwen2.5)   layers.bq [L, N, H]   layers.bk, layers.bv [L, K, H]
    qk_norm (Qwen3)                  layers.q_norm, layers.k_norm [L, H]: RMSNorm of each
                                     query / key head before RoPE (Qwen3 technical report,
                                     arXiv 2505.09388, section 2)

The stored K ("before RoPE") is the key after its bias and norm, just before the rotation.
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.kernels.attention import dense_attention_reference
from kvjax.models.nn import layers
from kvjax.models.nn.config import LlamaConfig
from kvjax.kernels.paged_attention import paged_attention
from kvjax.models.nn.kv_cache import PagedKVCache, flat_layers, from_flat_layers, write_token_rows

LAYER_PARAMS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")
#: Layer parameters of `LlamaConfig.attention_bias` and of `LlamaConfig.qk_norm`.
BIAS_PARAMS = ("bq", "bk", "bv")
QK_NORM_PARAMS = ("q_norm", "k_norm")


def layer_param_names(cfg: LlamaConfig) -> tuple[str, ...]:
  """The stacked layer parameters of `cfg`'s family (names after "layers.")."""
  return (LAYER_PARAMS + (BIAS_PARAMS if cfg.attention_bias else ())
          + (QK_NORM_PARAMS if cfg.qk_norm else ()))


def param_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
  """Canonical parameter names and shapes (see the module docstring)."""
  L, D, N, K = cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads
  H, F, V = cfg.head_dim, cfg.mlp_dim, cfg.vocab_size
  shapes = {
      "embed": (V, D),
      "layers.attn_norm": (L, D), "layers.wq": (L, D, N, H), "layers.wk": (L, D, K, H),
      "layers.wv": (L, D, K, H), "layers.wo": (L, N, H, D), "layers.mlp_norm": (L, D),
      "layers.w_gate": (L, D, F), "layers.w_up": (L, D, F), "layers.w_down": (L, F, D),
      "final_norm": (D,),
  }
  if cfg.attention_bias:
    shapes.update({"layers.bq": (L, N, H), "layers.bk": (L, K, H), "layers.bv": (L, K, H)})
  if cfg.qk_norm:
    shapes.update({"layers.q_norm": (L, H), "layers.k_norm": (L, H)})
  if not cfg.tie_embeddings:
    shapes["lm_head"] = (D, V)
  return shapes


class DecoderLayers(nnx.Module):
  """All L decoder layers, each parameter stacked on a leading layer axis."""

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
    init = nnx.initializers.normal(0.02)
    self.names = layer_param_names(cfg)
    shapes = param_shapes(cfg)
    for name in self.names:
      shape = shapes[f"layers.{name}"]
      if name.endswith("norm"):
        value = jnp.ones(shape, param_dtype)
      elif name in BIAS_PARAMS:
        value = jnp.zeros(shape, param_dtype)
      else:
        value = init(rngs.params(), shape, param_dtype)
      setattr(self, name, nnx.Param(value))

  def stacked(self) -> dict[str, jax.Array]:
    return {name: getattr(self, name)[...] for name in self.names}


def _sharded_paged_attention(mesh, implementation, platform=None, num_kv_heads=None):
  """`paged_attention` per `tp` shard (`shard_map`): q [T, N / tp, H] of the shard's query
  heads over the pool's `[P, B, F / tp]` (the shard's `num_kv_heads` heads, `PoolLayout`) of the
  same shard; block tables, lengths and query starts replicated. No communication: a query
  head's KV head lives on its shard."""
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415
  tp = mesh.axis_names[0]

  def per_shard(q, k_pool, v_pool, tables, lens, qsl, num_seqs):
    return paged_attention(q, k_pool, v_pool, tables, lens, qsl, num_seqs,
                           implementation=implementation, platform=platform,
                           num_kv_heads=num_kv_heads)

  heads = P(None, tp, None)
  pool = P(None, None, tp)
  return jax.shard_map(per_shard, mesh=mesh, in_specs=(heads, pool, pool, P(), P(), P(), P()),
                       out_specs=heads, check_vma=False)


def _attention_inputs(cfg: LlamaConfig, p, x_BTD, positions_BT, inv_freq):
  """A layer's attention inputs: (q after RoPE [B, T, N, H], K before RoPE, K after RoPE and V,
  each [B, T, K, H]); `p` is the layer's parameters in the compute dtype. Biases
  (`cfg.attention_bias`) are added after the projections, the per-head q/k RMSNorm
  (`cfg.qk_norm`) runs after them and before RoPE, as in transformers' Qwen2 and Qwen3."""
  h = layers.rms_norm(x_BTD, p["attn_norm"], cfg.rms_eps)
  q_BTNH = jnp.einsum("BTD,DNH->BTNH", h, p["wq"])
  k_BTKH = jnp.einsum("BTD,DKH->BTKH", h, p["wk"])
  v_BTKH = jnp.einsum("BTD,DKH->BTKH", h, p["wv"])
  if cfg.attention_bias:
    q_BTNH, k_BTKH, v_BTKH = q_BTNH + p["bq"], k_BTKH + p["bk"], v_BTKH + p["bv"]
  if cfg.qk_norm:
    q_BTNH = layers.rms_norm(q_BTNH, p["q_norm"], cfg.rms_eps)
    k_BTKH = layers.rms_norm(k_BTKH, p["k_norm"], cfg.rms_eps)
  return (layers.apply_rope(q_BTNH, positions_BT, inv_freq), k_BTKH,
          layers.apply_rope(k_BTKH, positions_BT, inv_freq), v_BTKH)


def _attention_output_and_mlp(cfg: LlamaConfig, p, x_BTD, attn_BTNH):
  """The rest of a layer after attention: output projection, residual, RMSNorm, SwiGLU."""
  x_BTD = x_BTD + jnp.einsum("BTNH,NHD->BTD", attn_BTNH, p["wo"])
  h = layers.rms_norm(x_BTD, p["mlp_norm"], cfg.rms_eps)
  return x_BTD + layers.swiglu(h, p["w_gate"], p["w_up"], p["w_down"])


def _paged_layer(cfg: LlamaConfig, dtype, inv_freq, pool: PagedKVCache, positions_T,
                 slot_mapping_T,
                 block_tables_SM, context_lens_S, query_start_loc_S1, num_seqs, *,
                 attention_impl, kv_head_repeat: int = 1, tp_mesh=None, platform=None):
  """The `lax.scan` body of one decoder layer over the paged pool (`Llama.ragged_step` and
  `ragged_layers` share it): writes the step's K (after RoPE) and V into the flat pool view
  `[L * P, B, F]` (`kv_cache.flat_layers`, heads folded as `pool.layout` says), runs paged
  attention on that view as it is, then the MLP. Carry (x, k_flat, v_flat), scanned inputs
  (the layer's parameters, its layer index); outputs its pre-RoPE K and V `[T, K, H]`."""
  l_, p_, b_, _ = pool.k_LPBF.shape
  layout = pool.layout
  positions_1T = positions_T[None]
  attention = (paged_attention if tp_mesh is None else _sharded_paged_attention(
      tp_mesh, attention_impl, platform, num_kv_heads=layout.heads_per_shard))
  attention_kw = ({"implementation": attention_impl, "platform": platform,
                   "num_kv_heads": layout.num_kv_heads} if tp_mesh is None else {})
  valid_T = slot_mapping_T >= 0
  block_T = jnp.where(valid_T, slot_mapping_T // b_, l_ * p_)  # past the pool: dropped
  col_T = jnp.where(valid_T, slot_mapping_T % b_, 0)

  def layer(carry, xs):
    x, k_flat, v_flat = carry
    p, i = xs
    p = {k: v.astype(dtype) for k, v in p.items()}
    q_1TNH, k_1TKH, k_rot_1TKH, v_1TKH = _attention_inputs(cfg, p, x, positions_1T, inv_freq)
    rows_T = block_T + i * p_
    k_w_TKH, v_w_TKH = k_rot_1TKH[0], v_1TKH[0]
    if kv_head_repeat > 1:  # the pool's K' = K * r heads: each KV head r times, in order
      k_w_TKH = jnp.repeat(k_w_TKH, kv_head_repeat, axis=1)
      v_w_TKH = jnp.repeat(v_w_TKH, kv_head_repeat, axis=1)
    k_flat, v_flat = write_token_rows(layout, k_flat, v_flat, rows_T, col_T, k_w_TKH, v_w_TKH)
    attn_TNH = attention(q_1TNH[0], k_flat, v_flat, block_tables_SM + i * p_, context_lens_S,
                         query_start_loc_S1, num_seqs, **attention_kw)
    x = _attention_output_and_mlp(cfg, p, x, attn_TNH[None].astype(x.dtype))
    return (x, k_flat, v_flat), (k_1TKH[0], v_1TKH[0])

  return layer


class Llama(nnx.Module):
  """LLaMA decoder: token embedding, L x (RMSNorm, GQA with RoPE, RMSNorm, SwiGLU), RMSNorm, head.

  Also Mistral, Qwen2/Qwen2.5 and Qwen3 through `cfg`'s switches (the module docstring).

  Args:
    cfg: architecture.
    rngs: initialisation randomness (weights are usually replaced by a loader).
    dtype: compute dtype of activations and matmuls (f32 on CPU, bf16 on accelerators); softmax,
      norms, RoPE and logits run in f32 whatever it is.
    param_dtype: storage dtype of parameters.
  """

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs, dtype=jnp.float32,
               param_dtype=jnp.float32):
    self.cfg = cfg
    self.dtype = dtype
    self.embed = nnx.Param(nnx.initializers.normal(0.02)(
        rngs.params(), (cfg.vocab_size, cfg.d_model), param_dtype))
    self.layers = DecoderLayers(cfg, rngs=rngs, param_dtype=param_dtype)
    self.final_norm = nnx.Param(jnp.ones((cfg.d_model,), param_dtype))
    self.lm_head = None if cfg.tie_embeddings else nnx.Param(nnx.initializers.normal(0.02)(
        rngs.params(), (cfg.d_model, cfg.vocab_size), param_dtype))
    self.inv_freq = nnx.Variable(jnp.asarray(layers.rope_inv_freq(cfg)))

  # ----------------------------------------------------------------------------- parameters
  @classmethod
  def from_params(cls, cfg: LlamaConfig, params: Mapping[str, np.ndarray], *, dtype=jnp.float32,
                  param_dtype=jnp.float32) -> "Llama":
    """Builds a model from a canonical flat parameter dict.

    Raises:
      ValueError: if a parameter is missing, unexpected, or has the wrong shape.
    """
    expected = param_shapes(cfg)
    missing = sorted(set(expected) - set(params))
    extra = sorted(set(params) - set(expected))
    if missing or extra:
      raise ValueError(f"parameter names differ from {cfg.name}'s: missing {missing}, "
                       f"unexpected {extra}")
    for name, shape in expected.items():
      if tuple(params[name].shape) != shape:
        raise ValueError(f"parameter {name} has shape {tuple(params[name].shape)}, "
                         f"expected {shape}")
    model = nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0), dtype=dtype,
                                       param_dtype=param_dtype))
    for name, value in params.items():
      owner, attr = (model.layers, name.split(".", 1)[1]) if name.startswith("layers.") else (
          model, name)
      getattr(owner, attr).set_value(jnp.asarray(value, param_dtype))
    model.inv_freq.set_value(jnp.asarray(layers.rope_inv_freq(cfg)))
    return model

  def to_params(self) -> dict[str, np.ndarray]:
    """The canonical flat parameter dict as numpy arrays (inverse of `from_params`)."""
    out = {"embed": self.embed[...], "final_norm": self.final_norm[...]}
    out.update({f"layers.{k}": v for k, v in self.layers.stacked().items()})
    if self.lm_head is not None:
      out["lm_head"] = self.lm_head[...]
    return {k: np.asarray(v) for k, v in out.items()}

  # ----------------------------------------------------------------------------- forward
  def _logits(self, x_BTD: jax.Array) -> jax.Array:
    x_BTD = layers.rms_norm(x_BTD, self.final_norm[...], self.cfg.rms_eps)
    if self.lm_head is None:
      return jnp.einsum("BTD,VD->BTV", x_BTD, self.embed[...].astype(x_BTD.dtype),
                        preferred_element_type=jnp.float32)
    return jnp.einsum("BTD,DV->BTV", x_BTD, self.lm_head[...].astype(x_BTD.dtype),
                      preferred_element_type=jnp.float32)

  def ragged_step(self, pool: PagedKVCache, tokens_T: jax.Array, positions_T: jax.Array,
                  slot_mapping_T: jax.Array, block_tables_SM: jax.Array,
                  context_lens_S: jax.Array, query_start_loc_S1: jax.Array,
                  num_seqs: jax.Array, logits_indices_S: jax.Array, *,
                  attention_impl: str | None = None, kv_head_repeat: int = 1,
                  tp_mesh=None, platform: str | None = None
                  ) -> tuple[jax.Array, PagedKVCache, jax.Array, jax.Array]:
    """One ragged batched step over the paged pool: every decode and prefill chunk together.

    The step's tokens of all sequences are flattened (T padded to a compiled size). Each layer
    first writes every real token's K (after RoPE) and V into its pool slot, then runs ragged
    paged attention (`kvjax.kernels.paged_attention`), so a sequence's chunk sees its own
    earlier tokens and any other chunk of the same sequence planned before it in this step.

        tokens_T          |seq 0 (decode)|seq 1 chunk ......|seq 2 chunk ..|pad ....|
        query_start_loc   0              1                  q1              q2 = qsl[num_seqs]
        slot_mapping_T    block * B + offset of each token's position; -1 for padding

    Layers share one flat view of the pool, [L * P, B, F]: layer i's block b is row i * P + b,
    so attention reads the carried pool in place (no per-layer copy) through block tables
    offset by i * P, and its cost follows each sequence's context, not the pool size.

    Args:
      pool: the paged pool (donated by the jitted caller).
      tokens_T: int32[T] token ids.
      positions_T: int32[T] absolute position of each token (0 for padding).
      slot_mapping_T: int32[T] pool slot `block_id * B + position % B` of each token, -1 for
        padding (never written).
      block_tables_SM: int32[S, M] each sequence's blocks (rows past `num_seqs` are padding).
      context_lens_S: int32[S] kv tokens of each sequence including this step's.
      query_start_loc_S1: int32[S + 1] cumulative query lengths from 0.
      num_seqs: int32 scalar, real sequences.
      logits_indices_S: int32[S] row of each sequence's last token in T (its logits).
      attention_impl: `paged_attention` implementation (static); None picks the backend's.
      kv_head_repeat: r (static): the pool holds each KV head r times, K' = K * r heads
        (tensor parallelism over more devices than KV heads, `kvjax.models.runner.sharding`).
      tp_mesh: a `tp` mesh (static): attention runs per shard under `shard_map`, each shard's
        query heads over its pool heads; None (one device): a plain call.
      platform: the target of the attention kernel (static; "cpu" | "tpu" | "cuda"); None: the
        platform being compiled for (`kvjax.kernels.platform.resolve_platform`).

    Returns:
      (f32[S, V] logits at each sequence's last token, the updated pool,
       [L, T, K, H] keys BEFORE RoPE of every token (what the store saves), [L, T, K, H] values).
    """
    cfg, dtype = self.cfg, self.dtype
    l_ = pool.num_layers
    inv_freq = self.inv_freq[...]
    stacked = self.layers.stacked()
    layer = _paged_layer(cfg, dtype, inv_freq, pool, positions_T, slot_mapping_T,
                         block_tables_SM, context_lens_S, query_start_loc_S1, num_seqs,
                         attention_impl=attention_impl, kv_head_repeat=kv_head_repeat,
                         tp_mesh=tp_mesh, platform=platform)

    x_1TD = jnp.take(self.embed[...], tokens_T, axis=0)[None].astype(dtype)
    layer_ids = jnp.arange(l_, dtype=jnp.int32)
    k_flat, v_flat = flat_layers(pool)
    (x_1TD, k_flat, v_flat), (k_pre_LTKH, v_LTKH) = jax.lax.scan(
        layer, (x_1TD, k_flat, v_flat), (stacked, layer_ids))
    last_1SD = jnp.take(x_1TD, logits_indices_S, axis=1)
    logits_SV = self._logits(last_1SD)[0]
    new_pool = from_flat_layers(k_flat, v_flat, pool)
    return logits_SV, new_pool, k_pre_LTKH, v_LTKH


def logits_after_context(model: Llama, k_pre_LSKH: jax.Array, v_LSKH: jax.Array,
                         tokens_T: jax.Array) -> jax.Array:
  """f32[T, V] logits of `tokens_T` at positions `[S, S + T)` after a given context KV.

  The tokens attend causally to the context's keys and values at positions `[0, S)` (K given
  before RoPE and rotated here) and to themselves, with dense attention (no cache, no Pallas):
  a plain differentiable function of the context KV, for calibration (the kvtc codec's Fisher
  metric takes its gradient with respect to `k_pre_LSKH` and `v_LSKH`; `kvjax.models.
  kv_calibration`). Not a serving path: every layer materialises [T, S + T] scores.

  Args:
    model: the model.
    k_pre_LSKH: f32[L, S, K, H] context keys before RoPE, positions 0..S-1.
    v_LSKH: f32[L, S, K, H] context values.
    tokens_T: int32[T] token ids at positions S..S+T-1.

  Returns:
    f32[T, V] logits.
  """
  cfg = model.cfg
  s_, t_ = k_pre_LSKH.shape[1], tokens_T.shape[0]
  inv_freq = model.inv_freq[...]
  pos_ctx_1S = jnp.arange(s_, dtype=jnp.int32)[None]
  pos_1T = (s_ + jnp.arange(t_, dtype=jnp.int32))[None]
  pos_kv_1S = jnp.concatenate([pos_ctx_1S, pos_1T], axis=1)

  def layer(x_1TD, xs):
    p, k_ctx_SKH, v_ctx_SKH = xs
    p = {k: v.astype(jnp.float32) for k, v in p.items()}
    q_1TNH, _, k_rot_1TKH, v_1TKH = _attention_inputs(cfg, p, x_1TD, pos_1T, inv_freq)
    k_all = jnp.concatenate(
        [layers.apply_rope(k_ctx_SKH[None].astype(jnp.float32), pos_ctx_1S, inv_freq),
         k_rot_1TKH], axis=1)
    v_all = jnp.concatenate([v_ctx_SKH[None].astype(jnp.float32), v_1TKH], axis=1)
    attn_1TNH = dense_attention_reference(q_1TNH, k_all, v_all, pos_1T, pos_kv_1S)
    return _attention_output_and_mlp(cfg, p, x_1TD, attn_1TNH), None

  x_1TD = jnp.take(model.embed[...], tokens_T, axis=0)[None].astype(jnp.float32)
  x_1TD, _ = jax.lax.scan(layer, x_1TD, (model.layers.stacked(), k_pre_LSKH, v_LSKH))
  return model._logits(x_1TD)[0]


def context_kv(model: Llama, tokens_T: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The KV of `tokens_T` at positions `[0, T)`: causal dense attention in f32, no cache.

  For calibration (`kvjax.models.loading.kv_calibration`: the kvtc codec's statistics and the Fisher
  probe's context), like `logits_after_context`. Not a serving path: every layer materialises
  [T, T] scores.

  Args:
    model: the model.
    tokens_T: int32[T] token ids.

  Returns:
    (f32[L, T, K, H] keys before RoPE, f32[L, T, K, H] values).
  """
  cfg = model.cfg
  inv_freq = model.inv_freq[...]
  pos_1T = jnp.arange(tokens_T.shape[0], dtype=jnp.int32)[None]

  def layer(x_1TD, p):
    p = {k: v.astype(jnp.float32) for k, v in p.items()}
    q_1TNH, k_pre_1TKH, k_rot_1TKH, v_1TKH = _attention_inputs(cfg, p, x_1TD, pos_1T, inv_freq)
    attn_1TNH = dense_attention_reference(q_1TNH, k_rot_1TKH, v_1TKH, pos_1T, pos_1T)
    return _attention_output_and_mlp(cfg, p, x_1TD, attn_1TNH), (k_pre_1TKH[0], v_1TKH[0])

  x_1TD = jnp.take(model.embed[...], tokens_T, axis=0)[None].astype(jnp.float32)
  _, (k_pre_LTKH, v_LTKH) = jax.lax.scan(layer, x_1TD, model.layers.stacked())
  return k_pre_LTKH, v_LTKH


# ------------------------------------------------------------------------------- layer groups
# Layer-wise pre-loading (CachedAttention, arXiv 2403.19708, section 3.2.1): a ragged step run
# as embed -> layer groups -> logits, so the engine can insert layer group g of a stored chunk
# just before the step's tokens run through group g. Additive to `ragged_step` (which is left
# as it is); `PagedModelRunner.step_begin/step_layers/step_finish` call these.


def ragged_embed(model: Llama, tokens_T: jax.Array) -> jax.Array:
  """The step's hidden states before layer 0: [1, T, D] in the compute dtype."""
  return jnp.take(model.embed[...], tokens_T, axis=0)[None].astype(model.dtype)


def ragged_logits(model: Llama, x_1TD: jax.Array, logits_indices_S: jax.Array) -> jax.Array:
  """f32[S, V] logits (final norm, head) at each sequence's last token row of `x_1TD`."""
  return model._logits(jnp.take(x_1TD, logits_indices_S, axis=1))[0]


def ragged_layers(model: Llama, pool: PagedKVCache, x_1TD: jax.Array, positions_T: jax.Array,
                  slot_mapping_T: jax.Array, block_tables_SM: jax.Array,
                  context_lens_S: jax.Array, query_start_loc_S1: jax.Array, num_seqs: jax.Array,
                  layer_start: jax.Array, *, num_layers: int, attention_impl: str | None = None,
                  group_params: Mapping[str, jax.Array] | None = None,
                  platform: str | None = None) -> tuple[jax.Array, PagedKVCache, jax.Array, jax.Array]:
  """Layers `[layer_start, layer_start + num_layers)` of `Llama.ragged_step`, scanned.

  The same per-layer computation as `ragged_step` (write the step's K after RoPE and V into the
  pool, then paged attention over the flat `[L * P, B, F]` view) over a static-size slice of
  the stacked layer parameters starting at a traced layer index, so groups of equal size share
  one compiled program. Running groups that tile `[0, L)` in order between `ragged_embed` and
  `ragged_logits` computes what one `ragged_step` call does.

  Args:
    model: the model.
    pool: the paged pool (donated by the jitted caller).
    x_1TD: [1, T, D] hidden states entering layer `layer_start`.
    positions_T .. num_seqs: as `Llama.ragged_step`.
    layer_start: int32 scalar, the group's first layer.
    num_layers: layers in the group (static), `layer_start + num_layers <= L`.
    attention_impl: `paged_attention` implementation (static).
    group_params: the group's stacked layer parameters `{name: [num_layers, ...]}`, sliced
      ahead of time; None slices them here (a dynamic slice that XLA's CPU backend fuses into
      the matmuls, about 2x slower per layer on the 2-core VM, so the runner passes them).
    platform: the attention kernel's target (static), as `Llama.ragged_step`.

  Returns:
    ([1, T, D] hidden states after the group, the updated pool, [num_layers, T, K, H] keys
     before RoPE, [num_layers, T, K, H] values).
  """
  cfg, dtype = model.cfg, model.dtype
  inv_freq = model.inv_freq[...]
  stacked = dict(group_params) if group_params is not None else {
      k: jax.lax.dynamic_slice_in_dim(v, layer_start, num_layers, axis=0)
      for k, v in model.layers.stacked().items()}
  layer = _paged_layer(cfg, dtype, inv_freq, pool, positions_T, slot_mapping_T,
                       block_tables_SM, context_lens_S, query_start_loc_S1, num_seqs,
                       attention_impl=attention_impl, platform=platform)

  layer_ids = layer_start + jnp.arange(num_layers, dtype=jnp.int32)
  k_flat, v_flat = flat_layers(pool)
  (x_1TD, k_flat, v_flat), (k_pre_GTKH, v_GTKH) = jax.lax.scan(
      layer, (x_1TD, k_flat, v_flat), (stacked, layer_ids))
  new_pool = from_flat_layers(k_flat, v_flat, pool)
  return x_1TD, new_pool, k_pre_GTKH, v_GTKH
