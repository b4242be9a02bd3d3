"""Reads of a layer range `[k, L)` of a stored raw chunk (Cake's layer axis,
docs/design/cake.md): record format 3's per-layer checksums, the ranged `get` of the chunk store
on every backend and through the tiers, and the whole-read fallback of older records.

The tiny layout is `[3, 2, 4, 2, 8]` float32: 1,536 bytes, 512 a layer.
"""

import dataclasses
import json
import os
import pathlib
import shutil

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

from kvjax.storage.backends import chunk_store
from kvjax.storage.backends.link import LinkLimiter
from kvjax.storage.format import checksum as checksums
from kvjax.storage.format import keys
from kvjax.storage.format.types import ChunkHit, ChunkRecord, MissReason
from kvjax.storage.tiering import tiers
from kvjax.testing.storage import (C, HASHES, ROOT, TOKENS, StoreAssertions, bits, layout,
                                   payloads, run, values)

TESTDATA = pathlib.Path(__file__).resolve().parent / "testdata"
LAYOUT = layout()
LAYER = LAYOUT.nbytes // LAYOUT.num_layers  # 512


class Link:
  """A limiter that records what it was charged."""

  def __init__(self):
    self.acquired = []

  async def acquire(self, nbytes):
    self.acquired.append(nbytes)


class RangeTestBase(StoreAssertions, parameterized.TestCase):

  async def flip(self, store, offset):
    """Flips one bit of chunk 0's raw object at byte `offset`."""
    root = await store.kvstore()
    key = await self.shard_key(store, HASHES[0])
    data = bytearray((await root.read(key)).value)
    data[offset] ^= 0x40
    await root.write(key, bytes(data))

  def get(self, store, k=0, **kw):
    return store.get_sync(HASHES[0], TOKENS[:C], ROOT, LAYOUT, layer_start=k, **kw)


class RecordFormat3Test(RangeTestBase):

  def test_a_raw_encoding_lists_each_layers_checksum(self):
    store = self.make_store("memory")
    kv = run(self.put0(store))
    (rec,) = store.records_sync()
    self.assertEqual(rec.format_version, 3)
    (enc,) = rec.encodings
    self.assertEqual(enc.layer_checksums, tuple(checksums.digest(kv[i]) for i in range(3)))
    self.assertEqual(enc.checksum, checksums.digest(kv))  # the whole object's, as before
    self.assertEqual(ChunkRecord.from_json(rec.to_json()), rec)

  def test_codec_encodings_have_none(self):
    store = self.make_store("memory")
    kv = values(LAYOUT)
    self.assertTrue(store.put_sync(HASHES[0], ROOT, TOKENS[:C], ROOT, kv,
                                   payloads=payloads(kv, (("int8", 0),))))
    (rec,) = store.records_sync()
    self.assertEqual([(e.codec, len(e.layer_checksums)) for e in rec.encodings],
                     [("raw", 3), ("int8", 0)])
    self.assertNotIn(b"layer_checksums", json.dumps(
        json.loads(rec.to_json())["encodings"][1]).encode())

  def test_older_formats_carry_no_layer_checksums(self):
    store = self.make_store("memory")
    run(self.put0(store))
    (rec,) = store.records_sync()
    with self.assertRaisesRegex(ValueError, "record format 2 has no layer checksums"):
      dataclasses.replace(rec, format_version=2).to_json()
    d = json.loads(rec.to_json())
    d["format_version"] = 2
    self.assertTrue(ChunkRecord.is_malformed(json.dumps(d).encode()))

  def test_a_wrong_number_of_layer_checksums_is_a_corrupt_entry(self):
    store = self.make_store("memory")

    async def body():
      await self.put0(store)
      root = await store.kvstore()
      key = chunk_store.index_key(HASHES[0])
      d = json.loads((await root.read(key)).value)
      d["encodings"][0]["layer_checksums"] = d["encodings"][0]["layer_checksums"][:2]
      await root.write(key, json.dumps(d).encode())

    run(body())
    self.assert_miss(store, self.get(store, 1), MissReason.CORRUPT)

  @parameterized.parameters(0, 3)  # a whole chunk, a session tail of 3 rows
  def test_verify_checks_the_layer_checksums(self, tail_rows):
    store = self.make_store("file")
    ids = keys.tail_token_ids(TOKENS[:tail_rows], C) if tail_rows else TOKENS[:C]
    self.assertTrue(store.put_sync(HASHES[0], ROOT, ids, ROOT, values(LAYOUT)))
    (rec,) = store.records_sync()
    self.assertIsNone(run(store.verify(rec)))
    sums = list(rec.encodings[0].layer_checksums)
    sums[1] = "0" * 32
    bad = dataclasses.replace(rec, encodings=(
        dataclasses.replace(rec.encodings[0], layer_checksums=tuple(sums)),))

    async def plant():
      root = await store.kvstore()
      await root.write(chunk_store.index_key(HASHES[0]), bad.to_json())

    run(plant())
    got = run(store.verify(bad))
    self.assertEqual((got.reason, got.detail.endswith("layers [1]")),
                     (MissReason.CHECKSUM_MISMATCH, True), got.detail)


class RangedReadTest(RangeTestBase):

  @parameterized.product(backend=("memory", "file", "ocdbt"), k=(1, 2),
                         dtype=("float32", "bfloat16"))
  def test_a_range_is_the_slice_of_the_whole_read_and_charged_its_bytes(self, backend, k,
                                                                       dtype):
    link = Link()
    store = self.make_store(backend, limiter=link)
    lay = layout(dtype)
    kv = run(self.put0(store, lay))
    whole = store.get_sync(HASHES[0], TOKENS[:C], ROOT, lay)
    part = store.get_sync(HASHES[0], TOKENS[:C], ROOT, lay, layer_start=k)
    self.assertIsInstance(part, ChunkHit)
    self.assertEqual((part.layer_start, part.kv.shape, part.kv.dtype),
                     (k, (3 - k,) + lay.shape[1:], kv.dtype))
    np.testing.assert_array_equal(bits(part.kv), bits(whole.kv[k:]))
    np.testing.assert_array_equal(bits(part.payload["values"]), bits(kv[k:]))
    per_layer = lay.nbytes // 3
    self.assertEqual((whole.nbytes, part.nbytes), (lay.nbytes, (3 - k) * per_layer))
    self.assertEqual(link.acquired, [lay.nbytes, (3 - k) * per_layer])
    snap = store.stats.snapshot()
    self.assertEqual((snap["hits"], snap["bytes_read"], snap["ranged_reads"],
                      snap["ranged_whole_reads"]),
                     (2, lay.nbytes + (3 - k) * per_layer, 1, 0))

  def test_the_emulated_link_grants_the_range_only(self):
    link = LinkLimiter(1e12)
    store = self.make_store("file", limiter=link)
    run(self.put0(store))
    self.assertIsInstance(self.get(store, 2), ChunkHit)
    self.assertEqual(link.bytes_granted, LAYER)

  @parameterized.parameters("memory", "file")
  def test_a_session_tail_reads_its_stored_rows_of_the_range(self, backend):
    store = self.make_store(backend)
    tail_ids = keys.tail_token_ids(TOKENS[:3], C)  # 3 real rows of 4
    kv = values(LAYOUT)
    self.assertTrue(store.put_sync(HASHES[0], ROOT, tail_ids, ROOT, kv))
    whole = store.get_sync(HASHES[0], tail_ids, ROOT, LAYOUT)
    part = store.get_sync(HASHES[0], tail_ids, ROOT, LAYOUT, layer_start=1)
    self.assertEqual(part.kv.shape, (2,) + LAYOUT.shape[1:])
    np.testing.assert_array_equal(bits(part.kv), bits(whole.kv[1:]))
    self.assertEqual(part.nbytes, 2 * LAYER * 3 // 4)

  @parameterized.parameters("memory", "file", "ocdbt")
  def test_a_damaged_layer_in_the_range_is_a_checksum_miss(self, backend):
    store = self.make_store(backend)
    run(self.put0(store))
    run(self.flip(store, 2 * LAYER + 7))  # layer 2
    got = self.get(store, 1)
    self.assert_miss(store, got, MissReason.CHECKSUM_MISMATCH)
    self.assertIn("layer 2", got.detail)

  @parameterized.parameters("memory", "file", "ocdbt")
  def test_a_damaged_layer_outside_the_range_is_not_read(self, backend):
    store = self.make_store(backend)
    kv = run(self.put0(store))
    run(self.flip(store, 7))  # layer 0
    part = self.get(store, 1)
    self.assertIsInstance(part, ChunkHit)
    np.testing.assert_array_equal(bits(part.kv), bits(kv[1:]))
    self.assertEqual(self.get(store).reason, MissReason.CHECKSUM_MISMATCH)  # whole: seen

  @parameterized.parameters("memory", "file", "ocdbt")
  def test_a_truncated_or_grown_object_is_corrupt(self, backend):
    for cut in (-1, 1):
      store = self.make_store(backend)

      async def body():
        await self.put0(store)
        await self.rewrite_raw(store, HASHES[0],
                               lambda data: data[:cut] if cut < 0 else data + b"\0")

      run(body())
      self.assertEqual(self.get(store, 2).reason, MissReason.CORRUPT, cut)

  @parameterized.parameters("memory", "file")
  def test_a_missing_object_is_missing_data(self, backend):
    store = self.make_store(backend)

    async def body():
      await self.put0(store)
      root = await store.kvstore()
      await root.write(await self.shard_key(store, HASHES[0]), None)

    run(body())
    self.assert_miss(store, self.get(store, 1), MissReason.MISSING_DATA)

  def test_a_layer_start_outside_the_layers_is_refused(self):
    store = self.make_store("memory")
    for k in (-1, 3):
      with self.assertRaisesRegex(ValueError, f"layer_start {k} not in"):
        self.get(store, k)

  def test_a_codec_encoding_is_read_whole(self):
    link = Link()
    store = self.make_store("memory", limiter=link)
    kv = values(LAYOUT)
    self.assertTrue(store.put_sync(HASHES[0], ROOT, TOKENS[:C], ROOT, layout=LAYOUT,
                                   payloads=payloads(kv, (("int8", 0),))))
    got = self.get(store, 1)
    self.assertEqual((got.encoding.codec, got.layer_start, got.nbytes, link.acquired),
                     ("int8", 0, got.encoding.nbytes, [got.encoding.nbytes]))


class OlderRecordsTest(RangeTestBase):
  """A record without layer checksums still serves a range: read and verified whole, sliced."""

  @parameterized.parameters("memory", "file")
  def test_a_format_2_record_is_read_whole_then_sliced(self, backend):
    link = Link()
    store = self.make_store(backend, limiter=link)

    async def body():
      kv = await self.put0(store)
      root = await store.kvstore()
      key = chunk_store.index_key(HASHES[0])
      rec = ChunkRecord.from_json((await root.read(key)).value)
      old = dataclasses.replace(rec, format_version=2, encodings=tuple(
          dataclasses.replace(e, layer_checksums=()) for e in rec.encodings))
      await root.write(key, old.to_json())
      return kv

    kv = run(body())
    part = self.get(store, 2)
    self.assertEqual((part.layer_start, part.nbytes, part.record.format_version),
                     (2, LAYOUT.nbytes, 2))
    np.testing.assert_array_equal(bits(part.kv), bits(kv[2:]))
    self.assertEqual(link.acquired, [LAYOUT.nbytes])
    snap = store.stats.snapshot()
    self.assertEqual((snap["bytes_read"], snap["ranged_reads"], snap["ranged_whole_reads"]),
                     (LAYOUT.nbytes, 0, 1))
    run(self.flip(store, 5))  # layer 0, outside the range: the whole read sees it
    self.assertEqual(self.get(store, 2).reason, MissReason.CHECKSUM_MISMATCH)

  def test_a_format_1_store_serves_a_range(self):
    d = os.path.join(self.create_tempdir().full_path, "store")
    shutil.copytree(TESTDATA / "v1_store", d)
    store = chunk_store.ChunkStore(d)
    self.addCleanup(store.close)
    part = self.get(store, 1)
    self.assertEqual((part.layer_start, part.nbytes), (1, LAYOUT.nbytes))
    np.testing.assert_array_equal(bits(part.kv), bits(values(LAYOUT, 0)[1:]))
    self.assertEqual(store.stats.snapshot()["ranged_whole_reads"], 1)


class TieredRangeTest(RangeTestBase):
  """`TieredStore.get(..., layer_start=k)` passes the range to every tier; the host tier, which
  holds chunks whole, slices; a partial hit is never promoted."""

  def make_tiered(self):
    host = tiers.HostMemoryTier(None)
    disk = self.make_store("file")
    return tiers.TieredStore([host, disk]), host, disk

  def tget(self, store, k, **kw):
    return run(store.get(HASHES[0], TOKENS[:C], ROOT, LAYOUT, layer_start=k, **kw))

  def test_a_disk_range_is_read_alone_and_not_promoted(self):
    store, host, disk = self.make_tiered()
    kv = values(LAYOUT)
    run(disk.put(HASHES[0], ROOT, TOKENS[:C], ROOT, kv))
    part = self.tget(store, 1)
    self.assertEqual((part.tier, part.layer_start, part.nbytes), ("disk", 1, 2 * LAYER))
    np.testing.assert_array_equal(bits(part.kv), bits(kv[1:]))
    self.assertEqual(run(host.records()), [])  # not promoted
    self.assertEqual((store.stats["disk"].hits, store.stats["disk"].bytes_read), (1, 2 * LAYER))
    self.assertEqual(disk.stats.snapshot()["ranged_reads"], 1)

  def test_the_host_tier_slices_what_it_holds(self):
    store, host, disk = self.make_tiered()
    kv = values(LAYOUT)
    run(disk.put(HASHES[0], ROOT, TOKENS[:C], ROOT, kv))
    self.assertEqual(self.tget(store, 0).tier, "disk")  # whole: promoted
    part = self.tget(store, 2)
    self.assertEqual((part.tier, part.layer_start, part.nbytes), ("host", 2, LAYER))
    np.testing.assert_array_equal(bits(part.kv), bits(kv[2:]))
    self.assertEqual(store.stats["host"].bytes_read, LAYER)
    with self.assertRaisesRegex(ValueError, "layer_start 3 not in"):
      self.tget(store, 3)

  def test_a_damaged_range_falls_through_and_drops_the_copy(self):
    store, host, disk = self.make_tiered()
    run(disk.put(HASHES[0], ROOT, TOKENS[:C], ROOT, values(LAYOUT)))
    run(self.flip(disk, LAYER + 1))  # layer 1
    got = self.tget(store, 1)
    self.assertEqual(got.reason, MissReason.CHECKSUM_MISMATCH)
    self.assertEqual(store.stats["disk"].misses, {"checksum_mismatch": 1})
    self.assertEqual(disk.contains_sync([HASHES[0]]), [False])  # dropped: the next save heals


if __name__ == "__main__":
  absltest.main()
