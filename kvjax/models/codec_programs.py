"""The jit'd encode of a device KV chunk at every stored level (the runner's saves)."""

from __future__ import annotations

import functools

import jax

from kvjax import codecs
from kvjax.kernels import kv_codec, kvtc


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
