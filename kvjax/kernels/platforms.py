"""The target platform of a Pallas kernel wrapper: "cpu", "tpu" or "cuda".

Kernel wrappers take `platform: str | None = None` and pick their kernel body by it: "cuda" the
Triton bodies (`*_gpu.py`, `paged_attention/gpu.py`), "tpu" the Mosaic TPU ones, "cpu" none (the
jnp reference, or any body in interpret mode). None means the platform of the default device.
Naming the platform lets a CPU host build a program for another one (`jax.export` with
`platforms=[...]`: lowering needs no device).
"""

from __future__ import annotations

import jax

PLATFORMS = ("cpu", "tpu", "cuda")


def resolve_platform(platform: str | None = None) -> str:
  """`platform`, or the default device's ("gpu" backends are "cuda").

  Raises:
    ValueError: a platform not in PLATFORMS.
  """
  if platform is None:
    backend = jax.default_backend()
    platform = "cuda" if backend == "gpu" else backend
  if platform not in PLATFORMS:
    raise ValueError(f"platform={platform!r}, want one of {PLATFORMS} (or None: the default "
                     "device's)")
  return platform
