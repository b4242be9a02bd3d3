"""`ServerConfig.long_prefill_token_threshold` (`--long_prefill_token_threshold`) and
`ServerConfig.prefill_order` (`--prefill_order`) and `ServerConfig.short_first_token_steps`
(`--short_first_token_steps`): checked when the config is built (so the CLI
reports them before loading a model), and passed to `LLM`."""

from absl.testing import absltest

from kvjax.serve.server import ServerConfig


class LongPrefillOptionTest(absltest.TestCase):

  def test_passed_to_llm(self):
    self.assertEqual(
        ServerConfig.from_flat(model="tiny").llm_options()["long_prefill_token_threshold"], 0)
    opts = ServerConfig.from_flat(model="tiny", long_prefill_token_threshold=256).llm_options()
    self.assertEqual(opts["long_prefill_token_threshold"], 256)
    small = ServerConfig.from_flat(model="tiny", chunk_sizes=(8, 16),
                                   long_prefill_token_threshold=8)
    self.assertEqual(small.llm_options()["long_prefill_token_threshold"], 8)

  def test_bad_values(self):
    for bad in (-1, 2.5, True):
      with self.assertRaisesRegex(ValueError, "long_prefill_token_threshold=.* must be an int"):
        ServerConfig.from_flat(model="tiny", long_prefill_token_threshold=bad)
    with self.assertRaisesRegex(ValueError, "long_prefill_token_threshold=8 is below the "
                                "smallest chunk size 16"):
      ServerConfig.from_flat(model="tiny", long_prefill_token_threshold=8)


  def test_prefill_order(self):
    self.assertEqual(ServerConfig.from_flat(model="tiny").llm_options()["prefill_order"],
                     "shortest_first")
    self.assertEqual(ServerConfig.from_flat(model="tiny", prefill_order="fcfs").llm_options()[
        "prefill_order"], "fcfs")
    with self.assertRaisesRegex(ValueError, "prefill_order='lpm'; use one of"):
      ServerConfig.from_flat(model="tiny", prefill_order="lpm")

  def test_short_first_token_steps(self):
    self.assertIs(
        ServerConfig.from_flat(model="tiny").llm_options()["short_first_token_steps"], True)
    self.assertIs(ServerConfig.from_flat(model="tiny", short_first_token_steps=False).llm_options()[
        "short_first_token_steps"], False)
    with self.assertRaisesRegex(ValueError, "short_first_token_steps='no' must be a bool"):
      ServerConfig.from_flat(model="tiny", short_first_token_steps="no")


if __name__ == "__main__":
  absltest.main()
