"""scripts/device_check_all.py's summary: each check's value, ceiling and fraction read from the
steps' JSON, the device's name, and every failed or skipped check named (no jax, no device)."""

import json
import pathlib
import sys
import tempfile

from absl.testing import absltest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "scripts"))
import device_check_all as dca  # noqa: E402  pylint: disable=wrong-import-position

HBM = 3.0e12


def write(dir_, name, record):
  (dir_ / name).write_text(json.dumps(record))


def fake_results(dir_: pathlib.Path) -> None:
  """One JSON per step, as each step's script writes it on a device (the fields read)."""
  write(dir_, "device_check_ceilings.json", {
      "hbm_copy": {"bytes_per_s": HBM, "how": "x + 1"},
      "h2d_copy": {"bytes_per_s": 20e9, "bytes": 1 << 29},
      "h2d_pinned": {"bytes_per_s": 50e9}})
  write(dir_, "device_check_engine_correctness.json", {"results": {
      "engine_greedy_match": {"prompts": 8, "prompts_matched": 8, "max_logprob_abs_err": 0.03,
                              "tie_margin_nats": 0.05, "ok": True, "dtype": "bfloat16"},
      "engine_warm_equals_cold": {"prompt_tokens": 1031, "loaded_tokens": 1024,
                                  "tokens_equal": True, "ok": True},
      "kvtc_consistent_repeats": {"ok": False, "error": "ValueError: boom"}}})
  write(dir_, "device_check_engine_engine.json", {
      "settings": {"ttft_lengths": [4096, 16384], "decode_batches": [1, 32, 64]},
      "results": {
          "ttft_4k": {"cold_ttft_s": 0.2, "warm_ttft_s": 0.05, "warm_loaded_tokens": 4096,
                      "ok": True},
          "ttft_16k": {"ok": False, "error": "RuntimeError: out of memory"},
          "decode": {
              "b1": {"tokens_per_s": 500.0, "step_bytes": 3e8, "mean_context": 544, "ok": True},
              "b32": {"tokens_per_s": 8000.0, "step_bytes": 6e8, "mean_context": 544,
                      "ok": True}},
          "cake_disk": {"cake_s": 0.1, "better_s": 0.12, "tokens": 8192, "store": "file",
                        "ok": True, "ttft_s": {"compute_only": {"median": 0.12},
                                               "load_only": {"median": 0.3}}},
          "cake_host": {"cake_s": 0.2, "better_s": 0.1, "tokens": 8192, "store": "memory",
                        "ok": True, "ttft_s": {"compute_only": {"median": 0.1},
                                               "load_only": {"median": 0.15}}}}})
  write(dir_, "device_check.json", {
      "correctness": [{"ok": True}, {"ok": True}],
      "bandwidth": [{"batch": b, "context": c, "bytes_per_s": 1e12 * b / 32 + c / 1e3}
                    for b in (1, 32) for c in (4096, 32768)]})
  write(dir_, "device_check_codec.json", {"cases": [
      {"codec": "int8", "ok": True, "model": "llama31_8b", "chunk": 256, "chunks_per_call": 48,
       "timing": {"decode_pallas_total_GB_per_s": 1500.0}},
      {"codec": "int4", "ok": False, "model": "llama31_8b", "error": "XlaRuntimeError: x"}]})
  write(dir_, "device_check_rans.json", {
      "shape": [30, 2, 256, 192], "coded_bytes": 1000,
      "results": {"pallas": {"decode_GB_per_s": 10.0, "byte_exact": True}}})


class SummaryTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.dir = pathlib.Path(tempfile.mkdtemp())
    fake_results(self.dir)
    self.checks, self.bad = dca.summarize({}, dca.extract_checks(self.dir, dry=False), {
        "bench_serve": {"verdict": "timeout"}}, [s.name for s in dca.STEPS])

  def test_every_check_in_order(self):
    self.assertEqual(list(self.checks), list(dca.CHECKS))

  def test_values_ceilings_fractions(self):
    c = self.checks
    self.assertEqual((c["hbm_copy"]["value"], c["hbm_copy"]["ok"]), (HBM, True))
    self.assertEqual((c["h2d_copy"]["value"], c["h2d_copy"]["ceiling"]), (20e9, 50e9))
    self.assertAlmostEqual(c["h2d_copy"]["fraction"], 0.4)
    self.assertEqual((c["engine_greedy_match"]["value"], c["engine_greedy_match"]["ceiling"],
                      c["engine_greedy_match"]["fraction"]), (8, 8, 1.0))
    self.assertEqual(c["engine_greedy_match"]["max_logprob_abs_err"], 0.03)
    # Decode against the HBM roofline: batch / (step bytes / HBM bytes/s).
    self.assertAlmostEqual(c["decode_tps_b1"]["ceiling"], 1 / (3e8 / HBM))
    self.assertAlmostEqual(c["decode_tps_b32"]["fraction"], 8000.0 / (32 / (6e8 / HBM)))
    # Cake: fraction = better / Cake; judged on a device against CAKE_MIN_FRACTION.
    self.assertAlmostEqual(c["cake_vs_better"]["fraction"], 1.2)
    self.assertTrue(c["cake_vs_better"]["ok"])
    self.assertAlmostEqual(c["cake_vs_better_host"]["fraction"], 0.5)
    self.assertFalse(c["cake_vs_better_host"]["ok"])
    self.assertEqual(c["attention_b32_4k"]["setting"], {"batch": 32, "context": 4096})
    self.assertEqual(c["attention_b1_32k"]["setting"], {"batch": 1, "context": 32768})
    self.assertAlmostEqual(c["attention_b32_4k"]["fraction"], (1e12 + 4.096) / HBM)
    self.assertAlmostEqual(c["kv_decode_int8"]["fraction"], 1.5e12 / HBM)
    # rANS: the ceiling is the link (4e9 when the script states none): "times the link".
    self.assertEqual(c["rans_decode"]["ceiling"], 4e9)
    self.assertAlmostEqual(c["rans_decode"]["fraction"], 2.5)
    self.assertTrue(c["rans_decode"]["ok"])

  def test_failed_and_skipped_are_named(self):
    self.assertEqual(self.bad, [
        "kvtc_consistent_repeats (failed)", "ttft_cold_16k (failed)", "ttft_warm_16k (failed)",
        "decode_tps_b64 (failed)", "cake_vs_better_host (failed)",
        "bench_serve_quick (skipped: step bench_serve: timeout)", "kv_decode_int4 (failed)"])
    self.assertEqual(self.checks["kvtc_consistent_repeats"]["error"], "ValueError: boom")

  def test_rans_slower_than_the_link_fails_on_a_device_not_in_a_dry_run(self):
    write(self.dir, "device_check_rans.json", {
        "shape": [30, 2, 256, 192], "coded_bytes": 1000, "link_GB_per_s": 12.5,
        "results": {"pallas": {"decode_GB_per_s": 10.0, "byte_exact": True}}})
    c = dca.extract_checks(self.dir, dry=False)["rans_decode"]
    self.assertEqual((c["ceiling"], c["fraction"], c["ok"]), (12.5e9, 0.8, False))
    write(self.dir, "device_check_rans_cpu.json", json.loads(
        (self.dir / "device_check_rans.json").read_text()))
    self.assertTrue(dca.extract_checks(self.dir, dry=True)["rans_decode"]["ok"])

  def test_above_its_own_ceiling_is_a_measurement_error_on_a_device(self):
    eng = json.loads((self.dir / "device_check_engine_engine.json").read_text())
    # b1 at 2x its roofline (1 / (3e8 / HBM) = 10,000 tokens/s), b32 at 1.04x (within 5%).
    eng["results"]["decode"]["b1"]["tokens_per_s"] = 20000.0
    eng["results"]["decode"]["b32"]["tokens_per_s"] = 1.04 * 32 / (6e8 / HBM)
    write(self.dir, "device_check_engine_engine.json", eng)
    c = dca.extract_checks(self.dir, dry=False)
    self.assertFalse(c["decode_tps_b1"]["ok"])
    self.assertIn("2.00x its own ceiling", c["decode_tps_b1"]["error"])
    self.assertTrue(c["decode_tps_b32"]["ok"])
    self.assertNotIn("error", c["decode_tps_b32"])
    self.assertTrue(c["cake_vs_better"]["ok"])  # a speed-up over a baseline, not a bound
    write(self.dir, "device_check_engine_engine_cpu.json", eng)
    write(self.dir, "device_check_ceilings_cpu.json", json.loads(
        (self.dir / "device_check_ceilings.json").read_text()))
    self.assertTrue(dca.extract_checks(self.dir, dry=True)["decode_tps_b1"]["ok"])

  def test_only_the_wanted_steps_checks(self):
    checks, bad = dca.summarize({}, dca.extract_checks(self.dir, dry=False), {}, ["rans"])
    self.assertEqual((list(checks), bad), (["rans_decode"], []))

  def test_device_names(self):
    self.assertEqual(dca.device_name("NVIDIA H100 80GB HBM3", "gpu"), "h100")
    self.assertEqual(dca.device_name("NVIDIA H200", "gpu"), "h200")
    self.assertEqual(dca.device_name("cpu", "cpu"), "cpu")
    self.assertEqual(dca.device_name("TPU v6 lite", "tpu"), "tpu_v6_lite")


if __name__ == "__main__":
  absltest.main()


class GreedyMatchTest(absltest.TestCase):
  """scripts/device_check_engine.py's comparison with the CPU f32 reference: tokens must equal
  up to the reference's first near-tie (top-1 minus top-2 under the margin)."""

  @staticmethod
  def steps(tokens, margins, logprobs=None):
    logprobs = logprobs or [-1.0] * len(tokens)
    return [{"token": t, "margin": m, "logprob": lp}
            for t, m, lp in zip(tokens, margins, logprobs)]

  def compare(self, want, got):
    import device_check_engine as dce  # noqa: PLC0415
    return dce.compare_greedy({"steps": [want]}, [got], tie_margin=0.05)

  def test_equal_tokens_match_with_the_logprob_error(self):
    r = self.compare(self.steps([5, 6, 7], [1.0, 1.0, 1.0], [-1.0, -2.0, -3.0]),
                     self.steps([5, 6, 7], [1.0, 1.0, 1.0], [-1.0, -2.25, -3.0]))
    self.assertEqual((r["ok"], r["prompts_matched"], r["max_logprob_abs_err"]), (True, 1, 0.25))
    self.assertEqual(r["per_prompt"][0]["tokens_compared"], 3)

  def test_a_difference_before_any_tie_fails(self):
    r = self.compare(self.steps([5, 6, 7], [1.0, 1.0, 0.01]), self.steps([5, 9, 7], [1.0] * 3))
    self.assertFalse(r["ok"])
    self.assertEqual(r["per_prompt"][0]["first_difference"], 1)

  def test_a_difference_at_or_after_a_tie_is_allowed(self):
    for got in ([5, 9, 7], [5, 6, 9]):
      r = self.compare(self.steps([5, 6, 7], [1.0, 0.01, 1.0]), self.steps(got, [1.0] * 3))
      self.assertTrue(r["ok"], got)
      self.assertEqual(r["per_prompt"][0]["tokens_compared"], 1)
      self.assertEqual(r["per_prompt"][0]["reference_tie_at"], 1)
