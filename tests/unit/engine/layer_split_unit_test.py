"""The layer axis of Cake on the engine and the fake runner: a meeting chunk split along layers
(compute layers [0, k), load [k, L)) answers exactly as a cold run.

The planner's cost model is frozen so the split is decided the same way every run: compute
costs 1 s per 16-token chunk and a stored chunk takes 1.5 s on the link, so with chunks 0-3
stored the planner loads chunk 3 whole and splits chunk 2 at k = 1 of the fake's L = 2 layers
(done at 2.5 s against 3 s token-only; tests/unit/scheduler/layer_split_test.py has the plan).
The engine's clock is a counter, so no load turns late.
"""

import itertools

import numpy as np
from absl.testing import absltest

from kvjax import SamplingParams
from kvjax.models.runner_api import SeqChunk
from kvjax.scheduler import CostModel
from kvjax.testing import engines
from kvjax.testing.fake_runner import fake_model_config

C = 16
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, logprobs=5)
PROMPT = [int(t) for t in np.random.default_rng(7).integers(0, 256, 4 * C + 1)]


def chunk_nbytes() -> int:
  cfg = fake_model_config()
  return cfg.n_layers * 2 * C * cfg.n_kv_heads * cfg.head_dim * 4


def make_engine(store, **kw):
  return engines.fake_engine(kv_store=store, kv_chunk_size=C, max_num_seqs=2,
                             chunk_sizes=(16, 32, 64), enable_prefix_caching=False, **kw)


class LayerSplitEngineUnitTest(absltest.TestCase):

  def test_a_split_meeting_chunk_equals_the_cold_run(self):
    cold_engine = make_engine(None)
    cold = engines.generate(cold_engine, [PROMPT], PARAMS)[0]
    engines.close_engine(cold_engine)
    frozen = CostModel(compute_prior=(0.0, 1 / C, 0.0), learn=False,
                       bandwidth_bytes_per_s=chunk_nbytes() / 1.5)
    ticks = itertools.count()
    e = make_engine(engines.memory_store_url(), kv_layer_split="auto", cost_model=frozen,
                    clock=lambda: next(ticks) * 1e-3)
    first = engines.generate(e, [PROMPT], PARAMS)[0]  # nothing stored yet: computes, saves
    e.kv_store.flush()
    out = engines.generate(e, [PROMPT], PARAMS)[0]
    trace = out.metrics.merge
    self.assertEqual(trace.layer_splits, {2: 1})
    self.assertEqual((trace.chunks_computed, sorted(trace.chunks_loaded)), ([0, 1], [2, 3]))
    # Chunk 2's layer 1 was inserted alone; its layer 0 was computed.
    self.assertEqual([(c[2], c[3], c[4]) for c in e.runner.calls
                      if c[0] == "insert_chunk_layers"], [(32, 1, 1)])  # start, layer, G
    for got in (first, out):
      self.assertEqual(got.token_ids, cold.token_ids)
      self.assertEqual(got.logprobs, cold.logprobs)  # bit for bit (raw)
    self.assertEqual((out.num_cached_tokens, out.metrics.num_computed_tokens), (2 * C, 2 * C + 1))
    engines.close_engine(e)

  def test_the_fake_runner_stops_a_piece_after_its_layers(self):
    # Low layers computed, then the high layers inserted (and the other order) give the cold
    # pool and logits: the piece wrote layer 0 only.
    r0, r1 = engines.fake_runner(), engines.fake_runner()
    blocks = tuple(range(5))
    cold = r0.step([SeqChunk(PROMPT, 0, blocks)])
    k_pre, v = r0.read_pre_rope(blocks[2:3], 2 * C, C)
    high = np.stack([k_pre, v], axis=1)[1:]  # [1, 2, C, K, H]: layer 1 of chunk 2
    r1.step([SeqChunk(PROMPT[:2 * C], 0, blocks)])
    before = r1.read_blocks(blocks[2:3])
    r1.step([SeqChunk(PROMPT[2 * C:3 * C], 2 * C, blocks, num_layers=1)])
    after = r1.read_blocks(blocks[2:3])
    np.testing.assert_array_equal(before[0][1], after[0][1])  # layer 1 untouched
    r1.insert_chunks_layers([high], [blocks[2:3]], [2 * C], 1)
    warm = r1.step([SeqChunk(PROMPT[3 * C:], 3 * C, blocks)])
    np.testing.assert_array_equal(warm.logits_SV, r0.step(
        [SeqChunk(PROMPT[3 * C:], 3 * C, blocks)]).logits_SV)
    del cold
    with self.assertRaisesRegex(ValueError, "num_layers"):
      r1.step([SeqChunk(PROMPT[:C], 0, blocks, num_layers=3)])


if __name__ == "__main__":
  absltest.main()
