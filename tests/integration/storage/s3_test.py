"""The chunk store over S3, against a local `moto_server` (plain zarr3 and ocdbt over s3).

One moto server per test class (`kvjax/testing/s3.py`: started in setUpClass on a free
127.0.0.1 port, stopped in tearDownClass; it answers one request at a time, so its conditional
writes are atomic as S3's are); every test uses its own key prefix in one bucket. Fake credentials and the
endpoint are set in the environment only while the class runs. moto comes with the `[test]`
extra; without it this module fails to import (loudly, never a skip).
"""

import asyncio
import itertools
import os
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

try:
  import boto3
  import moto.server  # noqa: F401 (the server in kvjax/testing/s3.py)
except ImportError as e:
  raise ImportError("tests/integration/storage/s3_test.py needs moto[server] and boto3: "
                    "pip install -e '.[test]'") from e

from kvjax.storage.backends import chunk_store
from kvjax.storage.format import keys
from kvjax.storage.backends import specs
from kvjax.testing.s3 import MotoServer
from kvjax.testing.storage import (C, HASHES, NS, ROOT, TOKENS, StoreAssertions, bits as _bits,
                                   layout as _layout, run, values as _values)
from kvjax.storage.format.types import ChunkHit, ChunkRecord, Encoding, KVLayout, MissReason

BUCKET = "kvjax-test"
REGION = "us-east-1"
TIMEOUT_S = 20.0  # Per tensorstore operation; a healthy local moto answers in milliseconds.
BACKENDS = (("s3",), ("ocdbt_s3",))


class MotoTestCase(parameterized.TestCase):
  """Starts moto, sets fake credentials and the endpoint, creates the bucket."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.server = MotoServer()
    cls.server.start()
    cls.env = mock.patch.dict(os.environ, {
        "AWS_ACCESS_KEY_ID": "kvjax-test", "AWS_SECRET_ACCESS_KEY": "kvjax-test",
        "AWS_REGION": REGION, "AWS_ENDPOINT_URL": cls.server.endpoint})
    cls.env.start()
    # Before any store opens it: tensorstore keeps retrying requests to a missing bucket.
    boto3.client("s3", endpoint_url=cls.server.endpoint, region_name=REGION).create_bucket(
        Bucket=BUCKET)

  @classmethod
  def tearDownClass(cls):
    cls.env.stop()
    cls.server.stop()
    super().tearDownClass()

  _ids = itertools.count()

  def url(self, backend="s3"):
    prefix = f"{type(self).__name__}-{next(self._ids)}"
    return {"s3": f"s3://{BUCKET}/{prefix}", "ocdbt_s3": f"ocdbt+s3://{BUCKET}/{prefix}"}[backend]


class S3ChunkStoreTest(StoreAssertions, MotoTestCase):

  def make_store(self, backend="s3", url=None, **kwargs):
    kwargs.setdefault("timeout_s", TIMEOUT_S)
    store = chunk_store.ChunkStore(url or self.url(backend), **kwargs)
    self.addCleanup(store.close)
    return store

  def test_spec_from_env(self):
    spec = specs.kvstore_spec(f"s3://{BUCKET}/p")
    self.assertEqual((spec["endpoint"], spec["aws_region"], spec["path"]),
                     (self.server.endpoint, REGION, "p/"))
    self.assertTrue(spec["use_conditional_write"])
    ocdbt = specs.kvstore_spec(f"ocdbt+s3://{BUCKET}/p")
    self.assertEqual(ocdbt["driver"], "ocdbt")
    self.assertEqual(specs.s3_spec(ocdbt), spec)

  @parameterized.product(backend=("s3", "ocdbt_s3"), dtype=("float32", "bfloat16"))
  def test_bytes_round_trip_exactly(self, backend, dtype):
    store = self.make_store(backend)
    layout = _layout(dtype)

    async def body():
      kv = await self.put0(store, layout)
      hit = await store.get(HASHES[0], TOKENS[:C], ROOT, layout)
      self.assertIsInstance(hit, ChunkHit)
      self.assertEqual((hit.kv.dtype, hit.kv.shape), (kv.dtype, layout.shape))
      np.testing.assert_array_equal(_bits(hit.kv), _bits(kv))
      self.assertEqual(hit.encoding.checksum, chunk_store.values_checksum(kv))

    run(body())
    self.assertFalse(store._verify_publish)  # moto honours conditional PUTs.
    snap = store.stats.snapshot()
    self.assertEqual((snap["hits"], snap["puts"], snap["bytes_read"]), (1, 1, layout.nbytes))

  @parameterized.parameters(*BACKENDS)
  def test_a_layer_range_reads_its_bytes_alone(self, backend):
    # A byte-range GET to the object's end: layers [2, 3) of the 3, verified; a damaged layer
    # in the range is a checksum miss, one outside it is not read; a short object is corrupt.
    store = self.make_store(backend)
    layout = _layout()
    per_layer = layout.nbytes // 3

    async def body():
      kv = await self.put0(store, layout)
      part = await store.get(HASHES[0], TOKENS[:C], ROOT, layout, layer_start=2)
      self.assertEqual((part.layer_start, part.nbytes), (2, per_layer))
      np.testing.assert_array_equal(_bits(part.kv), _bits(kv[2:]))
      root = await store.kvstore()
      key = await self.shard_key(store, HASHES[0])
      data = (await root.read(key)).value
      outcomes = []
      for bad in (data[:5] + bytes([data[5] ^ 1]) + data[6:],
                  data[:-5] + bytes([data[-5] ^ 1]) + data[-4:], data[:-1]):
        await root.write(key, bad)
        got = await store.get(HASHES[0], TOKENS[:C], ROOT, layout, layer_start=2)
        outcomes.append(got.reason.value if not isinstance(got, ChunkHit) else "hit")
      self.assertEqual(outcomes, ["hit", "checksum_mismatch", "corrupt"])

    run(body())
    snap = store.stats.snapshot()
    self.assertEqual((snap["ranged_reads"], snap["bytes_read"]), (4, 2 * per_layer))

  @parameterized.parameters(*BACKENDS)
  def test_contains_batched(self, backend):
    store = self.make_store(backend)
    ns = keys.KeyNamespace("fp", "float32", 1, 1)
    hashes = keys.chunk_hashes(ns, list(range(200)))
    present = set(range(0, 200, 29))
    layout = KVLayout(1, 1, 1, 2, "float32")

    async def body():
      await asyncio.gather(*(
          store.put(hashes[i], ROOT, [i], ROOT, np.full(layout.shape, i, np.float32))
          for i in present))
      return await store.contains(hashes)

    self.assertEqual(run(body()), [i in present for i in range(200)])

  def test_conditional_create_on_the_server(self):
    """The publish mechanism itself: a second create-if-absent of one key does not happen."""
    store = self.make_store()

    async def body():
      root = await store.kvstore()
      missing = await root.read("probe/x")
      self.assertEqual(missing.state, "missing")
      first = await root.write("probe/x", b"one", if_equal=missing.stamp.generation)
      second = await root.write("probe/x", b"two", if_equal=missing.stamp.generation)
      self.assertNotEqual(first.generation, b"")
      self.assertEqual(second.generation, b"")
      self.assertEqual((await root.read("probe/x")).value, b"one")
      # And concurrently: exactly one of 8 racing creates happens, every time.
      for trial in range(5):
        stamps = await asyncio.gather(*(
            root.write(f"probe/race{trial}", b"%d" % i, if_equal=missing.stamp.generation)
            for i in range(8)))
        self.assertEqual(sum(bool(s.generation) for s in stamps), 1)

    run(body())
    self.assertTrue(run(store._s3_honours_conditions(specs.s3_spec(store.kvstore_spec))))

  @parameterized.parameters(*BACKENDS)
  def test_concurrent_puts_one_winner(self, backend):
    """Two stores (as two processes) race on each key, all writers past the early check.

    Each store runs several writers of distinct values per key (fewer on ocdbt, whose manifest
    updates retry with backoff under contention). Without atomic conditional PUTs (tensorstore's
    HEAD-then-PUT) this can fail: several writers publish; on ocdbt two stores then even create
    two databases (uuid mismatch).
    """
    url = self.url(backend)
    stores = [self.make_store(url=url) for _ in range(2)]
    layout = _layout()
    writers = 4 if backend == "s3" else 1

    def seed(i, s, w):
      return 100 * i + 10 * s + w

    def absent(real):
      async def read(chunk_hash):
        del chunk_hash
        return await real(keys.hash_chunk(ROOT, [-1]))  # Never written: reads "missing".
      return read

    async def body():
      results = []
      with mock.patch.object(stores[0], "_read_record", side_effect=absent(
          stores[0]._read_record)), mock.patch.object(
              stores[1], "_read_record", side_effect=absent(stores[1]._read_record)):
        for i, h in enumerate(HASHES):
          tokens = TOKENS[i * C:(i + 1) * C]
          results.append(await asyncio.gather(*(
              store.put(h, ROOT, tokens, ROOT, _values(layout, seed(i, s, w)))
              for s, store in enumerate(stores) for w in range(writers))))
      return results

    for won in run(body()):
      self.assertEqual(sum(won), 1, won)
    for i, h in enumerate(HASHES):
      hit = stores[0].get_sync(h, TOKENS[i * C:(i + 1) * C], ROOT, layout)
      self.assertIsInstance(hit, ChunkHit)
      self.assertTrue(any(np.array_equal(_bits(hit.kv), _bits(_values(layout, seed(i, s, w))))
                          for s in range(2) for w in range(writers)))
    self.assertEqual(stores[0].gc_sync(), 0)  # Losers removed their own objects.
    objects = {"/".join(k.split("/")[:3]) for k in run(self.keys_under(stores[0], "data/"))}
    self.assertLen(objects, len(HASHES))
    self.assertEqual(sum(s.stats.puts for s in stores), len(HASHES))
    self.assertEqual(sum(s.stats.put_conflicts for s in stores),
                     len(HASHES) * (2 * writers - 1))
    self.assertEqual(sum(s.stats.put_failures for s in stores), 0)

  @parameterized.parameters(*BACKENDS)
  def test_token_mismatch(self, backend):
    store = self.make_store(backend)

    async def body():
      await self.put0(store)
      return await store.get(HASHES[0], TOKENS[1:C + 1], ROOT, _layout())

    self.assert_miss(store, run(body()), MissReason.TOKEN_MISMATCH)

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

  @parameterized.parameters(*BACKENDS)
  def test_truncated_data(self, backend):
    store = self.make_store(backend)

    async def body():
      await self.put0(store)
      await self.rewrite_raw(store, HASHES[0], lambda data: data[:len(data) // 2])
      return await store.get(HASHES[0], TOKENS[:C], ROOT, _layout())

    self.assert_miss(store, run(body()), MissReason.CORRUPT)

  @parameterized.parameters(*BACKENDS)
  def test_record_without_data(self, backend):
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
  def test_delete_records_gc(self, backend):
    store = self.make_store(backend)
    layout = _layout()
    parents = [ROOT] + HASHES[:-1]
    for i, h in enumerate(HASHES):
      self.assertTrue(store.put_sync(h, parents[i], TOKENS[i * C:(i + 1) * C], ROOT,
                                     _values(layout, i)))
    self.assertFalse(store.put_sync(HASHES[0], ROOT, TOKENS[:C], ROOT, _values(layout, 0)))
    records = store.records_sync()
    self.assertEqual({r.chunk_hash: r.parent_hash for r in records}, dict(zip(HASHES, parents)))
    self.assertEqual(store.gc_sync(), 0)

    # A put whose publish fails leaves a data object and no record: gc removes it.
    other = keys.chunk_hashes(NS, list(range(C)))[0]
    with mock.patch.object(store, "_publish_record", side_effect=OSError("crash")):
      self.assertFalse(store.put_sync(other, ROOT, list(range(C)), ROOT, _values(layout, 9)))
    self.assertNotEqual(run(self.keys_under(store, f"data/{other}/")), [])
    self.assertEqual(store.contains_sync([other]), [False])
    self.assertEqual(store.gc_sync(), 1)
    self.assertEqual(run(self.keys_under(store, f"data/{other}/")), [])

    self.assertTrue(store.delete_sync(HASHES[1]))
    self.assertFalse(store.delete_sync(HASHES[1]))
    self.assertEqual(store.contains_sync(HASHES), [True, False, True])
    self.assertEqual(run(self.keys_under(store, f"data/{HASHES[1]}/")), [])
    self.assert_miss(store, store.get_sync(HASHES[1], TOKENS[C:2 * C], ROOT, layout),
                     MissReason.ABSENT)
    self.assertEqual(sorted(r.chunk_hash for r in store.records_sync()),
                     sorted([HASHES[0], HASHES[2]]))
    self.assertEqual((store.stats.puts, store.stats.put_conflicts, store.stats.put_failures),
                     (3, 1, 1))

  @parameterized.named_parameters(("server_ignores_conditions", True),
                                  ("conditional_write_off", False))
  def test_fallback_without_conditional_puts(self, probe_fails):
    """HEAD-then-PUT plus read-after-write: still one record, conflicts still seen."""
    if probe_fails:
      store = self.make_store()
      patch = mock.patch.object(store, "_s3_honours_conditions", return_value=False)
      patch.start()
      self.addCleanup(patch.stop)
    else:
      store = self.make_store(conditional_write=False)
    layout = _layout()

    async def body():
      kv = await self.put0(store, layout)
      self.assertTrue(store._verify_publish)
      self.assertFalse(specs.s3_spec(store.kvstore_spec)["use_conditional_write"])
      self.assertFalse(await store.put(HASHES[0], ROOT, TOKENS[:C], ROOT, _values(layout, 1)))
      # Past the early check too: the HEAD sees the record, nothing is overwritten.
      real_read = store._read_record

      async def absent(chunk_hash):
        del chunk_hash
        return await real_read(keys.hash_chunk(ROOT, [-1]))

      with mock.patch.object(store, "_read_record", side_effect=absent):
        self.assertFalse(await store.put(HASHES[0], ROOT, TOKENS[:C], ROOT, _values(layout, 2)))
      hit = await store.get(HASHES[0], TOKENS[:C], ROOT, layout)
      np.testing.assert_array_equal(_bits(hit.kv), _bits(kv))
      self.assertEqual(await store.gc(), 0)

      # A racing writer replaces our record between our PUT and the read-back: we lost.
      root = await store.kvstore()
      key = chunk_store.index_key(HASHES[1])
      real_op = store._op

      async def op_then_overwrite(fut):
        res = await real_op(fut)
        if getattr(res, "generation", b""):  # Our PUT happened; the rival's lands now.
          await real_op(root.write(key, b"rival"))
        return res

      record = ChunkRecord(HASHES[1], HASHES[0], tuple(TOKENS[C:2 * C]), ROOT, layout, ())
      with mock.patch.object(store, "_op", side_effect=op_then_overwrite):
        self.assertFalse(await store._publish_record(record))
      self.assertEqual((await root.read(key)).value, b"rival")

    run(body())
    self.assertEqual((store.stats.puts, store.stats.put_conflicts), (1, 2))

  def test_missing_bucket_fails_fast(self):
    # A missing bucket makes tensorstore retry; the store's timeout turns that into an error.
    store = self.make_store(url="s3://kvjax-no-such-bucket/p", timeout_s=10.0)
    with self.assertRaises(Exception):  # noqa: B017  (tensorstore's error type varies)
      store.contains_sync([HASHES[0]])


class S3EngineTest(MotoTestCase):
  """The engine end to end over s3:// (endpoint from AWS_ENDPOINT_URL)."""

  def test_second_request_hits(self):
    from kvjax import SamplingParams  # pylint: disable=g-import-not-at-top
    from kvjax.testing.engines import real_llm  # pylint: disable=g-import-not-at-top

    greedy = SamplingParams(max_tokens=4, temperature=0)
    prompt = {"prompt_token_ids": [int(t) for t in
                                   np.random.default_rng(7).integers(0, 256, 150)]}
    llm = real_llm("tiny", cache_dir="", max_num_seqs=1, chunk_sizes=(16, 32, 64),
                   kv_store=self.url(), kv_chunk_size=32, kv_merge_mode="load_only",
                   enable_prefix_caching=False)  # the second request must hit the store
    try:
      first = llm.generate(prompt, greedy)[0]
      llm.flush()
      second = llm.generate(prompt, greedy)[0]
      llm.flush()
    finally:
      llm.close()
    self.assertEqual(first.num_cached_tokens, 0)
    self.assertEqual(second.num_cached_tokens, 128)
    self.assertEqual(second.token_ids, first.token_ids)
    self.assertEqual(second.metrics.loaded_from_tiers, ["remote"] * 4)


if __name__ == "__main__":
  absltest.main()
