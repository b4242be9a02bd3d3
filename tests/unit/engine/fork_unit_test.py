"""n > 1: one prefill shared by n decodes (`Engine.add_request(fork_of=)`) on the fake runner.

The prompt is computed once (exact counts of prefill tokens and steps), choice i equals a single
request seeded with `choice_seed(seed, i)`, and the fork copies exactly the parent's partly
filled last block."""

from absl.testing import absltest, parameterized

from kvjax.scheduler import SamplingParams
from kvjax.scheduler.request import choice_params, choice_seed
from kvjax.testing import engines

N = 4


def run_forked(engine, prompt, params, n=N):
  """Adds a parent and n - 1 forks; returns (outputs in choice order, every step's plan)."""
  plans = []
  engine.add_step_observer(lambda rec: plans.append(rec.plan))
  rids = [engine.add_request(prompt, choice_params(params, 0))]
  rids += [engine.add_request(prompt, choice_params(params, i), fork_of=rids[0])
           for i in range(1, n)]
  done = {}
  while len(done) < n:
    for out in engine.step():
      if out.finished:
        done[out.request_id] = out
  return [done[r] for r in rids], plans


class ForkTest(parameterized.TestCase):

  @parameterized.named_parameters(("partial_block", 45), ("whole_blocks", 48))
  def test_n4_computes_the_prompt_once_and_equals_four_seeded_requests(self, length):
    prompt = [(7 * i + 3) % 250 + 1 for i in range(length)]
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=1234)
    engine = engines.fake_engine(enable_prefix_caching=False)
    outs, plans = run_forked(engine, prompt, params)
    prefill_tokens = sum(c.num_tokens for p in plans for c in p.prefills)
    self.assertEqual(prefill_tokens, length)  # the prompt once, not four times
    self.assertEqual(sum(1 for p in plans if p.prefills), 1)  # 45 tokens: one chunk of 64
    self.assertEqual([o.metrics.num_computed_tokens for o in outs], [length, 0, 0, 0])
    forks = [f for p in plans for f in p.forks]
    self.assertEqual([f.child_id for f in forks], [o.request_id for o in outs[1:]])
    self.assertEqual([len(f.copies) for f in forks], [1 if length % 16 else 0] * 3)
    copies = [c for c in engine.runner.calls if c[0] == "copy_blocks"]
    self.assertLen(copies, 3 if length % 16 else 0)
    # Each choice equals a single request seeded as that choice, on a fresh engine.
    single = engines.fake_engine(enable_prefix_caching=False)
    for i, out in enumerate(outs):
      alone = engines.generate(single, [prompt], choice_params(params, i))[0]
      self.assertEqual(out.token_ids, alone.token_ids, i)
      self.assertEqual(out.finish_reason, alone.finish_reason)
    self.assertGreater(len({tuple(o.token_ids) for o in outs}), 1)  # the seeds differ
    # Identical requests get identical answers.
    again, _ = run_forked(engines.fake_engine(enable_prefix_caching=False), prompt, params)
    self.assertEqual([o.token_ids for o in again], [o.token_ids for o in outs])

  def test_a_parent_loading_its_prefix_from_the_store_forks_too(self):
    """A Cake merge (load-only: every stored chunk is loaded) forks at its last computed chunk:
    the children share the loaded blocks and equal cold single requests."""
    c = 32
    prompt = [(5 * i + 1) % 250 + 1 for i in range(3 * c + 17)]
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=77, ignore_eos=True)
    engine = engines.fake_engine(kv_store=engines.memory_store_url(), kv_chunk_size=c,
                                 enable_prefix_caching=False, merge_mode="load_only")
    engines.generate(engine, [prompt[:3 * c + 1]], SamplingParams(max_tokens=1))
    engine.kv_store.flush()
    outs, plans = run_forked(engine, prompt, params)
    self.assertEqual(sum(ch.num_tokens for p in plans for ch in p.prefills), 17)
    self.assertEqual(outs[0].num_cached_tokens, 3 * c)
    self.assertEqual(sum(len(p.forks) for p in plans), N - 1)
    cold = engines.fake_engine(enable_prefix_caching=False)
    for i, out in enumerate(outs):
      alone = engines.generate(cold, [prompt], choice_params(params, i))[0]
      self.assertEqual(out.token_ids, alone.token_ids, i)
    # A child's decodes completed store chunk 3 (positions 96..128: the shared prompt rows read
    # back from the pool, then its own tokens): a follow-up of that child's sequence loads it
    # and answers as cold.
    engine.kv_store.flush()
    follow = prompt + outs[2].token_ids + [9, 8, 7]
    greedy = SamplingParams(max_tokens=4, temperature=0, logprobs=2)
    warm = engines.generate(engine, [follow], greedy)[0]
    self.assertEqual(warm.num_cached_tokens, 4 * c)
    self.assertEqual(warm.logprobs, engines.generate(cold, [follow], greedy)[0].logprobs)
    engines.close_engine(engine)

  def test_greedy_choices_are_equal_and_penalties_apply_per_choice(self):
    prompt = list(range(1, 30))
    engine = engines.fake_engine()
    outs, _ = run_forked(engine, prompt, SamplingParams(max_tokens=12, temperature=0))
    self.assertLen({tuple(o.token_ids) for o in outs}, 1)
    banned = outs[0].token_ids[0]
    outs, _ = run_forked(engine, prompt, SamplingParams(max_tokens=12, temperature=0,
                                                        logit_bias={banned: -100}))
    for o in outs:
      self.assertNotIn(banned, o.token_ids)

  def test_seeds_are_derived_per_choice(self):
    self.assertEqual(choice_seed(5, 0), 5)
    self.assertIsNone(choice_seed(None, 3))
    seeds = {choice_seed(5, i) for i in range(128)}
    self.assertLen(seeds, 128)
    self.assertTrue(all(0 <= s < 2**63 for s in seeds))

  def test_a_fork_without_a_free_slot_runs_as_an_ordinary_request(self):
    prompt = list(range(1, 40))
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=9)
    engine = engines.fake_engine(max_num_seqs=2, enable_prefix_caching=True)
    outs, plans = run_forked(engine, prompt, params)
    self.assertEqual(sum(len(p.forks) for p in plans), 1)  # one slot free at the fork
    single = engines.fake_engine(max_num_seqs=2)
    for i, out in enumerate(outs):
      alone = engines.generate(single, [prompt], choice_params(params, i))[0]
      self.assertEqual(out.token_ids, alone.token_ids, i)

  def test_forks_preempted_by_a_short_pool_recompute_and_still_equal_single_requests(self):
    """6 blocks of 16 for a 45-token prompt and 4 x 20 tokens: the children's decodes run the
    pool short, the newest are preempted and resume from the device prefix cache (one token
    each, exactly), and every choice still equals its single seeded request."""
    prompt = [(7 * i + 3) % 250 + 1 for i in range(45)]
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=3)
    engine = engines.fake_engine(num_blocks=6)
    outs, plans = run_forked(engine, prompt, params)
    self.assertEqual(sum(len(p.forks) for p in plans), N - 1)
    self.assertEqual(sum(len(p.preempted) for p in plans), 2)
    self.assertEqual(sum(c.num_tokens for p in plans for c in p.prefills), 45 + 2)
    single = engines.fake_engine()
    for i, out in enumerate(outs):
      alone = engines.generate(single, [prompt], choice_params(params, i))[0]
      self.assertEqual(out.token_ids, alone.token_ids, i)

  def test_aborting_a_waiting_fork_and_a_bad_parent(self):
    engine = engines.fake_engine()
    parent = engine.add_request([1, 2, 3], SamplingParams(max_tokens=3))
    child = engine.add_request([1, 2, 3], SamplingParams(max_tokens=3), fork_of=parent)
    engine.abort_request(child)
    with self.assertRaisesRegex(ValueError, "fork_of"):
      engine.add_request([1, 2, 4], SamplingParams(max_tokens=3), fork_of=parent)
    with self.assertRaisesRegex(ValueError, "fork_of"):
      engine.add_request([1, 2, 3], SamplingParams(max_tokens=3), fork_of="nobody")
    while engine.has_unfinished_requests():
      engine.step()


if __name__ == "__main__":
  absltest.main()
