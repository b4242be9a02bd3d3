"""The docs site builds strictly, and the generated options page is current.

`mkdocs build --strict` fails on a broken link, a page missing from the nav, or a missing
snippet, so CI (which runs the README's test command) catches them. mkdocs and its material
theme come with the `test` extra.
"""

import os
import subprocess
import sys
import tempfile

from absl.testing import absltest

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# A path of the machine the docs were written on (its work tree, a home directory): pages cite
# files by their path in the repository instead.
_MACHINE_PATH = r"(?<![\w.])/(?:" + "|".join(("work", "home", "root")) + r")/"
sys.path.insert(0, os.path.join(_REPO, "scripts"))

import gen_options_doc  # noqa: E402  (scripts/ is not a package)


class DocsBuildTest(absltest.TestCase):

  def test_mkdocs_build_strict(self):
    with tempfile.TemporaryDirectory() as site:
      env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
      proc = subprocess.run(
          [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-f",
           os.path.join(_REPO, "mkdocs.yml"), "-d", site],
          cwd=_REPO, env=env, capture_output=True, text=True, timeout=300)
      self.assertEqual(proc.returncode, 0, msg=proc.stdout + proc.stderr)
      self.assertTrue(os.path.exists(os.path.join(site, "usage", "options", "index.html")))

  def test_pages_are_short_and_cite_no_issue_numbers(self):
    pages = [os.path.join(root, name)
             for root, _, files in os.walk(os.path.join(_REPO, "docs"))
             for name in files if name.endswith(".md")]
    self.assertGreaterEqual(len(pages), 8)
    # benchmarks/README.md, devices.md, agents.md, sessions.md and defaults.md are included
    # into the site
    # (docs/benchmarks*.md).
    for path in pages + [os.path.join(_REPO, "README.md"),
                         os.path.join(_REPO, "benchmarks", "README.md"),
                         os.path.join(_REPO, "benchmarks", "devices.md"),
                         os.path.join(_REPO, "benchmarks", "agents.md"),
                         os.path.join(_REPO, "benchmarks", "sessions.md"),
                         os.path.join(_REPO, "benchmarks", "defaults.md")]:
      with open(path, encoding="utf-8") as f:
        text = f.read()
      rel = os.path.relpath(path, _REPO)
      self.assertLessEqual(text.count("\n"), 400, msg=f"{rel} is over 400 lines")
      self.assertNotRegex(text, r"(?i)\bissue[ -]\d", msg=f"{rel} cites an issue number")
      self.assertNotRegex(text, _MACHINE_PATH, msg=f"{rel} names a machine path")

  def test_readme_is_short(self):
    with open(os.path.join(_REPO, "README.md"), encoding="utf-8") as f:
      self.assertLessEqual(f.read().count("\n"), 300)


class OptionsPageTest(absltest.TestCase):

  def test_checked_in_page_equals_generator_output(self):
    # A fresh interpreter: the page shows the real defaults, whatever this process imported or
    # changed.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [_REPO, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, os.path.join(_REPO, "scripts", "gen_options_doc.py"),
                           "--check"], cwd=_REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    self.assertEqual(proc.returncode, 0, msg=proc.stdout + proc.stderr)

  def test_every_llm_keyword_and_server_flag_is_listed(self):
    # The checked-in page (equal to the generator's output: the test above). Read as text: the
    # generator imports the server's absl flags, which a benchmark module loaded in the same
    # test process may define too (a duplicate-flag error, not a docs problem).
    with open(os.path.join(_REPO, "docs", "usage", "options.md"), encoding="utf-8") as f:
      page = f.read()
    for name in ("kv_store", "kv_codec", "max_num_seqs", "kv_placement", "api_key", "port",
                 "kv_store_capacity_bytes", "kv_layerwise_groups"):
      self.assertRegex(page, f"`(--)?{name}`")

  def test_scrub_and_flag_defaults(self):
    # The page's text comes from the configuration tree's fields (`kvjax.config`); issue
    # references are dropped, and a flag whose default is resolved at start-up shows what its
    # help text says it resolves to.
    self.assertEqual(gen_options_doc._scrub("alone (issue 14, part 4: detail)."),
                     "alone (detail).")
    self.assertEqual(gen_options_doc._flag_default(None, "Slots (default: 64; more)."), "64")
    self.assertEqual(gen_options_doc._flag_default(None, "Nothing said."), "none")
    self.assertEqual(gen_options_doc._flag_default([], ""), "(empty)")
    self.assertEqual(gen_options_doc._flag_default(True, ""), "true")

if __name__ == "__main__":
  absltest.main()
