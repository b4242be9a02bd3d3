"""KV cache events in vLLM's schema through the server, read with a real ZMQ SUB socket (issue
14): block hashes equal an independent computation of vLLM's sha256_cbor chain
(`kvjax.testing.vllm_hash`: CBOR written by hand, not cbor2), a reset is `AllBlocksCleared`, an eviction `BlockRemoved`, a salted
prompt is not advertised, replays return the published batches; and the llm-d routing gauges.

On the fake runner (`kvjax.testing.engines.fake_llm`: the server over `LLM` over a numpy model;
the events depend on token ids and blocks, not on the model's numbers); the real tiny model's
run is tests/integration/serve/kv_events_test.py."""

import hashlib
import os
from unittest import mock

import httpx
import jax.numpy as jnp
import msgpack
import numpy as np
import zmq
from absl.testing import absltest

from kvjax.engine import (AllBlocksClearedEvent, BlockRemovedEvent, BlockStoredEvent,
                          KVCacheEvents)
from kvjax.models.nn import config
from kvjax.models.nn.kv_cache import paged_block_nbytes
from kvjax.serve import ServerConfig
from kvjax.serve import kv_events
from kvjax.testing import engines, vllm_hash
from kvjax.testing.serve import serving

B = 16
NUM_BLOCKS = 8
SEED = "42"
TOPIC = "kv@pod-a@tiny"
TIMEOUT_MS = 30_000


def tokens(seed, n):
  return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]


def vllm_block_keys(ids, seed=SEED, block_size=B):
  return vllm_hash.block_keys(ids, seed, block_size)


class HasherTest(absltest.TestCase):

  def test_sha256_cbor_matches_the_hand_written_encoding(self):
    ids = tokens(0, 70) + [70000, 2**31 + 5]  # 1-, 2-, 3- and 5-byte CBOR integers
    hasher = kv_events.VllmBlockHasher("sha256_cbor", SEED)
    got = [kv_events.external_hash(h) for h in hasher.hash_prompt(ids, B)]
    self.assertEqual(got, vllm_block_keys(ids))
    self.assertLen(got, 4)  # the 8-token tail has no key
    self.assertEqual(kv_events.external_hash(hasher.none_hash, int_hashes=False),
                     hashlib.sha256(b"\x62" + SEED.encode()).digest())

  def test_pickle_sha256_and_the_seed(self):
    import pickle
    h = kv_events.VllmBlockHasher("sha256", "7")
    none = hashlib.sha256(pickle.dumps("7", protocol=pickle.HIGHEST_PROTOCOL)).digest()
    self.assertEqual(h.none_hash, none)
    self.assertEqual(h.hash_block(None, [1, 2]), hashlib.sha256(
        pickle.dumps((none, (1, 2), None), protocol=pickle.HIGHEST_PROTOCOL)).digest())
    with mock.patch.dict(os.environ, {"PYTHONHASHSEED": "123"}):
      self.assertEqual(kv_events.VllmBlockHasher().seed, "123")
    with mock.patch.dict(os.environ, {}, clear=True):
      self.assertEqual(kv_events.VllmBlockHasher().seed, "0")
    with self.assertRaisesRegex(ValueError, "kv_events_hash_algo"):
      kv_events.VllmBlockHasher("md5")

  def test_server_config_checks(self):
    with self.assertRaisesRegex(ValueError, "enable_prefix_caching"):
      ServerConfig.from_flat(model="tiny", enable_prefix_caching=False,
                   kv_events_endpoint="tcp://*:5557")
    with self.assertRaisesRegex(ValueError, "kv_events_hash_algo"):
      ServerConfig.from_flat(model="tiny", kv_events_hash_algo="xxhash")


class PublisherTest(absltest.TestCase):
  """The publisher without a model: synthetic index events, 32-byte hashes."""

  def test_groups_runs_skips_salted_chains_and_sends_bytes_hashes(self):
    ctx = zmq.Context.instance()
    hasher = kv_events.VllmBlockHasher("sha256_cbor", SEED)
    pub = kv_events.ZmqKVEventPublisher("tcp://127.0.0.1:*", hasher=hasher, int_hashes=False)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(pub.bound_endpoint())
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
      self.assertTrue(pub.wait_for_subscriber(30))
      root, salted = "r" * 64, "s" * 64
      ids = tokens(5, 3 * B)
      blocks = [ids[i * B:(i + 1) * B] for i in range(3)]
      pub.publish(KVCacheEvents(root, B, (
          BlockStoredEvent("k0", root, tuple(blocks[0])),
          BlockStoredEvent("k1", "k0", tuple(blocks[1])),
          BlockStoredEvent("x0", salted, tuple(blocks[0])),  # another namespace: skipped
          BlockStoredEvent("x1", "x0", tuple(blocks[1])),
          BlockStoredEvent("k2", "k1", tuple(blocks[2])),  # still k0's run
          BlockRemovedEvent("x1"),  # never published: no event
          BlockRemovedEvent("k2"),
          BlockStoredEvent("k2", "k1", tuple(blocks[2])),  # re-indexed: parent k1 is known
          AllBlocksClearedEvent())))
      self.assertTrue(sub.poll(TIMEOUT_MS))
      _, seq, payload = sub.recv_multipart()
      self.assertEqual(seq, bytes(8))
      h = hasher.hash_prompt(ids, B)
      self.assertEqual(msgpack.unpackb(payload)[1], [
          ["BlockStored", h, None, ids, B, None, "GPU", None],
          ["BlockRemoved", [h[2]], "GPU"],
          ["BlockStored", [h[2]], h[1], blocks[2], B, None, "GPU", None],
          ["AllBlocksCleared"]])
      self.assertEqual(pub.translator.num_tracked, 0)
    finally:
      pub.close()
      sub.close()


class KVEventsServeUnitTest(absltest.TestCase):

  @classmethod
  def make_llm(cls, **options):
    """The served `LLM` (tests/integration/serve/kv_events_test.py: the real tiny model)."""
    return engines.fake_llm(**options)

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    nbytes = paged_block_nbytes(config.tiny(), B, jnp.float32)  # the tiny model's
    cls.llm = cls.make_llm(chunk_sizes=(16, 32, 64), block_size=B,
                           kv_cache_memory_bytes=NUM_BLOCKS * nbytes, max_num_seqs=2)
    cls.pub = kv_events.ZmqKVEventPublisher(
        "tcp://127.0.0.1:*", topic=TOPIC, replay_endpoint="tcp://127.0.0.1:*",
        hasher=kv_events.VllmBlockHasher("sha256_cbor", SEED))
    cls._ctx = serving(cls.llm, kv_event_publisher=cls.pub)
    cls.srv = cls._ctx.__enter__()
    cls.ctx = zmq.Context.instance()
    cls.sub = cls.ctx.socket(zmq.SUB)
    cls.sub.setsockopt(zmq.LINGER, 0)
    cls.sub.connect(cls.pub.bound_endpoint())
    cls.sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    assert cls.pub.wait_for_subscriber(30), "the SUB socket never subscribed"
    cls.received = []  # (topic, seq, payload bytes) in arrival order

  @classmethod
  def tearDownClass(cls):
    cls.sub.close()
    cls._ctx.__exit__(None, None, None)
    cls.llm.close()
    super().tearDownClass()

  def complete(self, prompt, max_tokens=4, **extra):
    r = httpx.post(self.srv.url + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, **extra})
    r.raise_for_status()
    return r.json()

  def new_events(self):
    """Every event published since the last call, read from the SUB socket, in order."""
    self.srv.engine_call(lambda engine: None)  # the last step's events are handed over
    self.assertTrue(self.pub.wait_idle(30))
    events = []
    while len(self.received) < self.pub.num_published:
      self.assertTrue(self.sub.poll(TIMEOUT_MS), "a published batch never arrived")
      topic, seq, payload = self.sub.recv_multipart()
      self.received.append((topic, seq, payload))
      ts, batch, rank = msgpack.unpackb(payload)
      self.assertIsInstance(ts, float)
      self.assertEqual(rank, 0)
      events.extend(batch)
    return events

  @staticmethod
  def stored_blocks(events):
    """(hash, parent, tokens) per stored block, from `BlockStored` events of any grouping."""
    out = []
    for ev in events:
      if ev[0] != "BlockStored":
        continue
      tag, hashes, parent, ids, block_size, lora_id, medium, lora_name = ev
      assert (block_size, lora_id, medium, lora_name) == (B, None, "GPU", None), ev
      for i, h in enumerate(hashes):
        out.append((h, parent if i == 0 else hashes[i - 1], ids[i * B:(i + 1) * B]))
    return out

  def expected_blocks(self, ids, n_blocks):
    keys = vllm_block_keys(ids)[:n_blocks]
    return [(k, keys[i - 1] if i else None, ids[i * B:(i + 1) * B]) for i, k in enumerate(keys)]

  def test_events_trace(self):
    a = tokens(1, 40)
    self.complete(a)  # KV for 43 positions: two full blocks
    self.assertEqual(self.stored_blocks(self.new_events()), self.expected_blocks(a, 2))

    self.complete(tokens(2, 40), cache_salt="tenant")  # salted: not advertised
    self.complete(a)  # a device hit: nothing new is indexed
    self.assertEqual(self.new_events(), [])

    r = httpx.post(self.srv.url + "/reset_prefix_cache", timeout=60)
    self.assertEqual(r.json()["status"], "reset")
    self.assertEqual(self.new_events(), [["AllBlocksCleared"]])

    self.complete(a)
    self.assertEqual(self.stored_blocks(self.new_events()), self.expected_blocks(a, 2))
    b = tokens(3, 120)  # 124 positions: all 8 blocks, so a's cached blocks are evicted
    self.complete(b)
    events = self.new_events()
    removed = [h for ev in events if ev[0] == "BlockRemoved" for h in ev[1]]
    self.assertTrue(all(ev[2] == "GPU" for ev in events if ev[0] == "BlockRemoved"))
    self.assertCountEqual(removed, vllm_block_keys(a)[:2])
    self.assertEqual(self.stored_blocks(events), self.expected_blocks(b, 7))

    # Frames: the topic, consecutive 8-byte big-endian sequence numbers from 0.
    self.assertEqual({t for t, _, _ in self.received}, {TOPIC.encode()})
    self.assertEqual([int.from_bytes(s, "big") for _, s, _ in self.received],
                     list(range(len(self.received))))

    # A replay from sequence 1 returns the same payloads, then (-1, b"").
    dealer = self.ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(self.pub.bound_replay_endpoint())
    try:
      dealer.send_multipart([b"", (1).to_bytes(8, "big")])
      replayed = []
      while True:
        self.assertTrue(dealer.poll(TIMEOUT_MS), "the replay did not answer")
        empty, seq, payload = dealer.recv_multipart()
        if seq == kv_events.END_SEQ:
          self.assertEqual((empty, payload), (b"", b""))
          break
        replayed.append((seq, payload))
    finally:
      dealer.close()
    self.assertEqual(replayed, [(s, p) for _, s, p in self.received[1:]])

  def test_routing_gauges(self):
    got = self.srv.scrape()
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running"):
      self.assertEqual(got[(name, ())], 0)
    self.assertIn(("vllm:kv_cache_usage_perc", ()), got)
    n = self.srv.engine_call(lambda e: e.stats().kv_cache.num_blocks)
    self.assertEqual(got[("vllm:cache_config_info", (
        ("block_size", str(B)), ("enable_prefix_caching", "True"),
        ("num_gpu_blocks", str(n))))], 1.0)


if __name__ == "__main__":
  absltest.main()
