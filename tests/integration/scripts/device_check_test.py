"""scripts/device_check.sh: a short slice of the dry run in the default suite (the ceilings step
and the summary it ends with; a step out of time named and the exit non-zero), the whole dry run
under slow (every step on the CPU at tiny shapes, every check of the summary ok)."""

import json
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest
from absl.testing import absltest

REPO = pathlib.Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "scripts"))
import device_check_all as dca  # noqa: E402  pylint: disable=wrong-import-position


def run(*args, timeout=600):
  env = {**os.environ, "PYTHON": sys.executable}
  return subprocess.run(["bash", "scripts/device_check.sh", *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=timeout, check=False)


class DeviceCheckSliceTest(absltest.TestCase):

  def test_ceilings_step_writes_the_summary(self):
    out = tempfile.mkdtemp()
    p = run("--dry-run", "--only", "ceilings", "--out", out)
    self.assertEqual(p.returncode, 0, p.stdout[-2000:] + p.stderr[-2000:])
    s = json.loads((pathlib.Path(out) / "device_summary_cpu.json").read_text())
    for key in ("argv", "git_sha", "git_dirty", "git_diff_sha256", "versions", "loadavg_after"):
      self.assertIn(key, s)
    self.assertEqual((s["device"], s["dry_run"], s["speed_judged"]), ("cpu", True, False))
    self.assertEqual(list(s["checks"]), ["hbm_copy", "h2d_copy"])
    for name, c in s["checks"].items():
      self.assertTrue(c["ok"], name)
      self.assertGreater(c["value"], 0, name)
    self.assertGreater(s["checks"]["h2d_copy"]["ceiling"], 0)
    self.assertEqual(s["steps"]["ceilings"]["verdict"], "ok")
    self.assertEqual(s["failed_or_skipped"], [])

  def test_a_step_out_of_time_is_named_and_the_exit_is_nonzero(self):
    out = tempfile.mkdtemp()
    p = run("--dry-run", "--only", "ceilings", "--limit_scale", "0.001", "--out", out)
    self.assertEqual(p.returncode, 1)
    self.assertIn("hbm_copy (skipped: step ceilings: timeout)", p.stderr)
    s = json.loads((pathlib.Path(out) / "device_summary_cpu.json").read_text())
    self.assertEqual(s["checks"]["h2d_copy"]["skipped"], "step ceilings: timeout")

  def test_unknown_step_is_refused(self):
    p = run("--dry-run", "--only", "ceilings,warp_drive", "--out", tempfile.mkdtemp())
    self.assertEqual(p.returncode, 2)
    self.assertIn("unknown steps ['warp_drive']", p.stderr)


@pytest.mark.slow
class DeviceCheckDryRunTest(absltest.TestCase):

  def test_whole_dry_run(self):
    # The reference of the dry run's model (the CPU f32 engine) first, as on the CPU machine.
    p = run("--prepare", "--dry-run")
    self.assertEqual(p.returncode, 0, p.stdout[-3000:] + p.stderr[-3000:])
    out = tempfile.mkdtemp()
    p = run("--dry-run", "--out", out, timeout=900)
    self.assertEqual(p.returncode, 0, p.stdout[-3000:] + p.stderr[-3000:])
    s = json.loads((pathlib.Path(out) / "device_summary_cpu.json").read_text())
    self.assertEqual(list(s["checks"]), list(dca.CHECKS))
    self.assertEqual([n for n, c in s["checks"].items() if not c["ok"]], [])


if __name__ == "__main__":
  absltest.main()
