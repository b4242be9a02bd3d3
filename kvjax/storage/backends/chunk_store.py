"""The chunk store: async get/put/contains of stored KV chunks over a tensorstore kvstore.

Architecture (`docs/design/storage-format.md`):

  kvstore root (memory | file | ocdbt+file | s3)
    index/<chunk_hash>.json                     ChunkRecord, written LAST, only if absent
    data/<chunk_hash>/raw-0-<xxh3 of values>    one object: the values' C-order little-endian
                                                bytes, [L, 2, C, K, H] of layout.dtype; a session
                                                tail (`keys.tail_token_ids`: m real ids, then
                                                padding) stores [L, 2, m, K, H], its real rows
                                                only (`keys.stored_rows`): its padding rows read
                                                back as zeros
    data/<chunk_hash>/<codec>-<level>-<xxh3 of the bytes>
                                                one encoded payload (`codecs.encode_payload`)
  Record format 3 (written now): a raw encoding also lists one xxh3-128 per layer
  (`Encoding.layer_checksums`), so `get(..., layer_start=k)` reads layers `[k, L)` alone (one
  byte-range read from k * nbytes / L to the end, a seek on a plain file store) and verifies
  each; record format 2 (still read) has none, so a range of it is read whole and sliced.
  Record format 1 (older stores, still read): checksums are SHA-256 and a raw object is a
  zarr3 array under the key prefix `data/<chunk_hash>/raw-0-<sha256>/` (zarr.json, c/0/0/0/0/0).

- Fast verified reads: a raw chunk is one object read straight into a fresh numpy buffer
  (file stores: `os.preadv` in a worker thread, no tensorstore decode and no extra copy; other
  backends: one kvstore read, viewed without a copy), checked against the record's size and
  xxh3-128 (`storage.format.checksum`: the key gives identity, the checksum only catches corruption),
  then viewed as `[L, 2, C, K, H]`. Reading, hashing and entropy decoding run off the event loop.
  Measured on the 2-core dev VM, page cache, [30, 2, 256, 3, 64] float32 chunks (11.8 MB): the
  format 1 path (zarr3 open + sharded decode + SHA-256) verified 0.68 GB/s; see
  `scripts/bench_load.py` for the format 2 path.

- Encodings: one record lists every encoding stored for the chunk (raw and/or several codecs
  and levels side by side, all written by one `put`). `get` reads the record, lets the caller's
  `choose` pick one of the encodings this reader can decode (default: raw, else the first), and
  reads and verifies only that one. Every object's checksum is checked before it is used or
  decoded; a decode error is a CORRUPT miss.

- Commit last (levanter `store/jagged_array.py` `extend_async`): `put` writes the data object
  fully, then publishes the record with a conditional write that succeeds only if no record
  exists (`if_equal` = the "no value" storage generation). Of concurrent writers of one key exactly
  one wins; a loser removes its own data object unless the winner's record references the same
  object (data object keys contain the SHA-256 of the values, so two writers never write one
  object with different bytes: the key names the prefix, the checksum the bytes). A write that fails half-way leaves no record; its data is garbage
  that `gc` removes.
- S3: the create-if-absent is a conditional PUT (`If-None-Match: *`, see `specs`). On first use
  the store checks that the server honours it (a second conditional create of an existing probe
  key must fail). If the server ignores or rejects it, the store logs a warning and falls back to
  tensorstore's HEAD-then-PUT plus read-after-write verification: a publish counts as won only if
  the record read back is byte-identical to ours. That never lets a reader get wrong KV (reads
  verify) and catches most races, but is not atomic: two racing writers can both see their own
  record (the later one replaces the earlier; the earlier one's data object is then garbage for
  `gc`, and a reader caught in between gets a MISSING_DATA miss). Passing
  `conditional_write=False` selects that fallback up front.
- Verify on read: `get` returns a `ChunkHit` only after checking the record's model and layout
  version (`ChunkOrigin`), dtype, chunk size, layout, token ids, namespace, codec and codec
  version, the object's size, the checksum of the bytes read and the payload header's codec
  version (the stored-chunk guard, `ChunkRecord.mismatch`);
  anything else is a `ChunkMiss` with a reason, counted in `stats.misses_by_reason`, never an
  exception and never someone else's KV.
- Concurrency: one `ts.Context` per store (cache pool, copy/io concurrency limits), a byte limiter
  on data in flight (reads and writes; orbax `serialization/limits.py`), a timeout on every
  tensorstore operation. The async API runs on any event loop; the `*_sync` twins run it on one
  module-owned background event-loop thread, callable from any thread.

Modules: this one is the store core (`ChunkStore`: read, write, delete, list records);
`store_layout` names the objects and holds the encoding choosers; `store_runtime` the counters,
the byte limiter and the background loop (`run_sync`); `object_io` whole-object reads and miss
reasons; `s3_conditional` the S3 publish mode; `store_admin` the maintenance part (`StoreAdmin`, the
store's `admin`: `scan`, `orphans`, `gc`, `verify`, `object_files`, which the store forwards).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)
import numpy as np
import tensorstore as ts

from kvjax._typing import ChunkHash
from kvjax.storage.format import checksum as checksums
from kvjax.storage.format import codecs
from kvjax.storage.format import keys as chunk_keys
from kvjax.storage.backends import specs
from kvjax.storage.backends import s3_conditional
from kvjax.storage.backends.object_io import (BadSize, data_error_reason, first_bad_layer,
                                              read_file, read_file_range)
from kvjax.storage.backends.store_admin import DataObject, StoreAdmin, StoreIndex
from kvjax.storage.format.store_layout import (ABSENT_PROBE_KEY, DATA_PREFIX, INDEX_PREFIX,
                                               RAW_CODEC, RAW_CODEC_VERSION, RAW_LEVEL,
                                               choose_codec, default_choose, encoded_object_key,
                                               index_key, is_raw_object, layer_checksums,
                                               le_bytes, raw_nbytes, raw_object_key,
                                               values_checksum)
from kvjax.storage.format.store_layout import prefix_range as _prefix_range
from kvjax.storage.backends.store_runtime import (ByteLimiter, Limiter, StoreStats,
                                                  default_context_spec, run_sync)
from kvjax.storage.format.types import (Chooser, ChunkHit, ChunkMiss, ChunkOrigin, ChunkRecord,
                                        EncodedPayload, Encoding, KVLayout, MissReason)

__all__ = ["RAW_CODEC", "RAW_CODEC_VERSION", "RAW_LEVEL", "ByteLimiter", "ChunkStore",
           "DataObject", "Limiter", "StoreIndex", "StoreStats", "choose_codec", "default_choose",
           "default_context_spec", "encoded_object_key", "index_key", "is_raw_object",
           "raw_object_key", "run_sync", "values_checksum"]

_log = logging.getLogger(__name__)
_T = TypeVar("_T")


def _raw_values(buf: np.ndarray, encoding: Encoding, layout: KVLayout,
                num_layers: int) -> np.ndarray:
  """The last `num_layers` layers of a raw object, from their little-endian bytes `buf`, as
  `layout.dtype[num_layers, 2, C, K, H]` (a stored tail's padding rows as zeros)."""
  rows = encoding.nbytes // (layout.nbytes // layout.chunk_size)
  shape = (num_layers, 2, rows) + layout.shape[3:]
  kv = buf.view(np.dtype(layout.dtype)).reshape(shape)
  if sys.byteorder != "little":
    kv = kv.byteswap()
  if rows < layout.chunk_size:  # a tail's real rows: its padding rows are zeros
    full = np.zeros((num_layers,) + layout.shape[1:], np.dtype(layout.dtype))
    full[:, :, :rows] = kv
    kv = full
  return kv


class ChunkStore:
  """Stored KV chunks under one kvstore root, verified on every read.

  Example:
    store = ChunkStore("file:///tmp/kv")
    store.put_sync(h, parent, token_ids, ns.root_hash(), kv_L2CKH)
    hit_or_miss = store.get_sync(h, token_ids, ns.root_hash(), layout)
    # Codec payloads (several levels side by side), read back by choice:
    store.put_sync(h2, h, token_ids2, ns.root_hash(), layout=layout, payloads=[
        EncodedPayload("cachegen", 0, arrays0), EncodedPayload("cachegen", 2, arrays2)])
    hit = store.get_sync(h2, token_ids2, ns.root_hash(), layout,
                         choose=choose_codec("cachegen", 2))  # hit.payload == arrays2
  """

  def __init__(self, url: str, *, name: str = "disk", context: ts.Context | None = None,
               max_bytes_in_flight: int = 256 << 20, timeout_s: float = 30.0,
               limiter: Limiter | None = None,
               **kvstore_kwargs: Any):
    """Creates a store handle; nothing is opened until the first operation.

    Args:
      url: store URL (see `specs.kvstore_spec`).
      name: tier name reported in hits.
      context: tensorstore context; default: a fresh one from `default_context_spec()`.
        `memory://` stores are visible only to users of the same context.
      max_bytes_in_flight: bound on value bytes being read or written at once.
      timeout_s: limit on each tensorstore operation, seconds.
      limiter: optional link emulator; `get` awaits `limiter.acquire(nbytes)` before reading.
      **kvstore_kwargs: passed to `specs.kvstore_spec` (s3 `endpoint`, `region`,
        `conditional_write`, ...).
    """
    self.name = name
    self.url = url
    self.kvstore_spec = specs.kvstore_spec(url, **kvstore_kwargs)
    self.context = context if context is not None else ts.Context(default_context_spec())
    self.timeout_s = timeout_s
    self.stats = StoreStats()
    self._limiter = limiter
    self._bytes = ByteLimiter(max_bytes_in_flight)
    self._root: ts.KvStore | None = None
    self._no_value: bytes | None = None
    # S3 without working conditional PUTs: verify each publish by reading it back.
    self._verify_publish = False
    self._in_flight_lock = threading.Lock()
    self._in_flight: collections.Counter[str] = collections.Counter()
    self._closed = False
    #: Maintenance (`StoreAdmin`: scan, orphans, gc, verify, object files), over this store's
    #: public calls.
    self.admin = StoreAdmin(self)

  # -- maintenance (the admin part's) -----------------------------------------------------------

  def local_dir(self) -> str | None:
    """`StoreAdmin.local_dir`."""
    return self.admin.local_dir()

  async def scan(self, namespace: str = "") -> StoreIndex:
    """`StoreAdmin.scan`: every index record, failing loudly."""
    return await self.admin.scan(namespace)

  async def orphans(self, index: StoreIndex | None = None) -> list[DataObject]:
    """`StoreAdmin.orphans`: data objects no record references."""
    return await self.admin.orphans(index)

  async def gc(self) -> int:
    """`StoreAdmin.gc`: removes data objects no record references; returns how many."""
    return await self.admin.gc()

  async def verify(self, record: ChunkRecord) -> ChunkMiss | None:
    """`StoreAdmin.verify`: reads back every encoding of `record`; None, or the first miss."""
    return await self.admin.verify(record)

  def object_files(self, record: ChunkRecord) -> list[str]:
    """`StoreAdmin.object_files`.

    Raises:
      ValueError: not a plain file store.
    """
    return self.admin.object_files(record)

  def objects_being_written(self) -> set[str]:
    """Data objects this store is writing now (`gc` leaves them alone)."""
    with self._in_flight_lock:
      return set(self._in_flight)

  async def delete_object(self, object_key: str, *, array: bool = False) -> None:
    """Deletes one data object: a single key, or (`array`, record format 1) a key prefix."""
    await self._delete_object(object_key, array=array)

  # -- plumbing ---------------------------------------------------------------------------------

  async def _op(self, fut: Awaitable[_T]) -> _T:
    return await asyncio.wait_for(fut, self.timeout_s)

  async def kvstore(self) -> ts.KvStore:
    """The opened root kvstore (cached), for tools and tests."""
    if self._closed:
      raise RuntimeError(f"store {self.name!r} is closed")
    if self._root is None:
      await self._check_s3_conditional_write()
      root = await self._op(ts.KvStore.open(self.kvstore_spec, context=self.context))
      probe = await self._op(root.read(ABSENT_PROBE_KEY))
      if probe.state != "missing" or not probe.stamp.generation:
        raise RuntimeError(f"cannot learn the no-value generation of {self.url!r}")
      self._no_value = bytes(probe.stamp.generation)
      self._root = root
    return self._root

  async def _check_s3_conditional_write(self) -> None:
    """S3: selects atomic conditional PUTs if the server honours them, else the fallback."""
    self.kvstore_spec, verify = await s3_conditional.publish_mode(
        self.kvstore_spec, self.name, self._s3_honours_conditions)
    self._verify_publish = verify

  async def _s3_honours_conditions(self, s3: dict[str, Any]) -> bool:
    """Whether a create-if-absent of an existing key fails on this server, as it must."""
    return await s3_conditional.honours_conditional_put(s3, self.context, self._op)

  @contextlib.contextmanager
  def _writing(self, object_keys: Sequence[str]) -> Iterator[Callable[[], list[str]]]:
    """Marks data objects as being written, so `gc` in this process leaves them alone.

    Yields `release()`, which unmarks them early and returns those no other writer in this
    process still marks (this writer was the last); unmarking and that check are one atomic
    step, so of several writers of one object exactly one is told it was last.
    """
    with self._in_flight_lock:
      for o in object_keys:
        self._in_flight[o] += 1
    released = False

    def release() -> list[str]:
      nonlocal released
      if released:
        return []
      released = True
      last = []
      with self._in_flight_lock:
        for o in object_keys:
          self._in_flight[o] -= 1
          if not self._in_flight[o]:
            del self._in_flight[o]
            last.append(o)
      return last

    try:
      yield release
    finally:
      release()

  async def _read_record(self, chunk_hash: ChunkHash) -> ts.KvStore.ReadResult:
    root = await self.kvstore()
    return await self._op(root.read(index_key(chunk_hash)))

  async def _delete_object(self, object_key: str, *, array: bool = False) -> None:
    """Deletes one data object: a single key, or (`array`, record format 1) a key prefix."""
    root = await self.kvstore()
    if array:
      await self._op(root.delete_range(_prefix_range(object_key.rstrip("/") + "/")))
    else:
      await self._op(root.write(object_key, None))

  async def _drop_record(self, chunk_hash: ChunkHash, read: ts.KvStore.ReadResult) -> bool:
    """Deletes the index record `read` returned, only if it is still that one (a concurrent
    replacement stays). Returns whether it was deleted."""
    root = await self.kvstore()
    stamp = await self._op(root.write(index_key(chunk_hash), None,
                                      if_equal=read.stamp.generation))
    return bool(stamp.generation)

  async def _publish_record(self, record: ChunkRecord) -> bool:
    """Creates the index record if absent. Returns False if a record already exists."""
    root = await self.kvstore()
    data = record.to_json()
    key = index_key(record.chunk_hash)
    stamp = await self._op(root.write(key, data, if_equal=self._no_value))
    # A conditional write that did not happen returns an empty generation.
    if not stamp.generation:
      return False
    if self._verify_publish:  # Not atomic here: did a racing writer replace our record?
      back = await self._op(root.read(key))
      return back.state == "value" and back.value == data
    return True

  # -- public async API ---------------------------------------------------------------------------

  async def contains(self, hashes: Sequence[ChunkHash]) -> list[bool]:
    """Whether an index record exists for each hash (all reads issued concurrently).

    Presence is a hint for planning; `get` still verifies. A backend error reads as False.
    """
    await self.kvstore()

    async def one(h: ChunkHash) -> bool:
      try:
        return (await self._read_record(h)).state == "value"
      except Exception as e:  # noqa: BLE001
        _log.warning("contains(%s) on %s failed: %r", h, self.name, e)
        return False

    return list(await asyncio.gather(*(one(h) for h in hashes)))

  async def peek(self, hashes: Sequence[ChunkHash]) -> list[ChunkRecord | None]:
    """Each chunk's index record (parsed, not verified against data), or None if absent.

    A planning aid like `contains`, with the encodings and their sizes (to pick levels before
    reading). A malformed record or a backend error reads as None (logged); `get` verifies.
    """
    await self.kvstore()

    async def one(h: ChunkHash) -> ChunkRecord | None:
      try:
        res = await self._read_record(h)
        return ChunkRecord.from_json(res.value) if res.state == "value" else None
      except Exception as e:  # noqa: BLE001
        _log.warning("peek(%s) on %s failed: %r", h, self.name, e)
        return None

    return list(await asyncio.gather(*(one(h) for h in hashes)))

  async def get(self, chunk_hash: ChunkHash, token_ids: Sequence[int], namespace: str,
                layout: KVLayout, *, choose: Chooser | None = None,
                origin: ChunkOrigin | None = None, layer_start: int = 0) -> ChunkHit | ChunkMiss:
    """Reads and verifies one chunk, in the encoding `choose` picks, or its layers `[k, L)`.

    Args:
      chunk_hash: the chunk's key.
      token_ids: the C token ids the caller expects the KV to belong to.
      namespace: the caller's namespace id (`KeyNamespace.root_hash()`).
      layout: the raw shape and dtype the caller can use.
      choose: called with the record's encodings this reader can decode (in record order,
        unknown codecs, versions and levels left out); returns the one to read, or None for none
        of them. Default `default_choose`: raw if stored, else the first.
      origin: the model and layout version the caller's KV must come from (checked against the
        record's own, `ChunkRecord.mismatch`); None: not checked.
      layer_start: k in `[0, L)`; k > 0 asks for layers `[k, L)` only (Cake's layer axis,
        `docs/design/cake.md`). A raw encoding of record format 3 reads just those layers'
        bytes (one byte-range read, a seek on a plain file store), verifies each layer's
        checksum (`Encoding.layer_checksums`), charges the link limiter and `bytes_read` those
        bytes alone (`stats.ranged_reads`); an older raw record is read and verified whole, then
        sliced (`stats.ranged_whole_reads`). Either way the hit's `kv` is
        `layout.dtype[L - k, 2, C, K, H]` with `layer_start` k. Other codecs are read whole
        (`layer_start` 0 in the hit).

    Returns:
      A `ChunkHit` (`payload`: the encoding's arrays; `kv`: `layout.dtype[L, 2, C, K, H]`, or
      `[L - k, 2, C, K, H]` for a layer range, K before RoPE, for raw, else None; `nbytes`: the
      stored bytes read), or a `ChunkMiss` with its reason (also counted in
      `stats.misses_by_reason`): the record's model, layout, dtype, chunk size, tokens or
      namespace differ (`ChunkRecord.mismatch`); CODEC_VERSION_MISMATCH when nothing is chosen
      and the record holds a codec this reader knows at another version, or the payload's
      header names another version than its record; UNKNOWN_CODEC when no encoding is
      decodable or `choose` takes none; CHECKSUM_MISMATCH when a layer read (or the whole
      object) does not match its checksum. A damaged layer outside the range read is not seen.
      Never raises for store faults.

    Raises:
      ValueError: `choose` returned something that is not one of the encodings it was given;
        `layer_start` not in `[0, L)`.
    """
    if not 0 <= layer_start < layout.num_layers:
      raise ValueError(f"layer_start {layer_start} not in [0, {layout.num_layers})")
    result = await self._get(chunk_hash, tuple(int(t) for t in token_ids), namespace, layout,
                             choose or default_choose, origin, layer_start)
    if isinstance(result, ChunkMiss):
      self.stats.miss(result.reason)
    else:
      self.stats.add(hits=1, bytes_read=result.nbytes)
    return result

  async def _get(self, chunk_hash: ChunkHash, token_ids: tuple[int, ...], namespace: str,
                 layout: KVLayout, choose: Chooser, origin: ChunkOrigin | None,
                 layer_start: int) -> ChunkHit | ChunkMiss:
    def miss(reason: MissReason, detail: str = "") -> ChunkMiss:
      return ChunkMiss(chunk_hash, reason, detail)

    try:
      res = await self._read_record(chunk_hash)
    except Exception as e:  # noqa: BLE001
      return miss(MissReason.READ_ERROR, f"index read: {e!r}")
    if res.state != "value":
      return miss(MissReason.ABSENT)
    try:
      record = ChunkRecord.from_json(res.value)
    except ValueError as e:
      return miss(MissReason.CORRUPT, str(e))
    if record.chunk_hash != chunk_hash:
      return miss(MissReason.CORRUPT, f"record names chunk {record.chunk_hash}")
    bad = record.mismatch(token_ids, namespace, layout, origin)
    if bad is not None:
      return bad
    usable = [e for e in record.encodings
              if codecs.is_decodable(e.codec, e.codec_version, e.level)
              and e.checksum_algo in checksums.ALGORITHMS]
    encoding = choose(usable) if usable else None
    if encoding is None:
      stale = codecs.other_versions(record.encodings)
      if stale:
        return miss(MissReason.CODEC_VERSION_MISMATCH, stale)
      return miss(MissReason.UNKNOWN_CODEC,
                  ("none chosen of " if usable else "")
                  + ",".join(f"{e.codec}/{e.codec_version}/{e.level}" for e in record.encodings))
    if encoding not in usable:
      raise ValueError(f"choose returned {encoding!r}, not one of the encodings it was given")
    is_raw = encoding.codec == RAW_CODEC
    if (not encoding.object.startswith(f"{DATA_PREFIX}{chunk_hash}/")
        or is_raw != is_raw_object(encoding.object)
        or (is_raw and encoding.nbytes not in raw_nbytes(record, layout))
        or len(encoding.layer_checksums) not in ((0, layout.num_layers) if is_raw else (0,))):
      return miss(MissReason.CORRUPT, f"bad encoding entry {encoding!r}")

    ranged = layer_start > 0 and is_raw
    if ranged and encoding.layer_checksums:  # layers [k, L) alone
      nbytes = encoding.nbytes // layout.num_layers * (layout.num_layers - layer_start)
      if self._limiter is not None:
        await self._limiter.acquire(nbytes)
      self.stats.add(ranged_reads=1)
      return await self._get_raw_layers(record, encoding, layout, layer_start)
    if ranged:  # a record without layer checksums: read and verify whole, then slice
      self.stats.add(ranged_whole_reads=1)
    if self._limiter is not None:
      await self._limiter.acquire(encoding.nbytes)
    if is_raw and record.format_version == 1:
      hit = await self._get_raw_array(record, encoding, layout)
    elif is_raw:
      hit = await self._get_raw(record, encoding, layout)
    else:
      return await self._get_encoded(record, encoding, layout)
    return hit.from_layer(layer_start, hit.nbytes) if ranged and isinstance(hit, ChunkHit) else hit

  def _local_path(self, object_key: str) -> str | None:
    """The file holding a one-key object on a plain file store (else None: use tensorstore)."""
    if self.kvstore_spec.get("driver") != "file":
      return None
    return self.kvstore_spec["path"] + object_key

  async def _read_object(self, encoding: Encoding) -> tuple[np.ndarray, str]:
    """One whole one-key object as `uint8[encoding.nbytes]` and its checksum by the record's
    algorithm; the byte limiter is held while reading.

    Raises:
      FileNotFoundError, BadSize, OSError, or tensorstore's errors (`_data_error_reason`
      classifies them); a missing object on a tensorstore backend raises FileNotFoundError.
    """
    async with self._bytes.hold(encoding.nbytes):
      path = self._local_path(encoding.object)
      if path is not None:
        return await self._op(asyncio.to_thread(read_file, path, encoding.nbytes,
                                                encoding.checksum_algo))
      root = await self.kvstore()
      res = await self._op(root.read(encoding.object))
      if res.state != "value":
        raise FileNotFoundError(encoding.object)
      if len(res.value) != encoding.nbytes:
        raise BadSize(f"{len(res.value)} bytes, record says {encoding.nbytes}")
      buf = np.frombuffer(res.value, np.uint8)  # read-only view, no copy
      return buf, checksums.digest(buf, encoding.checksum_algo)

  async def _read_range(self, encoding: Encoding, offset: int) -> np.ndarray:
    """Bytes `[offset, nbytes)` of a one-key object as `uint8[nbytes - offset]`; the byte
    limiter is held while reading. A plain file store seeks (`object_io.read_file_range`);
    other backends read a byte range (tensorstore's `byte_range`, to the object's end, so an
    object of another length is seen).

    Raises:
      FileNotFoundError, BadSize, OSError, or tensorstore's errors (`data_error_reason`
      classifies them: a range past the end is OUT_OF_RANGE, corrupt).
    """
    want = encoding.nbytes - offset
    async with self._bytes.hold(want):
      path = self._local_path(encoding.object)
      if path is not None:
        return await self._op(asyncio.to_thread(read_file_range, path, encoding.nbytes, offset))
      root = await self.kvstore()
      res = await self._op(root.read(encoding.object, byte_range=slice(offset, None)))
      if res.state != "value":
        raise FileNotFoundError(encoding.object)
      if len(res.value) != want:
        raise BadSize(f"{offset + len(res.value)} bytes, record says {encoding.nbytes}")
      return np.frombuffer(res.value, np.uint8)  # read-only view, no copy

  async def _get_raw_layers(self, record: ChunkRecord, encoding: Encoding, layout: KVLayout,
                            layer_start: int) -> ChunkHit | ChunkMiss:
    """Layers `[layer_start, L)` of a raw object of record format 3: their bytes alone, each
    layer verified against its `Encoding.layer_checksums` entry."""
    step = encoding.nbytes // layout.num_layers
    try:
      buf = await self._read_range(encoding, layer_start * step)
    except Exception as e:  # noqa: BLE001
      return ChunkMiss(record.chunk_hash, data_error_reason(e), f"{encoding.object}: {e!r}")
    bad = await asyncio.to_thread(first_bad_layer, buf, encoding.layer_checksums[layer_start:],
                                  encoding.checksum_algo)
    if bad is not None:
      return ChunkMiss(record.chunk_hash, MissReason.CHECKSUM_MISMATCH,
                       f"{encoding.object}: layer {layer_start + bad}")
    kv = _raw_values(buf, encoding, layout, layout.num_layers - layer_start)
    return ChunkHit(record=record, encoding=encoding, kv=kv, tier=self.name,
                    layer_start=layer_start, nbytes=len(buf))

  async def _get_raw(self, record: ChunkRecord, encoding: Encoding,
                     layout: KVLayout) -> ChunkHit | ChunkMiss:
    try:
      buf, digest = await self._read_object(encoding)
    except Exception as e:  # noqa: BLE001
      return ChunkMiss(record.chunk_hash, data_error_reason(e), f"{encoding.object}: {e!r}")
    if digest != encoding.checksum:
      return ChunkMiss(record.chunk_hash, MissReason.CHECKSUM_MISMATCH)
    kv = _raw_values(buf, encoding, layout, layout.num_layers)
    return ChunkHit(record=record, encoding=encoding, kv=kv, tier=self.name)

  async def _get_raw_array(self, record: ChunkRecord, encoding: Encoding,
                           layout: KVLayout) -> ChunkHit | ChunkMiss:
    """Record format 1: the raw values are a zarr3 array (`specs.chunk_array_spec`)."""
    try:
      async with self._bytes.hold(encoding.nbytes):
        spec = specs.chunk_array_spec(self.kvstore_spec, encoding.object, layout, create=False)
        arr = await self._op(ts.open(spec, context=self.context, read=True))
        kv = await self._op(arr.read())
    except Exception as e:  # noqa: BLE001
      return ChunkMiss(record.chunk_hash, data_error_reason(e), repr(e))
    kv = np.asarray(kv)
    if kv.shape != layout.shape or kv.dtype != np.dtype(layout.dtype):
      return ChunkMiss(record.chunk_hash, MissReason.CORRUPT, f"read {kv.dtype}{list(kv.shape)}")
    if values_checksum(kv, encoding.checksum_algo) != encoding.checksum:
      return ChunkMiss(record.chunk_hash, MissReason.CHECKSUM_MISMATCH)
    return ChunkHit(record=record, encoding=encoding, kv=kv, tier=self.name)

  async def _get_encoded(self, record: ChunkRecord, encoding: Encoding,
                         layout: KVLayout) -> ChunkHit | ChunkMiss:
    def miss(reason: MissReason, detail: str = "") -> ChunkMiss:
      return ChunkMiss(record.chunk_hash, reason, detail)

    try:
      buf, digest = await self._read_object(encoding)
    except Exception as e:  # noqa: BLE001
      return miss(data_error_reason(e), f"{encoding.object}: {e!r}")
    if digest != encoding.checksum:
      return miss(MissReason.CHECKSUM_MISMATCH, encoding.object)
    # Entropy decoding is CPU work: off the event loop. Device codings (kvtc's "rans-bands") are
    # only parsed and verified here; the engine decodes them on the device.
    try:
      payload = await asyncio.to_thread(functools.partial(
          codecs.decode_payload, defer_entropy=True), encoding.codec, encoding.codec_version,
          encoding.level, memoryview(buf), layout)
    except codecs.UnknownCodec as e:
      return miss(MissReason.UNKNOWN_CODEC, str(e))
    except codecs.CodecVersionMismatch as e:
      return miss(MissReason.CODEC_VERSION_MISMATCH, f"{encoding.object}: {e}")
    except ValueError as e:  # CorruptPayload
      return miss(MissReason.CORRUPT, f"{encoding.object}: {e}")
    return ChunkHit(record=record, encoding=encoding, kv=None, tier=self.name, payload=payload)

  async def put(self, chunk_hash: ChunkHash, parent_hash: ChunkHash, token_ids: Sequence[int],
                namespace: str, kv: np.ndarray | None = None, *, layout: KVLayout | None = None,
                payloads: Sequence[EncodedPayload] = (),
                origin: ChunkOrigin | None = None) -> bool:
    """Stores one chunk in one or more encodings: data first, then the record if none exists
    (commit last).

    Args:
      chunk_hash: the chunk's key.
      parent_hash: the previous chunk's key (the namespace root for the first chunk).
      token_ids: the C token ids the KV belongs to.
      namespace: namespace id (`KeyNamespace.root_hash()`).
      kv: raw `[L, 2, C, K, H]` values (K before RoPE), any numpy dtype (float32, bfloat16,
        float16, ...), stored as one object of their bytes; or None. For a session tail
        (`token_ids` end with `keys.TAIL_PAD_ID`) only the rows of its real tokens are stored
        (`keys.stored_rows`); `get` returns zeros in its padding rows.
      layout: the raw layout the payloads decode to; default (and if given, must equal) the
        layout of `kv`. Required without `kv`.
      payloads: encodings to store beside (or instead of) `kv`, each one bytes object
        (`codecs.encode_payload`); a "raw" payload is the same as `kv`. At most one per
        (codec, level). Record order: raw first, then `payloads` in order.
      origin: the model and layout version that computed the KV, kept in the record for every
        reader to check (`ChunkRecord.mismatch`); None: none recorded.

    Returns:
      True if this call published the record; False if a record already existed (counted in
      `stats.put_conflicts`; nothing is written; a malformed record, `ChunkRecord.is_malformed`,
      is removed and replaced instead) or the backend failed (`stats.put_failures`; no
      record is left).

    Raises:
      ValueError: nothing to store, `kv` not `[L, 2, C, K, H]` with C == len(token_ids), no
        layout, a layout that disagrees, a payload that does not match its codec's contract
        (`codecs.validate_payload`), an unknown codec or level, or two payloads of one
        (codec, level).
    """
    token_ids = tuple(int(t) for t in token_ids)
    layout, checked = codecs.check_encodings(token_ids, kv, layout, payloads)
    values = checked[0].arrays["values"] if checked[0].codec == RAW_CODEC else None
    encoded = [p for p in checked if p.codec != RAW_CODEC]
    try:
      res = await self._read_record(chunk_hash)
      if res.state == "value":
        if not ChunkRecord.is_malformed(res.value):
          self.stats.add(put_conflicts=1)  # Already stored: skip the data write.
          return False
        # A record no version can read (torn, overwritten) would make this chunk a miss
        # forever: remove it (only the one read; a concurrent replacement stays) and store
        # afresh. Its data objects, if any, are left to `gc`.
        _log.warning("put(%s) on %s: replacing a malformed index record", chunk_hash,
                     self.name)
        await self._drop_record(chunk_hash, res)
    except Exception as e:  # noqa: BLE001
      _log.warning("put(%s) on %s failed: %r", chunk_hash, self.name, e)
      self.stats.add(put_failures=1)
      return False

    # Encode off the event loop (entropy coding is CPU work), then name objects by content.
    blobs = []
    if encoded:
      blobs = await asyncio.to_thread(
          lambda: [codecs.encode_payload(p.codec, p.level, p.arrays, layout) for p in encoded])
    encodings, writes = [], []
    if values is not None:
      rows = chunk_keys.stored_rows(token_ids)
      raw = le_bytes(values[:, :, :rows] if rows < values.shape[2] else values)
      checksum = checksums.digest(raw)
      enc = Encoding(RAW_CODEC, RAW_CODEC_VERSION, RAW_LEVEL, raw_object_key(chunk_hash, checksum),
                     len(raw), checksum, layer_checksums=layer_checksums(raw, layout.num_layers))
      encodings.append(enc)
      writes.append(functools.partial(self._write_blob, enc.object, raw))
    for p, blob in zip(encoded, blobs):
      checksum = checksums.digest(blob)
      enc = Encoding(p.codec, codecs.CURRENT_VERSION[p.codec], p.level,
                     encoded_object_key(chunk_hash, p.codec, p.level, checksum), len(blob),
                     checksum)
      encodings.append(enc)
      writes.append(functools.partial(self._write_blob, enc.object, blob))
    record = ChunkRecord(chunk_hash=chunk_hash, parent_hash=parent_hash, token_ids=token_ids,
                         namespace=namespace, layout=layout, encodings=tuple(encodings),
                         origin=origin)
    nbytes = sum(e.nbytes for e in encodings)
    objects = [e.object for e in encodings]

    with self._writing(objects) as release:
      try:
        async with self._bytes.hold(nbytes):
          await asyncio.gather(*(write() for write in writes))
        won = await self._publish_record(record)
      except Exception as e:  # noqa: BLE001
        _log.warning("put(%s) on %s failed: %r", chunk_hash, self.name, e)
        self.stats.add(put_failures=1)
        return False
      if won:
        self.stats.add(puts=1, bytes_written=nbytes)
        return True
      self.stats.add(put_conflicts=1)
      # Writers of equal values write the same object: the last of them in this process decides.
      for o in release():
        await self._drop_loser_object(chunk_hash, o)
      return False

  async def _write_blob(self, object_key: str, blob: bytes) -> None:
    root = await self.kvstore()
    await self._op(root.write(object_key, blob))

  async def _drop_loser_object(self, chunk_hash: ChunkHash, object_key: str) -> None:
    """After losing the publish race: delete our object unless the winner's record uses it.

    Called by the last writer of the object in this process (`_writing`'s release). A twin in
    another process can see its write fail; that put then counts as a failure and leaves no
    record, and an object it leaves is `gc`'s.
    """
    try:
      res = await self._read_record(chunk_hash)
      if res.state == "value":
        try:
          winner = ChunkRecord.from_json(res.value)
          if any(e.object == object_key for e in winner.encodings):
            return
        except ValueError:
          pass
      await self._delete_object(object_key)  # written by this version: one key
    except Exception as e:  # noqa: BLE001  (left for gc)
      _log.warning("dropping %s on %s failed: %r", object_key, self.name, e)

  async def delete(self, chunk_hash: ChunkHash) -> bool:
    """Removes a chunk's record, then the data objects it referenced.

    Returns:
      True if a record existed and was removed.
    """
    root = await self.kvstore()
    res = await self._read_record(chunk_hash)
    if res.state != "value" or not await self._drop_record(chunk_hash, res):
      return False
    try:
      record = ChunkRecord.from_json(res.value)
    except ValueError:  # Unparseable: everything under the chunk's data prefix.
      await self._op(root.delete_range(_prefix_range(f"{DATA_PREFIX}{chunk_hash}/")))
      return True
    await asyncio.gather(*(self._delete_object(
        e.object, array=record.format_version == 1 and e.codec == RAW_CODEC)
        for e in record.encodings))
    return True

  # -- listing (the `Tier` interface; maintenance is `StoreAdmin`'s) ----------------------------

  async def records(self) -> list[ChunkRecord]:
    """All parseable index records (malformed or unreadable ones are logged and skipped)."""
    root = await self.kvstore()
    keys = await self._op(root.list(_prefix_range(INDEX_PREFIX)))
    reads = await asyncio.gather(*(self._op(root.read(k)) for k in keys), return_exceptions=True)
    out = []
    for key, res in zip(keys, reads):
      if isinstance(res, BaseException) or res.state != "value":
        continue
      try:
        out.append(ChunkRecord.from_json(res.value))
      except ValueError as e:
        _log.warning("skipping malformed record %r: %s", key, e)
    return out

  def snapshot(self) -> dict[str, Any]:
    """`stats.snapshot()`: hits, misses by reason, bytes read and written, puts (the `Tier`
    counters of a store)."""
    return self.stats.snapshot()

  def close(self) -> None:
    """Drops the cached handles; the store cannot be used afterwards."""
    self._closed = True
    self._root = None

  # -- sync twins ----------------------------------------------------------------------------------

  def contains_sync(self, hashes: Sequence[ChunkHash]) -> list[bool]:
    return run_sync(self.contains(hashes))

  def get_sync(self, chunk_hash: ChunkHash, token_ids: Sequence[int], namespace: str,
               layout: KVLayout, *, choose: Chooser | None = None,
               origin: ChunkOrigin | None = None, layer_start: int = 0) -> ChunkHit | ChunkMiss:
    return run_sync(self.get(chunk_hash, token_ids, namespace, layout, choose=choose,
                             origin=origin, layer_start=layer_start))

  def put_sync(self, chunk_hash: ChunkHash, parent_hash: ChunkHash, token_ids: Sequence[int],
               namespace: str, kv: np.ndarray | None = None, *, layout: KVLayout | None = None,
               payloads: Sequence[EncodedPayload] = (),
               origin: ChunkOrigin | None = None) -> bool:
    return run_sync(self.put(chunk_hash, parent_hash, token_ids, namespace, kv, layout=layout,
                             payloads=payloads, origin=origin))

  def delete_sync(self, chunk_hash: ChunkHash) -> bool:
    return run_sync(self.delete(chunk_hash))

  def records_sync(self) -> list[ChunkRecord]:
    return run_sync(self.records())

  def gc_sync(self) -> int:
    return run_sync(self.gc())
