"""The JIT boundary: a model plus its device KV cache behind jit'd `prefill_chunk` and `decode_step`.

The module is split once (`nnx.split`) into a static graph and a parameter state; each entry
point is a pure jitted function of (state, cache, ...) that `nnx.merge`s the model, with the cache
donated so XLA updates it in place. Prefill compiles once per chunk size in `chunk_sizes` (a true
length masks the padded tail); decode compiles once.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax import codecs
from kvjax._paths import default_cache_root
from kvjax.kernels import kv_codec, kvtc
from kvjax.kernels.attention import DEFAULT_BLOCK_SIZE
from kvjax.models.kv_cache import KVCache, init_kv_cache, insert_chunk
from kvjax.models.llama import Llama, PrefillOutput, logits_after_context

DEFAULT_CHUNK_SIZES = (16, 32, 64, 128, 256, 512)


def enable_persistent_compilation_cache(path: str | None = None) -> str:
  """Points JAX's persistent compilation cache at `path` (default `<cache root>/jax`).

  A second process start then loads compiled prefill and decode programs instead of recompiling.
  Leaves a cache directory the user configured alone.
  """
  if jax.config.jax_compilation_cache_dir:
    return jax.config.jax_compilation_cache_dir
  path = path or os.path.join(default_cache_root(), "jax")
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  # Every program, however quick to compile: a second start (and an `LLM` of the same options
  # after the server) then compiles nothing (at 0.5 s, the small programs of every start were
  # compiled again each time).
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return path


@functools.lru_cache(maxsize=None)
def level_encoder(codec: str, levels: tuple[int, ...], use_pallas: bool,
                  platform: str | None = None):
  """One jit'd function encoding a device chunk at every level of `levels` in one call.

  Shared by both runner layouts (compiled once per codec, levels and backend choice);
  `platform` is the codec kernels' target (None: the platform being compiled for).

  Returns:
    `fn(kv_L2CKH, kvtc_transform_or_None, start) -> [(payload arrays by name, finite flag)]`,
    one entry per level (kvtc needs the device transform and the chunk's first position; other
    codecs ignore both).
  """

  def encode_all(kv, t, start):
    out = []
    for level in levels:
      if codec == codecs.KVTC:
        payload, finite = kvtc.kvtc_encode(kv, t, level, start=start)
      else:
        payload, finite = kv_codec.kv_encode(kv, codec, level, use_pallas=use_pallas,
                                             platform=platform)
      out.append((payload._asdict(), finite))
    return out

  return jax.jit(encode_all)


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
  """Device-side sizes.

  Attributes:
    num_slots: concurrent sequences (decode slots).
    max_seq_len: tokens per slot (prompt plus output); None means the model's context.
    chunk_sizes: compiled prefill chunk sizes, ascending.
    block_size: attention block over the cache, tokens.
    cache_dtype: KV cache dtype; None means the compute dtype.
  """

  num_slots: int = 4
  max_seq_len: int | None = None
  chunk_sizes: tuple[int, ...] = DEFAULT_CHUNK_SIZES
  block_size: int = DEFAULT_BLOCK_SIZE
  cache_dtype: object = None

  def __post_init__(self):
    if not self.chunk_sizes or list(self.chunk_sizes) != sorted(set(self.chunk_sizes)) or (
        self.chunk_sizes[0] <= 0):
      raise ValueError(f"chunk_sizes must be ascending positive ints, got {self.chunk_sizes}")
    if self.num_slots <= 0:
      raise ValueError(f"num_slots must be positive, got {self.num_slots}")


class ModelRunner:
  """Holds the model state and KV cache on the device; runs one prefill chunk or decode step.

  Only the engine thread calls it (the cache is donated on every call).
  """

  def __init__(self, model: Llama, config: RunnerConfig = RunnerConfig()):
    self.model_config = model.cfg
    self.config = config
    self.dtype = model.dtype
    max_seq_len = config.max_seq_len or model.cfg.max_seq_len
    if max_seq_len > model.cfg.max_seq_len:
      raise ValueError(f"max_seq_len={max_seq_len} exceeds the model's context "
                       f"{model.cfg.max_seq_len}")
    self.max_seq_len = max_seq_len
    graphdef, self.state = nnx.split(model)
    self.cache: KVCache = init_kv_cache(model.cfg, config.num_slots, max_seq_len,
                                        config.cache_dtype or model.dtype, config.block_size)

    def prefill(state, cache, tokens_T, slot, start, true_len, all_logits):
      return nnx.merge(graphdef, state).prefill_chunk(
          cache, tokens_T, slot, start, true_len, block_size=config.block_size,
          all_logits=all_logits)

    def decode(state, cache, tokens_B, positions_B, active_B):
      return nnx.merge(graphdef, state).decode_step(
          cache, tokens_B, positions_B, active_B, block_size=config.block_size)

    def after_context(state, k_pre, v, tokens):
      return logits_after_context(nnx.merge(graphdef, state), k_pre, v, tokens)

    def context_grad(state, k_pre, v, tokens, targets):
      def log_likelihood(k_pre, v):
        logp_TV = jax.nn.log_softmax(after_context(state, k_pre, v, tokens), axis=-1)
        return jnp.sum(jnp.take_along_axis(logp_TV, targets[:, None], axis=-1))
      return jax.grad(log_likelihood, argnums=(0, 1))(k_pre, v)

    self._prefill = jax.jit(prefill, static_argnames=("all_logits",), donate_argnums=(1,))
    self._decode = jax.jit(decode, donate_argnums=(1,))
    self._after_context = jax.jit(after_context)
    self._context_grad = jax.jit(context_grad)
    self._insert = jax.jit(insert_chunk, donate_argnums=(0,))
    self._inv_freq = model.inv_freq[...]
    # Pallas codec kernels where they compile; XLA's build of the jnp reference on CPU (Pallas
    # compiles nothing for CPU; interpret mode is for tests).
    self.use_pallas_codecs = jax.default_backend() != "cpu"
    self._compiled_sizes: set[int] = set()
    self.kvtc_transform: kvtc.KVTCTransform | None = None
    self._kvtc_device: kvtc.KVTCDeviceTransform | None = None

  def set_kvtc_transform(self, transform: kvtc.KVTCTransform) -> None:
    """Sets the model's kvtc transform (`kvjax.models.kv_calibration`), used by the "kvtc" codec.

    Raises:
      ValueError: a transform of another model shape.
    """
    cfg = self.model_config
    if (transform.num_layers, transform.num_kv_heads, transform.head_dim) != (
        cfg.n_layers, cfg.n_kv_heads, cfg.head_dim):
      raise ValueError(f"kvtc transform for L={transform.num_layers}, K={transform.num_kv_heads},"
                       f" H={transform.head_dim}; the model has L={cfg.n_layers}, "
                       f"K={cfg.n_kv_heads}, H={cfg.head_dim}")
    self.kvtc_transform = transform
    self._kvtc_device = transform.device_arrays()

  def logits_after_context(self, k_pre_LSKH, v_LSKH, tokens_T) -> jax.Array:
    """f32[T, V] logits of `tokens_T` after a given context KV (`llama.logits_after_context`:
    dense attention, for calibration; compiled once per (S, T)).

    Args:
      k_pre_LSKH: f32[L, S, K, H] context keys before RoPE (positions 0..S-1).
      v_LSKH: f32[L, S, K, H] context values.
      tokens_T: int[T] tokens at positions S..S+T-1.
    """
    return self._after_context(self.state, jnp.asarray(k_pre_LSKH, jnp.float32),
                               jnp.asarray(v_LSKH, jnp.float32), jnp.asarray(tokens_T, jnp.int32))

  def context_kv_gradient(self, k_pre_LSKH, v_LSKH, tokens_T, targets_T
                          ) -> tuple[jax.Array, jax.Array]:
    """Gradient of `sum_t log p(targets_T[t] | context, tokens_T[:t+1])` with respect to the
    context KV: (f32[L, S, K, H] for K before RoPE, f32[L, S, K, H] for V). Arguments as
    `logits_after_context`, plus targets_T: int[T], the token each position is scored on."""
    return self._context_grad(self.state, jnp.asarray(k_pre_LSKH, jnp.float32),
                              jnp.asarray(v_LSKH, jnp.float32), jnp.asarray(tokens_T, jnp.int32),
                              jnp.asarray(targets_T, jnp.int32))

  def _need_kvtc(self) -> kvtc.KVTCDeviceTransform:
    if self._kvtc_device is None:
      raise ValueError("kv_codec 'kvtc' needs a calibrated transform (set_kvtc_transform)")
    return self._kvtc_device

  def reset(self) -> None:
    """Zeroes the KV cache (every slot), keeping the compiled programs."""
    self.cache = init_kv_cache(self.model_config, self.config.num_slots, self.max_seq_len,
                               self.cache.k_LBSKH.dtype, self.config.block_size)

  @property
  def chunk_sizes(self) -> tuple[int, ...]:
    return self.config.chunk_sizes

  @property
  def max_chunk_size(self) -> int:
    return self.config.chunk_sizes[-1]

  def is_compiled(self, num_tokens: int) -> bool:
    """Whether a prefill of `num_tokens` tokens runs an already compiled program."""
    return self.bucket_for(num_tokens) in self._compiled_sizes

  def block_until_ready(self) -> None:
    """Waits for every pending write of the KV cache."""
    jax.block_until_ready(self.cache)

  def bucket_for(self, num_tokens: int) -> int:
    """Smallest compiled chunk size holding `num_tokens`.

    Raises:
      ValueError: if `num_tokens` is not in [1, max chunk size].
    """
    if not 1 <= num_tokens <= self.max_chunk_size:
      raise ValueError(f"chunk of {num_tokens} tokens; compiled sizes go from 1 to "
                       f"{self.max_chunk_size}")
    return self.chunk_sizes[bisect.bisect_left(self.chunk_sizes, num_tokens)]

  def prefill_chunk(self, token_ids, slot: int, start: int, *,
                    all_logits: bool = False) -> PrefillOutput:
    """Prefills `token_ids` into `slot` at positions `[start, start + len(token_ids))`.

    Args:
      token_ids: int sequence of 1..max chunk size tokens.
      slot: decode slot in [0, num_slots).
      start: position of the first token; the slot must hold this sequence's `[0, start)`.
      all_logits: return f32[len, V] logits (tests) instead of f32[V] for the last token.

    Returns:
      `PrefillOutput` with device arrays; its padded rows are trimmed. The runner keeps the
      updated cache.

    Raises:
      ValueError: if the chunk does not fit the slot or the compiled sizes.
    """
    n = len(token_ids)
    bucket = self.bucket_for(n)
    if not 0 <= slot < self.config.num_slots:
      raise ValueError(f"slot {slot} outside [0, {self.config.num_slots})")
    if start < 0 or start + n > self.max_seq_len:
      raise ValueError(f"positions [{start}, {start + n}) exceed max_seq_len={self.max_seq_len}")
    tokens = np.zeros((bucket,), np.int32)
    tokens[:n] = token_ids
    out = self._prefill(self.state, self.cache, tokens, np.int32(slot), np.int32(start),
                        np.int32(n), all_logits)
    self.cache = out.cache
    self._compiled_sizes.add(bucket)
    return dataclasses.replace(
        out, logits=out.logits[:n] if all_logits else out.logits,
        k_pre_rope_LTKH=out.k_pre_rope_LTKH[:, :n], v_LTKH=out.v_LTKH[:, :n])

  def decode_step(self, tokens_B: np.ndarray, positions_B: np.ndarray,
                  active_B: np.ndarray) -> jax.Array:
    """One token for every active slot; returns f32[slots, V] logits (device array)."""
    logits, self.cache = self._decode(self.state, self.cache, np.asarray(tokens_B, np.int32),
                                      np.asarray(positions_B, np.int32),
                                      np.asarray(active_B, bool))
    return logits

  def insert_chunk(self, kv_L2CKH, slot: int, start: int) -> None:
    """Writes a stored chunk (K before RoPE, and V) into `slot` at `[start, start + C)`.

    Args:
      kv_L2CKH: [L, 2, C, K, H] host or device array, any float dtype.
      slot: decode slot.
      start: position of the chunk's first token.

    Raises:
      ValueError: if the chunk's shape does not match the model or the slot's positions.
    """
    cfg = self.model_config
    want = (cfg.n_layers, 2, kv_L2CKH.shape[2], cfg.n_kv_heads, cfg.head_dim)
    if tuple(kv_L2CKH.shape) != want:
      raise ValueError(f"chunk of shape {tuple(kv_L2CKH.shape)}, model wants {want}")
    if not 0 <= slot < self.config.num_slots or start < 0 or (
        start + kv_L2CKH.shape[2] > self.max_seq_len):
      raise ValueError(f"chunk at slot {slot}, positions [{start}, {start + kv_L2CKH.shape[2]}) "
                       f"does not fit {self.config.num_slots} slots of {self.max_seq_len}")
    self.cache = self._insert(self.cache, kv_L2CKH, np.int32(slot), np.int32(start),
                              self._inv_freq)

  def insert_payload(self, codec: str, arrays, slot: int, start: int) -> None:
    """Decodes a stored chunk's payload straight into `slot` at `[start, start + C)`.

    Dequantizes (undoing CacheGen deltas), applies RoPE to K at the target positions and writes
    the cache, in one jit'd call with the cache donated (`kvjax.kernels.kv_codec.kv_decode`).

    Args:
      codec: "raw", "int8", "int4", "cachegen" or "kvtc" (needs `set_kvtc_transform`; the
        payload's `transform_id` must be this runner's transform).
      arrays: the payload's arrays by name (`kvjax.kernels.kv_codec.payload_from_arrays`,
        `kvjax.kernels.kvtc.payload_from_arrays`).
      slot: decode slot.
      start: position of the chunk's first token.

    Raises:
      ValueError: a payload that does not match the model or does not fit the slot, or a kvtc
        payload without this runner's transform.
    """
    cfg = self.model_config
    if codec == codecs.KVTC:
      self._insert_kvtc(arrays, slot, start)
      return
    payload = kv_codec.payload_from_arrays(codec, arrays)
    n_layers, c, n_kv_heads, head_dim = kv_codec.validate_payload(payload)
    if (n_layers, n_kv_heads, head_dim) != (cfg.n_layers, cfg.n_kv_heads, cfg.head_dim):
      raise ValueError(f"payload for L={n_layers}, K={n_kv_heads}, H={head_dim}; the model has "
                       f"L={cfg.n_layers}, K={cfg.n_kv_heads}, H={cfg.head_dim}")
    if not 0 <= slot < self.config.num_slots or start < 0 or start + c > self.max_seq_len:
      raise ValueError(f"chunk at slot {slot}, positions [{start}, {start + c}) does not fit "
                       f"{self.config.num_slots} slots of {self.max_seq_len}")
    cos, sin = self._cos_sin(start, c)
    k, v = kv_codec.kv_decode(payload, self.cache.k_LBSKH, self.cache.v_LBSKH, np.int32(slot),
                              np.int32(start), cos, sin, use_pallas=self.use_pallas_codecs)
    self.cache = KVCache(k, v, self.cache.lengths_B)

  def _cos_sin(self, start: int, c: int) -> tuple[np.ndarray, np.ndarray]:
    angles = (start + np.arange(c, dtype=np.float32))[:, None] * np.asarray(self._inv_freq)
    angles = np.concatenate([angles, angles], axis=-1)  # [C, H], HF rotate_half layout
    return np.cos(angles), np.sin(angles)

  def _insert_kvtc(self, arrays, slot: int, start: int) -> None:
    t = self._need_kvtc()
    payload = kvtc.payload_from_arrays(arrays)
    if bytes(np.asarray(payload.transform_id)) != self.kvtc_transform.transform_id:
      raise ValueError("kvtc chunk coded with another transform than this runner's")
    _, c, _ = kvtc.validate_payload(payload, t)
    if not 0 <= slot < self.config.num_slots or start < 0 or start + c > self.max_seq_len:
      raise ValueError(f"chunk at slot {slot}, positions [{start}, {start + c}) does not fit "
                       f"{self.config.num_slots} slots of {self.max_seq_len}")
    cos, sin = self._cos_sin(start, c)
    k, v = kvtc.kvtc_decode(payload, t, self.cache.k_LBSKH, self.cache.v_LBSKH, np.int32(slot),
                            np.int32(start), cos, sin)
    self.cache = KVCache(k, v, self.cache.lengths_B)

  def encode_levels(self, kv_L2CKH, codec: str, levels: tuple[int, ...], start: int) -> list:
    """Quantizes one device chunk (K before RoPE) at every level in one jit'd device call.

    Thread-safe (no cache access). Dispatches asynchronously: the arrays stay on the device
    until the saver copies them to the host (once, for all levels).

    Args:
      kv_L2CKH: [L, 2, C, K, H] device array.
      codec: a codec other than "raw".
      levels: the levels to store side by side.
      start: position of the chunk's first token (kvtc codes the first tokens of a sequence
        finer; the chunk must be decoded at the same position).

    Returns:
      [(codec, level, {name: device array}, finite flag)] per level; store a level only when its
      flag is True (no NaN/inf).

    Raises:
      ValueError: an unknown codec or level.
    """
    if codec == codecs.KVTC:
      self._need_kvtc()
      for level in levels:
        codecs.check_codec(codec, (level,))
    fn = level_encoder(codec, tuple(levels), self.use_pallas_codecs)
    t = self._kvtc_device if codec == codecs.KVTC else None
    return [(codec, level, arrays, finite)
            for level, (arrays, finite) in zip(levels, fn(kv_L2CKH, t, np.int32(start)))]

  def close(self) -> None:
    """Frees the parameters and the KV cache on the device; the runner is unusable afterwards."""
    for leaf in jax.tree_util.tree_leaves((self.state, self.cache)):
      if isinstance(leaf, jax.Array) and not leaf.is_deleted():
        leaf.delete()

  def kv_cache_nbytes(self) -> int:
    """Device bytes the slots' K and V buffers take (reserved whole at construction)."""
    return int(self.cache.k_LBSKH.nbytes + self.cache.v_LBSKH.nbytes)

  def cache_ok(self) -> bool:
    """The KV cache buffers are alive (a failed donated call can leave them deleted)."""
    return not self.cache.k_LBSKH.is_deleted()

  def warmup(self, chunk_sizes: tuple[int, ...] | None = None, *, decode: bool = True) -> None:
    """Compiles (or loads from the persistent cache) every prefill size and the decode step
    (`chunk_sizes`: these sizes only; `decode=False`: no decode step).

    Writes only slot 0 positions that a later prefill at position 0 overwrites.
    """
    for size in self.chunk_sizes if chunk_sizes is None else chunk_sizes:
      if size <= self.max_seq_len:
        jax.block_until_ready(self.prefill_chunk([0] * size, 0, 0).logits)
    if decode:
      b = self.config.num_slots
      jax.block_until_ready(self.decode_step(np.zeros(b), np.zeros(b), np.zeros(b, bool)))
    self.cache = dataclasses.replace(self.cache, lengths_B=jnp.zeros_like(self.cache.lengths_B))
