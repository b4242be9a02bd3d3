"""Object names of a chunk store and the encoding choosers (no I/O).

A store root holds `index/<chunk_hash>.json` (the `ChunkRecord`, written last) and the data
objects under `data/<chunk_hash>/` (`raw-0-<checksum>`, `<codec>-<level>-<checksum>`); see
`kvjax/storage/backends/chunk_store.py` for the publish protocol.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np
import tensorstore as ts

from kvjax._typing import ChunkHash
from kvjax.storage.format import checksum as checksums
from kvjax.storage.format import keys as chunk_keys
from kvjax.storage.format.types import Chooser, ChunkRecord, Encoding, KVLayout

RAW_CODEC = "raw"
RAW_CODEC_VERSION = 1
RAW_LEVEL = 0

INDEX_PREFIX = "index/"
DATA_PREFIX = "data/"
# A key that is never written; reading it yields the backend's "no value" generation.
ABSENT_PROBE_KEY = "index/.absent-probe"


def index_key(chunk_hash: ChunkHash) -> str:
  return f"{INDEX_PREFIX}{chunk_hash}.json"


def raw_object_key(chunk_hash: ChunkHash, checksum: str) -> str:
  return f"{DATA_PREFIX}{chunk_hash}/{RAW_CODEC}-{RAW_LEVEL}-{checksum}"


def encoded_object_key(chunk_hash: ChunkHash, codec: str, level: int, checksum: str) -> str:
  return f"{DATA_PREFIX}{chunk_hash}/{codec}-{level}-{checksum}"


def is_raw_object(object_key: str) -> bool:
  """Whether a data object's name says it holds raw values ("raw-<level>-<checksum>")."""
  return object_key.rstrip("/").rsplit("/", 1)[-1].startswith(f"{RAW_CODEC}-")


def default_choose(encodings: Sequence[Encoding]) -> Encoding | None:
  """Raw if stored, else the first decodable encoding in record order."""
  return next((e for e in encodings if e.codec == RAW_CODEC), encodings[0] if encodings else None)


def choose_codec(codec: str, level: int | None = None) -> Chooser:
  """A chooser that takes only `codec` (at `level`, if given)."""
  def choose(encodings: Sequence[Encoding]) -> Encoding | None:
    return next((e for e in encodings
                 if e.codec == codec and (level is None or e.level == level)), None)
  return choose


def prefix_range(prefix: str) -> ts.KvStore.KeyRange:
  """All keys starting with `prefix` (which ends with "/")."""
  return ts.KvStore.KeyRange(prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1))


def values_checksum(values: np.ndarray, algo: str = checksums.CURRENT) -> str:
  """Hex checksum (xxh3-128 by default, see `storage.format.checksum`) of an array's C-order bytes."""
  return checksums.digest(values, algo)


def layer_checksums(raw: bytes | memoryview, num_layers: int,
                    algo: str = checksums.CURRENT) -> tuple[str, ...]:
  """One hex checksum per layer of a raw object's bytes (`Encoding.layer_checksums`): layer l's
  is of bytes `[l * n / L, (l + 1) * n / L)` of the n bytes.

  Raises:
    ValueError: n is not a multiple of `num_layers`.
  """
  n = len(raw)
  if num_layers < 1 or n % num_layers:
    raise ValueError(f"{n} bytes do not split into {num_layers} layers")
  step, view = n // num_layers, memoryview(raw)
  return tuple(checksums.digest(view[i * step:(i + 1) * step], algo) for i in range(num_layers))


def le_bytes(values: np.ndarray) -> bytes:
  """An array's C-order bytes, little endian (the stored raw format)."""
  values = np.ascontiguousarray(values)
  return (values if sys.byteorder == "little" else values.byteswap()).tobytes()


def raw_nbytes(record: ChunkRecord, layout: KVLayout) -> tuple[int, ...]:
  """Sizes a raw object of `record` may have: its rows stored (`keys.stored_rows`), or (a tail
  written before tails were stored trimmed) the whole padded chunk."""
  rows = chunk_keys.stored_rows(record.token_ids)
  return (layout.nbytes // layout.chunk_size * rows, layout.nbytes)
