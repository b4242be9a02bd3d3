"""The paged runner's step outputs on the CPU backend: numpy arrays, so the engine's per-request
slicing of a step of any token count compiles nothing (eager jax slices compiled one program per
new shape: 50-150 ms each on the 2-core VM, paid by almost every step)."""

import functools

import jax
import numpy as np
from absl.testing import absltest

from kvjax.models.nn.llama import Llama
from kvjax.models.runner.paged_runner import PagedModelRunner
from kvjax.models.runner.runner_api import PagedRunnerConfig, SeqChunk
from kvjax.models.loading.registry import load_model

B = 16
TINY = load_model("tiny")
RNG = np.random.default_rng(3)
TOKENS = [int(t) for t in RNG.integers(0, 256, 60)]


@functools.cache
def runner():
  """One runner for the file: its programs compile once (each test pre-warms what it times)."""
  cfg = PagedRunnerConfig(num_blocks=32, block_size=B, chunk_sizes=(16, 32, 64),
                          max_num_batched_tokens=64)
  return PagedModelRunner(Llama.from_params(TINY.config, TINY.params), cfg)


class HostOutputsTest(absltest.TestCase):

  def test_outputs_are_numpy_trimmed_and_new_shapes_compile_nothing(self):
    self.assertEqual(jax.default_backend(), "cpu")
    r = runner()
    self.assertTrue(r.host_outputs)
    r.step([SeqChunk(TOKENS[:20], 0, [0, 1])])  # compiles the 32-token bucket
    r.read_pre_rope([0], 0, 16)  # and the one-block read
    with jax.log_compiles(True), self.assertNoLogs("jax", level="WARNING"):
      # A new token count (27) in the same bucket, two sequences, rows cut per sequence.
      out = r.step([SeqChunk((TOKENS[20],), 20, [0, 1]), SeqChunk(TOKENS[30:56], 0, [2, 3])])
      k_piece, v_piece = out.k_pre_rope_LTKH[:, 1:27], out.v_LTKH[:, 1:27]
      k_read, _ = r.read_pre_rope([2], 0, 11)
    self.assertIsInstance(out.logits_SV, np.ndarray)
    self.assertEqual(out.logits_SV.shape, (2, TINY.config.vocab_size))
    self.assertEqual(out.k_pre_rope_LTKH.shape,
                     (TINY.config.n_layers, 27, TINY.config.n_kv_heads, TINY.config.head_dim))
    self.assertEqual(out.offsets, (0, 1))
    self.assertEqual((k_piece.shape[1], v_piece.shape[1]), (26, 26))
    # The pool holds what the step computed: K read back (un-rotated) equals the step's K.
    np.testing.assert_allclose(k_read, k_piece[:, :11], rtol=1e-5, atol=1e-5)


class CopyBlocksTest(absltest.TestCase):

  def test_a_copied_block_decodes_as_the_original_bit_for_bit(self):
    """n > 1's fork: the parent's partly filled last block copied to another block; a decode
    reading the copy gives the parent's logits exactly, and only the destination changed."""
    r = runner()
    r.step([SeqChunk(TOKENS[:20], 0, [10, 11])])
    before = np.asarray(r.pool.k_LPBF).copy()
    r.copy_blocks([11], [15])
    after = np.asarray(r.pool.k_LPBF)
    np.testing.assert_array_equal(after[:, 15], before[:, 11])
    np.testing.assert_array_equal(np.delete(after, 15, axis=1), np.delete(before, 15, axis=1))
    # Parent and child decode the same token in one step (each into its own last block),
    # padded with a prefill to the 32-token bucket the step above compiled.
    out = r.step([SeqChunk((TOKENS[20],), 20, [10, 11]), SeqChunk((TOKENS[20],), 20, [10, 15]),
                  SeqChunk(TOKENS[30:56], 0, [12, 13])])
    np.testing.assert_array_equal(out.logits_SV[1], out.logits_SV[0])
    with self.assertRaises(ValueError):
      r.copy_blocks([11], [11])  # a destination that is also a source


if __name__ == "__main__":
  absltest.main()
