"""Exact step plans from the token-budget scheduler."""

from absl.testing import absltest, parameterized

from kvjax.scheduler import (DecodeItem, PrefillChunk, Request, RequestStatus, SamplingParams,
                             Scheduler, SchedulerConfig, StepResult, chunk_tokens)
from kvjax.scheduler.kv_cache_manager import KVCacheManager
from kvjax.scheduler.level_policy import Candidate
from kvjax.scheduler.output import StoredChunk, StoredPrefix
from kvjax.scheduler.config import LoadConfig

SIZES = (16, 32, 64, 128, 256, 512)


def req(rid, n):
  return Request(rid, list(range(n)), SamplingParams(max_tokens=4))


class ChunkTokensTest(parameterized.TestCase):

  @parameterized.parameters(
      (300, 512, 256),   # largest compiled size under the prompt's remainder
      (44, 512, 32),
      (12, 512, 12),     # a tail shorter than the smallest size is taken whole (padded)
      (1000, 512, 512),
      (1000, 100, 64),   # the budget caps the chunk
      (1000, 10, 0),     # nothing compiled fits the budget and the prompt is longer
      (10, 10, 10),
      (0, 512, 0),
  )
  def test_chunk_tokens(self, remaining, budget, want):
    self.assertEqual(chunk_tokens(remaining, budget, SIZES), want)


class SchedulerTest(absltest.TestCase):

  def test_prompt_is_split_into_compiled_sizes_then_decodes(self):
    s = Scheduler(SchedulerConfig(num_slots=2, token_budget=512, chunk_sizes=SIZES))
    r = req("a", 300)
    s.add_request(r)
    plan = s.schedule()
    self.assertEqual(plan.prefills, (PrefillChunk("a", 0, 0, 256, False),
                                     PrefillChunk("a", 0, 256, 32, False),
                                     PrefillChunk("a", 0, 288, 12, True)))
    self.assertEqual(plan.decodes, ())
    self.assertIs(r.status, RequestStatus.DECODING)
    r.output_token_ids.append(7)
    plan = s.schedule()
    self.assertEqual(plan.decodes, (DecodeItem("a", 0, 300, 7),))
    self.assertEqual(plan.prefills, ())
    self.assertEqual(r.num_computed_tokens, 301)

  def test_decodes_first_then_ongoing_prefill_then_admission(self):
    # First come first served (`PrefillOrderTest` covers the default, shortest first).
    s = Scheduler(SchedulerConfig(num_slots=3, token_budget=100, chunk_sizes=SIZES,
                                  prefill_order="fcfs"))
    a, b, c = req("a", 10), req("b", 200), req("c", 40)
    for r in (a, b, c):
      s.add_request(r)
    plan = s.schedule()
    # a takes its whole 10-token prompt; b takes compiled sizes from the remaining 90 (64 + 16);
    # the 10 left fit no chunk of c's 40-token prompt, so c waits.
    self.assertEqual(plan.prefills, (PrefillChunk("a", 0, 0, 10, True),
                                     PrefillChunk("b", 1, 0, 64, False),
                                     PrefillChunk("b", 1, 64, 16, False)))
    self.assertEqual(list(s.waiting), [c])
    self.assertEqual(plan.admitted, ("a", "b"))  # c waits: not scheduled yet
    a.output_token_ids.append(1)
    plan = s.schedule()
    self.assertEqual(plan.decodes, (DecodeItem("a", 0, 10, 1),))
    self.assertEqual(plan.admitted, ())
    self.assertEqual(plan.prefills, (PrefillChunk("b", 1, 80, 64, False),
                                     PrefillChunk("b", 1, 144, 32, False)))
    self.assertEqual(plan.num_scheduled_tokens, 97)
    a.output_token_ids.append(2)
    plan = s.schedule()
    self.assertEqual(plan.prefills, (PrefillChunk("b", 1, 176, 16, False),
                                     PrefillChunk("b", 1, 192, 8, True),
                                     PrefillChunk("c", 2, 0, 64 // 2, False),
                                     PrefillChunk("c", 2, 32, 8, True)))
    self.assertEqual(plan.num_scheduled_tokens, 1 + 16 + 8 + 32 + 8)
    self.assertEqual(plan.admitted, ("c",))

  def test_finish_frees_slot_for_waiting_request(self):
    s = Scheduler(SchedulerConfig(num_slots=1, token_budget=64, chunk_sizes=SIZES))
    a, b = req("a", 8), req("b", 8)
    s.add_request(a)
    s.add_request(b)
    self.assertEqual(s.schedule().prefills, (PrefillChunk("a", 0, 0, 8, True),))
    self.assertEqual(list(s.waiting), [b])
    self.assertIs(s.finish_request("a", "length"), a)
    self.assertEqual((a.status, a.finish_reason, a.slot), (RequestStatus.FINISHED, "length", None))
    plan = s.schedule()
    self.assertEqual((plan.prefills, plan.admitted), ((PrefillChunk("b", 0, 0, 8, True),), ("b",)))
    self.assertIsNone(s.finish_request("zzz", "abort"))

  def test_budget_below_the_smallest_chunk_is_rejected(self):
    with self.assertRaisesRegex(ValueError, "token_budget=8 is below"):
      SchedulerConfig(num_slots=1, token_budget=8, chunk_sizes=SIZES)

  def test_abort_waiting_request_and_duplicate_ids(self):
    s = Scheduler(SchedulerConfig(num_slots=1, token_budget=64, chunk_sizes=SIZES))
    s.add_request(req("a", 8))
    with self.assertRaisesRegex(ValueError, "already scheduled"):
      s.add_request(req("a", 8))
    self.assertEqual(s.finish_request("a", "abort").finish_reason, "abort")
    self.assertFalse(s.has_unfinished())
    self.assertTrue(s.schedule().is_empty)


def run_steps(s, steps, now=False):
  """Plans `steps` steps; returns each step's prefills as (request id, start, tokens). A request
  whose last prefill chunk (or a decode) was planned samples token 1."""
  out = []
  for k in range(steps):
    plan = s.schedule(now_s=float(k) if now else None)
    out.append([(c.request_id, c.start, c.num_tokens) for c in plan.prefills])
    s.update(StepResult(now_s=k + 0.5, sampled=tuple(
        (c.request_id, 1) for c in plan.prefills if c.is_last) + tuple(
        (d.request_id, 1) for d in plan.decodes)))
  return out


class LongPrefillThresholdTest(absltest.TestCase):
  """vLLM's `long_prefill_token_threshold`: one request's prefill takes at most T tokens a step."""

  def sched(self, threshold, budget=512, order="shortest_first", **kw):
    return Scheduler(SchedulerConfig(num_slots=4, token_budget=budget, chunk_sizes=SIZES,
                                     long_prefill_token_threshold=threshold,
                                     prefill_order=order), **kw)

  def test_a_long_prefill_leaves_the_rest_of_the_budget_to_a_later_one(self):
    plans = {}
    for t in (0, 256):
      s = self.sched(t, order="fcfs")  # shortest first would admit b before a's second step
      s.add_request(req("a", 1000))
      s.add_request(req("b", 300))
      plans[t] = run_steps(s, 4)
    # Off: a takes the whole budget until its last step; b gets the 24 tokens that step leaves.
    self.assertEqual(plans[0], [[("a", 0, 512)],
                                [("a", 512, 256), ("a", 768, 128), ("a", 896, 64),
                                 ("a", 960, 32), ("a", 992, 8), ("b", 0, 16)],
                                [("b", 16, 256), ("b", 272, 16), ("b", 288, 12)],
                                []])
    # 256: a takes 256 a step; b is admitted in the first step with the other 256 and, its 44
    # left under the threshold, ends in the second (a's decodes take one token from then on).
    self.assertEqual(plans[256], [[("a", 0, 256), ("b", 0, 256)],
                                  [("a", 256, 256), ("b", 256, 32), ("b", 288, 12)],
                                  [("a", 512, 256)],
                                  [("a", 768, 128), ("a", 896, 64), ("a", 960, 32),
                                   ("a", 992, 8)]])

  def test_not_a_compiled_size_and_a_prefill_under_it(self):
    s = self.sched(200, budget=512)
    s.add_request(req("a", 400))
    s.add_request(req("b", 150))
    # 200 is no compiled size: a takes 128 + 64 (at most 200); b's 150 is under the threshold:
    # it is not limited (128 + 16 + a padded 6-token tail).
    self.assertEqual(run_steps(s, 1), [[("a", 0, 128), ("a", 128, 64), ("b", 0, 128),
                                        ("b", 128, 16), ("b", 144, 6)]])

  def test_paged_admission_allocates_the_capped_first_chunk(self):
    kvm = KVCacheManager(64, 16, namespace_root="ab" * 32)
    s = self.sched(128, kv_cache=kvm)
    s.add_request(req("a", 1000))
    self.assertEqual(run_steps(s, 1), [[("a", 0, 128)]])
    self.assertLen(kvm.block_table("a"), 128 // 16)  # not the 512 the budget would fit
    self.assertEqual(run_steps(s, 1), [[("a", 128, 128)]])
    self.assertLen(kvm.block_table("a"), 256 // 16)

  def test_consistent_mode_takes_one_store_chunk_per_request_a_step(self):
    # Whatever the threshold (below a store chunk, two chunks, off): a step runs its tokens in
    # one ragged call, where a second chunk of the request would attend to the first one's KV
    # before its round trip through the codec.
    for t, want in ((16, [("a", 0, 64)]), (128, [("a", 0, 64)]), (100, [("a", 0, 64)]),
                    (0, [("a", 0, 64)])):
      s = self.sched(t, save_chunk_size=64, consistent=True)
      s.add_request(req("a", 300))
      self.assertEqual(run_steps(s, 1), [want], t)

  def test_bad_thresholds(self):
    for bad in (-1, 1.5, True, "8"):
      with self.assertRaisesRegex(ValueError, "long_prefill_token_threshold=.* must be an int"):
        SchedulerConfig(chunk_sizes=SIZES, long_prefill_token_threshold=bad)
    with self.assertRaisesRegex(ValueError, "long_prefill_token_threshold=8 is below"):
      SchedulerConfig(chunk_sizes=SIZES, long_prefill_token_threshold=8)
    self.assertEqual(SchedulerConfig().long_prefill_token_threshold, 0)  # off by default


class SamplingParamsTest(parameterized.TestCase):

  @parameterized.parameters(
      dict(max_tokens=0), dict(max_tokens=-3), dict(max_tokens=2.5), dict(temperature=-1.0),
      dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2), dict(logprobs=21), dict(stop=[""]),
      dict(stop=[3]), dict(seed="x"), dict(max_tokens=True))
  def test_bad_values_raise_and_name_the_field(self, **kwargs):
    with self.assertRaisesRegex(ValueError, list(kwargs)[0]):
      SamplingParams(**kwargs)

  def test_stop_string_is_normalised_to_tuple(self):
    self.assertEqual(SamplingParams(stop="\n").stop, ("\n",))
    self.assertEqual(SamplingParams().stop, ())


class PrefillOrderTest(absltest.TestCase):
  """`SchedulerConfig.prefill_order`: a short request queued behind a long prefill."""

  def plans(self, order, kv_cache=None):
    s = Scheduler(SchedulerConfig(num_slots=4, token_budget=64, chunk_sizes=(16, 32, 64),
                                  prefill_order=order), kv_cache=kv_cache)
    if kv_cache is not None:  # a finished request leaves 64 tokens' blocks on the device
      s.add_request(Request("d0", list(range(500, 564)), SamplingParams(max_tokens=4)))
      run_steps(s, 1)
      s.finish_request("d0", "stop")
    s.add_request(req("a", 200))
    first = run_steps(s, 1)
    # 64 tokens on the device (with a block manager) or not (without), then 8 new ones.
    s.add_request(Request("d1", list(range(500, 564)) + [9] * 8, SamplingParams(max_tokens=4)))
    plan = s.schedule()
    return s, first, plan

  def test_a_device_hit_is_admitted_and_computed_ahead_of_a_cold_prompt(self):
    kvm = KVCacheManager(64, 16, namespace_root="ab" * 32)
    s, first, plan = self.plans("shortest_first", kvm)
    self.assertEqual(first, [[("a", 0, 64)]])
    # d1 has 8 tokens left past its 64 on the device, a 136: d1 is admitted and goes first; its
    # first token comes with the step, so a takes one smallest chunk (short first-token steps).
    self.assertEqual([(c.request_id, c.start, c.num_tokens) for c in plan.prefills],
                     [("d1", 64, 8), ("a", 64, 16)])
    self.assertEqual((plan.admitted, plan.device_hits), (("d1",), (("d1", 64),)))
    self.assertEqual(s.num_waiting(), 0)

  def test_one_admitted_early_then_preempted_by_a_longer_prefills_blocks_is_queued_again(self):
    kvm = KVCacheManager(7, 16, namespace_root="ab" * 32)  # 112 tokens in all
    # Short first-token steps off: d ending would leave a only 16 tokens, which fit the pool.
    s = Scheduler(SchedulerConfig(num_slots=4, token_budget=64, chunk_sizes=(16, 32, 64),
                                  short_first_token_steps=False), kv_cache=kvm)
    one = SamplingParams(max_tokens=1)
    s.add_request(Request("a", list(range(100)), one))
    self.assertEqual(run_steps(s, 1), [[("a", 0, 64)]])  # 4 blocks
    s.add_request(Request("d", list(range(30)), one))
    plan = s.schedule()
    # d (30 left) goes before a (36 left) and takes free blocks; a's next 32 need 2 more than
    # are left, so d, the newest, is preempted and queued again, nothing of it in the plan;
    # a's whole rest fits the budget d's planned tokens left.
    self.assertEqual([(c.request_id, c.start, c.num_tokens) for c in plan.prefills],
                     [("a", 64, 32), ("a", 96, 4)])
    self.assertEqual((plan.preempted, plan.admitted, plan.device_hits), (("d",), (), ()))
    self.assertEqual([r.request_id for r in s.waiting], ["d"])
    self.assertEqual([rid for rid, _ in plan.block_tables], ["a"])
    self.assertLen(kvm.block_table("a"), 7)  # its 100 tokens

  def test_queued_requests_keep_their_order(self):
    s = Scheduler(SchedulerConfig(num_slots=4, token_budget=64, chunk_sizes=(16, 32, 64)))
    s.add_request(req("a", 300))
    run_steps(s, 1)
    s.add_request(req("b", 40))  # fewer left than a's 236, as is c, behind it with fewer still
    s.add_request(req("c", 10))
    plan = s.schedule()
    # b and c both go before a, in queue order (c never passes b); the 14 left fit no chunk.
    self.assertEqual([(c.request_id, c.start, c.num_tokens) for c in plan.prefills],
                     [("b", 0, 32), ("b", 32, 8), ("c", 0, 10)])
    self.assertEqual(plan.admitted, ("b", "c"))

  def test_fcfs_admits_it_only_with_budget_left(self):
    kvm = KVCacheManager(64, 16, namespace_root="ab" * 32)
    s, _, plan = self.plans("fcfs", kvm)
    self.assertEqual([(c.request_id, c.start, c.num_tokens) for c in plan.prefills],
                     [("a", 64, 64)])
    self.assertEqual((plan.admitted, s.num_waiting()), ((), 1))

  def test_without_a_device_cache_a_short_cold_prompt_goes_first(self):
    # No device cache: d1 has all 72 tokens left, a 136: d1 first, a gets nothing that fits.
    _, _, plan = self.plans("shortest_first")
    self.assertEqual([(c.request_id, c.start, c.num_tokens) for c in plan.prefills],
                     [("d1", 0, 64)])
    self.assertEqual(plan.admitted, ("d1",))


class LookaheadWindowTest(absltest.TestCase):

  def stored(self, n):
    return StoredPrefix(16, tuple(StoredChunk("disk", (Candidate("raw/0", 100, 0),))
                                  for _ in range(n)))

  def test_window_lists_prefilling_merges_then_waiting_requests_with_stored_chunks(self):
    s = Scheduler(SchedulerConfig(num_slots=1, token_budget=64, chunk_sizes=SIZES),
                  load_config=LoadConfig(lookahead_window=2, merge_mode="load_only"),
                  save_chunk_size=16)
    s.add_request(req("a", 70), self.stored(4))   # runs (its merge loads)
    s.add_request(req("b", 70))                   # nothing stored: not in the window
    s.add_request(req("c", 70), self.stored(2))
    s.add_request(req("d", 70), self.stored(2))
    s.add_request(req("e", 70), self.stored(2))   # beyond the window of 2
    self.assertEqual(s.schedule(now_s=0.0).lookahead, ("a", "c", "d"))
    s.finish_request("a", "abort")
    s.finish_request("c", "abort")
    self.assertEqual(s.schedule(now_s=1.0).lookahead[-2:], ("d", "e"))

  def test_window_zero_is_off(self):
    s = Scheduler(SchedulerConfig(num_slots=1, token_budget=64, chunk_sizes=SIZES),
                  save_chunk_size=16)
    s.add_request(req("a", 70), self.stored(4))
    s.add_request(req("c", 70), self.stored(2))
    self.assertEqual(s.schedule(now_s=0.0).lookahead, ())

  def test_negative_window_is_rejected(self):
    with self.assertRaisesRegex(ValueError, "lookahead_window"):
      LoadConfig(lookahead_window=-1)


if __name__ == "__main__":
  absltest.main()
