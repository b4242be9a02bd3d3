"""Lossless entropy coding of int8 symbol arrays, one probability model per group (`pcodec`).

CacheGen (arXiv 2310.07240, section 5.2) arithmetic-codes its quantized deltas with a probability
model per layer and channel. Here the caller splits the array into groups (cachegen: one group
per (layer, K/V) slice of `[L, 2, C, K, H]`) and each group is one pcodec chunk: pcodec picks
bins over the group's symbols (for these small integer alphabets, one bin per symbol with its
weight: a categorical model of the group, stored in the chunk header) and codes them with tANS.
Channels of a group share its model because the codec's per-channel step already scales every
channel to one spread; measured on real SmolLM2 KV, separate per-channel models would save at
most 2-4% before paying for their tables and cost 3-11% more once their parameters or tables are
stored (table in `kvjax/storage/codecs.py`).

pcodec is used as a plain order-0 coder: no delta encoding, classic mode (`_CONFIG`).

Byte format of one coded array (little endian):

    u32 G                 groups (the array's C-order values are G equal groups)
    u32 nbytes[G]         length of each group's pcodec standalone file
    G pcodec standalone files, back to back, to the end

kvtc components (`encode_components`): int16 codes `q[L, 2, C, D]` (D components by descending
variance) are coded with one pcodec model per (layer, K/V, band of components), bands
`COMPONENT_BANDS` (clipped to D): the spread of a component falls by orders of magnitude from the
first to the last, so one model per (layer, K/V) would waste bits on the quiet ones. Format:

    u32 B                 bands actually used (after clipping to D)
    u32 nbytes[L * 2 * B] length of each group's pcodec standalone file, (l, kv, band) order
    the files, back to back (each codes the band's codes component-major: [width, C])

This is the one function pair to swap for another entropy coder (e.g. a device-decodable rANS).

A damaged file can decode to wrong symbols without an error from pcodec, so callers check a CRC
of the decoded values (`codecs` does).
"""

from __future__ import annotations

import struct

import numpy as np
import pcodec
from pcodec import standalone

_CONFIG = pcodec.ChunkConfig(enable_8_bit=True, delta_spec=pcodec.DeltaSpec.no_op(),
                             mode_spec=pcodec.ModeSpec.classic())


_CONFIG_16 = pcodec.ChunkConfig(delta_spec=pcodec.DeltaSpec.no_op(),
                                mode_spec=pcodec.ModeSpec.classic())
#: Band edges over kvtc components (clipped to D; the last band runs to D).
COMPONENT_BANDS = (0, 2, 6, 16, 40, 96)


class EntropyError(ValueError):
  """Coded bytes that cannot be decoded (truncated, malformed, inconsistent)."""


def encode_groups(q: np.ndarray, num_groups: int) -> bytes:
  """Entropy-codes an int8 array with one model per group.

  Args:
    q: int8 array of any shape; its C-order values are split into `num_groups` equal groups.
    num_groups: G >= 1, dividing `q.size`.

  Returns:
    The coded bytes (format in the module docstring).

  Raises:
    ValueError: `q` is not int8 or `num_groups` does not divide its size.
  """
  if q.dtype != np.int8:
    raise ValueError(f"entropy coding wants int8, got {q.dtype}")
  if num_groups < 1 or q.size % num_groups:
    raise ValueError(f"{num_groups} groups do not divide {q.size} values")
  groups = np.ascontiguousarray(q).reshape(num_groups, -1)
  files = [standalone.simple_compress(np.ascontiguousarray(g), _CONFIG) for g in groups]
  head = struct.pack(f"<I{num_groups}I", num_groups, *(len(f) for f in files))
  return head + b"".join(files)


def decode_groups(data: bytes | memoryview, shape: tuple[int, ...]) -> np.ndarray:
  """Decodes `encode_groups` output to an int8 array of `shape`.

  Raises:
    EntropyError: truncated or malformed bytes, a group count that does not divide the size,
      group lengths that do not add up, or a group with too few or too many values.
  """
  data = memoryview(data).cast("B")
  size = int(np.prod(shape, dtype=np.int64))
  if len(data) < 4:
    raise EntropyError("truncated entropy header")
  (num_groups,) = struct.unpack_from("<I", data, 0)
  if num_groups < 1 or size % num_groups or 4 + 4 * num_groups > len(data):
    raise EntropyError(f"{num_groups} groups for {size} values in {len(data)} bytes")
  lengths = struct.unpack_from(f"<{num_groups}I", data, 4)
  pos = 4 + 4 * num_groups
  if pos + sum(lengths) != len(data):
    raise EntropyError(f"group lengths add up to {pos + sum(lengths)} bytes, have {len(data)}")
  out = np.empty((num_groups, size // num_groups), np.int8)
  for g, n in enumerate(lengths):
    try:
      progress = standalone.simple_decompress_into(bytes(data[pos:pos + n]), out[g])
    except (RuntimeError, TypeError, ValueError) as e:
      raise EntropyError(f"group {g}: {e}") from e
    if not progress.finished or progress.n_processed != out.shape[1]:
      raise EntropyError(f"group {g}: {progress.n_processed} values, want {out.shape[1]}")
    pos += n
  return out.reshape(shape)


def _bands(d: int) -> list[tuple[int, int]]:
  edges = [e for e in COMPONENT_BANDS if e < d] + [d]
  return list(zip(edges[:-1], edges[1:]))


def encode_components(q_L2CD: np.ndarray) -> bytes:
  """Entropy-codes kvtc codes with one model per (layer, K/V, band of components).

  Args:
    q_L2CD: int16[L, 2, C, D].

  Returns:
    The coded bytes (format in the module docstring).

  Raises:
    ValueError: not int16[L, 2, C, D].
  """
  if q_L2CD.dtype != np.int16 or q_L2CD.ndim != 4 or q_L2CD.shape[1] != 2:
    raise ValueError(f"kvtc codes must be int16[L, 2, C, D], got {q_L2CD.dtype}{q_L2CD.shape}")
  bands = _bands(q_L2CD.shape[3])
  comp = np.ascontiguousarray(np.swapaxes(q_L2CD, 2, 3))           # [L, 2, D, C]
  files = [standalone.simple_compress(np.ascontiguousarray(comp[l, a, lo:hi]).reshape(-1),
                                      _CONFIG_16)
           for l in range(comp.shape[0]) for a in range(2) for lo, hi in bands]
  head = struct.pack(f"<I{len(files)}I", len(bands), *(len(f) for f in files))
  return head + b"".join(files)


def decode_components(data: bytes | memoryview, shape: tuple[int, ...]) -> np.ndarray:
  """Decodes `encode_components` output to int16 `shape` = [L, 2, C, D].

  Raises:
    EntropyError: truncated or malformed bytes, or a group with too few or too many values.
  """
  data = memoryview(data).cast("B")
  if len(shape) != 4 or shape[1] != 2:
    raise EntropyError(f"kvtc codes shape {shape} is not [L, 2, C, D]")
  l_, _, c, d = shape
  bands = _bands(d)
  n = l_ * 2 * len(bands)
  if len(data) < 4 + 4 * n:
    raise EntropyError("truncated kvtc entropy header")
  (num_bands,) = struct.unpack_from("<I", data, 0)
  if num_bands != len(bands):
    raise EntropyError(f"{num_bands} bands, want {len(bands)} for D={d}")
  lengths = struct.unpack_from(f"<{n}I", data, 4)
  pos = 4 + 4 * n
  if pos + sum(lengths) != len(data):
    raise EntropyError(f"group lengths add up to {pos + sum(lengths)} bytes, have {len(data)}")
  comp = np.empty((l_, 2, d, c), np.int16)
  i = 0
  for l in range(l_):
    for a in range(2):
      for lo, hi in bands:
        out = np.empty(((hi - lo) * c,), np.int16)
        try:
          progress = standalone.simple_decompress_into(bytes(data[pos:pos + lengths[i]]), out)
        except (RuntimeError, TypeError, ValueError) as e:
          raise EntropyError(f"group {i}: {e}") from e
        if not progress.finished or progress.n_processed != out.size:
          raise EntropyError(f"group {i}: {progress.n_processed} values, want {out.size}")
        comp[l, a, lo:hi] = out.reshape(hi - lo, c)
        pos += lengths[i]
        i += 1
  return np.ascontiguousarray(np.swapaxes(comp, 2, 3))
