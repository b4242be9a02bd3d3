"""`python -m kvjax.serve`'s flag errors in-process: each bad value is one `app.UsageError`
line from `config_from_flags` (the server's flags in a `FlagValues` of their own), and `main`
prints it as one line and exits 1. One subprocess case (one line, no traceback, no flag listing,
exit code 1) stays in tests/integration/serve/serve_main_test.py."""

import contextlib
import io
from unittest import mock

from absl import app
from absl import flags
from absl.testing import absltest
from absl.testing import parameterized

from kvjax.serve import __main__ as serve_main


def server_flags(*argv: str) -> flags.FlagValues:
  flag_values = flags.FlagValues()
  serve_main.define_flags(flag_values)
  flag_values(["kvjax.serve", *argv])
  return flag_values


TINY = ("--model=tiny", "--port=0", "--cache_dir=", "--chunk_sizes=16,32", "--max_num_seqs=1")


class BadFlagValueTest(parameterized.TestCase):

  @parameterized.parameters(
      ("--kv_lookahead_window=-3", "kv_lookahead_window=-3 must be an int"),
      ("--long_prefill_token_threshold=-1", "long_prefill_token_threshold=-1 must be an int >= 0"),
      ("--allowed_origins=app.example", "not an origin"),
  )
  def test_a_bad_value_is_one_usage_error_line(self, flag, message):
    with self.assertRaisesRegex(app.UsageError, message) as raised:
      serve_main.config_from_flags(server_flags(*TINY, flag))
    self.assertNotIn("\n", str(raised.exception))

  def test_auth_for_health_needs_a_key(self):
    with mock.patch.dict("os.environ", {"KVJAX_API_KEY": ""}):
      with self.assertRaisesRegex(app.UsageError, "--auth_health_and_metrics needs --api_key"):
        serve_main.config_from_flags(server_flags(*TINY, "--auth_health_and_metrics"))

  def test_main_prints_one_line_and_exits_1(self):
    # Found by a fresh-user check: absl's usage text (every flag, ~200 lines) came first.
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
      with self.assertRaises(SystemExit) as raised:
        serve_main.main(["kvjax.serve", "extra"])
    self.assertEqual(raised.exception.code, 1)
    self.assertEqual(err.getvalue().count("\n"), 1, err.getvalue())
    self.assertIn("error: unexpected arguments ['extra']", err.getvalue())
    self.assertNotIn("--kv_store:", err.getvalue())  # no flag listing
    self.assertEqual(out.getvalue(), "")  # nothing listened


if __name__ == "__main__":
  absltest.main()
