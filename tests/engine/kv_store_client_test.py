"""The store client's saver: bounded queue, drops under pressure, flush, chunk slicing."""

import asyncio
import threading

import numpy as np
from absl.testing import absltest

from kvjax.engine.kv_store_client import KVStoreClient, SaveJob
from kvjax.storage.types import KVLayout

LAYOUT = KVLayout(num_layers=2, chunk_size=4, num_kv_heads=1, head_dim=2, dtype="float32")


class BlockingStore:
  """Records puts; the first put waits until released."""

  def __init__(self):
    self.tiers = []
    self.puts = []
    self.entered = threading.Event()
    self.release = threading.Event()

  async def put(self, chunk_hash, parent_hash, token_ids, namespace, kv):
    self.entered.set()
    await asyncio.get_running_loop().run_in_executor(None, self.release.wait)
    self.puts.append((chunk_hash, parent_hash, tuple(token_ids), kv.copy()))
    return ["disk"]


def job(first_chunk=0, n_chunks=2, offset=0.0):
  t = n_chunks * LAYOUT.chunk_size
  k = np.arange(2 * t * 2, dtype=np.float32).reshape(2, t, 1, 2) + offset
  v = -k
  # Two pieces that split a chunk in the middle, as prefill chunks of other sizes do.
  return SaveJob(namespace="root", hashes=[f"h{i}" for i in range(n_chunks)],
                 token_ids=list(range(t)), first_chunk=first_chunk, replace=set(),
                 pieces=[(0, k[:, :3], v[:, :3]), (3, k[:, 3:], v[:, 3:])])


class SaverTest(absltest.TestCase):

  def test_full_queue_drops_and_counts_then_flush_writes_the_rest(self):
    store = BlockingStore()
    client = KVStoreClient(store, model_fingerprint="fp", layout=LAYOUT, kv_layout_version=1,
                           max_pending_saves=1)
    self.assertTrue(client.submit_save(job()))
    self.assertTrue(store.entered.wait(timeout=30))  # the saver holds job 1
    self.assertTrue(client.submit_save(job(offset=100.0)))  # queued
    self.assertFalse(client.submit_save(job(offset=200.0)))  # dropped, never blocks
    self.assertEqual(client.saver_stats.jobs_dropped, 1)
    store.release.set()
    client.flush()
    self.assertEqual(client.saver_stats.jobs_done, 2)
    self.assertEqual(client.saver_stats.chunks_saved, 4)
    client.close()

  def test_chunks_are_sliced_from_pieces_with_parents(self):
    store = BlockingStore()
    store.release.set()
    client = KVStoreClient(store, model_fingerprint="fp", layout=LAYOUT, kv_layout_version=1)
    j = job()
    k = np.concatenate([j.pieces[0][1], j.pieces[1][1]], axis=1)
    client.submit_save(j)
    client.flush()
    self.assertEqual([p[:3] for p in store.puts],
                     [("h0", "root", (0, 1, 2, 3)), ("h1", "h0", (4, 5, 6, 7))])
    np.testing.assert_array_equal(store.puts[1][3][:, 0], k[:, 4:8])
    np.testing.assert_array_equal(store.puts[1][3][:, 1], -k[:, 4:8])
    # Loaded chunks are not saved again.
    store.puts.clear()
    client.submit_save(job(first_chunk=1))
    client.flush()
    self.assertEqual([p[0] for p in store.puts], ["h1"])
    client.close()


if __name__ == "__main__":
  absltest.main()
