"""The server's store and sessions as a product: a bounded default store
(`--kv_store_capacity_bytes`, `DEFAULT_STORE_CAPACITY_BYTES`) and its start-up line; a session
that survives a restart of the server over the same store folder (its next turn extends the
conversation and loads the stored tail, the output equal to a cold run); 400s with clear messages
for a null user content, an over-long `cache_salt` and a lone-surrogate escape."""

import tempfile

import pytest
from absl.testing import absltest

from kvjax import LLM
from kvjax.testing.engines import real_llm
from kvjax.serve.server import ServerConfig, store_startup_line
from kvjax.storage import DEFAULT_STORE_CAPACITY_BYTES
from tests.unit.serve import store_and_sessions_serve_unit_test as unit

C = 32


def make_llm(store: str) -> LLM:
  # No device prefix cache, load-only: every cached token of turn 2 is a store hit.
  return real_llm("tiny", cache_dir="", max_num_seqs=2, chunk_sizes=(16, 32, 64), kv_store=store,
                  kv_chunk_size=C, block_size=16,
                  enable_prefix_caching=False, kv_merge_mode="load_only")


class RestartTest(unit.RestartUnitTest):
  """A session surviving a server restart, over the real tiny model."""

  @classmethod
  def make_llm(cls, store: str) -> LLM:
    return make_llm(store)


class ServerConfigStoreTest(absltest.TestCase):

  def test_the_default_store_is_bounded(self):
    (tier,) = ServerConfig.from_flat(model="tiny").engine.kv.store_config().tiers
    self.assertEqual((tier.kind, tier.capacity_bytes), ("disk", DEFAULT_STORE_CAPACITY_BYTES))
    self.assertEqual(DEFAULT_STORE_CAPACITY_BYTES, 4 * 2**30)
    self.assertTrue(tier.url.startswith("file://") and tier.url.endswith("/store"))

  def test_the_capacity_flag(self):
    config = ServerConfig.from_flat(model="tiny", kv_store="memory://",
                                    kv_store_capacity_bytes=1 << 20, kv_link_bytes_per_s=1e9)
    (tier,) = config.engine.kv.store_config().tiers
    self.assertEqual((tier.url, tier.capacity_bytes, tier.link_bytes_per_s),
                     ("memory://", 1 << 20, 1e9))
    (s3,) = ServerConfig.from_flat(model="tiny",
                                   kv_store="s3://bucket/kv").engine.kv.store_config().tiers
    self.assertIsNone(s3.capacity_bytes)  # the bucket's lifecycle rules bound it
    for bad in (0, -1, True, 1.5):
      with self.assertRaisesRegex(ValueError, "kv_store_capacity_bytes"):
        ServerConfig.from_flat(model="tiny", kv_store_capacity_bytes=bad)
    with self.assertRaisesRegex(ValueError, "give each tier its capacity_bytes"):
      ServerConfig.from_flat(model="tiny", kv_store_capacity_bytes=1 << 20,
                   kv_tiers='[{"kind": "disk", "url": "memory://"}]')
    with self.assertRaisesRegex(ValueError, "kv_store: unknown store URL scheme 'ftp'"):
      ServerConfig.from_flat(model="tiny", kv_store="ftp://host/kv")

  def test_start_up_line_says_where_how_large_and_sessions(self):
    d = tempfile.mkdtemp()
    config = ServerConfig.from_flat(model="tiny", kv_store=f"file://{d}", kv_chunk_size=C,
                                    cache_dir="", kv_store_capacity_bytes=3 << 20)
    llm = real_llm("tiny", compile_on_init=False, **config.llm_options())
    try:
      line = store_startup_line(config, llm)
    finally:
      llm.close()
    self.assertIn(f"KV store file://{d} (disk: 0 B in 0 chunks, capacity 3.0 MiB; "
                  "--kv_store_capacity_bytes sets it", line)
    self.assertIn(f"chat sessions persist across restarts in {d}/sessions/", line)
    config = ServerConfig.from_flat(model="tiny", kv_store="memory://", kv_chunk_size=C,
                                    cache_dir="")
    llm = real_llm("tiny", compile_on_init=False, **config.llm_options())
    try:
      line = store_startup_line(config, llm)
    finally:
      llm.close()
    self.assertIn("capacity 4.0 GiB", line)
    self.assertIn("chat sessions live in memory only", line)


@pytest.mark.slow  # same assertions on the fake runner: store_and_sessions_serve_unit_test.py
class ValidationTest(unit.ValidationUnitTest):
  """Request validation with the server over the real tiny model."""

  @classmethod
  def make_llm(cls):
    return real_llm("tiny", cache_dir="", chunk_sizes=(16, 32), max_num_seqs=2)


if __name__ == "__main__":
  absltest.main()
