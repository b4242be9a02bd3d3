"""Maintenance of a chunk store (the `kvjax.store` CLI and tools): scanning the index, the
data objects no record references and their removal (`gc`), read-back verification, and the
files behind a record. `StoreAdmin` is a part of `kvjax.storage.backends.chunk_store.ChunkStore`
(`ChunkStore.admin`); it asks the store only through its public calls (`kvstore`, `get`,
`objects_being_written`, `delete_object`, `kvstore_spec`, `url`, `timeout_s`)."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import os

from kvjax._typing import ChunkHash
from kvjax.storage.format import checksum as checksums
from kvjax.storage.format import codecs
from kvjax.storage.format import entropy
from kvjax.storage.format.store_layout import (DATA_PREFIX, INDEX_PREFIX, RAW_CODEC,
                                               layer_checksums, le_bytes, prefix_range)
from kvjax.storage.format.types import ChunkHit, ChunkMiss, ChunkRecord, MissReason


@dataclasses.dataclass(frozen=True)
class StoreIndex:
  """A store's index (`ChunkStore.scan`).

  Attributes:
    records: parseable records, sorted by chunk hash.
    malformed: chunk hashes (from key names) whose record does not parse, sorted.
  """

  records: tuple[ChunkRecord, ...]
  malformed: tuple[ChunkHash, ...]


@dataclasses.dataclass(frozen=True)
class DataObject:
  """A stored data object (`ChunkStore.orphans`).

  Attributes:
    object: its key below the store root ("data/<chunk_hash>/<codec>-<level>-<checksum>").
    nbytes: bytes of its keys' values.
    array: whether it is a key prefix (a record format 1 zarr3 array) rather than one key.
  """

  object: str
  nbytes: int
  array: bool = False


def _file_size(path: str) -> int:
  try:
    return os.stat(path).st_size
  except OSError:
    return 0


def _decode_deferred(hit: ChunkHit) -> ChunkHit | ChunkMiss:
  """`hit`, or a CORRUPT miss if an array left coded for the device does not decode on the host
  (`entropy.decode_rans_codes`: streams that do not end where they began)."""
  for name, a in hit.payload.items():
    if isinstance(a, entropy.RansCodes):
      try:
        entropy.decode_rans_codes(a)
      except entropy.EntropyError as e:
        return ChunkMiss(hit.record.chunk_hash, MissReason.CORRUPT, f"{name}: {e}")
  return hit


def _check_layers(hit: ChunkHit) -> ChunkHit | ChunkMiss:
  """`hit`, or a CHECKSUM_MISMATCH miss if a whole raw hit's bytes do not match its record's
  per-layer checksums (record format 3: a layer-range read would refuse that layer)."""
  enc, layout = hit.encoding, hit.record.layout
  if enc.codec != RAW_CODEC or not enc.layer_checksums or hit.kv is None:
    return hit
  rows = enc.nbytes // (layout.nbytes // layout.chunk_size)  # a tail's stored rows
  got = layer_checksums(le_bytes(hit.kv[:, :, :rows]), layout.num_layers, enc.checksum_algo)
  bad = [i for i, (a, b) in enumerate(zip(got, enc.layer_checksums)) if a != b]
  if bad:
    return ChunkMiss(hit.record.chunk_hash, MissReason.CHECKSUM_MISMATCH,
                     f"{enc.object}: layer checksums of layers {bad}")
  return hit


class StoreAdmin:
  """Listing, sizes, garbage and verification of a `ChunkStore`.

  Owns nothing: every call reads the store afresh through its public calls. Async methods run
  on the caller's event loop, as the store's own.

  Args:
    store: the `ChunkStore`.
  """

  def __init__(self, store):
    self._store = store

  async def _op(self, fut):
    return await asyncio.wait_for(fut, self._store.timeout_s)

  def local_dir(self) -> str | None:
    """The directory of a file or ocdbt+file store (no trailing "/"), else None."""
    spec = self._store.kvstore_spec
    if spec.get("driver") == "ocdbt":
      spec = spec["base"]
    if spec.get("driver") == "file":
      return spec["path"].rstrip("/") or "/"
    return None

  async def scan(self, namespace: str = "") -> StoreIndex:
    """Reads every index record, failing loudly (unlike `records`, which skips what it cannot
    read).

    Args:
      namespace: keep only records whose namespace id starts with this (hex) prefix; malformed
        records are kept whatever the filter (their namespace is unknown).

    Returns:
      The parseable records and the hashes of the malformed ones, each sorted by chunk hash.

    Raises:
      Exception: tensorstore's error when listing or reading the index fails.
    """
    root = await self._store.kvstore()
    keys = sorted(k.decode() for k in await self._op(root.list(prefix_range(INDEX_PREFIX))))
    keys = [k for k in keys if k.endswith(".json")]
    reads = await asyncio.gather(*(self._op(root.read(k)) for k in keys))
    records, malformed = [], []
    for key, res in zip(keys, reads):
      if res.state != "value":
        continue  # Deleted since the listing.
      try:
        record = ChunkRecord.from_json(res.value)
      except ValueError:
        malformed.append(ChunkHash(key[len(INDEX_PREFIX):-len(".json")]))
        continue
      if record.namespace.startswith(namespace):
        records.append(record)
    records.sort(key=lambda r: r.chunk_hash)
    return StoreIndex(tuple(records), tuple(sorted(malformed)))

  async def _data_objects(self, index: StoreIndex) -> dict[str, list[str]]:
    """Data objects of chunks without a malformed record: object key -> its keys.

    A chunk whose record exists but does not parse still names its chunk (index/<hash>.json):
    its data is kept, so an operator can inspect or restore it.
    """
    root = await self._store.kvstore()
    kept = set(index.malformed)
    out: dict[str, list[str]] = collections.defaultdict(list)
    for key in sorted(k.decode() for k in await self._op(root.list(prefix_range(DATA_PREFIX)))):
      parts = key.split("/")
      if len(parts) >= 3 and parts[1] not in kept:
        out["/".join(parts[:3])].append(key)
    return out

  async def orphans(self, index: StoreIndex | None = None) -> list[DataObject]:
    """Data objects that no record references (failed or lost writes): what `gc` removes.

    Args:
      index: an unfiltered `scan()` to reuse, else one is made.

    Returns:
      The objects sorted by key, with their sizes in bytes (file stores: `stat`; otherwise the
      lengths of their keys' values). Objects being written by this store are left out.
    """
    index = index if index is not None else await self.scan()
    referenced = {e.object for r in index.records for e in r.encodings}
    by_object = await self._data_objects(index)
    busy = self._store.objects_being_written()
    root = await self._store.kvstore()
    path = self.local_dir() if self._store.kvstore_spec.get("driver") == "file" else None
    out = []
    for obj in sorted(set(by_object) - referenced - busy):
      keys = by_object[obj]
      if path is not None:
        nbytes = sum(_file_size(os.path.join(path, k)) for k in keys)
      else:
        values = await asyncio.gather(*(self._op(root.read(k)) for k in keys))
        nbytes = sum(len(v.value) for v in values if v.state == "value")
      out.append(DataObject(obj, nbytes, array=keys != [obj]))
    return out

  async def gc(self) -> int:
    """Removes data objects that no record references (failed or lost writes).

    Data of a chunk whose index record exists but is malformed is kept.

    Objects being written by this store are kept. A writer in another process can lose an
    in-flight object to `gc`; its record then reads as MISSING_DATA, never as wrong data.

    Returns:
      Number of data objects removed.
    """
    garbage = await self.orphans()
    await asyncio.gather(*(self._store.delete_object(o.object, array=o.array)
                           for o in garbage))
    return len(garbage)

  async def verify(self, record: ChunkRecord) -> ChunkMiss | None:
    """Reads back every encoding of `record` this reader can decode, as a server would
    (`get` with the record's own token ids, namespace and layout: sizes, checksums, decode;
    arrays `get` leaves coded for the device, kvtc's "rans-bands", are decoded here on the host
    with the checks the device decoder makes; a raw encoding's per-layer checksums, record
    format 3, are checked against the bytes read as well).

    Returns:
      None if all of them verify; else the first miss (its detail prefixed with the encoding
      when the record has several), or UNKNOWN_CODEC when this reader knows none of them.
      Counted in `stats` like any read.
    """
    known = [e for e in record.encodings
             if codecs.is_decodable(e.codec, e.codec_version, e.level)
             and e.checksum_algo in checksums.ALGORITHMS] or [None]
    for enc in known:  # None: no known encoding; get reports UNKNOWN_CODEC
      got = await self._store.get(record.chunk_hash, record.token_ids, record.namespace, record.layout,
                           origin=record.origin, choose=lambda encodings, want=enc: next(
                               (e for e in encodings if e == want), None))
      if isinstance(got, ChunkHit):
        got = await asyncio.to_thread(_decode_deferred, got)
      if isinstance(got, ChunkHit):
        got = await asyncio.to_thread(_check_layers, got)
      if isinstance(got, ChunkMiss):
        where = f"{enc.codec}/{enc.codec_version}/{enc.level}" if len(known) > 1 else ""
        return dataclasses.replace(got, detail=": ".join(x for x in (where, got.detail) if x))
    return None

  def object_files(self, record: ChunkRecord) -> list[str]:
    """The files holding a record's data objects, on a plain file store (bench and tools).

    Raises:
      ValueError: not a plain file store (ocdbt, memory and s3 have no file per object).
    """
    spec = self._store.kvstore_spec
    if spec.get("driver") != "file":
      raise ValueError(f"store {self._store.url!r} is not a plain file store")
    base = spec["path"]
    out = []
    for e in record.encodings:
      if record.format_version == 1 and e.codec == RAW_CODEC:
        out += [base + e.object + "/zarr.json", base + e.object + "/c/0/0/0/0/0"]
      else:
        out.append(base + e.object)
    return out
