"""`ServerConfig`'s store options: `kv_placement` (`--kv_placement`) checked and passed to `LLM`
with a store; `kv_tiers` (`--kv_tiers`) checked before the server binds its port."""

from absl.testing import absltest

from kvjax.serve.server import ServerConfig

TIERS = '[{"kind": "host", "capacity_bytes": 1048576}, {"kind": "disk", "url": "memory://p"}]'


class PlacementOptionTest(absltest.TestCase):

  def test_passed_with_a_store_only(self):
    opts = ServerConfig.from_flat(model="tiny", kv_tiers=TIERS,
                                  kv_placement="write_back").llm_options()
    self.assertEqual(opts["kv_placement"], "write_back")
    self.assertEqual(opts["kv_store"].placement, "write_through")  # LLM applies the option
    self.assertNotIn("kv_placement",
                     ServerConfig.from_flat(model="tiny", kv_tiers=TIERS).llm_options())
    self.assertNotIn("kv_placement", ServerConfig.from_flat(
        model="tiny", kv_store=None, kv_placement="write_back").llm_options())

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


if __name__ == "__main__":
  absltest.main()
