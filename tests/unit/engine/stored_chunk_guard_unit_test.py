"""The stored-chunk guard: a chunk written under another model, layout version, dtype, chunk size
or codec version that lands under the reader's key is refused (a miss with its own reason,
counted in `kvjax_store_rejected_chunks_total`), never decoded, and the answer equals the cold
run's.

Each test plants chunks the way a connector that left the field under test out of its keys would:
a writer of the other setting stores the prompt, and its chunks are copied under the reader's
keys and namespace, each keeping its own record fields (tokens, layout, encodings, origin). On the
fake runner (`kvjax.testing.engines.fake_llm`); docs/design/storage-format.md, "The stored-chunk
guard".
"""

import dataclasses
from unittest import mock

import numpy as np
from absl.testing import absltest
from prometheus_client.parser import text_string_to_metric_families

from kvjax import SamplingParams
from kvjax.entrypoints import root as root_module
from kvjax.serve.metrics import ServeMetrics
from kvjax.storage import StoreConfig, TierConfig
from kvjax.storage.format import keys
from kvjax.storage.backends.chunk_store import ChunkStore, index_key, run_sync
from kvjax.storage.format.types import ChunkHit, EncodedPayload, MissReason
from kvjax.testing import engines

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
C = 32
PROMPT = [int(t) for t in np.random.default_rng(11).integers(0, 256, 150)]
#: Full chunks of `PROMPT[:-1]` a reader of C = 32 looks up.
N_CHUNKS = (len(PROMPT) - 1) // C


def make_llm(store, **kw):
  kw.setdefault("kv_chunk_size", C)
  # Load-only: every stored chunk found is read (the chunk accounting is exact); no device
  # prefix cache (the store's reads are what is tested).
  return engines.fake_llm(max_num_seqs=2, chunk_sizes=(16, 32, 64), kv_store=store,
                          kv_merge_mode="load_only", enable_prefix_caching=False, **kw)


def disk(llm) -> ChunkStore:
  (tier,) = llm.kv_store.store.tiers
  return tier


def plant(writer, reader, *, kv_dtype: str | None = None) -> int:
  """Copies the writer's stored chunks of `PROMPT` under the reader's keys and namespace, each
  with its own tokens, layout, encodings and origin (`kv_dtype`: its raw values cast to that
  dtype first). Returns how many it planted."""
  src_keys = keys.chunk_hashes(writer.kv_store.namespace(None), PROMPT)
  ns = reader.kv_store.namespace(None)
  dst_keys, root = keys.chunk_hashes(ns, PROMPT), ns.root_hash()
  src, dst = disk(writer), disk(reader)
  n = 0
  for i, rec in enumerate(run_sync(src.peek(src_keys[:N_CHUNKS]))):
    got = src.get_sync(src_keys[i], rec.token_ids, rec.namespace, rec.layout)
    assert isinstance(got, ChunkHit), got
    layout, kv, payloads = rec.layout, got.kv, ()
    if kv is None:
      payloads = (EncodedPayload(got.encoding.codec, got.encoding.level, got.payload),)
    elif kv_dtype is not None:
      kv = kv.astype(kv_dtype)
      layout = dataclasses.replace(layout, dtype=kv_dtype)
    assert dst.put_sync(dst_keys[i], dst_keys[i - 1] if i else root, rec.token_ids, root, kv,
                        layout=layout, payloads=payloads, origin=rec.origin)
    n += 1
  return n


class StoredChunkGuardUnitTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cold = make_llm(None)
    cls.cold = cold.generate({"prompt_token_ids": PROMPT}, GREEDY)[0].token_ids
    cold.close()

  def writer(self, **kw):
    llm = make_llm(engines.memory_store_url("writer"), **kw)
    self.addCleanup(llm.close)
    llm.generate({"prompt_token_ids": PROMPT}, GREEDY)
    llm.flush()
    return llm

  def reader(self, **kw):
    llm = make_llm(engines.memory_store_url("reader"), **kw)
    self.addCleanup(llm.close)
    return llm

  def assert_refused(self, reader, planted: int, reason: MissReason):
    """The reader's run: every planted chunk a miss of `reason`, the cold answer, the miss in
    the server's rejected-chunks counter; then the reader's own saves replaced them."""
    self.assertEqual(planted, N_CHUNKS)
    out = reader.generate({"prompt_token_ids": PROMPT}, GREEDY)[0]
    reader.flush()
    self.assertEqual(out.token_ids, self.cold)
    self.assertEqual((out.num_cached_tokens, out.metrics.num_rejected_chunks), (0, N_CHUNKS))
    misses = reader.kv_store.store.stats["disk"].misses
    self.assertEqual(set(misses), {reason.value})
    self.assertGreaterEqual(misses[reason.value], N_CHUNKS)
    metrics = ServeMetrics(engine_stats=reader.engine.stats)
    self.addCleanup(metrics.close)
    rejected = {s.labels["reason"]: s.value
                for fam in text_string_to_metric_families(metrics.render().decode())
                for s in fam.samples if s.name == "kvjax_store_rejected_chunks_total"}
    self.assertEqual(rejected, {reason.value: misses[reason.value]})
    # The reader's computed chunks replaced the foreign ones: the next run loads its own.
    again = reader.generate({"prompt_token_ids": PROMPT}, GREEDY)[0]
    self.assertEqual(again.token_ids, self.cold)
    self.assertEqual(again.num_cached_tokens, N_CHUNKS * C)

  def test_another_model(self):
    # Another model's weights (the fake of another seed: another fingerprint, other KV); on a
    # reader that trusted the key it would load and answer wrong.
    writer = self.writer(runner_seed=1)
    reader = self.reader()
    self.assertNotEqual(writer.kv_store.origin.model_fingerprint,
                        reader.kv_store.origin.model_fingerprint)
    self.assert_refused(reader, plant(writer, reader), MissReason.MODEL_MISMATCH)

  def test_another_layout_version(self):
    # A writer whose stored layout means something else (`KV_LAYOUT_VERSION` 2).
    with mock.patch.object(root_module, "KV_LAYOUT_VERSION", 2):
      writer = self.writer()
    reader = self.reader()
    self.assertEqual((writer.kv_store.origin.kv_layout_version,
                      reader.kv_store.origin.kv_layout_version), (2, 1))
    self.assert_refused(reader, plant(writer, reader), MissReason.LAYOUT_MISMATCH)

  def test_another_dtype(self):
    # The same KV stored in float16: its record says so, the reader wants float32.
    writer = self.writer()
    reader = self.reader()
    self.assert_refused(reader, plant(writer, reader, kv_dtype="float16"),
                        MissReason.DTYPE_MISMATCH)

  def test_another_chunk_size(self):
    # Chunks of 16 tokens under the keys of chunks of 32.
    writer = self.writer(kv_chunk_size=16)
    reader = self.reader()
    self.assert_refused(reader, plant(writer, reader), MissReason.CHUNK_SIZE_MISMATCH)

  def test_another_codec_version(self):
    # int8 chunks whose records say another byte-format version of int8 (a newer writer's).
    writer = self.writer(kv_codec="int8")
    reader = self.reader(kv_codec="int8")
    planted = plant(writer, reader)
    dst = disk(reader)
    ns = reader.kv_store.namespace(None)
    hashes = keys.chunk_hashes(ns, PROMPT)[:N_CHUNKS]
    for h, rec in zip(hashes, run_sync(dst.peek(hashes))):
      newer = tuple(dataclasses.replace(e, codec_version=e.codec_version + 1)
                    for e in rec.encodings)
      data = dataclasses.replace(rec, encodings=newer).to_json()
      run_sync(self._write(dst, index_key(h), data))
    self.assert_refused(reader, planted, MissReason.CODEC_VERSION_MISMATCH)

  @staticmethod
  async def _write(store: ChunkStore, key: str, data: bytes) -> None:
    await (await store.kvstore()).write(key, data)

  def test_origin_is_stored_and_survives_a_restart(self):
    # The reader's own chunks carry its origin and load back after a restart on one store.
    url = f"file://{self.create_tempdir().full_path}"
    first = make_llm(url)
    first.generate({"prompt_token_ids": PROMPT}, GREEDY)
    first.flush()
    origin = first.kv_store.origin
    first.close()
    again = make_llm(url)
    self.addCleanup(again.close)
    recs = disk(again).records_sync()
    self.assertLen(recs, len(PROMPT) // C)
    self.assertEqual({r.origin for r in recs}, {origin})
    out = again.generate({"prompt_token_ids": PROMPT}, GREEDY)[0]
    self.assertEqual((out.token_ids, out.num_cached_tokens), (self.cold, N_CHUNKS * C))

  def test_origin_survives_demotion_and_promotion(self):
    # Write-back: the host tier's records carry the origin into the disk tier when it demotes
    # them, and promotions carry it back up; the chunks then load from both.
    url = engines.memory_store_url("demote")
    config = StoreConfig((TierConfig("host", capacity_bytes=2 * 12288),
                          TierConfig("disk", url=url)), placement="write_back")
    llm = make_llm(config)
    self.addCleanup(llm.close)
    self.assertEqual(llm.kv_store.layout.nbytes, 12288)  # the host holds two raw chunks
    llm.generate({"prompt_token_ids": PROMPT}, GREEDY)
    llm.flush()
    other = [int(t) for t in np.random.default_rng(12).integers(0, 256, 150)]
    llm.generate({"prompt_token_ids": other}, GREEDY)
    llm.flush()
    host, disk_tier = llm.kv_store.store.tiers
    on_disk = run_sync(disk_tier.records())
    self.assertGreaterEqual(len(on_disk), N_CHUNKS)
    self.assertEqual({r.origin for r in on_disk}, {llm.kv_store.origin})
    out = llm.generate({"prompt_token_ids": PROMPT}, GREEDY)[0]
    self.assertEqual((out.token_ids, out.num_cached_tokens), (self.cold, N_CHUNKS * C))
    self.assertGreater(llm.engine.stats().tiers[0].promotions, 0)
    self.assertEqual({r.origin for r in run_sync(host.records())}, {llm.kv_store.origin})


if __name__ == "__main__":
  absltest.main()
