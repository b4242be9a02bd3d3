"""The connector's device seam: every jax call of the KV connector lives here.

Device work belongs to the runner; until the runner takes it, the connector calls these few
functions only (entropy decode on the device, host -> device puts, device -> host gets), so
the rest of `kvjax/connector/` imports no jax.

`resolve_platform` (re-exported from `kvjax.kernels.platform`) names the runner's platform.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from kvjax.kernels import kvtc_rans
from kvjax.kernels.platform import resolve_platform
from kvjax.storage import entropy
from kvjax.storage.types import ChunkHit, ChunkMiss, MissReason


def held_nbytes(hit: ChunkHit) -> int:
  """Bytes a staged chunk holds: its stored bytes plus every array already decoded on the device
  (`decode_on_device`)."""
  return int(hit.encoding.nbytes) + sum(int(a.nbytes) for a in hit.payload.values()
                                        if isinstance(a, jax.Array))


def rans_decode(a: entropy.RansCodes, *, use_pallas: bool, platform: str):
  """(codes on the device, ok: bool) of one array the reader left rANS-coded.

  Raises:
    ValueError: band arrays that do not fit together (`kvtc_rans.pack_bands`)."""
  packed = kvtc_rans.pack_bands(a.shape, a.bands, a.offsets, a.arrays)
  q, ok = kvtc_rans.decode_codes(packed, use_pallas=use_pallas, platform=platform)
  return q, bool(ok)


def decode_on_device(got: ChunkHit, decode) -> ChunkHit | ChunkMiss:
  """Host bytes -> device -> rANS decode of every entropy-coded array (one jit'd call each,
  `kvtc_rans.decode_codes`); a failed `ok` check is a CORRUPT miss. The staged payload then
  holds the int16 codes as a device array, for the runner's dequantize -> inverse transform ->
  RoPE -> cache write.

  Args:
    got: a landed hit whose payload may hold `entropy.RansCodes` arrays.
    decode: `RansCodes -> (codes on the device, ok)` (`rans_decode` with the runner's
      platform).
  """
  arrays = dict(got.payload)
  for name, a in got.payload.items():
    if not isinstance(a, entropy.RansCodes):
      continue
    try:
      q, ok = decode(a)
    except ValueError as e:
      return ChunkMiss(got.record.chunk_hash, MissReason.CORRUPT, f"{name}: {e}")
    if not ok:
      return ChunkMiss(got.record.chunk_hash, MissReason.CORRUPT,
                       f"{name}: rANS streams did not decode to their initial state")
    arrays[name] = q
  return dataclasses.replace(got, payload=arrays)


def put(piece: np.ndarray) -> Any:
  """Starts putting a host array on the default device (not waited for)."""
  return jax.device_put(np.ascontiguousarray(piece))


def get(tree: Any) -> Any:
  """Copies a tree of device arrays to the host in one transfer."""
  return jax.device_get(tree)


__all__ = ["decode_on_device", "get", "held_nbytes", "put", "rans_decode", "resolve_platform"]
