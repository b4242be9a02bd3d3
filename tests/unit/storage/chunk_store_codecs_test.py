"""Chunks stored in several encodings: ChunkStore, host tier, TieredStore and the CLI.

Every damaged or unusable encoding must come back as a miss with the right reason, never as
someone else's arrays or garbage.
"""

import asyncio
import contextvars
import dataclasses
import io
import struct
import threading
import zlib
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

from kvjax.storage.format import checksum
from kvjax.storage.backends import chunk_store
from kvjax.storage.format import codecs
from kvjax.storage.tiering.host_tier import HostMemoryTier
from kvjax.storage.tiering.tiers import TieredStore
from kvjax.storage.format.types import ChunkHit, ChunkRecord, EncodedPayload, MissReason
from kvjax.store import cli
from kvjax.testing.storage import (C, CODEC_LEVELS, HASHES, ROOT, TOKENS, StoreAssertions, bits,
                                   layout as _layout, payloads as _payloads, run,
                                   values as _values)

BACKENDS = (("memory",), ("file",), ("ocdbt",))
LAYOUT = _layout()


def chooser(codec, level=None):
  return chunk_store.choose_codec(codec, level)


class Base(StoreAssertions, parameterized.TestCase):

  def assert_payload(self, hit, want):
    self.assertIsInstance(hit, ChunkHit)
    self.assertEqual(list(hit.payload), list(want))
    for name, a in want.items():
      self.assertEqual(hit.payload[name].dtype, a.dtype, name)
      np.testing.assert_array_equal(bits(hit.payload[name]), bits(a), err_msg=name)

  async def put_all(self, store, kv=None, which=CODEC_LEVELS, with_raw=True):
    kv = _values(LAYOUT) if kv is None else kv
    ps = _payloads(kv, which)
    self.assertTrue(await store.put(HASHES[0], ROOT, TOKENS[:C], ROOT,
                                    kv if with_raw else None, layout=LAYOUT, payloads=ps))
    return kv, ps

  async def record(self, store):
    root = await store.kvstore()
    return ChunkRecord.from_json((await root.read(chunk_store.index_key(HASHES[0]))).value)

  async def rewrite_record(self, store, **changes):
    root = await store.kvstore()
    rec = dataclasses.replace(await self.record(store), **changes)
    await root.write(chunk_store.index_key(HASHES[0]), rec.to_json())
    return rec


class SideBySideTest(Base):

  @parameterized.parameters(*BACKENDS)
  def test_levels_side_by_side_and_choose_each(self, backend):
    store = self.make_store(backend)

    async def body():
      kv, ps = await self.put_all(store)
      rec = await self.record(store)
      self.assertEqual([(e.codec, e.level) for e in rec.encodings],
                       [("raw", 0), *CODEC_LEVELS])
      hit = await store.get(HASHES[0], TOKENS[:C], ROOT, LAYOUT)  # default: raw
      self.assertEqual(hit.encoding.codec, "raw")
      np.testing.assert_array_equal(bits(hit.kv), bits(kv))
      self.assert_payload(hit, {"values": kv})
      for p in ps:
        hit = await store.get(HASHES[0], TOKENS[:C], ROOT, LAYOUT,
                              choose=chooser(p.codec, p.level))
        self.assertEqual((hit.encoding.codec, hit.encoding.level), (p.codec, p.level))
        self.assertIsNone(hit.kv)
        self.assert_payload(hit, p.arrays)
        self.assertEqual(hit.encoding.object,
                         f"data/{HASHES[0]}/{p.codec}-{p.level}-{hit.encoding.checksum}")
      return rec

    rec = run(body())
    keys = run(self.keys_under(store, f"data/{HASHES[0]}/"))
    for e in rec.encodings[1:]:
      self.assertIn(e.object, keys)  # one plain key per encoded payload
    snap = store.stats.snapshot()
    self.assertEqual((snap["hits"], snap["puts"]), (1 + len(CODEC_LEVELS), 1))
    self.assertEqual(snap["bytes_written"], sum(e.nbytes for e in rec.encodings))
    self.assertEqual(snap["bytes_read"], sum(e.nbytes for e in rec.encodings))
    # Stored sizes: the quantized codecs are smaller than raw float32, coarser levels smaller.
    size = {(e.codec, e.level): e.nbytes for e in rec.encodings}
    self.assertLess(size[("int8", 0)], size[("raw", 0)])
    self.assertLessEqual(size[("cachegen", 3)], size[("cachegen", 0)])

  def test_default_choice_without_raw_is_first_in_record_order(self):
    store = self.make_store()

    async def body():
      _, ps = await self.put_all(store, which=(("int4", 0), ("int8", 0)), with_raw=False)
      hit = await store.get(HASHES[0], TOKENS[:C], ROOT, LAYOUT)
      self.assertEqual(hit.encoding.codec, "int4")
      self.assert_payload(hit, ps[0].arrays)
      seen = []
      hit = await store.get(HASHES[0], TOKENS[:C], ROOT, LAYOUT,
                            choose=lambda encs: seen.extend(encs) or encs[-1])
      self.assertEqual([e.codec for e in seen], ["int4", "int8"])
      self.assert_payload(hit, ps[1].arrays)

    run(body())

  def test_chooser_declines_and_bad_chooser(self):
    store = self.make_store()

    async def body():
      await self.put_all(store, which=(("int8", 0),))
      miss = await store.get(HASHES[0], TOKENS[:C], ROOT, LAYOUT, choose=lambda encs: None)
      self.assert_miss(store, miss, MissReason.UNKNOWN_CODEC)
      rec = await self.record(store)
      foreign = dataclasses.replace(rec.encodings[0], level=3)
      with self.assertRaisesRegex(ValueError, "not one of"):
        await store.get(HASHES[0], TOKENS[:C], ROOT, LAYOUT, choose=lambda encs: foreign)

    run(body())

  def test_unknown_encodings_are_skipped(self):
    store = self.make_store()

    async def body():
      _, ps = await self.put_all(store, which=(("int8", 0),), with_raw=False)
      rec = await self.record(store)
      future = dataclasses.replace(rec.encodings[0], codec_version=9)
      await self.rewrite_record(store, encodings=(future, rec.encodings[0]))
      seen = []
      hit = await store.get(HASHES[0], TOKENS[:C], ROOT, LAYOUT,
                            choose=lambda encs: seen.extend(encs) or encs[0])
      self.assertEqual([(e.codec, e.codec_version) for e in seen], [("int8", 1)])
      self.assert_payload(hit, ps[0].arrays)
      await self.rewrite_record(store, encodings=(
          dataclasses.replace(rec.encodings[0], codec="zfp"),
          dataclasses.replace(rec.encodings[0], level=5)))
      return await store.get(HASHES[0], TOKENS[:C], ROOT, LAYOUT)

    self.assert_miss(store, run(body()), MissReason.UNKNOWN_CODEC)

  def test_a_known_codec_at_another_version_only_is_its_own_miss(self):
    store = self.make_store()

    async def body():
      await self.put_all(store, which=(("int8", 0),), with_raw=False)
      rec = await self.record(store)
      await self.rewrite_record(store, encodings=(
          dataclasses.replace(rec.encodings[0], codec_version=9),
          dataclasses.replace(rec.encodings[0], codec="zfp")))
      return await store.get(HASHES[0], TOKENS[:C], ROOT, LAYOUT)

    miss = run(body())
    self.assert_miss(store, miss, MissReason.CODEC_VERSION_MISMATCH)
    self.assertEqual(miss.detail, "int8/v9/0")

  def test_a_payload_of_another_version_than_its_record_is_never_decoded(self):
    # The record says int8 version 1 (this reader's), the bytes' header another version: a
    # payload written by another codec version under a record that does not say so.
    store = self.make_store()

    async def body():
      _, ps = await self.put_all(store, which=(("int8", 0),), with_raw=False)
      rec = await self.record(store)
      blob = bytearray(codecs.encode_payload("int8", 0, ps[0].arrays, LAYOUT))
      header = codecs.read_header(bytes(blob))
      version_at = blob.index(struct.pack("<HBB", 1, 0, len(ps[0].arrays)))
      blob[version_at:version_at + 2] = struct.pack("<H", 2)
      end = header.data_offset - 4  # the header's CRC-32 sits just before the data
      blob[end:end + 4] = struct.pack("<I", zlib.crc32(bytes(blob[:end])))
      root = await store.kvstore()
      digest = checksum.digest(bytes(blob))
      await root.write(rec.encodings[0].object, bytes(blob))
      await self.rewrite_record(store, encodings=(dataclasses.replace(
          rec.encodings[0], nbytes=len(blob), checksum=digest),))
      return await store.get(HASHES[0], TOKENS[:C], ROOT, LAYOUT)

    miss = run(body())
    self.assert_miss(store, miss, MissReason.CODEC_VERSION_MISMATCH)
    self.assertIn("int8 version 2, its record says version 1", miss.detail)

  def test_limiter_charges_stored_bytes(self):
    acquired = []

    class Link:

      async def acquire(self, nbytes):
        acquired.append(nbytes)

    store = self.make_store(limiter=Link())

    async def body():
      await self.put_all(store, which=(("cachegen", 1),))
      hit = await store.get(HASHES[0], TOKENS[:C], ROOT, LAYOUT, choose=chooser("cachegen"))
      return hit.encoding.nbytes

    nbytes = run(body())
    self.assertEqual(acquired, [nbytes])
    self.assertLess(nbytes, LAYOUT.nbytes)


class PutValidationTest(Base):

  def test_bad_puts_raise_and_write_nothing(self):
    store = self.make_store()
    kv = _values(LAYOUT)
    int8 = _payloads(kv, (("int8", 0),))[0]
    wrong_shape = EncodedPayload("int8", 0, {**int8.arrays, "scale": int8.arrays["scale"][:1]})
    cases = {
        "nothing": dict(),
        "no_layout": dict(payloads=[int8]),
        "wrong_shape": dict(layout=LAYOUT, payloads=[wrong_shape]),
        "layout_disagrees": dict(kv=kv, layout=_layout(num_layers=2), payloads=[int8]),
        "twice": dict(layout=LAYOUT, payloads=[int8, int8]),
        "unknown_codec": dict(layout=LAYOUT, payloads=[EncodedPayload("zfp", 0, {})]),
        "unknown_level": dict(layout=LAYOUT, payloads=[EncodedPayload("int8", 2, int8.arrays)]),
        "raw_twice": dict(kv=kv, payloads=[EncodedPayload("raw", 0, {"values": kv})]),
        "not_a_payload": dict(layout=LAYOUT, payloads=[("int8", 0, int8.arrays)]),
    }
    for name, kwargs in cases.items():
      with self.subTest(name), self.assertRaises(ValueError):
        run(store.put(HASHES[0], ROOT, TOKENS[:C], ROOT, **kwargs))
    self.assertEqual(run(self.keys_under(store)), [])
    self.assertEqual(store.stats.snapshot()["puts"], 0)

  def test_raw_payload_is_kv(self):
    store = self.make_store()
    kv = _values(LAYOUT)

    async def body():
      self.assertTrue(await store.put(HASHES[0], ROOT, TOKENS[:C], ROOT,
                                      payloads=[EncodedPayload("raw", 0, {"values": kv})]))
      hit = await store.get(HASHES[0], TOKENS[:C], ROOT, LAYOUT)
      np.testing.assert_array_equal(bits(hit.kv), bits(kv))
      self.assertEqual(hit.encoding.checksum, chunk_store.values_checksum(kv))

    run(body())


class DamageTest(Base):

  async def stored(self, store, codec="cachegen", level=1):
    await self.put_all(store, which=((codec, level),), with_raw=False)
    return (await self.record(store)).encodings[0]

  @parameterized.parameters(*BACKENDS)
  def test_flipped_byte_is_checksum_miss(self, backend):
    store = self.make_store(backend)

    async def body():
      enc = await self.stored(store)
      root = await store.kvstore()
      data = bytearray((await root.read(enc.object)).value)
      data[len(data) // 2] ^= 1
      await root.write(enc.object, bytes(data))
      return await store.get(HASHES[0], TOKENS[:C], ROOT, LAYOUT)

    self.assert_miss(store, run(body()), MissReason.CHECKSUM_MISMATCH)

  @parameterized.parameters(*BACKENDS)
  def test_truncated_object_is_corrupt(self, backend):
    store = self.make_store(backend)

    async def body():
      enc = await self.stored(store)
      root = await store.kvstore()
      await root.write(enc.object, (await root.read(enc.object)).value[:enc.nbytes // 2])
      return await store.get(HASHES[0], TOKENS[:C], ROOT, LAYOUT)

    self.assert_miss(store, run(body()), MissReason.CORRUPT)

  def test_undecodable_bytes_with_matching_checksum_are_corrupt(self):
    # A record that vouches for bad bytes (e.g. a buggy writer): the decoder still refuses.
    store = self.make_store()

    async def body():
      enc = await self.stored(store)
      root = await store.kvstore()
      data = bytearray((await root.read(enc.object)).value)
      data[-3] ^= 0xFF
      await root.write(enc.object, bytes(data))
      await self.rewrite_record(store, encodings=(dataclasses.replace(
          enc, checksum=checksum.digest(bytes(data))),))
      return await store.get(HASHES[0], TOKENS[:C], ROOT, LAYOUT)

    self.assert_miss(store, run(body()), MissReason.CORRUPT)

  def test_record_of_other_encoding_is_corrupt(self):
    # The record says int8 but the object holds cachegen bytes (checksum matches them).
    store = self.make_store()

    async def body():
      enc = await self.stored(store)
      await self.rewrite_record(store, encodings=(dataclasses.replace(enc, codec="int8",
                                                                      level=0),))
      return await store.get(HASHES[0], TOKENS[:C], ROOT, LAYOUT)

    self.assert_miss(store, run(body()), MissReason.CORRUPT)

  @parameterized.parameters(*BACKENDS)
  def test_missing_object(self, backend):
    store = self.make_store(backend)

    async def body():
      enc = await self.stored(store, "int8", 0)
      await (await store.kvstore()).delete_range(chunk_store._prefix_range(
          f"data/{HASHES[0]}/"))
      self.assertEqual(await self.keys_under(store, "data/"), [])
      return await store.get(HASHES[0], TOKENS[:C], ROOT, LAYOUT, choose=chooser(enc.codec))

    self.assert_miss(store, run(body()), MissReason.MISSING_DATA)

  def test_bad_entries_are_corrupt(self):
    store = self.make_store()

    async def body():
      enc = await self.stored(store, "int8", 0)
      out = []
      for bad in (dataclasses.replace(enc, object=f"data/{HASHES[1]}/x"),  # another chunk's
                  dataclasses.replace(enc, object=enc.object.replace("int8-", "raw-")),
                  dataclasses.replace(enc, nbytes=enc.nbytes + 1)):
        await self.rewrite_record(store, encodings=(bad,))
        out.append(await store.get(HASHES[0], TOKENS[:C], ROOT, LAYOUT))
      return out

    for miss in run(body()):
      self.assertEqual(miss.reason, MissReason.CORRUPT, miss.detail)


class LifecycleTest(Base):

  @parameterized.parameters(*BACKENDS)
  def test_delete_and_gc_handle_every_encoding(self, backend):
    store = self.make_store(backend)

    async def body():
      await self.put_all(store, which=(("int8", 0), ("cachegen", 2)))
      root = await store.kvstore()
      stray = f"data/{HASHES[0]}/cachegen-0-{'0' * 64}"
      await root.write(stray, b"a failed writer's object")
      self.assertEqual(await store.gc(), 1)
      keys = await self.keys_under(store, "data/")
      self.assertNotIn(stray, keys)
      self.assertLen([k for k in keys if "/raw-0-" not in k], 2)
      self.assertTrue(await store.delete(HASHES[0]))
      self.assertEqual(await self.keys_under(store, "data/"), [])

    run(body())

  @parameterized.parameters(*BACKENDS)
  def test_racing_writers_publish_one_record_and_keep_its_objects(self, backend):
    store = self.make_store(backend)
    # Writers 0-2 hold distinct values; 3-5 repeat them (same objects as another writer).
    kvs = [_values(LAYOUT, i % 3) for i in range(6)]
    ps = [_payloads(kv, (("int8", 0), ("cachegen", 1))) for kv in kvs]

    async def body():
      won = await asyncio.gather(*(store.put(HASHES[0], ROOT, TOKENS[:C], ROOT, layout=LAYOUT,
                                             payloads=p) for p in ps))
      self.assertEqual(sum(won), 1)
      winner = won.index(True)
      for p in ps[winner]:
        hit = await store.get(HASHES[0], TOKENS[:C], ROOT, LAYOUT, choose=chooser(p.codec))
        self.assert_payload(hit, p.arrays)
      rec = await self.record(store)
      self.assertEqual(await self.keys_under(store, "data/"), sorted(e.object
                                                                     for e in rec.encodings))

    run(body())

  @parameterized.parameters(*BACKENDS)
  def test_a_twin_loser_that_writes_after_the_first_one_decided_still_leaves_no_object(
      self, backend):
    # The interleaving a CI run hit. Losers A and B hold equal values (the same objects). A
    # loses to W, finds no other writer of its objects and deletes them; while A is still
    # deleting, B (past its check, slow to encode) writes them again, loses too, and must
    # delete them itself rather than leave them to A.
    store = self.make_store(backend)
    role = contextvars.ContextVar("role", default=None)  # tasks and to_thread copy it
    b_encoding, release_b = threading.Event(), threading.Event()
    a_checked, w_published = asyncio.Event(), asyncio.Event()
    a_deleted_first, b_done = asyncio.Event(), asyncio.Event()
    a_deletes, loop = [], None  # the loop: body's, for the encoding thread to signal on
    encode, publish, delete = (codecs.encode_payload, store._publish_record,
                               store._delete_object)

    def gated_encode(*args, **kwargs):
      if role.get() == "B":
        b_encoding.set()
        self.assertTrue(release_b.wait(60))
      elif role.get() == "A":
        loop.call_soon_threadsafe(a_checked.set)
      return encode(*args, **kwargs)

    async def gated_publish(record):
      if role.get() == "A":
        await w_published.wait()
      if role.get() == "W":
        await a_checked.wait()
      won = await publish(record)
      if role.get() == "W":
        w_published.set()
      return won

    async def gated_delete(key, **kwargs):
      if role.get() == "A":
        a_deletes.append(key)
        if len(a_deletes) == 2:
          await b_done.wait()
      await delete(key, **kwargs)
      if len(a_deletes) == 1:
        a_deleted_first.set()

    store._publish_record, store._delete_object = gated_publish, gated_delete
    self.enter_context(mock.patch.object(codecs, "encode_payload", gated_encode))
    winner = _payloads(_values(LAYOUT, 0), (("int8", 0), ("cachegen", 1)))
    loser = _payloads(_values(LAYOUT, 1), (("int8", 0), ("cachegen", 1)))

    def put(ps):
      return store.put(HASHES[0], ROOT, TOKENS[:C], ROOT, layout=LAYOUT, payloads=ps)

    async def body():
      nonlocal loop
      loop = asyncio.get_running_loop()
      role.set("B")
      b = asyncio.create_task(put(loser))
      self.assertTrue(await asyncio.to_thread(b_encoding.wait, 60))
      role.set("A")
      a = asyncio.create_task(put(loser))
      role.set("W")
      self.assertTrue(await put(winner))
      await a_deleted_first.wait()
      release_b.set()
      self.assertFalse(await b)
      b_done.set()
      self.assertFalse(await a)
      rec = await self.record(store)
      self.assertEqual(await self.keys_under(store, "data/"),
                       sorted(e.object for e in rec.encodings))
      self.assertEqual(store.stats.put_conflicts, 2)

    self.addCleanup(release_b.set)  # a failing run must not leave B's thread blocked
    run(asyncio.wait_for(body(), 120))

  def test_second_put_is_a_conflict(self):
    store = self.make_store()

    async def body():
      kv, ps = await self.put_all(store, which=(("int8", 0),))
      self.assertFalse(await store.put(HASHES[0], ROOT, TOKENS[:C], ROOT, kv, payloads=ps))

    run(body())
    self.assertEqual(store.stats.snapshot()["put_conflicts"], 1)


class HostAndTiersTest(Base):

  def test_host_tier_round_trip_and_capacity(self):
    kv = _values(LAYOUT)
    ps = _payloads(kv, (("int8", 0), ("cachegen", 1)))
    host = HostMemoryTier(None)

    async def body():
      self.assertTrue(await host.put(HASHES[0], ROOT, TOKENS[:C], ROOT, layout=LAYOUT,
                                     payloads=ps))
      for p in ps:
        hit = await host.get(HASHES[0], TOKENS[:C], ROOT, LAYOUT, choose=chooser(p.codec))
        self.assertIsNone(hit.kv)
        self.assert_payload(hit, p.arrays)
        self.assertFalse(hit.payload["q" if p.codec == "int8" else "delta_q"].flags.writeable)
        self.assertEqual(hit.encoding.checksum, codecs.payload_checksum(p.arrays))
      self.assertEqual(host.used_bytes, sum(codecs.payload_nbytes(p.arrays) for p in ps))
      self.assertEqual((await host.get(HASHES[0], TOKENS[:C], ROOT, LAYOUT)).encoding.codec,
                       "int8")
      miss = await host.get(HASHES[0], TOKENS[:C], ROOT, LAYOUT, choose=chooser("int4"))
      self.assertEqual(miss.reason, MissReason.UNKNOWN_CODEC)
      # Adding raw to a held chunk: raw goes first in its record.
      self.assertTrue(await host.put(HASHES[0], ROOT, TOKENS[:C], ROOT, kv))
      self.assertFalse(await host.put(HASHES[0], ROOT, TOKENS[:C], ROOT, kv))
      rec = (await host.records())[0]
      self.assertEqual([e.codec for e in rec.encodings], ["raw", "int8", "cachegen"])
      np.testing.assert_array_equal((await host.get(HASHES[0], TOKENS[:C], ROOT, LAYOUT)).kv, kv)
      with self.assertRaises(ValueError):
        await host.put(HASHES[1], HASHES[0], TOKENS[C:2 * C], ROOT, layout=LAYOUT, payloads=[
            EncodedPayload("int8", 0, {"q": ps[0].arrays["q"]})])

    run(body())
    # Capacity counts the arrays held: two int8 chunks fit where one raw float32 chunk does.
    int8_bytes = codecs.payload_nbytes(ps[0].arrays)
    small = HostMemoryTier(2 * int8_bytes)
    for i in range(3):
      kv_i = _values(LAYOUT, i)
      self.assertTrue(run(small.put(HASHES[i], ROOT, TOKENS[i * C:(i + 1) * C], ROOT,
                                    layout=LAYOUT, payloads=_payloads(kv_i, (("int8", 0),)))))
    self.assertEqual((len(small), small.used_bytes, small.evictions), (2, 2 * int8_bytes, 1))

  def test_tiered_put_and_promotion_of_encoded_hits(self):
    disk = self.make_store("file", name="disk")
    tiered = TieredStore([HostMemoryTier(None), disk])
    kv = _values(LAYOUT)
    ps = _payloads(kv, (("cachegen", 0), ("cachegen", 3)))

    async def body():
      self.assertEqual(await tiered.put(HASHES[0], ROOT, TOKENS[:C], ROOT, layout=LAYOUT,
                                        payloads=ps), ["host", "disk"])
      await tiered.tiers[0].delete(HASHES[0])
      hit = await tiered.get(HASHES[0], TOKENS[:C], ROOT, LAYOUT,
                             choose=chooser("cachegen", 3))
      self.assertEqual(hit.tier, "disk")
      self.assert_payload(hit, ps[1].arrays)
      hit = await tiered.get(HASHES[0], TOKENS[:C], ROOT, LAYOUT,
                             choose=chooser("cachegen", 3))
      self.assertEqual(hit.tier, "host")  # promoted
      self.assert_payload(hit, ps[1].arrays)
      # The host holds only level 3: level 0 falls through to disk and is promoted beside it.
      hit = await tiered.get(HASHES[0], TOKENS[:C], ROOT, LAYOUT,
                             choose=chooser("cachegen", 0))
      self.assertEqual(hit.tier, "disk")
      self.assert_payload(hit, ps[0].arrays)
      rec = (await tiered.tiers[0].records())[0]
      self.assertEqual([e.level for e in rec.encodings], [3, 0])
      with self.assertRaises(ValueError):
        await tiered.put(HASHES[1], HASHES[0], TOKENS[C:2 * C], ROOT, payloads=ps)  # no layout

    run(body())
    stats = tiered.stats
    self.assertEqual(stats["host"].promotions, 2)
    self.assertEqual(stats["host"].misses, {"absent": 1, "unknown_codec": 1})


class CliTest(Base):

  def test_verify_decodes_every_encoding_and_du_counts_them(self):
    store = self.make_store("file")

    async def body():
      await self.put_all(store, which=(("int8", 0), ("cachegen", 1)))
      rec = await self.record(store)
      root = await store.kvstore()
      enc = rec.encodings[2]
      data = bytearray((await root.read(enc.object)).value)
      data[-1] ^= 1
      await root.write(enc.object, bytes(data))
      return rec

    rec = run(body())
    store.close()
    out = io.StringIO()
    self.assertEqual(cli.main(["kvjax.store", "verify", "--store", self.url], stdout=out),
                     cli.EXIT_BAD)
    self.assertEqual(out.getvalue().splitlines(), [
        f"BAD {HASHES[0]} checksum_mismatch  cachegen/1/1: {rec.encodings[2].object}",
        "verified 1 chunks: 0 ok, 1 bad"])
    out = io.StringIO()
    self.assertEqual(cli.main(["kvjax.store", "du", "--store", self.url], stdout=out),
                     cli.EXIT_OK)
    sizes = {f"{e.codec}/{e.level}": e.nbytes for e in rec.encodings}
    self.assertIn("  by codec/level: " + ", ".join(
        f"{k} {v} ({cli._human_bytes(v)})" for k, v in sorted(sizes.items())),
        out.getvalue().splitlines())


if __name__ == "__main__":
  absltest.main()
