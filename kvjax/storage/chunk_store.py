"""The chunk store: async get/put/contains of stored KV chunks over a tensorstore kvstore.

Architecture (DESIGN.md sections 3-5):

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
  Record format 1 (older stores, still read): checksums are SHA-256 and a raw object is a
  zarr3 array under the key prefix `data/<chunk_hash>/raw-0-<sha256>/` (zarr.json, c/0/0/0/0/0).

- Fast verified reads: a raw chunk is one object read straight into a fresh numpy buffer
  (file stores: `os.preadv` in a worker thread, no tensorstore decode and no extra copy; other
  backends: one kvstore read, viewed without a copy), checked against the record's size and
  xxh3-128 (`storage.checksum`: the key gives identity, the checksum only catches corruption),
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
- Verify on read: `get` returns a `ChunkHit` only after checking the record's token ids,
  namespace, layout, codec, the object's size and the checksum of the bytes read;
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
import logging
import os
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)
import numpy as np
import tensorstore as ts

from kvjax._typing import ChunkHash
from kvjax.storage import checksum as checksums
from kvjax.storage import codecs
from kvjax.storage import entropy
from kvjax.storage import keys as chunk_keys
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


def _prefix_range(prefix: str) -> ts.KvStore.KeyRange:
  """All keys starting with `prefix` (which ends with "/")."""
  return ts.KvStore.KeyRange(prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1))


def _with_conditional_write(spec: dict[str, Any], on: bool) -> dict[str, Any]:
  """A copy of `spec` whose s3 kvstore (itself or an ocdbt base) has `use_conditional_write=on`."""
  if spec.get("driver") == "ocdbt":
    return {**spec, "base": _with_conditional_write(spec["base"], on)}
  return {**spec, "use_conditional_write": on} if spec.get("driver") == "s3" else spec


def values_checksum(values: np.ndarray, algo: str = checksums.CURRENT) -> str:
  """Hex checksum (xxh3-128 by default, see `storage.checksum`) of an array's C-order bytes."""
  return checksums.digest(values, algo)


def _le_bytes(values: np.ndarray) -> bytes:
  """An array's C-order bytes, little endian (the stored raw format)."""
  values = np.ascontiguousarray(values)
  return (values if sys.byteorder == "little" else values.byteswap()).tobytes()


def _raw_nbytes(record: ChunkRecord, layout: KVLayout) -> tuple[int, ...]:
  """Sizes a raw object of `record` may have: its rows stored (`keys.stored_rows`), or (a tail
  written before tails were stored trimmed) the whole padded chunk."""
  rows = chunk_keys.stored_rows(record.token_ids)
  return (layout.nbytes // layout.chunk_size * rows, layout.nbytes)


class _BadSize(Exception):
  """A data object whose length is not what its record says (truncated or grown)."""


def _read_file(path: str, nbytes: int, algo: str) -> tuple[np.ndarray, str]:
  """Reads a whole file of exactly `nbytes` bytes into a fresh buffer and checksums it.

  Runs in a worker thread (`os.preadv` and xxh3 release the GIL).

  Returns:
    (uint8[nbytes] buffer, hex digest of it).

  Raises:
    FileNotFoundError: no such file.
    _BadSize: the file is not `nbytes` long.
    OSError: any other read failure.
  """
  fd = os.open(path, os.O_RDONLY)
  try:
    size = os.fstat(fd).st_size
    if size != nbytes:
      raise _BadSize(f"{size} bytes, record says {nbytes}")
    buf = np.empty(nbytes, np.uint8)
    view, got = memoryview(buf), 0
    while got < nbytes:
      n = os.preadv(fd, [view[got:]], got)
      if n <= 0:
        raise _BadSize(f"{got} bytes read, record says {nbytes}")
      got += n
  finally:
    os.close(fd)
  return buf, checksums.digest(buf, algo)


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
  if isinstance(e, FileNotFoundError):
    return MissReason.MISSING_DATA
  if isinstance(e, _BadSize):
    return MissReason.CORRUPT
  if isinstance(e, OSError):
    return MissReason.READ_ERROR
  status = _status(e)
  if status == "NOT_FOUND":
    return MissReason.MISSING_DATA
  if status in ("DATA_LOSS", "INVALID_ARGUMENT", "FAILED_PRECONDITION", "OUT_OF_RANGE"):
    return MissReason.CORRUPT
  return MissReason.READ_ERROR


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
              if codecs.is_decodable(e.codec, e.codec_version, e.level)
              and e.checksum_algo in checksums.ALGORITHMS]
    encoding = choose(usable) if usable else None
    if encoding is None:
      return miss(MissReason.UNKNOWN_CODEC,
                  ("none chosen of " if usable else "")
                  + ",".join(f"{e.codec}/{e.codec_version}/{e.level}" for e in record.encodings))
    if encoding not in usable:
      raise ValueError(f"choose returned {encoding!r}, not one of the encodings it was given")
    is_raw = encoding.codec == RAW_CODEC
    if (not encoding.object.startswith(f"{_DATA}{chunk_hash}/")
        or is_raw != is_raw_object(encoding.object)
        or (is_raw and encoding.nbytes not in _raw_nbytes(record, layout))):
      return miss(MissReason.CORRUPT, f"bad encoding entry {encoding!r}")

    if self._limiter is not None:
      await self._limiter.acquire(encoding.nbytes)
    if is_raw and record.format_version == 1:
      return await self._get_raw_array(record, encoding, layout)
    if is_raw:
      return await self._get_raw(record, encoding, layout)
    return await self._get_encoded(record, encoding, layout)

  def _local_path(self, object_key: str) -> str | None:
    """The file holding a one-key object on a plain file store (else None: use tensorstore)."""
    if self.kvstore_spec.get("driver") != "file":
      return None
    return self.kvstore_spec["path"] + object_key

  async def _read_object(self, encoding: Encoding) -> tuple[np.ndarray, str]:
    """One whole one-key object as `uint8[encoding.nbytes]` and its checksum by the record's
    algorithm; the byte limiter is held while reading.

    Raises:
      FileNotFoundError, _BadSize, OSError, or tensorstore's errors (`_data_error_reason`
      classifies them); a missing object on a tensorstore backend raises FileNotFoundError.
    """
    async with self._bytes.hold(encoding.nbytes):
      path = self._local_path(encoding.object)
      if path is not None:
        return await self._op(asyncio.to_thread(_read_file, path, encoding.nbytes,
                                                encoding.checksum_algo))
      root = await self.kvstore()
      res = await self._op(root.read(encoding.object))
      if res.state != "value":
        raise FileNotFoundError(encoding.object)
      if len(res.value) != encoding.nbytes:
        raise _BadSize(f"{len(res.value)} bytes, record says {encoding.nbytes}")
      buf = np.frombuffer(res.value, np.uint8)  # read-only view, no copy
      return buf, checksums.digest(buf, encoding.checksum_algo)

  async def _get_raw(self, record: ChunkRecord, encoding: Encoding,
                     layout: KVLayout) -> ChunkHit | ChunkMiss:
    try:
      buf, digest = await self._read_object(encoding)
    except Exception as e:  # noqa: BLE001
      return ChunkMiss(record.chunk_hash, _data_error_reason(e), f"{encoding.object}: {e!r}")
    if digest != encoding.checksum:
      return ChunkMiss(record.chunk_hash, MissReason.CHECKSUM_MISMATCH)
    rows = encoding.nbytes // (layout.nbytes // layout.chunk_size)
    shape = layout.shape[:2] + (rows,) + layout.shape[3:]
    kv = buf.view(np.dtype(layout.dtype)).reshape(shape)
    if sys.byteorder != "little":
      kv = kv.byteswap()
    if rows < layout.chunk_size:  # a tail's real rows: its padding rows are zeros
      full = np.zeros(layout.shape, np.dtype(layout.dtype))
      full[:, :, :rows] = kv
      kv = full
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
      return ChunkMiss(record.chunk_hash, _data_error_reason(e), repr(e))
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
      return miss(_data_error_reason(e), f"{encoding.object}: {e!r}")
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
      kv: raw `[L, 2, C, K, H]` values (K before RoPE), any numpy dtype (float32, bfloat16,
        float16, ...), stored as one object of their bytes; or None. For a session tail
        (`token_ids` end with `keys.TAIL_PAD_ID`) only the rows of its real tokens are stored
        (`keys.stored_rows`); `get` returns zeros in its padding rows.
      layout: the raw layout the payloads decode to; default (and if given, must equal) the
        layout of `kv`. Required without `kv`.
      payloads: encodings to store beside (or instead of) `kv`, each one bytes object
        (`codecs.encode_payload`); a "raw" payload is the same as `kv`. At most one per
        (codec, level). Record order: raw first, then `payloads` in order.

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
      raw = _le_bytes(values[:, :, :rows] if rows < values.shape[2] else values)
      checksum = checksums.digest(raw)
      enc = Encoding(RAW_CODEC, RAW_CODEC_VERSION, RAW_LEVEL, raw_object_key(chunk_hash, checksum),
                     len(raw), checksum)
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
                         namespace=namespace, layout=layout, encodings=tuple(encodings))
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
      await self._op(root.delete_range(_prefix_range(f"{_DATA}{chunk_hash}/")))
      return True
    await asyncio.gather(*(self._delete_object(
        e.object, array=record.format_version == 1 and e.codec == RAW_CODEC)
        for e in record.encodings))
    return True

  # -- maintenance: listing, sizes, garbage (the `kvjax.store` CLI) -------------------------------

  def local_dir(self) -> str | None:
    """The directory of a file or ocdbt+file store (no trailing "/"), else None."""
    spec = self.kvstore_spec
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
    root = await self.kvstore()
    keys = sorted(k.decode() for k in await self._op(root.list(_prefix_range(_INDEX))))
    keys = [k for k in keys if k.endswith(".json")]
    reads = await asyncio.gather(*(self._op(root.read(k)) for k in keys))
    records, malformed = [], []
    for key, res in zip(keys, reads):
      if res.state != "value":
        continue  # Deleted since the listing.
      try:
        record = ChunkRecord.from_json(res.value)
      except ValueError:
        malformed.append(ChunkHash(key[len(_INDEX):-len(".json")]))
        continue
      if record.namespace.startswith(namespace):
        records.append(record)
    records.sort(key=lambda r: r.chunk_hash)
    return StoreIndex(tuple(records), tuple(sorted(malformed)))

  async def records(self) -> list[ChunkRecord]:
    """All parseable index records (malformed or unreadable ones are logged and skipped)."""
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

  async def _data_objects(self, index: StoreIndex) -> dict[str, list[str]]:
    """Data objects of chunks without a malformed record: object key -> its keys.

    A chunk whose record exists but does not parse still names its chunk (index/<hash>.json):
    its data is kept, so an operator can inspect or restore it.
    """
    root = await self.kvstore()
    kept = set(index.malformed)
    out: dict[str, list[str]] = collections.defaultdict(list)
    for key in sorted(k.decode() for k in await self._op(root.list(_prefix_range(_DATA)))):
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
    with self._in_flight_lock:
      busy = set(self._in_flight)
    root = await self.kvstore()
    path = self.local_dir() if self.kvstore_spec.get("driver") == "file" else None
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
    await asyncio.gather(*(self._delete_object(o.object, array=o.array) for o in garbage))
    return len(garbage)

  async def verify(self, record: ChunkRecord) -> ChunkMiss | None:
    """Reads back every encoding of `record` this reader can decode, as a server would
    (`get` with the record's own token ids, namespace and layout: sizes, checksums, decode;
    arrays `get` leaves coded for the device, kvtc's "rans-bands", are decoded here on the host
    with the checks the device decoder makes).

    Returns:
      None if all of them verify; else the first miss (its detail prefixed with the encoding
      when the record has several), or UNKNOWN_CODEC when this reader knows none of them.
      Counted in `stats` like any read.
    """
    known = [e for e in record.encodings
             if codecs.is_decodable(e.codec, e.codec_version, e.level)
             and e.checksum_algo in checksums.ALGORITHMS] or [None]
    for enc in known:  # None: no known encoding; get reports UNKNOWN_CODEC
      got = await self.get(record.chunk_hash, record.token_ids, record.namespace, record.layout,
                           choose=lambda encodings, want=enc: next(
                               (e for e in encodings if e == want), None))
      if isinstance(got, ChunkHit):
        got = await asyncio.to_thread(_decode_deferred, got)
      if isinstance(got, ChunkMiss):
        where = f"{enc.codec}/{enc.codec_version}/{enc.level}" if len(known) > 1 else ""
        return dataclasses.replace(got, detail=": ".join(x for x in (where, got.detail) if x))
    return None

  def object_files(self, record: ChunkRecord) -> list[str]:
    """The files holding a record's data objects, on a plain file store (bench and tools).

    Raises:
      ValueError: not a plain file store (ocdbt, memory and s3 have no file per object).
    """
    if self.kvstore_spec.get("driver") != "file":
      raise ValueError(f"store {self.url!r} is not a plain file store")
    base = self.kvstore_spec["path"]
    out = []
    for e in record.encodings:
      if record.format_version == 1 and e.codec == RAW_CODEC:
        out += [base + e.object + "/zarr.json", base + e.object + "/c/0/0/0/0/0"]
      else:
        out.append(base + e.object)
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
