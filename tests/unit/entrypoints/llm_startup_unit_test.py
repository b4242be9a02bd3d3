"""`LLM(...)` reports its start-up by default, as `python -m kvjax.serve` does: one
`kvjax: <message>` line on stderr per `StartupEvent` (weights, KV cache, each compiled program,
ready, with seconds); `startup_progress=None` reports nothing, `log_startup` logs instead; the
test factories build quiet `LLM`s. On the fake runner (no model, no compile)."""

import contextlib
import io
import logging
import re

from absl.testing import absltest

from kvjax.entrypoints import llm as llm_module
from kvjax.testing.engines import fake_llm, fake_runner_seam

# The fake's 6 programs: a step per token bucket (8, 16, 32, 64), the insert of a stored
# 32-token chunk, the read-back of a session tail.
OPTIONS = dict(cache_dir="", chunk_sizes=(16, 32, 64), kv_store="memory://", kv_chunk_size=32,
               compile_on_init=True)


def _no_seconds(line: str) -> str:
  return re.sub(r"\d+(\.\d+)? s\b", "<t> s", line)


class StartupProgressTest(absltest.TestCase):

  def build(self, **kw):
    """Builds and closes an `LLM` on the fake runner; returns what reached stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), fake_runner_seam():
      llm_module.LLM("tiny", **OPTIONS, **kw).close()
    return err.getvalue()

  def test_default_prints_every_event_to_stderr(self):
    events = []
    self.assertEqual(self.build(startup_progress=events.append), "")
    printed = self.build().splitlines()
    self.assertEqual([_no_seconds(line) for line in printed],
                     [_no_seconds(f"kvjax: {e.message}") for e in events])
    self.assertEqual([e.phase for e in events],
                     ["weights", "weights", "cache", "cache", "store"] + ["compile"] * 7
                     + ["ready"])
    self.assertEqual(_no_seconds(printed[0]), "kvjax: loading tiny weights")
    self.assertRegex(printed[1], r"^kvjax: loaded tiny weights in \d+\.\d s$")
    self.assertRegex(printed[3], r"^kvjax: KV cache: float32 weights and KV \(dtype='auto' on "
                     r"cpu\), \d+ blocks of 16 tokens")
    self.assertEqual(printed[5], "kvjax: compiling 6 programs (or loading them from the "
                     "compilation cache)")
    self.assertRegex(printed[6], r"^kvjax: compiled 1/6: step of 8 tokens \(\d+\.\d s\)$")
    self.assertRegex(printed[-1], r"^kvjax: tiny: 6 programs ready in \d+\.\d s$")

  def test_none_reports_nothing(self):
    with self.assertNoLogs("kvjax.entrypoints.llm", logging.INFO):
      self.assertEqual(self.build(startup_progress=None), "")

  def test_log_startup_logs_instead(self):
    with self.assertLogs("kvjax.entrypoints.llm", logging.INFO) as logs:
      self.assertEqual(self.build(startup_progress=llm_module.log_startup), "")
    self.assertLen(logs.records, 13)
    self.assertEqual(logs.records[0].getMessage(), "loading tiny weights")

  def test_test_factories_are_quiet(self):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
      fake_llm(compile_on_init=True, chunk_sizes=(16, 32)).close()
    self.assertEqual(err.getvalue(), "")


if __name__ == "__main__":
  absltest.main()
