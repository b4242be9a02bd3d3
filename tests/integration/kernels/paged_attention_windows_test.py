"""The TPU paged-attention kernel over a block table cut into windows of columns (one kernel
call each, merged by softmax statistics: how a long context's `[S, M]` table stays inside the
chip's SMEM), interpret mode: equal to the one-call kernel and the dense oracle."""

import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest, parameterized

from kvjax.kernels import paged_attention as pa
from kvjax.kernels.paged_attention import tpu as tpu_lib
from tests.integration.kernels.paged_attention_test import BS, CASES, HEADS, TOL, make_batch


class WindowedTableTest(parameterized.TestCase):

  def test_window_columns(self):
    self.assertEqual(tpu_lib._window_columns(41, 8192, 8, 128 * 1024), 3192)
    self.assertEqual(tpu_lib._window_columns(41, 2048, 8, 128 * 1024), 2048)  # fits: one call
    self.assertEqual(tpu_lib._window_columns(4, 100, 2, 3), 2)  # at least one kv step

  # The default run: each batch, head grouping and window size once (the edges with GQA in
  # windows of a few kv steps, the mixed batch in windows of one); the rest of the product is
  # `slow`.
  @parameterized.parameters(("mixed", "g1", 1), ("edges", "g3", 14))
  def test_windows_match_one_call_and_oracle(self, case, heads, entries):
    self._check_windows_match_one_call_and_oracle(case, heads, entries)

  @parameterized.parameters(("mixed", "g1", 14), ("mixed", "g3", 1), ("mixed", "g3", 14),
                            ("edges", "g1", 1), ("edges", "g1", 14), ("edges", "g3", 1))
  @pytest.mark.slow
  def test_windows_match_one_call_and_oracle_slow(self, case, heads, entries):
    self._check_windows_match_one_call_and_oracle(case, heads, entries)

  def _check_windows_match_one_call_and_oracle(self, case, heads, entries):
    args, oracle, real = make_batch(CASES[case], HEADS[heads], jnp.float32)
    s_, m_ = args[3].shape
    kw = dict(query_block=4, kv_tokens_per_step=2 * BS, interpret=True)
    whole = np.asarray(pa.paged_attention_tpu(*args, **kw))
    # entries=1: windows of one kv step (2 columns); 14: a few steps per window.
    self.assertLess(tpu_lib._window_columns(s_, m_, 2, entries), m_)
    cut = np.asarray(pa.paged_attention_tpu(*args, max_table_entries=entries, **kw))
    self.assertTrue(np.isfinite(cut).all())
    np.testing.assert_allclose(cut[real], oracle[real], **TOL["float32"])
    np.testing.assert_allclose(cut, whole, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(cut[~real], 0.0)


if __name__ == "__main__":
  absltest.main()
