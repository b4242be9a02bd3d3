"""Every results JSON under benchmarks/results/ carries its provenance (scripts/benchlib.py).

The check walks the checked-in results (except `benchmarks/results/archive/`, the files made
before provenance was required, described by its README) and fails naming each file and the
keys of `benchlib.PROVENANCE_KEYS` it lacks. The helpers that write and compare results are
pinned on small hand-made records.
"""

import json
import os
import pathlib
import sys
import tempfile

from absl.testing import absltest

REPO = pathlib.Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "scripts"))
import benchlib  # noqa: E402  pylint: disable=wrong-import-position

RESULTS = REPO / "benchmarks" / "results"


class CheckedInResultsTest(absltest.TestCase):

  def test_every_results_json_has_provenance(self):
    missing = benchlib.missing_provenance(RESULTS)
    self.assertEqual(missing, {}, msg="results files without provenance (write them with "
                     "benchlib.provenance() and benchlib.write_json, or move them to "
                     "benchmarks/results/archive/ with a note):\n" + "\n".join(
                         f"  benchmarks/results/{path}: missing {keys}"
                         for path, keys in missing.items()))

  def test_archive_says_what_it_holds(self):
    archive = RESULTS / "archive"
    if not any(archive.rglob("*.json")):
      self.skipTest("nothing archived")
    readme = (archive / "README.md").read_text(encoding="utf-8")
    for path in sorted(archive.glob("*.json")):  # the top-level files are listed one by one
      self.assertIn(f"`{path.name}`", readme, msg=f"archive/README.md does not list {path.name}")


class MissingProvenanceTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.root = pathlib.Path(self.create_tempdir().full_path)

  def write(self, rel: str, text: str) -> None:
    path = self.root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")

  def test_names_each_file_and_missing_key(self):
    benchlib.write_json(self.root / "good.json", {**benchlib.provenance(), "x": 1})
    benchlib.write_json(self.root / "sub" / "good.json", {**benchlib.provenance()})
    self.write("old.json", json.dumps({"git_sha": "abc", "machine": {}, "versions": {}}))
    self.write("sub/list.json", "[1, 2]")
    self.write("broken.json", "{not json")
    self.write("archive/old.json", "{}")  # archived: not checked
    self.write("notes.txt", "not a results file")
    self.assertEqual(benchlib.missing_provenance(self.root), {
        "broken.json": ["<not a JSON object: JSONDecodeError>"],
        "old.json": ["argv", "git_dirty", "git_diff_sha256", "loadavg_before", "loadavg_after"],
        "sub/list.json": ["<not a JSON object: list>"]})

  def test_archive_is_skipped_only_at_the_top(self):
    self.write("runs/archive/old.json", "{}")
    self.assertEqual(list(benchlib.missing_provenance(self.root)), ["runs/archive/old.json"])


class ProvenanceRecordTest(absltest.TestCase):

  def test_write_json_records_every_key(self):
    path = pathlib.Path(self.create_tempdir().full_path) / "a" / "r.json"
    benchlib.write_json(path, {**benchlib.provenance(("numpy", "no-such-package-xyz")), "v": 2})
    got = json.loads(path.read_text(encoding="utf-8"))
    self.assertEqual([k for k in benchlib.PROVENANCE_KEYS if k not in got], [])
    self.assertEqual(got["v"], 2)
    self.assertEqual(got["argv"][0], benchlib.command_line()[0])
    self.assertLen(got["loadavg_before"], 3)
    self.assertLen(got["loadavg_after"], 3)
    self.assertIsNone(got["versions"]["no-such-package-xyz"])
    self.assertIsNotNone(got["versions"]["numpy"])
    self.assertRegex(got["git_sha"], r"^([0-9a-f]{40}|unknown)$")
    if got["git_dirty"] is not None:  # inside a git checkout
      self.assertRegex(got["git_diff_sha256"], r"^[0-9a-f]{64}$")

  def test_command_line_names_no_folder_of_this_machine(self):
    argv = sys.argv
    try:
      sys.argv = [str(REPO / "scripts" / "x.py"), f"--out={REPO}/benchmarks/results",
                  f"--data={REPO.parent}/shared/data/books", "--n=3"]
      got = benchlib.command_line()
    finally:
      sys.argv = argv
    self.assertEqual(got[1:], ["scripts/x.py", "--out=benchmarks/results",
                               "--data=../shared/data/books", "--n=3"])
    self.assertNotIn(str(REPO), " ".join(got))
    self.assertFalse(pathlib.Path(got[0]).is_absolute(), msg=got[0])

  def test_median_seconds_blocks_inside_the_timed_span(self):
    calls, blocked = [], []
    got = benchlib.median_seconds(lambda: calls.append(1) or len(calls), 4, blocked.append)
    self.assertEqual((len(calls), blocked), (5, [1, 2, 3, 4, 5]))  # one untimed call first
    self.assertGreaterEqual(got, 0.0)
    with self.assertRaises(ValueError):
      benchlib.median_seconds(lambda: None, 0)

  def test_finish_refuses_a_record_without_provenance(self):
    with self.assertRaisesRegex(KeyError, "argv"):
      benchlib.finish({"git_sha": "abc"})
    with tempfile.TemporaryDirectory() as d:
      with self.assertRaises(KeyError):
        benchlib.write_json(pathlib.Path(d) / "r.json", {"x": 1})


@absltest.skipUnless(os.path.exists("/proc/self/stat"), "reads Linux's /proc")
class ProcessCpuTest(absltest.TestCase):

  def test_reads_user_plus_system_seconds_of_a_process(self):
    sum(i * i for i in range(200_000))  # some CPU time of our own
    got = benchlib.process_cpu_s(os.getpid())
    t = os.times()  # the same kernel counters, read in the same tick
    self.assertAlmostEqual(got, t.user + t.system, delta=0.05)
    self.assertGreater(got, 0.0)

  def test_a_process_that_is_gone_reads_none(self):
    self.assertIsNone(benchlib.process_cpu_s(2**22 + 12345))  # above Linux's pid_max


class RoundsTest(absltest.TestCase):

  def test_interleaved_rounds_rotate(self):
    self.assertEqual(benchlib.interleaved_rounds(["A", "B", "C"], 4),
                     [["A", "B", "C"], ["B", "C", "A"], ["C", "A", "B"], ["A", "B", "C"]])
    for bad in ((["A", "A"], 3), ([], 3), (["A"], 0)):
      with self.assertRaises(ValueError):
        benchlib.interleaved_rounds(*bad)

  def test_summarize(self):
    self.assertEqual(benchlib.summarize([3.0, 1.0, 2.0]),
                     {"median": 2.0, "min": 1.0, "max": 3.0, "spread": 1.0,
                      "rounds": [3.0, 1.0, 2.0]})
    self.assertEqual(benchlib.summarize([4.0, 2.0])["median"], 3.0)
    with self.assertRaises(ValueError):
      benchlib.summarize([])

  def test_below_bound_takes_the_larger_spread(self):
    bound = benchlib.summarize([10.0, 10.2, 9.8])  # spread 0.04
    self.assertTrue(benchlib.below_bound(benchlib.summarize([9.5, 9.5, 9.5]), bound))
    self.assertFalse(benchlib.below_bound(benchlib.summarize([9.7, 9.7, 9.7]), bound))
    # The measurement's own spread (0.1) covers 9.5 against 10.
    self.assertFalse(benchlib.below_bound(benchlib.summarize([9.0, 9.5, 9.95]), bound))
    # cake.json's 4,096-token cell at B*, one run each: 8.49 s against a bound of 10.38 s.
    self.assertTrue(benchlib.below_bound(benchlib.summarize([8.49]), benchlib.summarize([10.38])))


class CpuClockTest(absltest.TestCase):

  def test_share_is_cpu_over_wall(self):
    clock = benchlib.CpuClock()
    sum(i * i for i in range(200_000))  # some CPU work
    got = clock.read()
    self.assertGreater(got["wall_s"], 0)
    self.assertAlmostEqual(got["cpu_share"], got["cpu_s"] / got["wall_s"])


if __name__ == "__main__":
  absltest.main()
