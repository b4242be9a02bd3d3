"""The records the rooms read, derived from the options tree in one place each:
`KVStoreOptions.store_config` (the store's tiers: `kv_store`, `kv_tiers`,
`kv_store_capacity_bytes`, links, `kv_placement`), `EngineOptions.load_config` and
`scheduler_config`."""

import json
import os
from unittest import mock

from absl.testing import absltest

from kvjax.config import EngineOptions
from kvjax.config.options import LOCAL_LINK_LATENCY_S, REMOTE_LINK_LATENCY_S
from kvjax.scheduler.config import LoadConfig, SchedulerConfig
from kvjax.storage import DEFAULT_STORE_CAPACITY_BYTES
from kvjax.storage.tiering.tiers import StoreConfig, TierConfig


def store(**flat):
  return EngineOptions.from_flat(**flat).kv.store_config()


class StoreConfigTest(absltest.TestCase):

  def test_no_store(self):
    self.assertIsNone(store())
    self.assertFalse(EngineOptions().has_store)

  def test_a_url_is_one_tier_with_its_capacity_and_link(self):
    self.assertEqual(store(kv_store="memory://a"), StoreConfig((TierConfig(
        "disk", url="memory://a", capacity_bytes=DEFAULT_STORE_CAPACITY_BYTES),)))
    self.assertEqual(DEFAULT_STORE_CAPACITY_BYTES, 4 * 2**30)
    self.assertEqual(store(kv_store="/tmp/kv", kv_store_capacity_bytes=1 << 20,
                           kv_link_bytes_per_s=1e9),
                     StoreConfig((TierConfig("disk", url="/tmp/kv", capacity_bytes=1 << 20,
                                             link_bytes_per_s=1e9),)))
    (s3,) = store(kv_store="s3://bucket/kv").tiers
    self.assertEqual((s3.kind, s3.capacity_bytes), ("remote", None))  # the bucket's rules bound it
    (traced,) = store(kv_store="memory://t", kv_link_trace="rates.txt").tiers
    self.assertEqual(traced.link_trace, "rates.txt")

  def test_the_default_store_is_under_the_cache_root(self):
    with mock.patch.dict(os.environ, {"KVJAX_CACHE_DIR": "/srv/kvjax"}):
      options = EngineOptions.from_flat(kv_store="default")
      (tier,) = options.kv.store_config().tiers
      self.assertEqual(options.kv.store_url, "file:///srv/kvjax/store")
    self.assertEqual((tier.url, tier.capacity_bytes),
                     ("file:///srv/kvjax/store", DEFAULT_STORE_CAPACITY_BYTES))

  def test_tiers_as_json_and_placement(self):
    tiers = [{"kind": "host", "capacity_bytes": 1024}, {"kind": "disk", "url": "memory://b"}]
    want = (TierConfig("host", capacity_bytes=1024), TierConfig("disk", url="memory://b"))
    self.assertEqual(store(kv_tiers=json.dumps(tiers), kv_placement="write_back"),
                     StoreConfig(want, placement="write_back"))
    self.assertEqual(store(kv_tiers=json.dumps(tiers), kv_store="default"), StoreConfig(want))
    self.assertIsNone(EngineOptions.from_flat(kv_tiers=json.dumps(tiers)).kv.store_url)
    given = StoreConfig(want)
    self.assertIs(store(kv_store=given), given)

  def test_bad_store_options_name_the_option(self):
    tiers = '[{"kind": "disk", "url": "memory://c"}]'
    for flat, message in (
        (dict(kv_store="ftp://h/kv"), "kv_store: unknown store URL scheme 'ftp'"),
        (dict(kv_store="memory://", kv_store_capacity_bytes=0), "kv_store_capacity_bytes=0"),
        (dict(kv_store="memory://", kv_store_capacity_bytes=True), "kv_store_capacity_bytes"),
        (dict(kv_tiers=tiers, kv_store="memory://"), "give kv_store or kv_tiers, not both"),
        (dict(kv_tiers=tiers, kv_store_capacity_bytes=1 << 20), "give each tier its capacity"),
        (dict(kv_tiers=tiers, kv_link_bytes_per_s=1e9), "with kv_tiers, set links per tier"),
        (dict(kv_tiers='[{"kind": "host"}]'), "kv_tiers: a host tier needs capacity_bytes"),
        (dict(kv_store=StoreConfig((TierConfig("disk", url="memory://d"),)),
              kv_store_capacity_bytes=1 << 20), "with a StoreConfig, give each tier")):
      with self.assertRaisesRegex(ValueError, message, msg=str(flat)):
        EngineOptions.from_flat(**flat)


class LoadAndSchedulerConfigTest(absltest.TestCase):

  def test_load_config_of_the_options(self):
    options = EngineOptions.from_flat(
        kv_store="memory://e", kv_merge_mode="load_only", kv_max_loads_in_flight=3,
        kv_ttft_target_s=0.5, kv_layerwise_groups=2, kv_lookahead_window=5,
        kv_codec="int8", kv_chunk_size=64)
    self.assertEqual(options.load_config(), LoadConfig(
        merge_mode="load_only", max_loads_in_flight=3, link_latency_s=LOCAL_LINK_LATENCY_S,
        kv_ttft_target_s=0.5, layerwise_groups=2, lookahead_window=5, consistent=True))

  def test_without_a_store_no_lookahead_nor_consistency(self):
    self.assertEqual(EngineOptions.from_flat(kv_codec="int8", kv_chunk_size=64).load_config(),
                     LoadConfig(lookahead_window=0, consistent=False))

  def test_a_remote_tier_gets_the_remote_latency_prior(self):
    self.assertEqual(EngineOptions.from_flat(kv_store="s3://b/kv").load_config().link_latency_s,
                     REMOTE_LINK_LATENCY_S)
    tiers = '[{"kind": "disk", "url": "memory://f"}, {"kind": "remote", "url": "s3://b/kv"}]'
    self.assertEqual(EngineOptions.from_flat(kv_tiers=tiers).load_config().link_latency_s,
                     REMOTE_LINK_LATENCY_S)

  def test_scheduler_config_of_the_options(self):
    options = EngineOptions.from_flat(max_num_seqs=3, chunk_sizes=(16, 32),
                                      max_num_batched_tokens=48, prefill_order="fcfs",
                                      enable_prefix_caching=False)
    self.assertEqual(options.scheduler_config(), SchedulerConfig(
        num_slots=3, token_budget=48, chunk_sizes=(16, 32), prefill_order="fcfs",
        enable_prefix_caching=False))


if __name__ == "__main__":
  absltest.main()
