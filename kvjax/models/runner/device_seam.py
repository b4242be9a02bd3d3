"""The runner's device as the KV connector sees it (`kvjax.connector.device.DeviceSeam`):
host -> device puts, device -> host gets, rANS entropy decode on the device.

Device work belongs to the runner: the connector holds one of these (`KVStoreClient(device=)`,
`PagedModelRunner.device_seam()`) and imports no jax itself.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from kvjax.kernels import kvtc_rans
from kvjax.kernels.platform import resolve_platform


class JaxDeviceSeam:
  """The connector's device seam on jax's default device.

  Args:
    platform: the target platform of the runner whose cache the chunks go to ("cpu" | "tpu" |
      "cuda", `kvjax.kernels.platform`; a paged runner's `platform`): the entropy decoder is
      chosen and compiled for it, not for the host. None: the platform being compiled for
      (`resolve_platform`: the default backend outside an abstract mesh).
    use_pallas_entropy: how an array the reader left entropy-coded
      (`kvjax.storage.format.entropy.RansCodes`: kvtc's "rans-bands" `q`) is decoded on the device: the
      Pallas rANS kernel (True) or the jit'd jnp reference (False); None: Pallas when
      `platform` is GPU or TPU, the jnp reference on CPU (measured faster there than the numpy
      host decoder, `scripts/bench_rans.py`).

  Raises:
    ValueError: an unknown platform (`resolve_platform`).
  """

  def __init__(self, platform: str | None = None, use_pallas_entropy: bool | None = None):
    #: The entropy decoder's target platform ("cpu" | "tpu" | "cuda").
    self.platform = resolve_platform(platform)
    self.use_pallas_entropy = (self.platform != "cpu" if use_pallas_entropy is None
                               else bool(use_pallas_entropy))

  def put(self, host_array: np.ndarray) -> jax.Array:
    """Starts putting a host array on the default device (not waited for)."""
    return jax.device_put(np.ascontiguousarray(host_array))

  def get(self, tree: Any) -> Any:
    """Copies a tree of device arrays to the host in one transfer."""
    return jax.device_get(tree)

  def decode_entropy(self, codes) -> tuple[jax.Array, bool]:
    """(int16 codes `[L, 2, C, D]` on the device, ok: bool) of one
    `kvjax.storage.format.entropy.RansCodes` (`kvtc_rans.decode_codes`, one jit'd call).

    Raises:
      ValueError: band arrays that do not fit together (`kvtc_rans.pack_bands`)."""
    packed = kvtc_rans.pack_bands(codes.shape, codes.bands, codes.offsets, codes.arrays)
    q, ok = kvtc_rans.decode_codes(packed, use_pallas=self.use_pallas_entropy,
                                   platform=self.platform)
    return q, bool(ok)

  def nbytes(self, value: Any) -> int:
    """Bytes `value` holds on the device: a `jax.Array`'s size, else 0."""
    return int(value.nbytes) if isinstance(value, jax.Array) else 0
