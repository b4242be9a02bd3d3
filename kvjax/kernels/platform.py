"""The target platform of a kernel: the devices a program compiles for, not the host.

Every kernel wrapper takes `platform` ("cpu" | "tpu" | "cuda"); None means the platform of the
devices being compiled for: the abstract mesh in context (`jax.sharding.use_abstract_mesh`, how
a program is traced for TPU topology devices on a machine without a TPU), else
`jax.default_backend()`. So a program for a v6e (or a CUDA GPU) can be traced, lowered and
compiled on a CPU-only machine (scripts/compile_check.py), and a runner picks kernels from the
devices it places its arrays on.
"""

from __future__ import annotations

from typing import Sequence

import jax

#: The platforms a kernel can be chosen for.
PLATFORMS = ("cpu", "tpu", "cuda")
# jax's device.platform names -> ours ("gpu" is CUDA: the only GPU the kernels target).
_JAX_NAMES = {"cpu": "cpu", "tpu": "tpu", "gpu": "cuda", "cuda": "cuda"}


def platform_name(jax_platform: str) -> str:
  """Our name of a jax platform name ("gpu" -> "cuda").

  Raises:
    ValueError: a platform no kernel targets (e.g. "rocm", "metal").
  """
  if jax_platform not in _JAX_NAMES:
    raise ValueError(f"platform {jax_platform!r}: kernels target {PLATFORMS}")
  return _JAX_NAMES[jax_platform]


def platform_of(devices: Sequence) -> str:
  """The platform of `devices` (one platform; TPU topology devices count as "tpu").

  Raises:
    ValueError: no devices, devices of several platforms, or one no kernel targets.
  """
  names = {platform_name(d.platform) for d in devices}
  if len(names) != 1:
    raise ValueError(f"devices of platforms {sorted(names)}: want exactly one")
  return names.pop()


def resolve_platform(platform: str | None = None) -> str:
  """`platform` checked, or (None) the platform being compiled for: the abstract mesh in
  context when it names its devices' platform, else `jax.default_backend()`.

  Raises:
    ValueError: a platform outside `PLATFORMS`.
  """
  if platform is not None:
    if platform not in PLATFORMS:
      raise ValueError(f"platform={platform!r}, want one of {PLATFORMS}")
    return platform
  mesh = jax.sharding.get_abstract_mesh()
  device = None if mesh.empty else mesh.abstract_device
  if device is not None:
    return platform_name(device.platform)
  return platform_name(jax.default_backend())
