"""The chunk store: async get/put/contains of stored KV chunks over a tensorstore kvstore.

Architecture (DESIGN.md sections 3-5):

  kvstore root (memory | file | ocdbt+file | s3)
    index/<chunk_hash>.json                      ChunkRecord, written LAST, only if absent
    data/<chunk_hash>/raw-0-<sha256 of values>/  zarr3 array [L, 2, C, K, H], one shard object
        zarr.json, c/0/0/0/0/0
    data/<chunk_hash>/<codec>-<level>-<sha256 of the bytes>
                                                 one encoded payload (`codecs.encode_payload`)

- Encodings: one record lists every encoding stored for the chunk (raw and/or several codecs
  and levels side by side, all written by one `put`). `get` reads the record, lets the caller's
  `choose` pick one of the encodings this reader can decode (default: raw, else the first), and
  reads and verifies only that one. Non-raw objects are plain kvstore values whose SHA-256 is
  checked before decoding; a decode error is a CORRUPT miss.

- Commit last (levanter `store/jagged_array.py` `extend_async`): `put` writes the data object
  fully, then publishes the record with a conditional write that succeeds only if no record
  exists (`if_equal` = the "no value" storage generation). Of concurrent writers of one key exactly
  one wins; a loser removes its own data object unless the winner's record references the same
  object (data object keys contain the SHA-256 of the values, so two writers never write one
  object with different bytes). A write that fails half-way leaves no record; its data is garbage
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
- Verify on read: `get` returns a `ChunkHit` only after checking the record's token ids,
  namespace, layout, codec and the SHA-256 of the values (raw) or bytes (other codecs) read;
  anything else is a `ChunkMiss` with a reason, counted in `stats.misses_by_reason`, never an
  exception and never someone else's KV.
- Concurrency: one `ts.Context` per store (cache pool, copy/io concurrency limits), a byte limiter
  on data in flight (reads and writes; orbax `serialization/limits.py`), a timeout on every
  tensorstore operation. The async API runs on any event loop; the `*_sync` twins run it on one
  module-owned background event-loop thread, callable from any thread.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import hashlib
import logging
import os
import threading
from collections.abc import Awaitable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)
import numpy as np
import tensorstore as ts

from kvjax._typing import ChunkHash
from kvjax.storage import codecs
from kvjax.storage import specs
from kvjax.storage.types import (Chooser, ChunkHit, ChunkMiss, ChunkRecord, EncodedPayload,
                                 Encoding, KVLayout, MissReason)

_log = logging.getLogger(__name__)
_T = TypeVar("_T")

RAW_CODEC = "raw"
RAW_CODEC_VERSION = 1
RAW_LEVEL = 0

_INDEX = "index/"
_DATA = "data/"
# A key that is never written; reading it yields the backend's "no value" generation.
_ABSENT_PROBE_KEY = "index/.absent-probe"
# S3 only: written once per store open to check that conditional PUTs are honoured.
_CONDITIONAL_PROBE_KEY = ".kvjax-conditional-write-probe"


class Limiter(Protocol):
  """A link emulator: `acquire(nbytes)` returns when `nbytes` may pass."""

  async def acquire(self, nbytes: int) -> None:
    ...


def default_context_spec() -> dict[str, Any]:
  """Context resources of a store: a cache pool and concurrency limits."""
  return {
      "cache_pool": {"total_bytes_limit": 64 << 20},
      "data_copy_concurrency": {"limit": max(1, os.cpu_count() or 1)},
      "file_io_concurrency": {"limit": 64},
  }


def index_key(chunk_hash: ChunkHash) -> str:
  return f"{_INDEX}{chunk_hash}.json"


def raw_object_key(chunk_hash: ChunkHash, checksum: str) -> str:
  return f"{_DATA}{chunk_hash}/{RAW_CODEC}-{RAW_LEVEL}-{checksum}"


def encoded_object_key(chunk_hash: ChunkHash, codec: str, level: int, checksum: str) -> str:
  return f"{_DATA}{chunk_hash}/{codec}-{level}-{checksum}"


def is_array_object(object_key: str) -> bool:
  """Whether a data object is a zarr3 array (a key prefix: raw) or one key (encoded bytes)."""
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


def _prefix_range(prefix: str) -> ts.KvStore.KeyRange:
  """All keys starting with `prefix` (which ends with "/")."""
  return ts.KvStore.KeyRange(prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1))


def _with_conditional_write(spec: dict[str, Any], on: bool) -> dict[str, Any]:
  """A copy of `spec` whose s3 kvstore (itself or an ocdbt base) has `use_conditional_write=on`."""
  if spec.get("driver") == "ocdbt":
    return {**spec, "base": _with_conditional_write(spec["base"], on)}
  return {**spec, "use_conditional_write": on} if spec.get("driver") == "s3" else spec


def values_checksum(values: np.ndarray) -> str:
  """Hex SHA-256 of an array's C-order value bytes."""
  values = np.ascontiguousarray(values)
  return hashlib.sha256(values.reshape(-1).view(np.uint8)).hexdigest()


# ---------------------------------------------------------------------------------------------
# Stats, byte limiter, background loop.


@dataclasses.dataclass
class StoreStats:
  """Counters of one store; mutate through the store, read with `snapshot()`.

  Attributes:
    hits: verified reads.
    misses_by_reason: misses per `MissReason`.
    bytes_read: value bytes of verified reads.
    bytes_written: value bytes of published puts.
    puts: published puts.
    put_conflicts: puts that found the record already present (lost the race or came late).
    put_failures: puts that failed on a backend error (no record published).
  """

  hits: int = 0
  misses_by_reason: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  bytes_read: int = 0
  bytes_written: int = 0
  puts: int = 0
  put_conflicts: int = 0
  put_failures: int = 0
  _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False,
                                            compare=False)

  def add(self, **deltas: int) -> None:
    with self._lock:
      for k, v in deltas.items():
        setattr(self, k, getattr(self, k) + v)

  def miss(self, reason: MissReason) -> None:
    with self._lock:
      self.misses_by_reason[reason] += 1

  def snapshot(self) -> dict[str, Any]:
    """A consistent copy; `misses_by_reason` maps reason values (str) to counts."""
    with self._lock:
      return {
          "hits": self.hits,
          "misses_by_reason": {r.value: n for r, n in self.misses_by_reason.items()},
          "bytes_read": self.bytes_read, "bytes_written": self.bytes_written,
          "puts": self.puts, "put_conflicts": self.put_conflicts,
          "put_failures": self.put_failures,
      }


class _Waiter:
  __slots__ = ("nbytes", "loop", "future", "granted")

  def __init__(self, nbytes: int, loop: asyncio.AbstractEventLoop, future: asyncio.Future):
    self.nbytes, self.loop, self.future, self.granted = nbytes, loop, future, False


class ByteLimiter:
  """Bounds bytes in flight, FIFO; usable from several event loops and threads at once.

  A request larger than the limit is clamped to it, so it runs alone instead of never.
  """

  def __init__(self, max_bytes: int):
    if max_bytes <= 0:
      raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    self._max = max_bytes
    self._used = 0
    self._lock = threading.Lock()
    self._waiters: collections.deque[_Waiter] = collections.deque()

  @property
  def in_use(self) -> int:
    return self._used

  async def acquire(self, nbytes: int) -> None:
    n = min(max(0, nbytes), self._max)
    with self._lock:
      if not self._waiters and self._used + n <= self._max:
        self._used += n
        return
      loop = asyncio.get_running_loop()
      waiter = _Waiter(n, loop, loop.create_future())
      self._waiters.append(waiter)
    try:
      await waiter.future
    except asyncio.CancelledError:
      with self._lock:
        granted = waiter.granted
        if not granted:
          self._waiters.remove(waiter)
      if granted:
        self.release(n)
      raise

  def release(self, nbytes: int) -> None:
    n = min(max(0, nbytes), self._max)
    with self._lock:
      self._used -= n
      while self._waiters and self._used + self._waiters[0].nbytes <= self._max:
        w = self._waiters.popleft()
        w.granted = True
        self._used += w.nbytes
        w.loop.call_soon_threadsafe(_resolve, w.future)

  @contextlib.asynccontextmanager
  async def hold(self, nbytes: int):
    await self.acquire(nbytes)
    try:
      yield
    finally:
      self.release(nbytes)


def _resolve(future: asyncio.Future) -> None:
  if not future.done():
    future.set_result(None)


_loop_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_loop_thread: threading.Thread | None = None


def _background_loop() -> asyncio.AbstractEventLoop:
  """The module's one background event loop (started on first use, daemon thread)."""
  global _loop, _loop_thread
  with _loop_lock:
    if _loop is None or _loop_thread is None or not _loop_thread.is_alive():
      loop = asyncio.new_event_loop()
      thread = threading.Thread(target=loop.run_forever, name="kvjax-chunk-store", daemon=True)
      thread.start()
      _loop, _loop_thread = loop, thread
    return _loop


def run_sync(coro: Awaitable[_T]) -> _T:
  """Runs a coroutine on the background loop and waits for it (from any thread but that loop's).

  Raises:
    RuntimeError: called from the background loop's own thread (it would deadlock).
  """
  loop = _background_loop()
  if threading.current_thread() is _loop_thread:
    if asyncio.iscoroutine(coro):
      coro.close()
    raise RuntimeError("sync store call from the store's own event loop; await the async API")
  return asyncio.run_coroutine_threadsafe(coro, loop).result()


# ---------------------------------------------------------------------------------------------
# Error classification.


def _status(e: BaseException) -> str:
  """The absl status code tensorstore puts at the front of its error messages, if any."""
  head = str(e).split(":", 1)[0].strip()
  return head if head.isupper() else ""


def _data_error_reason(e: BaseException) -> MissReason:
  """Miss reason of an exception raised while opening or reading a data object."""
  if isinstance(e, (asyncio.TimeoutError, TimeoutError)):
    return MissReason.READ_ERROR
  status = _status(e)
  if status == "NOT_FOUND":
    return MissReason.MISSING_DATA
  if status in ("DATA_LOSS", "INVALID_ARGUMENT", "FAILED_PRECONDITION", "OUT_OF_RANGE"):
    return MissReason.CORRUPT
  return MissReason.READ_ERROR


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
               limiter: Limiter | None = None, zstd_level: int | None = specs.DEFAULT_ZSTD_LEVEL,
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
      zstd_level: zstd level inside the shard for new objects (None: off).
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
    self._zstd_level = zstd_level
    self._root: ts.KvStore | None = None
    self._no_value: bytes | None = None
    # S3 without working conditional PUTs: verify each publish by reading it back.
    self._verify_publish = False
    self._in_flight_lock = threading.Lock()
    self._in_flight: collections.Counter[str] = collections.Counter()
    self._closed = False

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
      probe = await self._op(root.read(_ABSENT_PROBE_KEY))
      if probe.state != "missing" or not probe.stamp.generation:
        raise RuntimeError(f"cannot learn the no-value generation of {self.url!r}")
      self._no_value = bytes(probe.stamp.generation)
      self._root = root
    return self._root

  async def _check_s3_conditional_write(self) -> None:
    """S3: selects atomic conditional PUTs if the server honours them, else the fallback."""
    s3 = specs.s3_spec(self.kvstore_spec)
    if s3 is None:
      return
    if s3.get("use_conditional_write") and not await self._s3_honours_conditions(s3):
      _log.warning(
          "store %r: %s does not honour conditional PUTs (If-None-Match); falling back to "
          "HEAD-then-PUT with read-after-write checks, which is not atomic under racing writers",
          self.name, s3.get("endpoint", "S3"))
      self.kvstore_spec = _with_conditional_write(self.kvstore_spec, False)
      s3 = specs.s3_spec(self.kvstore_spec)
    self._verify_publish = not s3.get("use_conditional_write")

  async def _s3_honours_conditions(self, s3: dict[str, Any]) -> bool:
    """Whether a create-if-absent of an existing key fails on this server, as it must."""
    kv = await self._op(ts.KvStore.open(s3, context=self.context))
    absent = await self._op(kv.read(_ABSENT_PROBE_KEY))
    await self._op(kv.write(_CONDITIONAL_PROBE_KEY, b"kvjax"))
    try:
      stamp = await self._op(kv.write(_CONDITIONAL_PROBE_KEY, b"kvjax",
                                      if_equal=absent.stamp.generation))
    except Exception as e:  # noqa: BLE001  (e.g. 501 Not Implemented)
      _log.warning("conditional PUT on %s failed: %r", s3.get("endpoint", "S3"), e)
      return False
    return not stamp.generation

  @contextlib.contextmanager
  def _writing(self, object_key: str) -> Iterator[None]:
    """Marks a data object as being written, so `gc` in this process leaves it alone."""
    with self._in_flight_lock:
      self._in_flight[object_key] += 1
    try:
      yield
    finally:
      with self._in_flight_lock:
        self._in_flight[object_key] -= 1
        if not self._in_flight[object_key]:
          del self._in_flight[object_key]

  async def _read_record(self, chunk_hash: ChunkHash) -> ts.KvStore.ReadResult:
    root = await self.kvstore()
    return await self._op(root.read(index_key(chunk_hash)))

  async def _delete_object(self, object_key: str) -> None:
    root = await self.kvstore()
    if is_array_object(object_key):
      await self._op(root.delete_range(_prefix_range(object_key.rstrip("/") + "/")))
    else:
      await self._op(root.write(object_key, None))

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
                layout: KVLayout, *, choose: Chooser | None = None) -> ChunkHit | ChunkMiss:
    """Reads and verifies one chunk, in the encoding `choose` picks.

    Args:
      chunk_hash: the chunk's key.
      token_ids: the C token ids the caller expects the KV to belong to.
      namespace: the caller's namespace id (`KeyNamespace.root_hash()`).
      layout: the raw shape and dtype the caller can use.
      choose: called with the record's encodings this reader can decode (in record order,
        unknown codecs, versions and levels left out); returns the one to read, or None for none
        of them. Default `default_choose`: raw if stored, else the first.

    Returns:
      A `ChunkHit` (`payload`: the encoding's arrays; `kv`: `layout.dtype[L, 2, C, K, H]`, K
      before RoPE, for raw, else None), or a `ChunkMiss` with its reason (also counted in
      `stats.misses_by_reason`): UNKNOWN_CODEC when no encoding is decodable or `choose` takes
      none. Never raises for store faults.

    Raises:
      ValueError: `choose` returned something that is not one of the encodings it was given.
    """
    result = await self._get(chunk_hash, tuple(int(t) for t in token_ids), namespace, layout,
                             choose or default_choose)
    if isinstance(result, ChunkMiss):
      self.stats.miss(result.reason)
    else:
      self.stats.add(hits=1, bytes_read=result.encoding.nbytes)
    return result

  async def _get(self, chunk_hash: ChunkHash, token_ids: tuple[int, ...], namespace: str,
                 layout: KVLayout, choose: Chooser) -> ChunkHit | ChunkMiss:
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
    bad = record.mismatch(token_ids, namespace, layout)
    if bad is not None:
      return bad
    usable = [e for e in record.encodings
              if codecs.is_decodable(e.codec, e.codec_version, e.level)]
    encoding = choose(usable) if usable else None
    if encoding is None:
      return miss(MissReason.UNKNOWN_CODEC,
                  ("none chosen of " if usable else "")
                  + ",".join(f"{e.codec}/{e.codec_version}/{e.level}" for e in record.encodings))
    if encoding not in usable:
      raise ValueError(f"choose returned {encoding!r}, not one of the encodings it was given")
    is_raw = encoding.codec == RAW_CODEC
    if (not encoding.object.startswith(f"{_DATA}{chunk_hash}/")
        or is_raw != is_array_object(encoding.object)
        or (is_raw and encoding.nbytes != layout.nbytes)):
      return miss(MissReason.CORRUPT, f"bad encoding entry {encoding!r}")

    if self._limiter is not None:
      await self._limiter.acquire(encoding.nbytes)
    if is_raw:
      return await self._get_raw(record, encoding, layout)
    return await self._get_encoded(record, encoding, layout)

  async def _get_raw(self, record: ChunkRecord, encoding: Encoding,
                     layout: KVLayout) -> ChunkHit | ChunkMiss:
    try:
      async with self._bytes.hold(encoding.nbytes):
        spec = specs.chunk_array_spec(self.kvstore_spec, encoding.object, layout, create=False)
        arr = await self._op(ts.open(spec, context=self.context, read=True))
        kv = await self._op(arr.read())
    except Exception as e:  # noqa: BLE001
      return ChunkMiss(record.chunk_hash, _data_error_reason(e), repr(e))
    kv = np.asarray(kv)
    if kv.shape != layout.shape or kv.dtype != np.dtype(layout.dtype):
      return ChunkMiss(record.chunk_hash, MissReason.CORRUPT, f"read {kv.dtype}{list(kv.shape)}")
    if values_checksum(kv) != encoding.checksum:
      return ChunkMiss(record.chunk_hash, MissReason.CHECKSUM_MISMATCH)
    return ChunkHit(record=record, encoding=encoding, kv=kv, tier=self.name)

  async def _get_encoded(self, record: ChunkRecord, encoding: Encoding,
                         layout: KVLayout) -> ChunkHit | ChunkMiss:
    def miss(reason: MissReason, detail: str = "") -> ChunkMiss:
      return ChunkMiss(record.chunk_hash, reason, detail)

    root = await self.kvstore()
    try:
      async with self._bytes.hold(encoding.nbytes):
        res = await self._op(root.read(encoding.object))
    except Exception as e:  # noqa: BLE001
      return miss(_data_error_reason(e), repr(e))
    if res.state != "value":
      return miss(MissReason.MISSING_DATA, encoding.object)
    data = res.value
    if len(data) != encoding.nbytes:
      return miss(MissReason.CORRUPT, f"{encoding.object}: {len(data)} bytes, record says "
                  f"{encoding.nbytes}")
    if hashlib.sha256(data).hexdigest() != encoding.checksum:
      return miss(MissReason.CHECKSUM_MISMATCH, encoding.object)
    try:  # Entropy decoding is CPU work: off the event loop.
      payload = await asyncio.to_thread(codecs.decode_payload, encoding.codec,
                                        encoding.codec_version, encoding.level, data, layout)
    except codecs.UnknownCodec as e:
      return miss(MissReason.UNKNOWN_CODEC, str(e))
    except ValueError as e:  # CorruptPayload
      return miss(MissReason.CORRUPT, f"{encoding.object}: {e}")
    return ChunkHit(record=record, encoding=encoding, kv=None, tier=self.name, payload=payload)

  async def put(self, chunk_hash: ChunkHash, parent_hash: ChunkHash, token_ids: Sequence[int],
                namespace: str, kv: np.ndarray | None = None, *, layout: KVLayout | None = None,
                payloads: Sequence[EncodedPayload] = ()) -> bool:
    """Stores one chunk in one or more encodings: data first, then the record if none exists
    (commit last).

    Args:
      chunk_hash: the chunk's key.
      parent_hash: the previous chunk's key (the namespace root for the first chunk).
      token_ids: the C token ids the KV belongs to.
      namespace: namespace id (`KeyNamespace.root_hash()`).
      kv: raw `[L, 2, C, K, H]` values (K before RoPE), any numpy dtype tensorstore stores
        (float32, bfloat16, float16, ...), stored as a zarr3 array; or None.
      layout: the raw layout the payloads decode to; default (and if given, must equal) the
        layout of `kv`. Required without `kv`.
      payloads: encodings to store beside (or instead of) `kv`, each one bytes object
        (`codecs.encode_payload`); a "raw" payload is the same as `kv`. At most one per
        (codec, level). Record order: raw first, then `payloads` in order.

    Returns:
      True if this call published the record; False if a record already existed (counted in
      `stats.put_conflicts`; nothing is written) or the backend failed (`stats.put_failures`; no
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
      if (await self._read_record(chunk_hash)).state == "value":
        self.stats.add(put_conflicts=1)  # Already stored: skip the data write.
        return False
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
      checksum = values_checksum(values)
      enc = Encoding(RAW_CODEC, RAW_CODEC_VERSION, RAW_LEVEL, raw_object_key(chunk_hash, checksum),
                     values.nbytes, checksum)
      encodings.append(enc)
      writes.append(functools.partial(self._write_raw, enc.object, layout, values))
    for p, blob in zip(encoded, blobs):
      checksum = hashlib.sha256(blob).hexdigest()
      enc = Encoding(p.codec, codecs.CURRENT_VERSION[p.codec], p.level,
                     encoded_object_key(chunk_hash, p.codec, p.level, checksum), len(blob),
                     checksum)
      encodings.append(enc)
      writes.append(functools.partial(self._write_blob, enc.object, blob))
    record = ChunkRecord(chunk_hash=chunk_hash, parent_hash=parent_hash, token_ids=token_ids,
                         namespace=namespace, layout=layout, encodings=tuple(encodings))
    nbytes = sum(e.nbytes for e in encodings)
    objects = [e.object for e in encodings]

    with contextlib.ExitStack() as writing:
      for o in objects:
        writing.enter_context(self._writing(o))
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
      for o in objects:
        await self._drop_loser_object(chunk_hash, o)
      return False

  async def _write_raw(self, object_key: str, layout: KVLayout, values: np.ndarray) -> None:
    spec = specs.chunk_array_spec(self.kvstore_spec, object_key, layout, create=True,
                                  zstd_level=self._zstd_level)
    arr = await self._op(ts.open(spec, context=self.context))
    await self._op(arr.write(values))

  async def _write_blob(self, object_key: str, blob: bytes) -> None:
    root = await self.kvstore()
    await self._op(root.write(object_key, blob))

  async def _drop_loser_object(self, chunk_hash: ChunkHash, object_key: str) -> None:
    """After losing the publish race: delete our object unless the winner's record uses it.

    Writers of equal values write the same object; while another writer in this process is still
    writing it, the last of them decides. (A twin in another process can see its write fail;
    that put then counts as a failure and leaves no record.)
    """
    with self._in_flight_lock:
      if self._in_flight[object_key] > 1:
        return
    try:
      res = await self._read_record(chunk_hash)
      if res.state == "value":
        try:
          winner = ChunkRecord.from_json(res.value)
          if any(e.object == object_key for e in winner.encodings):
            return
        except ValueError:
          pass
      await self._delete_object(object_key)
    except Exception as e:  # noqa: BLE001  (left for gc)
      _log.warning("dropping %s on %s failed: %r", object_key, self.name, e)

  async def delete(self, chunk_hash: ChunkHash) -> bool:
    """Removes a chunk's record, then the data objects it referenced.

    Returns:
      True if a record existed and was removed.
    """
    root = await self.kvstore()
    res = await self._read_record(chunk_hash)
    if res.state != "value":
      return False
    # Conditional delete: only the record we read (a concurrent replacement stays).
    stamp = await self._op(root.write(index_key(chunk_hash), None,
                                      if_equal=res.stamp.generation))
    if not stamp.generation:
      return False
    try:
      objects = [e.object for e in ChunkRecord.from_json(res.value).encodings]
    except ValueError:  # Unparseable: everything under the chunk's data prefix.
      await self._op(root.delete_range(_prefix_range(f"{_DATA}{chunk_hash}/")))
      return True
    await asyncio.gather(*(self._delete_object(o) for o in objects))
    return True

  async def records(self) -> list[ChunkRecord]:
    """All parseable index records (malformed ones are logged and skipped)."""
    root = await self.kvstore()
    keys = await self._op(root.list(_prefix_range(_INDEX)))
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

  async def gc(self) -> int:
    """Removes data objects that no record references (failed or lost writes).

    Data of a chunk whose index record exists but is malformed is kept.

    Objects being written by this store are kept. A writer in another process can lose an
    in-flight object to `gc`; its record then reads as MISSING_DATA, never as wrong data.

    Returns:
      Number of data objects removed.
    """
    root = await self.kvstore()
    records = await self.records()
    referenced = {e.object for r in records for e in r.encodings}
    # A record that exists but does not parse still names its chunk (index/<hash>.json): keep
    # that chunk's data, so an operator can inspect or restore it.
    index_keys = await self._op(root.list(_prefix_range(_INDEX)))
    indexed = {k.decode()[len(_INDEX):-len(".json")] for k in index_keys
               if k.decode().endswith(".json")}
    unparsed = indexed - {r.chunk_hash for r in records}
    keys = await self._op(root.list(_prefix_range(_DATA)))
    objects = set()
    for key in keys:
      parts = key.decode().split("/")
      if len(parts) >= 3 and parts[1] not in unparsed:
        objects.add("/".join(parts[:3]))
    with self._in_flight_lock:
      busy = set(self._in_flight)
    garbage = sorted(objects - referenced - busy)
    await asyncio.gather(*(self._delete_object(o) for o in garbage))
    return len(garbage)

  def close(self) -> None:
    """Drops the cached handles; the store cannot be used afterwards."""
    self._closed = True
    self._root = None

  # -- sync twins ----------------------------------------------------------------------------------

  def contains_sync(self, hashes: Sequence[ChunkHash]) -> list[bool]:
    return run_sync(self.contains(hashes))

  def get_sync(self, chunk_hash: ChunkHash, token_ids: Sequence[int], namespace: str,
               layout: KVLayout, *, choose: Chooser | None = None) -> ChunkHit | ChunkMiss:
    return run_sync(self.get(chunk_hash, token_ids, namespace, layout, choose=choose))

  def put_sync(self, chunk_hash: ChunkHash, parent_hash: ChunkHash, token_ids: Sequence[int],
               namespace: str, kv: np.ndarray | None = None, *, layout: KVLayout | None = None,
               payloads: Sequence[EncodedPayload] = ()) -> bool:
    return run_sync(self.put(chunk_hash, parent_hash, token_ids, namespace, kv, layout=layout,
                             payloads=payloads))

  def delete_sync(self, chunk_hash: ChunkHash) -> bool:
    return run_sync(self.delete(chunk_hash))

  def records_sync(self) -> list[ChunkRecord]:
    return run_sync(self.records())

  def gc_sync(self) -> int:
    return run_sync(self.gc())
