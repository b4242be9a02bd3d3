"""The connector's device seam: what the KV connector asks of the device, as a protocol.

Device work belongs to the runner (`kvjax/models/runner/device_seam.py`: `JaxDeviceSeam`, handed out
by `PagedModelRunner.device_seam()`; the fake runner's is numpy). The connector calls the
device only through a `DeviceSeam` it is given (`KVStoreClient(device=)`): entropy decode on
the device, host -> device puts, device -> host gets, the device bytes a value holds. No
module of `kvjax/connector/` imports jax.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import numpy as np

from kvjax.storage.format import entropy
from kvjax.storage.format.types import ChunkHit, ChunkMiss, MissReason


@runtime_checkable
class DeviceSeam(Protocol):
  """The runner's device, as the connector sees it (plain data in, handles out).

  Attributes:
    platform: the target platform of the runner whose cache the chunks go to ("cpu" | "tpu" |
      "cuda", `kvjax.kernels.platform`): the device decoders are chosen and compiled for it.
  """

  platform: str

  def put(self, host_array: np.ndarray) -> Any:
    """Starts putting a host array on the device (not waited for); returns its handle."""
    ...

  def get(self, tree: Any) -> Any:
    """Copies a tree of device arrays (host arrays pass through) to the host in one
    transfer."""
    ...

  def decode_entropy(self, codes: entropy.RansCodes) -> tuple[Any, bool]:
    """(int16 codes `[L, 2, C, D]` on the device, ok: bool) of one array the reader left
    rANS-coded (`entropy.RansCodes`); ok False: a stream did not decode to its initial state.

    Raises:
      ValueError: band arrays that do not fit together."""
    ...

  def nbytes(self, value: Any) -> int:
    """Bytes `value` holds on the device: an array's size for a device array, 0 for anything
    else (host arrays, scalars)."""
    ...


def held_nbytes(hit: ChunkHit, seam: DeviceSeam) -> int:
  """Bytes a staged chunk holds: its stored bytes plus every array already decoded on the device
  (`decode_on_device`)."""
  return int(hit.nbytes) + sum(seam.nbytes(a) for a in hit.payload.values())


def decode_on_device(got: ChunkHit, seam: DeviceSeam) -> ChunkHit | ChunkMiss:
  """Host bytes -> device -> rANS decode of every entropy-coded array (`seam.decode_entropy`,
  one jit'd call each on a jax runner); a failed `ok` check, or bands that do not fit, is a
  CORRUPT miss. The staged payload then holds the int16 codes as a device array, for the
  runner's dequantize -> inverse transform -> RoPE -> cache write.

  Args:
    got: a landed hit whose payload may hold `entropy.RansCodes` arrays.
    seam: the runner's device seam.
  """
  arrays = dict(got.payload)
  for name, a in got.payload.items():
    if not isinstance(a, entropy.RansCodes):
      continue
    try:
      q, ok = seam.decode_entropy(a)
    except ValueError as e:
      return ChunkMiss(got.record.chunk_hash, MissReason.CORRUPT, f"{name}: {e}")
    if not ok:
      return ChunkMiss(got.record.chunk_hash, MissReason.CORRUPT,
                       f"{name}: rANS streams did not decode to their initial state")
    arrays[name] = q
  return dataclasses.replace(got, payload=arrays)


__all__ = ["DeviceSeam", "decode_on_device", "held_nbytes"]
