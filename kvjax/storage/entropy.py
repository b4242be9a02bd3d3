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
