"""Partial depth in the paged runner (the layer axis of Cake, docs/design/cake.md): a step begun
in layer groups stops a `SeqChunk.num_layers` piece at its group boundary k and re-packs the
rest into a smaller token bucket, on a random 4-layer tiny LLaMA.

Asserted: the other sequences' logits, K and V and pool blocks equal those of the same step
without the piece; the piece's blocks hold in layers [0, k) what a full-depth run writes and
in layers [k, L) what was there before, bit for bit; the rows each group ran and the runner's
token-layer counts are exact.
"""

import numpy as np
import pytest
from absl.testing import absltest, parameterized

from kvjax.models.loading.registry import tiny_params
from kvjax.models.nn import config
from kvjax.models.nn.llama import Llama
from kvjax.models.runner.paged_runner import PagedModelRunner
from kvjax.models.runner.runner_api import LayerCounts, PagedRunnerConfig, SeqChunk

B = 16
L = 4
CFG = config.tiny(n_layers=L)
MODEL = Llama.from_params(CFG, tiny_params(CFG, seed=3))
RUNNER_CONFIG = PagedRunnerConfig(num_blocks=64, block_size=B, chunk_sizes=(16, 32, 64),
                                  max_num_batched_tokens=128)
TOKENS = [int(t) for t in np.random.default_rng(11).integers(0, 256, 400)]

# A prefill chunk of 40 tokens from 0 (blocks 0-2), a decode at position 48 (blocks 4-7, its
# first 48 positions computed before the step), and split pieces: 32 tokens at position 32 of
# blocks 10-13 and 16 tokens at position 16 of blocks 20-21 (their prefixes computed before).
FULL = (SeqChunk(TOKENS[:40], 0, (0, 1, 2)),)
DECODE_HISTORY = SeqChunk(TOKENS[100:148], 0, (4, 5, 6, 7))
DECODE = SeqChunk(TOKENS[148:149], 48, (4, 5, 6, 7))
PIECES = ((SeqChunk(TOKENS[200:232], 0, (10, 11, 12, 13)),
           SeqChunk(TOKENS[232:264], 32, (10, 11, 12, 13))),
          (SeqChunk(TOKENS[300:316], 0, (20, 21)), SeqChunk(TOKENS[316:332], 16, (20, 21))))


def blocks_of(seq: SeqChunk) -> list[int]:
  """The blocks a sequence's tokens land in."""
  end = seq.start + len(seq.token_ids)
  return list(seq.block_ids[seq.start // B:-(-end // B)])


def rows_of(seq: SeqChunk) -> slice:
  """A sequence's positions within the rows `read_blocks(blocks_of(seq))` returns."""
  o = seq.start % B
  return slice(o, o + len(seq.token_ids))


def new_runner(split_pieces):
  """A runner with the decode's history and each split piece's prefix computed."""
  runner = PagedModelRunner(MODEL, RUNNER_CONFIG)
  runner.step([DECODE_HISTORY] + [prefix for prefix, _ in split_pieces])
  return runner


class PartialDepthTest(parameterized.TestCase):

  # Each case: groups (of L = 4 layers), each split piece's k, and whether the re-pack and the
  # outputs are numpy (the CPU backend's host outputs) or jax arrays (other platforms').
  @pytest.mark.slow  # 11 s; the fake runner's exactness: tests/unit/engine/layer_split_unit_test.py
  def test_a_split_piece_runs_its_low_layers_only_two_groups_one_piece_jax(self):
    self.check_split_piece(2, (2,), False)

  @pytest.mark.slow
  def test_a_split_piece_runs_its_low_layers_only_four_groups_two_pieces_numpy(self):
    self.check_split_piece(4, (1, 3), True)

  def check_split_piece(self, groups, ks, host_outputs):
    pieces = [(prefix, SeqChunk(p.token_ids, p.start, p.block_ids, num_layers=k))
              for (prefix, p), k in zip(PIECES, ks)]
    # Without the pieces: the reference step, then each piece at full depth on its own.
    ref = new_runner(pieces)
    want = ref.step_grouped([FULL[0], DECODE], groups)
    ref_pieces = ref.step([p for _, p in PIECES[:len(ks)]])
    # With them: the pieces between the other sequences, their blocks' high layers holding
    # a stored chunk's values already (an insert of layers [k, L) before the step).
    split = new_runner(pieces)
    split.host_outputs = host_outputs
    for (_, piece), k in zip(pieces, ks):
      high = np.random.default_rng(k).standard_normal(
          (L - k, 2, len(piece.token_ids), CFG.n_kv_heads, CFG.head_dim)).astype(np.float32)
      split.insert_chunk_layers(high, blocks_of(piece), piece.start, k)
    before = [split.read_blocks(blocks_of(p)) for _, p in pieces]
    counts = split.layer_counts()
    seqs = [FULL[0], pieces[0][1], DECODE] + [p for _, p in pieces[1:]]
    st = split.step_begin(seqs, groups)
    while st.next_group < len(st.groups):
      split.step_layers(st)
    got = split.step_finish(st)

    # The other sequences: logits, K and V rows, pool blocks as without the pieces.
    others = {0: 0, 2: 1}  # row in `seqs` -> row in the reference step
    for i, j in others.items():
      np.testing.assert_allclose(np.asarray(got.logits_SV)[i], np.asarray(want.logits_SV)[j],
                                 atol=1e-5)
      n = len(seqs[i].token_ids)
      for a, b in ((got.k_pre_rope_LTKH, want.k_pre_rope_LTKH), (got.v_LTKH, want.v_LTKH)):
        np.testing.assert_allclose(np.asarray(a)[:, got.offsets[i]:got.offsets[i] + n],
                                   np.asarray(b)[:, want.offsets[j]:want.offsets[j] + n],
                                   atol=1e-5)
      for a, b in zip(split.read_blocks(blocks_of(seqs[i])), ref.read_blocks(blocks_of(seqs[i]))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    # Each piece: layers [0, k) as at full depth, [k, L) untouched, zero logits and K, V above.
    for j, ((_, piece), k) in enumerate(zip(pieces, ks)):
      i = seqs.index(piece)
      n, o = len(piece.token_ids), got.offsets[i]
      np.testing.assert_array_equal(np.asarray(got.logits_SV)[i], 0.0)
      np.testing.assert_allclose(np.asarray(got.k_pre_rope_LTKH)[:k, o:o + n],
                                 np.asarray(ref_pieces.k_pre_rope_LTKH)[
                                     :k, ref_pieces.offsets[j]:ref_pieces.offsets[j] + n],
                                 atol=1e-5)
      np.testing.assert_array_equal(np.asarray(got.k_pre_rope_LTKH)[k:, o:o + n], 0.0)
      np.testing.assert_array_equal(np.asarray(got.v_LTKH)[k:, o:o + n], 0.0)
      after = split.read_blocks(blocks_of(piece))
      full = ref.read_blocks(blocks_of(piece))
      for a, b, c in zip(after, full, before[j]):
        rows = rows_of(piece)
        np.testing.assert_allclose(np.asarray(a)[:k, rows], np.asarray(b)[:k, rows], atol=1e-5)
        np.testing.assert_array_equal(np.asarray(a)[k:], np.asarray(c)[k:])

    # Rows per group and token-layers: exact.
    n_full = 40 + 1
    expect_rows = []
    for l0, l1 in st.groups:
      expect_rows.append((l0, l1, n_full + sum(len(p.token_ids) for _, p in pieces
                                               if p.num_layers > l0)))
    self.assertEqual(st.group_rows, expect_rows)
    self.assertEqual(st.bucket, 64)  # 41 tokens after the last piece left (128 before)
    run = sum(n * (l1 - l0) for l0, l1, n in expect_rows)
    skipped = sum(len(p.token_ids) * (L - p.num_layers) for _, p in pieces)
    self.assertEqual(run + skipped, (n_full + sum(len(p.token_ids) for _, p in pieces)) * L)
    self.assertEqual(split.layer_counts(),
                     LayerCounts(counts.token_layers_run + run,
                                 counts.token_layers_skipped + skipped))

  @pytest.mark.slow  # 16 s; the fake runner's exactness: tests/unit/engine/layer_split_unit_test.py
  def test_a_step_of_split_pieces_only_runs_nothing_above_them(self):
    prefix, p = PIECES[0]
    piece = SeqChunk(p.token_ids, p.start, p.block_ids, num_layers=2)
    ref, split = new_runner([PIECES[0]]), new_runner([PIECES[0]])
    ref.step([p])
    before = split.read_blocks(blocks_of(piece))
    st = split.step_begin([piece], 2)
    split.step_layers(st)
    split.step_layers(st)
    got = split.step_finish(st)
    self.assertEqual(st.group_rows, [(0, 2, 32), (2, 4, 0)])
    self.assertEqual(st.live, ())
    np.testing.assert_array_equal(np.asarray(got.logits_SV), 0.0)
    self.assertEqual(np.asarray(got.k_pre_rope_LTKH).shape, (L, 32, CFG.n_kv_heads,
                                                              CFG.head_dim))
    for a, b, c in zip(split.read_blocks(blocks_of(piece)), ref.read_blocks(blocks_of(piece)),
                       before):
      np.testing.assert_allclose(np.asarray(a)[:2], np.asarray(b)[:2], atol=1e-5)
      np.testing.assert_array_equal(np.asarray(a)[2:], np.asarray(c)[2:])
    del prefix

  def test_split_points_and_bad_input(self):
    runner = PagedModelRunner(MODEL, RUNNER_CONFIG)
    self.assertEqual(runner.layer_split_points(1), ())
    self.assertEqual(runner.layer_split_points(2), (2,))
    self.assertEqual(runner.layer_split_points(4), (1, 2, 3))
    piece = PIECES[0][0]
    for k, groups in ((1, 2), (3, 2), (0, 4), (5, 4)):
      with self.assertRaisesRegex(ValueError, f"num_layers={k}"):
        runner.step_begin([SeqChunk(piece.token_ids, 0, piece.block_ids, num_layers=k)], groups)
    with self.assertRaises(ValueError):
      runner.layer_split_points(5)
    # A piece of all L layers is a full forward.
    st = runner.step_begin([SeqChunk(piece.token_ids, 0, piece.block_ids, num_layers=L)], 2)
    self.assertEqual(st.stops, (L,))


if __name__ == "__main__":
  absltest.main()
