"""The server's store options are engine options (`kvjax.config.KVStoreOptions`): `kv_placement`
(`--kv_placement`) and `kv_tiers` (`--kv_tiers`) reach the store's `StoreConfig`, made in one
place (`KVStoreOptions.store_config`), and a bad tier list is refused before the server binds its
port."""

from absl.testing import absltest

from kvjax.serve.server import ServerConfig
from kvjax.storage.tiering.tiers import StoreConfig, TierConfig

TIERS = '[{"kind": "host", "capacity_bytes": 1048576}, {"kind": "disk", "url": "memory://p"}]'
TIER_CONFIGS = (TierConfig("host", capacity_bytes=1048576), TierConfig("disk", url="memory://p"))


class PlacementOptionTest(absltest.TestCase):

  def test_placement_reaches_the_store_config(self):
    config = ServerConfig.from_flat(model="tiny", kv_tiers=TIERS, kv_placement="write_back")
    self.assertEqual(config.engine.kv.store_config(),
                     StoreConfig(TIER_CONFIGS, placement="write_back"))
    self.assertEqual(ServerConfig.from_flat(model="tiny", kv_tiers=TIERS).engine.kv.store_config(),
                     StoreConfig(TIER_CONFIGS, placement="write_through"))
    self.assertIsNone(ServerConfig.from_flat(model="tiny", kv_store=None,
                                             kv_placement="write_back").engine.kv.store_config())

  def test_bad_value(self):
    with self.assertRaisesRegex(ValueError, "kv_placement"):
      ServerConfig.from_flat(model="tiny", kv_placement="write_around")

  def test_a_bad_tier_list_is_refused_before_the_server_starts(self):
    # Found by a fresh-user check: a host tier without capacity_bytes failed only after the
    # server had bound its port and said it was listening.
    with self.assertRaisesRegex(ValueError, "kv_tiers: a host tier needs capacity_bytes"):
      ServerConfig.from_flat(model="tiny", kv_tiers='[{"kind": "host"}]')
    with self.assertRaisesRegex(ValueError, "kv_tiers: tier config 'host' is not JSON"):
      ServerConfig.from_flat(model="tiny", kv_tiers="host")

  def test_kv_tiers_replace_kv_store(self):
    with self.assertRaisesRegex(ValueError, "give kv_store or kv_tiers, not both"):
      ServerConfig.from_flat(model="tiny", kv_store="memory://", kv_tiers=TIERS)
    with self.assertRaisesRegex(ValueError, "with kv_tiers, give each tier its capacity_bytes"):
      ServerConfig.from_flat(model="tiny", kv_tiers=TIERS, kv_store_capacity_bytes=1 << 20)


if __name__ == "__main__":
  absltest.main()
