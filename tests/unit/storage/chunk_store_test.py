"""Tests for kvjax.storage.backends.chunk_store and kvjax.storage.backends.specs.

Every fault must come back as a miss with the right reason (and its counter), never as KV.
"""

import asyncio
import dataclasses
import os
import pathlib
import shutil
import threading
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np
import tensorstore as ts

from kvjax.storage.backends import chunk_store
from kvjax.storage.format import keys
from kvjax.storage.backends import specs
from kvjax.storage.tiering import tiers
from kvjax.testing import codec_payloads
from kvjax.testing.storage import (C, HASHES, NS, ROOT, TOKENS, StoreAssertions, bits as _bits,
                                   layout as _layout, run, values as _values)
from kvjax.storage.format.types import (RECORD_FORMAT_VERSION, ChunkHit, ChunkRecord, Encoding,
                                        KVLayout, MissReason)

TESTDATA = pathlib.Path(__file__).resolve().parent / "testdata"
BACKENDS = (("memory",), ("file",), ("ocdbt",))


class StoreTestBase(StoreAssertions, parameterized.TestCase):
  """The stores of these tests: `StoreAssertions.make_store`."""


class RoundTripTest(StoreTestBase):

  @parameterized.product(backend=("memory", "file", "ocdbt"),
                         dtype=("float32", "bfloat16", "float16"))
  def test_bytes_round_trip_exactly(self, backend, dtype):
    store = self.make_store(backend)
    layout = _layout(dtype)

    async def body():
      kv = await self.put0(store, layout)
      hit = await store.get(HASHES[0], TOKENS[:C], ROOT, layout)
      self.assertIsInstance(hit, ChunkHit)
      self.assertEqual(hit.kv.dtype, kv.dtype)
      self.assertEqual(hit.kv.shape, layout.shape)
      np.testing.assert_array_equal(_bits(hit.kv), _bits(kv))
      self.assertEqual(hit.tier, "disk")
      self.assertEqual(hit.record.token_ids, tuple(TOKENS[:C]))
      self.assertEqual(hit.encoding.nbytes, layout.nbytes)
      self.assertEqual(hit.encoding.checksum, chunk_store.values_checksum(kv))
      self.assertEqual(hit.encoding.object,
                       f"data/{HASHES[0]}/raw-0-{chunk_store.values_checksum(kv)}")

    run(body())
    snap = store.stats.snapshot()
    self.assertEqual((snap["hits"], snap["puts"], snap["bytes_read"], snap["bytes_written"]),
                     (1, 1, layout.nbytes, layout.nbytes))
    self.assertEqual(snap["misses_by_reason"], {})

  @parameterized.parameters(*BACKENDS)
  def test_sync_twins_and_listing(self, backend):
    store = self.make_store(backend)
    layout = _layout()
    kvs = [_values(layout, i) for i in range(3)]
    parents = [ROOT] + HASHES[:-1]
    for i, kv in enumerate(kvs):
      self.assertTrue(store.put_sync(HASHES[i], parents[i], TOKENS[i * C:(i + 1) * C], ROOT, kv))
    self.assertFalse(store.put_sync(HASHES[0], ROOT, TOKENS[:C], ROOT, kvs[0]))  # Already there.
    self.assertEqual(store.contains_sync(HASHES), [True, True, True])
    records = store.records_sync()
    self.assertEqual(sorted(r.chunk_hash for r in records), sorted(HASHES))
    self.assertEqual({r.chunk_hash: r.parent_hash for r in records}, dict(zip(HASHES, parents)))
    hit = store.get_sync(HASHES[2], TOKENS[2 * C:], ROOT, layout)
    np.testing.assert_array_equal(hit.kv, kvs[2])
    self.assertEqual(store.gc_sync(), 0)
    self.assertTrue(store.delete_sync(HASHES[1]))
    self.assertFalse(store.delete_sync(HASHES[1]))
    self.assertEqual(store.contains_sync(HASHES), [True, False, True])
    peeked = run(store.peek(HASHES))
    self.assertIsNone(peeked[1])
    self.assertEqual(peeked[0], next(r for r in records if r.chunk_hash == HASHES[0]))
    self.assertEqual(run(self.keys_under(store, f"data/{HASHES[1]}/")), [])
    self.assertEqual(store.stats.put_conflicts, 1)

  @parameterized.parameters(*BACKENDS)
  def test_raw_object_is_the_little_endian_values(self, backend):
    store = self.make_store(backend)
    layout = _layout()

    async def body():
      kv = await self.put0(store, layout)
      enc = (await store.get(HASHES[0], TOKENS[:C], ROOT, layout)).encoding
      self.assertEqual((enc.codec_version, enc.checksum_algo), (1, "xxh3-128"))
      self.assertLen(enc.checksum, 32)
      root = await store.kvstore()
      data = (await root.read(enc.object)).value
      self.assertEqual(data, kv.astype("<f4").tobytes())
      # One layer is a contiguous byte range.
      per_layer = layout.nbytes // layout.num_layers
      np.testing.assert_array_equal(
          np.frombuffer(data[per_layer:2 * per_layer], "<f4").reshape(layout.shape[1:]), kv[1])

    run(body())

  @parameterized.parameters(*BACKENDS)
  def test_limiter_sees_data_bytes(self, backend):
    acquired = []

    class Link:

      async def acquire(self, nbytes):
        acquired.append(nbytes)

    store = self.make_store(backend, limiter=Link())
    layout = _layout()

    async def body():
      await self.put0(store, layout)
      await store.get(HASHES[0], TOKENS[:C], ROOT, layout)

    run(body())
    self.assertEqual(acquired, [layout.nbytes])

  @parameterized.parameters(*BACKENDS)
  def test_batched_contains_1000(self, backend):
    store = self.make_store(backend)
    ns = dataclasses.replace(NS, chunk_size=1)
    hashes = keys.chunk_hashes(ns, list(range(1000)))
    present = set(range(0, 1000, 97))
    layout = KVLayout(1, 1, 1, 2, "float32")

    async def body():
      await asyncio.gather(*(
          store.put(hashes[i], ROOT, [i], ROOT, np.full(layout.shape, i, np.float32))
          for i in present))
      return await store.contains(hashes)

    self.assertEqual(run(body()), [i in present for i in range(1000)])

  @parameterized.parameters(*BACKENDS)
  def test_create_only_if_absent_generation(self, backend):
    """The publish mechanism: `if_equal` = the generation a missing key reads as."""
    store = self.make_store(backend)

    async def body():
      root = await store.kvstore()
      missing = await root.read("probe/x")
      self.assertEqual(missing.state, "missing")
      first = await root.write("probe/x", b"one", if_equal=missing.stamp.generation)
      second = await root.write("probe/x", b"two", if_equal=missing.stamp.generation)
      self.assertNotEqual(first.generation, b"")
      self.assertEqual(second.generation, b"")  # Condition failed: nothing written.
      self.assertEqual((await root.read("probe/x")).value, b"one")

    run(body())

  def test_rejects_bad_shape(self):
    store = self.make_store("memory")
    with self.assertRaises(ValueError):
      store.put_sync(HASHES[0], ROOT, TOKENS[:C], ROOT, np.zeros((3, 2, C + 1, 2, 8), np.float32))


class FaultTest(StoreTestBase):

  @parameterized.parameters(*BACKENDS)
  def test_absent(self, backend):
    store = self.make_store(backend)
    self.assert_miss(store, store.get_sync(HASHES[0], TOKENS[:C], ROOT, _layout()),
                     MissReason.ABSENT)

  @parameterized.parameters(*BACKENDS)
  def test_corrupted_data_bytes(self, backend):
    store = self.make_store(backend)

    async def body():
      await self.put0(store)
      root = await store.kvstore()
      key = await self.shard_key(store, HASHES[0])
      data = bytearray((await root.read(key)).value)
      data[5] ^= 0x40  # Inside layer 0's values; the shard index (at the end) stays valid.
      await root.write(key, bytes(data))
      return await store.get(HASHES[0], TOKENS[:C], ROOT, _layout())

    self.assert_miss(store, run(body()), MissReason.CHECKSUM_MISMATCH)

  def test_corrupted_bytes_on_disk(self):
    store = self.make_store("file")

    async def body():
      await self.put0(store)
      key = await self.shard_key(store, HASHES[0])
      path = pathlib.Path(self.tmp, "store", key)
      data = bytearray(path.read_bytes())
      data[len(data) // 3] ^= 0x01
      path.write_bytes(bytes(data))
      return await store.get(HASHES[0], TOKENS[:C], ROOT, _layout())

    self.assert_miss(store, run(body()), MissReason.CHECKSUM_MISMATCH)

  @parameterized.parameters(*BACKENDS)
  def test_a_malformed_record_is_replaced_by_the_next_put(self, backend):
    # Found by a fresh-user check: an overwritten index record made its chunk a miss on every
    # request, and every save of it a conflict. A record of another format version stays.
    store = self.make_store(backend)

    async def body():
      root = await store.kvstore()
      key = chunk_store.index_key(HASHES[0])
      for garbage in (b'{"chunk_hash": "garb', b"[1, 2]", b'{"format_version": 2}',
                      b'{"chunk_hash": "x"}'):
        await root.write(key, garbage)
        self.assertTrue(ChunkRecord.is_malformed(garbage), garbage)
        kv = await self.put0(store)
        hit = await store.get(HASHES[0], TOKENS[:C], ROOT, _layout())
        self.assertIsInstance(hit, ChunkHit)
        np.testing.assert_array_equal(_bits(hit.kv), _bits(kv))
        self.assertTrue(await store.delete(HASHES[0]))
      newer = b'{"format_version": 99, "fields": "of a newer writer"}'
      self.assertFalse(ChunkRecord.is_malformed(newer))
      await root.write(key, newer)
      self.assertFalse(await store.put(HASHES[0], ROOT, TOKENS[:C], ROOT, _values(_layout())))
      self.assertEqual((await root.read(key)).value, newer)

    run(body())
    self.assertEqual((store.stats.puts, store.stats.put_conflicts), (4, 1))

  @parameterized.parameters(*BACKENDS)
  def test_truncated_data(self, backend):
    store = self.make_store(backend)

    async def body():
      await self.put0(store)
      root = await store.kvstore()
      key = await self.shard_key(store, HASHES[0])
      data = (await root.read(key)).value
      await root.write(key, data[:len(data) // 2])
      return await store.get(HASHES[0], TOKENS[:C], ROOT, _layout())

    self.assert_miss(store, run(body()), MissReason.CORRUPT)

  @parameterized.parameters(*BACKENDS)
  def test_data_object_missing(self, backend):
    store = self.make_store(backend)

    async def body():
      await self.put0(store)
      root = await store.kvstore()
      await root.write(await self.shard_key(store, HASHES[0]), None)
      return await store.get(HASHES[0], TOKENS[:C], ROOT, _layout())

    self.assert_miss(store, run(body()), MissReason.MISSING_DATA)

  @parameterized.parameters(*BACKENDS)
  def test_index_record_without_data(self, backend):
    store = self.make_store(backend)
    layout = _layout()
    record = ChunkRecord(HASHES[0], ROOT, tuple(TOKENS[:C]), ROOT, layout,
                         (Encoding("raw", 1, 0, f"data/{HASHES[0]}/raw-0-{'0' * 64}",
                                   layout.nbytes, "0" * 64),))

    async def body():
      root = await store.kvstore()
      await root.write(chunk_store.index_key(HASHES[0]), record.to_json())
      self.assertEqual(await store.contains([HASHES[0]]), [True])
      return await store.get(HASHES[0], TOKENS[:C], ROOT, layout)

    self.assert_miss(store, run(body()), MissReason.MISSING_DATA)

  @parameterized.parameters(*BACKENDS)
  def test_data_without_index_record_is_invisible_and_collected(self, backend):
    store = self.make_store(backend)

    async def body():
      await self.put0(store)
      root = await store.kvstore()
      await root.write(chunk_store.index_key(HASHES[0]), None)
      self.assertEqual(await store.contains([HASHES[0]]), [False])
      miss = await store.get(HASHES[0], TOKENS[:C], ROOT, _layout())
      self.assertEqual(await store.gc(), 1)
      self.assertEqual(await self.keys_under(store, "data/"), [])
      return miss

    self.assert_miss(store, run(body()), MissReason.ABSENT)

  @parameterized.parameters(*BACKENDS)
  def test_deleted_between_contains_and_get(self, backend):
    store = self.make_store(backend)

    async def body():
      await self.put0(store)
      self.assertEqual(await store.contains([HASHES[0]]), [True])
      self.assertTrue(await store.delete(HASHES[0]))
      return await store.get(HASHES[0], TOKENS[:C], ROOT, _layout())

    self.assert_miss(store, run(body()), MissReason.ABSENT)

  @parameterized.parameters(*BACKENDS)
  def test_token_mismatch(self, backend):
    store = self.make_store(backend)

    async def body():
      await self.put0(store)
      return await store.get(HASHES[0], TOKENS[1:C + 1], ROOT, _layout())

    self.assert_miss(store, run(body()), MissReason.TOKEN_MISMATCH)

  @parameterized.parameters(
      ("model_fingerprint", "other-model"), ("kv_dtype", "bfloat16"), ("cache_salt", "tenant"))
  def test_namespace_mismatch(self, field, value):
    store = self.make_store("memory")
    other = dataclasses.replace(NS, **{field: value})

    async def body():
      await self.put0(store)
      # The real lookup path: the other namespace's keys differ, so nothing is found.
      other_hashes = keys.chunk_hashes(other, TOKENS)
      self.assertEqual(await store.contains(other_hashes), [False] * 3)
      # Forced: the same key asked for under the other namespace.
      return await store.get(HASHES[0], TOKENS[:C], other.root_hash(), _layout())

    self.assert_miss(store, run(body()), MissReason.NAMESPACE_MISMATCH)

  @parameterized.named_parameters(
      ("dtype", _layout("bfloat16"), MissReason.DTYPE_MISMATCH),
      ("layers", _layout(num_layers=2), MissReason.LAYOUT_MISMATCH),
      ("heads", dataclasses.replace(_layout(), num_kv_heads=1), MissReason.LAYOUT_MISMATCH))
  def test_layout_mismatch(self, layout, reason):
    store = self.make_store("memory")

    async def body():
      await self.put0(store)
      return await store.get(HASHES[0], TOKENS[:C], ROOT, layout)

    self.assert_miss(store, run(body()), reason)

  @parameterized.named_parameters(
      ("not_json", b"{not json"),
      ("other_format", None),
      ("missing_field", b'{"format_version": 1}'),
      ("without_checksum_algo", b"no_algo"),
  )
  def test_malformed_record(self, raw):
    store = self.make_store("memory")

    async def body():
      await self.put0(store)
      root = await store.kvstore()
      key = chunk_store.index_key(HASHES[0])
      data = raw
      if data == b"no_algo":
        data = (await root.read(key)).value.replace(b'"checksum_algo": "xxh3-128", ', b"")
        self.assertNotIn(b"checksum_algo", data)
      if data is None:
        current = f'"format_version": {RECORD_FORMAT_VERSION}'.encode()
        self.assertIn(current, (await root.read(key)).value)
        data = (await root.read(key)).value.replace(current, b'"format_version": 99')
      await root.write(key, data)
      return await store.get(HASHES[0], TOKENS[:C], ROOT, _layout())

    self.assert_miss(store, run(body()), MissReason.CORRUPT)

  def test_unknown_codec(self):
    store = self.make_store("memory")

    async def body():
      await self.put0(store)
      root = await store.kvstore()
      key = chunk_store.index_key(HASHES[0])
      record = ChunkRecord.from_json((await root.read(key)).value)
      enc = dataclasses.replace(record.encodings[0], codec="zfp")  # a codec this reader lacks
      await root.write(key, dataclasses.replace(record, encodings=(enc,)).to_json())
      return await store.get(HASHES[0], TOKENS[:C], ROOT, _layout())

    self.assert_miss(store, run(body()), MissReason.UNKNOWN_CODEC)

  def test_backend_read_error(self):
    store = self.make_store("memory")

    async def body():
      await self.put0(store)
      with mock.patch.object(store, "_read_record", side_effect=OSError("unreachable")):
        self.assertEqual(await store.contains([HASHES[0]]), [False])
        return await store.get(HASHES[0], TOKENS[:C], ROOT, _layout())

    self.assert_miss(store, run(body()), MissReason.READ_ERROR)

  @parameterized.parameters(*BACKENDS)
  def test_failing_write_leaves_no_record(self, backend):
    store = self.make_store(backend)

    async def body():
      with mock.patch.object(store, "_publish_record", side_effect=OSError("crash")):
        self.assertFalse(await store.put(HASHES[0], ROOT, TOKENS[:C], ROOT, _values(_layout())))
      self.assertEqual(await store.contains([HASHES[0]]), [False])
      self.assertEqual(await store.records(), [])
      self.assertNotEqual(await self.keys_under(store, "data/"), [])  # Data was written...
      self.assertEqual(await store.gc(), 1)  # ... and is garbage.
      self.assertEqual(await self.keys_under(store, "data/"), [])
      return await store.get(HASHES[0], TOKENS[:C], ROOT, _layout())

    self.assert_miss(store, run(body()), MissReason.ABSENT)
    self.assertEqual(store.stats.put_failures, 1)
    self.assertEqual(store.stats.puts, 0)


class ConcurrentWritersTest(StoreTestBase):

  def check_one_winner(self, store, results, values):
    self.assertEqual(sum(results), 1, results)
    hit = store.get_sync(HASHES[0], TOKENS[:C], ROOT, _layout())
    self.assertIsInstance(hit, ChunkHit)
    self.assertTrue(any(np.array_equal(_bits(hit.kv), _bits(v)) for v in values))
    self.assertEqual(store.gc_sync(), 0)  # Losers removed their own objects.
    objects = {"/".join(k.split("/")[:3]) for k in run(self.keys_under(store, "data/"))}
    self.assertEqual(objects, {hit.encoding.object})
    self.assertEqual(store.stats.puts, 1)
    self.assertEqual(store.stats.put_conflicts, len(results) - 1)

  @parameterized.parameters(*BACKENDS)
  def test_asyncio_writers(self, backend):
    store = self.make_store(backend)
    # Writers 0-3 hold distinct values; 4-7 repeat them (same data object as another writer).
    values = [_values(_layout(), i % 4) for i in range(8)]

    async def body():
      return await asyncio.gather(*(store.put(HASHES[0], ROOT, TOKENS[:C], ROOT, v)
                                    for v in values))

    self.check_one_winner(store, run(body()), values)

  @parameterized.parameters(*BACKENDS)
  def test_threaded_writers(self, backend):
    store = self.make_store(backend)
    values = [_values(_layout(), i) for i in range(8)]
    results = [None] * 8
    barrier = threading.Barrier(8)

    def writer(i):
      barrier.wait()
      results[i] = store.put_sync(HASHES[0], ROOT, TOKENS[:C], ROOT, values[i])

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    self.check_one_winner(store, results, values)

  @parameterized.parameters(*BACKENDS)
  def test_two_stores_one_root_race(self, backend):
    """Writers that skip the early existence check still publish exactly one record."""
    store = self.make_store(backend)
    values = [_values(_layout(), i) for i in range(8)]
    real_read = store._read_record
    calls = []

    async def first_read_absent(chunk_hash):
      calls.append(chunk_hash)
      res = await real_read(chunk_hash)
      if len(calls) <= 8:  # The 8 early checks all see "absent", as in a tight race.
        return await real_read(keys.hash_chunk(ROOT, [-1]))
      return res

    async def body():
      with mock.patch.object(store, "_read_record", side_effect=first_read_absent):
        return await asyncio.gather(*(store.put(HASHES[0], ROOT, TOKENS[:C], ROOT, v)
                                      for v in values))

    self.check_one_winner(store, run(body()), values)


class ByteLimiterTest(absltest.TestCase):

  def test_bounds_and_fifo(self):
    async def body():
      lim = chunk_store.ByteLimiter(100)
      await lim.acquire(60)
      order = []

      async def want(n, tag):
        await lim.acquire(n)
        order.append(tag)

      a = asyncio.create_task(want(50, "a"))
      b = asyncio.create_task(want(10, "b"))  # Fits, but waits behind a (FIFO).
      await asyncio.sleep(0)
      self.assertEqual(order, [])
      lim.release(60)
      await asyncio.gather(a, b)
      self.assertEqual(order, ["a", "b"])
      self.assertEqual(lim.in_use, 60)
      lim.release(50)
      lim.release(10)
      self.assertEqual(lim.in_use, 0)
      await lim.acquire(10**9)  # Clamped to the limit: runs alone instead of never.
      self.assertEqual(lim.in_use, 100)
      lim.release(10**9)
      self.assertEqual(lim.in_use, 0)

    run(body())


class SpecsTest(parameterized.TestCase):

  def test_kvstore_urls(self):
    self.assertEqual(specs.kvstore_spec("memory://"), {"driver": "memory"})
    self.assertEqual(specs.kvstore_spec("memory://a"), {"driver": "memory", "path": "a/"})
    self.assertEqual(specs.kvstore_spec("file:///x/y"), {"driver": "file", "path": "/x/y/"})
    self.assertEqual(specs.kvstore_spec("/x/y/"), {"driver": "file", "path": "/x/y/"})
    with mock.patch.dict(os.environ):  # the default store: <cache root>/store
      os.environ.pop("KVJAX_CACHE_DIR", None)
      self.assertEqual(specs.kvstore_spec("")["path"],
                       os.path.expanduser("~/.cache/kvjax/store/"))
      os.environ["KVJAX_CACHE_DIR"] = "/x/cache"
      self.assertEqual(specs.kvstore_spec("")["path"], "/x/cache/store/")
    self.assertEqual(specs.kvstore_spec("ocdbt+file:///x"),
                     {"driver": "ocdbt", "base": {"driver": "file", "path": "/x/"}})

  def test_s3(self):
    with mock.patch.dict(os.environ, {"AWS_ENDPOINT_URL": "http://h:1", "AWS_REGION": "r1"}):
      s = specs.kvstore_spec("s3://bucket/pre/fix/")
      self.assertEqual((s["bucket"], s["path"], s["endpoint"], s["aws_region"]),
                       ("bucket", "pre/fix/", "http://h:1", "r1"))
      s = specs.kvstore_spec("s3://bucket", endpoint="http://e:2", region="r2")
      self.assertEqual((s["endpoint"], s["aws_region"]), ("http://e:2", "r2"))
      self.assertNotIn("path", s)
    self.assertIn("max_retries", s["s3_request_retries"])
    ts.KvStore.Spec(s)  # Valid for tensorstore.

  @parameterized.parameters("gs://b/p", "http://x", "foo://bar")
  def test_unknown_scheme(self, url):
    with self.assertRaisesRegex(ValueError, url.split("://")[0]):
      specs.kvstore_spec(url)

  @parameterized.parameters(None, 1)
  def test_chunk_array_spec(self, zstd):
    layout = _layout("bfloat16")
    spec = specs.chunk_array_spec({"driver": "memory", "path": "r/"}, "data/h/o", layout,
                                  create=True, zstd_level=zstd)
    self.assertEqual(spec["kvstore"], {"driver": "memory", "path": "r/data/h/o/"})
    md = spec["metadata"]
    self.assertEqual(md["shape"], [3, 2, C, 2, 8])
    self.assertEqual(md["data_type"], "bfloat16")
    shard = md["codecs"][0]
    self.assertEqual(shard["name"], "sharding_indexed")
    self.assertEqual(shard["configuration"]["chunk_shape"], [1, 2, C, 2, 8])
    self.assertEqual([c["name"] for c in shard["configuration"]["codecs"]],
                     ["bytes"] + (["zstd"] if zstd else []))
    arr = ts.open(spec).result()
    x = _values(layout)
    arr.write(x).result()
    np.testing.assert_array_equal(_bits(arr.read().result()), _bits(x))


class RecordFormat1Test(StoreAssertions, parameterized.TestCase):
  """A store written by record format 1 (SHA-256 checksums, zarr3 raw arrays) still loads.

  `testdata/v1_store` was written by that code: chunk 0 raw (values seed 0), chunk 1 raw (seed
  1) plus int8/0 and cachegen/1 payloads of it.
  """

  def setUp(self):
    super().setUp()
    self.dir = os.path.join(self.create_tempdir().full_path, "store")
    shutil.copytree(TESTDATA / "v1_store", self.dir)
    self.store = chunk_store.ChunkStore(self.dir)
    self.addCleanup(self.store.close)

  def test_every_encoding_reads_and_verifies(self):
    layout = _layout()
    records = {r.chunk_hash: r for r in self.store.records_sync()}
    self.assertEqual({r.format_version for r in records.values()}, {1})
    self.assertEqual({e.checksum_algo for r in records.values() for e in r.encodings},
                     {"sha256"})
    for i in (0, 1):
      hit = self.store.get_sync(HASHES[i], TOKENS[i * C:(i + 1) * C], ROOT, layout)
      self.assertIsInstance(hit, ChunkHit)
      np.testing.assert_array_equal(_bits(hit.kv), _bits(_values(layout, i)))
      self.assertLen(hit.encoding.checksum, 64)
    for codec, level in (("int8", 0), ("cachegen", 1)):
      hit = self.store.get_sync(HASHES[1], TOKENS[C:2 * C], ROOT, layout,
                                choose=chunk_store.choose_codec(codec, level))
      want = codec_payloads.encode(codec, level, _values(layout, 1))
      self.assertEqual(sorted(hit.payload), sorted(want))
      for name, a in want.items():
        np.testing.assert_array_equal(_bits(hit.payload[name]), _bits(a))
    self.assertEqual([run(self.store.verify(r)) for r in records.values()], [None, None])
    self.assertEqual(self.store.gc_sync(), 0)

  def test_damaged_format1_shard_is_a_checksum_miss(self):
    async def body():
      root = await self.store.kvstore()
      key = await self.shard_key(self.store, HASHES[0])
      self.assertTrue(key.endswith("/c/0/0/0/0/0"))
      data = bytearray((await root.read(key)).value)
      data[5] ^= 0x40
      await root.write(key, bytes(data))
      return await self.store.get(HASHES[0], TOKENS[:C], ROOT, _layout())

    self.assert_miss(self.store, run(body()), MissReason.CHECKSUM_MISMATCH)

  def test_new_chunks_beside_old_ones_and_delete_of_old_arrays(self):
    layout = _layout()
    kv = _values(layout, 2)
    self.assertTrue(self.store.put_sync(HASHES[2], HASHES[1], TOKENS[2 * C:], ROOT, kv))
    new = next(r for r in self.store.records_sync() if r.chunk_hash == HASHES[2])
    self.assertEqual((new.format_version, new.encodings[0].checksum_algo), (3, "xxh3-128"))
    np.testing.assert_array_equal(
        self.store.get_sync(HASHES[2], TOKENS[2 * C:], ROOT, layout).kv, kv)
    self.assertTrue(self.store.delete_sync(HASHES[0]))
    self.assertEqual(run(self.keys_under(self.store, f"data/{HASHES[0]}/")), [])
    self.assertEqual(self.store.gc_sync(), 0)
    # An orphaned format 1 array (its record gone) is collected as one object.
    run(self._drop_record(HASHES[1]))
    orphans = run(self.store.orphans())
    self.assertEqual([(o.object.split("/")[2][:4], o.array) for o in orphans],
                     [("cach", False), ("int8", False), ("raw-", True)])
    self.assertEqual(self.store.gc_sync(), 3)
    self.assertEqual(run(self.keys_under(self.store, f"data/{HASHES[1]}/")), [])

  async def _drop_record(self, chunk_hash):
    root = await self.store.kvstore()
    await root.write(chunk_store.index_key(chunk_hash), None)

  def test_promoted_into_host_tier_keeps_the_sha256(self):
    layout = _layout()
    host = tiers.HostMemoryTier(None)
    store = tiers.TieredStore([host, self.store])
    hit = run(store.get(HASHES[0], TOKENS[:C], ROOT, layout))
    self.assertEqual(hit.tier, "disk")
    (rec,) = run(host.records())
    self.assertEqual((rec.encodings[0].checksum, rec.encodings[0].checksum_algo),
                     (hit.encoding.checksum, "sha256"))


if __name__ == "__main__":
  absltest.main()
