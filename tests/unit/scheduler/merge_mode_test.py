"""The merge modes, stated once (`kvjax/merge_mode.py`): the option tree, the scheduler, the
engine and the sessions room all read them from there."""

from absl.testing import absltest

from kvjax import config
from kvjax.merge_mode import MERGE_MODES, MergeMode, parse_merge_mode
from kvjax.scheduler import LoadConfig
from kvjax.scheduler import MergeMode as SchedulerMergeMode


class MergeModeTest(absltest.TestCase):

  def test_one_set_of_values(self):
    self.assertEqual(MERGE_MODES, ("cake", "compute_only", "load_only"))
    self.assertIs(SchedulerMergeMode, MergeMode)
    self.assertEqual(set(config.MERGE_MODES), set(MERGE_MODES))
    for value in MERGE_MODES:
      self.assertIs(parse_merge_mode(value), MergeMode(value))
      self.assertIs(parse_merge_mode(MergeMode(value)), MergeMode(value))
      self.assertEqual(LoadConfig(merge_mode=value).merge_mode, value)

  def test_unknown_modes_raise_naming_the_option(self):
    for bad in ("both", "", None, 1, "CAKE"):
      with self.assertRaisesRegex(ValueError, r"merge_mode=.*use one of \['cake'"):
        parse_merge_mode(bad)
    with self.assertRaisesRegex(ValueError, "kv_merge_mode='both'"):
      parse_merge_mode("both", "kv_merge_mode")
    with self.assertRaisesRegex(ValueError, "merge_mode='both'"):
      LoadConfig(merge_mode="both")


if __name__ == "__main__":
  absltest.main()
