"""Checksums of stored chunk bytes: which algorithm, and why it need not be cryptographic.

A stored chunk is found by its key: a chained SHA-256 over the namespace and the token ids
(`keys.py`). That key is what makes a hit the right chunk (identity), and every read also checks
the record's token ids, namespace and layout. The checksum has one job left: to catch bytes that
changed after they were written (a flipped bit, a truncated or half-replaced file, a torn copy).
For that a fast non-cryptographic hash with a wide output is enough; an attacker who can rewrite
the store's files can rewrite the record and its checksum too, so a cryptographic hash would not
stop them either.

    algorithm   record format   speed on one core of the 2-core dev VM (11.8 MB chunk)
    sha256      1 (old stores)  1.8 GB/s   (hashlib)
    xxh3-128    2 (written now) 25 GB/s    (`xxhash` package, XXH3 128-bit)

xxh3-128 keeps verification under 5% of a page-cache read, where SHA-256 took most of it. Records
name their algorithm per encoding (`Encoding.checksum_algo`); records of format 1, which have no
such field, are SHA-256 and stay readable.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np
import xxhash

#: Algorithm of checksums written now.
XXH3_128 = "xxh3-128"
#: Algorithm of record format 1 (every checksum before `checksum_algo` existed).
SHA256 = "sha256"
CURRENT = XXH3_128
ALGORITHMS = (XXH3_128, SHA256)


def digest(data: bytes | memoryview | np.ndarray, algo: str = CURRENT) -> str:
  """Hex checksum of a bytes-like object (an array: its C-order bytes).

  Args:
    data: bytes, a memoryview, or a numpy array (made C-contiguous; its raw bytes are hashed).
    algo: one of `ALGORITHMS`.

  Returns:
    Lower-case hex digest (32 characters for xxh3-128, 64 for sha256).

  Raises:
    ValueError: an unknown algorithm.
  """
  if isinstance(data, np.ndarray):
    data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
  if algo == XXH3_128:
    return xxhash.xxh3_128_hexdigest(data)
  if algo == SHA256:
    return hashlib.sha256(data).hexdigest()
  raise ValueError(f"unknown checksum algorithm {algo!r}; known: {', '.join(ALGORITHMS)}")


def digest_arrays(arrays: Iterable[np.ndarray], algo: str = CURRENT) -> str:
  """Hex checksum over several arrays' C-order bytes, in order (one array: `digest` of it).

  Raises:
    ValueError: an unknown algorithm.
  """
  if algo == XXH3_128:
    h = xxhash.xxh3_128()
  elif algo == SHA256:
    h = hashlib.sha256()
  else:
    raise ValueError(f"unknown checksum algorithm {algo!r}; known: {', '.join(ALGORITHMS)}")
  for a in arrays:
    h.update(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
  return h.hexdigest()
