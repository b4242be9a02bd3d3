"""The codec programs of the paged runner: the jit'd encode of a device KV chunk at every stored
level (the runner's saves), and the payload inserts (a stored chunk's payload decoded on the
device and written into its pool blocks: `kv_codec.kv_decode` for raw, int8, int4 and
cachegen, per shard under tensor parallelism; `kvtc.dequantize_reference` for kvtc).

Each function builds a program; none holds a pool (the runner,
`kvjax.models.runner.paged_runner.PagedModelRunner`, owns it and passes it in).

Axes: L layers, C tokens of a chunk, K key/value heads, H head width.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from kvjax import codecs
from kvjax.kernels import kv_codec, kv_payloads, kvtc
from kvjax.models.nn.config import LlamaConfig
from kvjax.models.nn.kv_cache import write_chunk_blocks
from kvjax.models.nn.layers import apply_rope
from kvjax.models.runner.runner_api import RunnerGeometry
from kvjax.models.runner.sharding import TensorParallel, put


@functools.lru_cache(maxsize=None)
def level_encoder(codec: str, levels: tuple[int, ...], use_pallas: bool,
                  platform: str | None = None):
  """One jit'd function encoding a device chunk at every level of `levels` in one call.

  Compiled once per codec, levels and backend choice; `platform` is the codec kernels' target
  (None: the platform being compiled for).

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


def rope_tables(start: int, c: int, inv_freq) -> tuple[np.ndarray, np.ndarray]:
  """cos and sin, f32[C, H] each (HF rotate_half layout), of positions `[start, start + c)`:
  the payload insert's RoPE of K."""
  angles = (start + np.arange(c, dtype=np.float32))[:, None] * np.asarray(inv_freq)
  angles = np.concatenate([angles, angles], axis=-1)  # [C, H], HF rotate_half layout
  return np.cos(angles), np.sin(angles)


def payload_insert_program(model_config: LlamaConfig, *, use_pallas: bool,
                           platform: str | None, tp: TensorParallel | None = None,
                           pool_shardings=None):
  """The jit'd payload insert (`kv_codec.kv_decode`: dequantize, RoPE K; then the block write),
  pool donated: `fn(pool, payload, block_ids, cos_CH, sin_CH) -> pool`.

  With `tp`, the codec kernel runs per shard: each device decodes its own heads of the payload
  (placed by head, `place_payload`), and the pool keeps `pool_shardings`.
  """
  if tp is None:
    cfg = model_config

    def insert_payload(pool, payload, block_ids, cos_CH, sin_CH):
      c = cos_CH.shape[0]
      scratch = jnp.zeros((cfg.n_layers, 1, c, cfg.n_kv_heads, cfg.head_dim), jnp.float32)
      k, v = kv_codec.kv_decode(payload, scratch, scratch, 0, 0, cos_CH, sin_CH,
                                use_pallas=use_pallas, platform=platform)
      return write_chunk_blocks(pool, k[:, 0], v[:, 0], block_ids)

    return jax.jit(insert_payload, donate_argnums=(0,))

  def insert_payload_sharded(pool, payload, block_ids, cos_CH, sin_CH):
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

  return jax.jit(insert_payload_sharded, donate_argnums=(0,), out_shardings=pool_shardings)


def _payload_shardings(tp: TensorParallel):
  """Where a payload's arrays go under `tp`: by KV head ([L, 2, C, K, *] arrays, and the
  4-axis ones)."""
  return tp.chunk_sharding, tp.sharding(P(None, None, "tp", None))


def place_payload(payload, tp: TensorParallel, kv_head_repeat: int):
  """Tensor parallel: each device receives its heads of every payload array (each KV head
  repeated `kv_head_repeat` times on the host first when the pool repeats heads)."""
  r, (heads5, heads4) = kv_head_repeat, _payload_shardings(tp)
  return type(payload)(*(
      put(np.repeat(np.asarray(x), r, axis=x.ndim - 2) if r > 1 else x,
          heads5 if x.ndim == 5 else heads4) for x in payload))


def payload_specs(model_config: LlamaConfig, codec: str, c: int, *, sharding=None,
                  tp: TensorParallel | None = None, kv_head_repeat: int = 1):
  """A chunk of `c` tokens' payload of `codec` as ShapeDtypeStructs, placed as the runner's
  `insert_payload` places it: on `sharding` without `tp`, by head under `tp` (each KV head
  repeated `kv_head_repeat` times)."""
  cfg = model_config
  chunk = jax.ShapeDtypeStruct((cfg.n_layers, 2, c, cfg.n_kv_heads, cfg.head_dim), jnp.float32)
  payload = jax.eval_shape(
      lambda x: kv_codec.kv_encode(x, codec, use_pallas=False, platform="cpu")[0], chunk)
  if tp is None:
    return type(payload)(*(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
                           for x in payload))
  heads5, heads4 = _payload_shardings(tp)
  out = []
  for x in payload:
    shape = list(x.shape)
    shape[x.ndim - 2] *= kv_head_repeat
    out.append(jax.ShapeDtypeStruct(tuple(shape), x.dtype,
                                    sharding=heads5 if x.ndim == 5 else heads4))
  return type(payload)(*out)


def kvtc_insert_program(model_config: LlamaConfig, inv_freq):
  """The jit'd kvtc payload insert, pool donated: `fn(pool, payload, device transform,
  block_ids, start) -> pool` (dequantize and inverse-transform at the encoder's position,
  `kvtc.dequantize_reference`; RoPE K at the chunk's positions, as a raw insert does; write
  whole blocks)."""
  n_kv_heads, head_dim = model_config.n_kv_heads, model_config.head_dim

  def insert_kvtc(pool, payload, t, block_ids, start):
    kv = kvtc.dequantize_reference(payload, t, n_kv_heads, head_dim, start=start)
    positions_1C = (start + jnp.arange(kv.shape[2], dtype=jnp.int32))[None]
    k_LCKH = apply_rope(kv[:, 0], positions_1C, inv_freq)
    return write_chunk_blocks(pool, k_LCKH, kv[:, 1], block_ids)

  return jax.jit(insert_kvtc, donate_argnums=(0,))


class RunnerCodecs:
  """The codec side of one paged runner: its payload insert programs, the kvtc transform (with
  its device copy and insert program) and the level encoders. Holds no pool: every insert takes
  the runner's pool and returns the new one.

  Args:
    model_config: the model's architecture (L, K, H are read).
    inv_freq: f32[H / 2] RoPE inverse frequencies.
    platform: the platform the programs are built for ("cpu" | "tpu" | "cuda"); Pallas codec
      kernels off CPU.
    tp: the runner's tensor-parallel mesh, or None.
    kv_head_repeat: r, copies of each KV head in the pool.
    pool_shardings: the pool's shardings under `tp`.
  """

  def __init__(self, model_config: LlamaConfig, inv_freq, *, platform: str | None,
               tp: TensorParallel | None = None, kv_head_repeat: int = 1,
               pool_shardings=None):
    self._cfg, self._inv_freq, self._platform = model_config, inv_freq, platform
    self._tp, self._kv_head_repeat = tp, kv_head_repeat
    self.use_pallas = platform != "cpu"
    self.insert_program = payload_insert_program(model_config, use_pallas=self.use_pallas,
                                                 platform=platform, tp=tp,
                                                 pool_shardings=pool_shardings)
    #: The kvtc codec's transform (`set_kvtc_transform`), its device copy and insert program.
    self.kvtc_transform: kvtc.KVTCTransform | None = None
    self._kvtc_device: kvtc.KVTCDeviceTransform | None = None
    self._kvtc_insert = None

  def set_kvtc_transform(self, transform: kvtc.KVTCTransform) -> None:
    """See `PagedModelRunner.set_kvtc_transform`.

    Raises:
      ValueError: a transform of another model shape, or a tensor-parallel runner.
    """
    cfg = self._cfg
    if self._tp is not None:
      raise ValueError("kv_codec='kvtc' runs on one device (no tensor parallelism)")
    if (transform.num_layers, transform.num_kv_heads, transform.head_dim) != (
        cfg.n_layers, cfg.n_kv_heads, cfg.head_dim):
      raise ValueError(f"kvtc transform for L={transform.num_layers}, K={transform.num_kv_heads},"
                       f" H={transform.head_dim}; the model has L={cfg.n_layers}, "
                       f"K={cfg.n_kv_heads}, H={cfg.head_dim}")
    self.kvtc_transform = transform
    self._kvtc_device = transform.device_arrays()
    if self._kvtc_insert is None:
      self._kvtc_insert = kvtc_insert_program(cfg, self._inv_freq)

  def _need_kvtc(self) -> kvtc.KVTCDeviceTransform:
    if self._kvtc_device is None:
      raise ValueError("kv_codec 'kvtc' needs a calibrated transform (set_kvtc_transform)")
    return self._kvtc_device

  def insert(self, pool, codec: str, arrays, geometry: RunnerGeometry, block_ids: Sequence[int],
             start: int):
    """Decodes a stored chunk's payload into its blocks of `pool` (see
    `PagedModelRunner.insert_payload`; `geometry` checks the blocks); returns the new pool.

    Raises:
      ValueError: a payload that does not match the model, blocks that do not fit it, or a
        kvtc payload without this runner's transform.
    """
    if codec == codecs.KVTC:
      t = self._need_kvtc()
      payload = kvtc.payload_from_arrays(arrays)
      if bytes(np.asarray(payload.transform_id)) != self.kvtc_transform.transform_id:
        raise ValueError("kvtc chunk coded with another transform than this runner's")
      _, c, _ = kvtc.validate_payload(payload, t)
      ids = geometry.check_chunk(c, block_ids, start)
      return self._kvtc_insert(pool, payload, t, ids, np.int32(start))
    payload = kv_codec.payload_from_arrays(codec, arrays)
    n_layers, c, n_kv_heads, head_dim = kv_payloads.validate_payload(payload)
    cfg = self._cfg
    if (n_layers, n_kv_heads, head_dim) != (cfg.n_layers, cfg.n_kv_heads, cfg.head_dim):
      raise ValueError(f"payload for L={n_layers}, K={n_kv_heads}, H={head_dim}; the model has "
                       f"L={cfg.n_layers}, K={cfg.n_kv_heads}, H={cfg.head_dim}")
    ids = geometry.check_chunk(c, block_ids, start)
    cos_CH, sin_CH = rope_tables(start, c, self._inv_freq)
    if self._tp is not None:  # each device receives its heads of every payload array
      payload = place_payload(payload, self._tp, self._kv_head_repeat)
    return self.insert_program(pool, payload, ids, cos_CH, sin_CH)

  def encode_levels(self, kv_L2CKH, codec: str, levels: tuple[int, ...], start: int) -> list:
    """See `PagedModelRunner.encode_levels`.

    Raises:
      ValueError: an unknown codec or level, or kvtc without a transform.
    """
    t = None
    if codec == codecs.KVTC:
      t = self._need_kvtc()
      for level in levels:
        codecs.check_codec(codec, (level,))
    fn = level_encoder(codec, tuple(levels), self.use_pallas, self._platform)
    return [(codec, level, arrays, finite)
            for level, (arrays, finite) in zip(levels, fn(kv_L2CKH, t, np.int32(start)))]

  def aot_programs(self, pool, *, chunk_tokens: int, block_size: int, codec_names: Sequence[str],
                   dtype, sds) -> list[tuple[str, object, tuple]]:
    """Per codec the payload insert and the encode of every level, as `(name, jitted function,
    abstract arguments)` (see `PagedModelRunner.aot_programs`); `sds(shape, dtype, sharding=None)`
    places an argument as the runner places host inputs. kvtc (one device only: none under
    tensor parallelism) gets its insert (`kvtc_insert_program`) and level encoder with an
    abstract device transform; the rANS decode that precedes its insert is the store client's
    (`kvjax.kernels.kvtc_rans`), not the runner's."""
    cfg, c = self._cfg, chunk_tokens
    chunk = sds((cfg.n_layers, 2, c, cfg.n_kv_heads, cfg.head_dim), dtype)
    out = []
    for codec in codec_names:
      if codec == codecs.KVTC:
        if self._tp is None:
          out += self._kvtc_aot_programs(pool, chunk, c, block_size, sds)
        continue
      if codec != "raw" or self._tp is None:
        payload = payload_specs(cfg, codec, c, sharding=sds(()).sharding, tp=self._tp,
                                kv_head_repeat=self._kv_head_repeat)
        out.append((f"insert_payload[{codec},C={c}]", self.insert_program,
                    (pool, payload, sds((c // block_size,)),
                     sds((c, cfg.head_dim), jnp.float32), sds((c, cfg.head_dim), jnp.float32))))
      levels = tuple(codecs.CODEC_LEVELS[codec])
      fn = level_encoder(codec, levels, self.use_pallas, self._platform)
      out.append((f"encode[{codec},levels={len(levels)},C={c}]", fn, (chunk, None, sds(()))))
    return out

  def _kvtc_aot_programs(self, pool, chunk, c: int, block_size: int, sds) -> list:
    """kvtc's insert and level encoder with abstract arguments (see `aot_programs`)."""
    cfg = self._cfg
    l_, d, f32 = cfg.n_layers, cfg.n_kv_heads * cfg.head_dim, jnp.float32
    levels = tuple(codecs.CODEC_LEVELS[codecs.KVTC])
    t = kvtc.KVTCDeviceTransform(
        sds((l_, 2, d), f32), sds((l_, 2, d, d), f32), sds((l_, 2, d, d), f32),
        sds((len(levels), l_, 2), f32), sds((l_, 2, kvtc.PREDICT_FEATURES * d, d), f32),
        sds((16,), jnp.uint8))
    payload = kvtc.KVTCPayload(sds((l_, 2, c, d), jnp.int16), sds((l_, 2), f32),
                               sds((16,), jnp.uint8))
    insert = self._kvtc_insert or kvtc_insert_program(cfg, self._inv_freq)
    fn = level_encoder(codecs.KVTC, levels, self.use_pallas, self._platform)
    return [(f"insert_payload[kvtc,C={c}]", insert,
             (pool, payload, t, sds((c // block_size,)), sds(()))),
            (f"encode[kvtc,levels={len(levels)},C={c}]", fn, (chunk, t, sds(())))]
