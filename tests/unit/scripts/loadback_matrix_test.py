"""scripts/loadback_matrix.py: its `--quick` slice runs clean (exit 0, "<N> load-backs, 0 wrong"
last, a results JSON with provenance), and a wrong answer or a cell that loads nothing fails it."""

import json
import pathlib
import re
import subprocess
import sys
import types

from absl.testing import absltest

SCRIPTS = pathlib.Path(__file__).resolve().parents[3] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import benchlib  # noqa: E402  pylint: disable=wrong-import-position
import loadback_matrix as lm  # noqa: E402  pylint: disable=wrong-import-position


def output(token_ids, logprobs, tiers=(), device_tokens=0):
  """What `_check` reads of a `RequestOutput`."""
  return types.SimpleNamespace(
      token_ids=list(token_ids), num_cached_tokens=32 * len(tiers) + device_tokens,
      logprobs=[{t: lp} for t, lp in zip(token_ids, logprobs)],
      metrics=types.SimpleNamespace(loaded_from_tiers=list(tiers),
                                    num_device_cached_tokens=device_tokens))


class QuickMatrixTest(absltest.TestCase):

  def test_quick_slice_runs_clean(self):
    out = self.create_tempdir().full_path + "/matrix.json"
    proc = subprocess.run([sys.executable, str(SCRIPTS / "loadback_matrix.py"), "--quick",
                           f"--out={out}"], capture_output=True, text=True, timeout=300,
                          check=False)
    self.assertEqual(proc.returncode, 0, proc.stdout[-2000:] + proc.stderr[-4000:])
    last = proc.stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"(\d+) load-backs, 0 wrong", last)
    self.assertIsNotNone(match, last)
    record = json.loads(pathlib.Path(out).read_text())
    self.assertContainsSubset(benchlib.PROVENANCE_KEYS, record)
    cells = {(c["tier"], c["codec"], c["event"]) for c in record["cells"]}
    self.assertEqual(cells, set(lm.QUICK.cells()))
    self.assertEqual(record["loadbacks"], int(match.group(1)))
    self.assertEqual((record["wrong"], record["failed_cells"]), (0, []))
    for c in record["cells"]:  # every cell loaded something from its own tier
      self.assertTrue(c["ok"], c)
      self.assertGreater(c["loadbacks"], 0, c)


class CheckTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.refs = {65: lm.Reference([5, 6, 7], [-0.5, -1.0, -2.0])}

  def check(self, codec, out, tier="disk"):
    res = lm.CellResult(tier, codec, "fresh")
    lm.Matrix._check(None, res, self.refs, codec, tier, [out], [65])
    return res

  def test_an_equal_answer_from_the_tier_is_a_load_back(self):
    res = self.check("raw", output([5, 6, 7], [-0.5, -1.0, -2.0], tiers=("disk", "disk")))
    self.assertEqual((res.loadbacks, res.loaded_chunks, res.wrong, res.ok), (1, 2, [], True))

  def test_other_tokens_are_wrong(self):
    res = self.check("int8", output([5, 6, 8], [-0.5, -1.0, -2.0], tiers=("disk",)))
    self.assertLen(res.wrong, 1)
    self.assertFalse(res.ok)
    self.assertEqual(lm.summary_line([res]), "1 load-backs, 1 wrong")

  def test_lossless_logprobs_beyond_the_tolerance_are_wrong_lossy_not_checked(self):
    off = output([5, 6, 7], [-0.5, -1.0, -2.0 + 3e-5], tiers=("disk",))
    self.assertLen(self.check("raw", off).wrong, 1)
    self.assertEqual(self.check("cachegen", off).wrong, [])

  def test_a_cell_that_loads_nothing_from_its_tier_fails(self):
    res = self.check("raw", output([5, 6, 7], [-0.5, -1.0, -2.0], tiers=("host",)))
    self.assertEqual((res.loadbacks, res.ok), (0, False))
    device = self.check("raw", output([5, 6, 7], [-0.5, -1.0, -2.0], device_tokens=48),
                        tier="device")
    self.assertEqual(device.loadbacks, 1)


if __name__ == "__main__":
  absltest.main()
