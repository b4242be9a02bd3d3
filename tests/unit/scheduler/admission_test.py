"""Exact admission plans: many short prompts at once, and short prompts beside a store hit.

Short first-token steps (`SchedulerConfig.short_first_token_steps`, rules a and b in the
scheduler's module note) cut the longer prefills of a step that carries a first token; a
prefill that ends its prompt within the step is short and goes whole, admissions included.
Frozen cost models, so every plan is hand-checkable (1 s per 16-token chunk anywhere).
"""

from absl.testing import absltest, parameterized

from kvjax.scheduler import (Candidate, CostModel, Request, SamplingParams,
                             Scheduler, SchedulerConfig, StoredChunk, StoredPrefix)
from kvjax.scheduler.kv_cache_manager import KVCacheManager
from kvjax.testing.plans import plan_steps, prefills

SIZES = (16, 32, 64, 128, 256, 512)  # LLM's default chunk sizes; the budget is the largest
C = 16


def model(bandwidth_bytes_per_s):
  return CostModel(compute_prior=(0.0, 1 / C, 0.0), learn=False,
                   bandwidth_bytes_per_s=bandwidth_bytes_per_s)


def req(rid, n, max_tokens=4, base=0):
  return Request(rid, [base + i for i in range(n)], SamplingParams(max_tokens=max_tokens,
                                                                   ignore_eos=True))


def stored(n, nbytes=100):
  """A lookup result: the first `n` store chunks held by the host tier (one raw encoding)."""
  return StoredPrefix(C, tuple(StoredChunk("host", (Candidate("raw/0", nbytes, 0),))
                               for _ in range(n)))


class ManyShortPromptsTest(parameterized.TestCase):
  """`LLM(kv_store=None, max_num_seqs=64)`'s scheduler: 64 slots, a 512-token budget, the paged
  layout; 64 prompts of 40 tokens at once, 32 tokens each."""

  @parameterized.parameters(
      dict(short_first_token_steps=True, prefill_order="shortest_first"),  # the defaults
      dict(short_first_token_steps=False, prefill_order="shortest_first"),
      dict(short_first_token_steps=True, prefill_order="fcfs"))
  def test_every_first_token_within_six_steps(self, **options):
    kvm = KVCacheManager(64 * (40 + 32) // 16 + 64, 16, namespace_root="ab" * 32)
    s = Scheduler(SchedulerConfig(num_slots=64, token_budget=512, chunk_sizes=SIZES, **options),
                  kv_cache=kvm)
    for i in range(64):  # distinct prompts: no device prefix hits
      s.add_request(req(f"r{i}", 40, max_tokens=32, base=1000 * i))
    plans = plan_steps(s, 7)
    # (admitted, first tokens, decodes, prefill tokens) per step. Step 0: 12 whole prompts and
    # 32 tokens of a 13th. Step 1: its 8 end its prompt beside 12 decodes; the queued prompts
    # of 40 each end within the step too, so they are short and go whole (12, then 12 tokens
    # left fit no chunk). The budget is what admits: 12 a step as the decodes grow, the last
    # 3 in step 5, all 64 first tokens long before the first request finishes (step 32).
    self.assertEqual([(len(p.admitted), sum(c.is_last for c in p.prefills), len(p.decodes),
                       p.num_scheduled_tokens - len(p.decodes)) for p in plans],
                     [(13, 12, 0, 512), (12, 13, 12, 488), (12, 12, 25, 480), (12, 11, 37, 472),
                      (12, 12, 48, 464), (3, 4, 60, 144), (0, 0, 64, 0)], options)
    self.assertEqual(prefills(plans[1])[:3], [("r12", 32, 8), ("r13", 0, 32), ("r13", 32, 8)])
    self.assertEqual(s.num_waiting(), 0)


class ShortPromptsBehindALongOneTest(parameterized.TestCase):
  """A cold long prompt queued ahead of short ones, while others decode (rule a for the
  queue): the long one is admitted first and leaves room for the short ones behind it."""

  @parameterized.parameters(True, False)
  def test_short_prompts_behind_a_long_one_get_their_first_tokens_in_its_first_step(
      self, short):
    s = Scheduler(SchedulerConfig(num_slots=64, token_budget=512, chunk_sizes=SIZES,
                                  short_first_token_steps=short))
    for i in range(4):
      s.add_request(req(f"d{i}", 64, max_tokens=16, base=1000 * i))
    plan_steps(s, 2)  # their prompts, then a decode step
    s.add_request(req("cold", 1024, base=9000))
    for i in range(8):
      s.add_request(req(f"s{i}", 40, base=20000 + 100 * i))
    plans = [prefills(p) for p in plan_steps(s, 2, start=2)]
    shorts = [[(f"s{i}", 0, 32), (f"s{i}", 32, 8)] for i in range(8)]
    if short:
      # 4 decodes, 320 tokens of short prompts behind: cold takes 176 of the 188 left
      # (128 + 32 + 16) and every short prompt ends its prompt in the same step, admitted in
      # queue order after it.
      self.assertEqual(plans[0], [("cold", 0, 128), ("cold", 128, 32), ("cold", 160, 16)]
                       + sum(shorts, []))
      self.assertEqual(plans[1], [("cold", 176, 256), ("cold", 432, 128), ("cold", 560, 64),
                                  ("cold", 624, 32), ("cold", 656, 16)])
    else:
      # Without the rule cold takes the step's 508 and the short prompts wait a step.
      self.assertEqual(plans[0], [("cold", 0, 256), ("cold", 256, 128), ("cold", 384, 64),
                                  ("cold", 448, 32), ("cold", 480, 16)])
      self.assertEqual(plans[1], sum(shorts, []) + [("cold", 496, 128), ("cold", 624, 32),
                                                    ("cold", 656, 16)])


class ShortPromptsBesideAStoreHitTest(absltest.TestCase):
  """The rules still cut a long cold prefill beside a hit's first token, never a short one."""

  def test_rule_a_cuts_the_long_cold_prompt_not_the_short_ones(self):
    plans = {}
    for short in (True, False):
      s = Scheduler(SchedulerConfig(num_slots=8, token_budget=128, chunk_sizes=(16, 32, 64),
                                    short_first_token_steps=short), model(1e12))
      s.add_request(req("d", 8, max_tokens=8))
      s.add_request(req("x", 66, base=500), stored(4))  # a hit: 2 new tokens once loaded
      s.add_request(req("s0", 40, base=1000))
      s.add_request(req("s1", 40, base=2000))
      s.add_request(req("L", 300, base=3000))           # a long cold prompt
      s.add_request(req("s2", 40, base=4000))
      plans[short] = [prefills(p) for p in plan_steps(s, 3)]
    # Step 0: d, s0, s1 whole, L the 32 left; x is admitted and loads. Step 1: x's chunks are
    # in and its 2-token tail goes first, its first token with the step beside 3 decodes. s2
    # (40 tokens, ending within the step) goes whole; L, 268 left, takes the step so far (5
    # tokens) again, at least a smallest chunk: 16. Without the rule L takes 80.
    step0 = [("d", 0, 8), ("s0", 0, 32), ("s0", 32, 8), ("s1", 0, 32), ("s1", 32, 8),
             ("L", 0, 32)]
    self.assertEqual(plans[True], [step0,
                                   [("x", 64, 2), ("s2", 0, 32), ("s2", 32, 8), ("L", 32, 16)],
                                   [("L", 48, 64), ("L", 112, 32), ("L", 144, 16)]])
    self.assertEqual(plans[False], [step0,
                                    [("x", 64, 2), ("s2", 0, 32), ("s2", 32, 8), ("L", 32, 64),
                                     ("L", 96, 16)],
                                    [("L", 112, 64), ("L", 176, 32), ("L", 208, 16)]])

  def test_rule_b_cuts_the_cold_prefill_and_admits_short_prompts_whole(self):
    # 160 B/s: x's four 100-byte chunks land 2.5 s after they are issued (3 at step 1, the
    # link's bandwidth-delay product; the last at step 2).
    plans = {}
    for short in (True, False):
      s = Scheduler(SchedulerConfig(num_slots=8, token_budget=64, chunk_sizes=(16, 32, 64),
                                    short_first_token_steps=short), model(160))
      s.add_request(req("a", 200))
      plan_steps(s, 1)
      s.add_request(req("x", 66, base=500), stored(4))
      s.add_request(req("s0", 20, base=1000))
      s.add_request(req("s1", 20, base=2000))
      plans[short] = [(prefills(p), p.admitted) for p in plan_steps(s, 3, start=1)]
    # Step 1: a takes 32 (2 s, the loads land at 2.5 s); s0's 20 end within the 32 the budget
    # has left: it goes whole (its first token now); s1 does not fit the 12 left. Step 2: s1
    # (fewer left than a) goes first and ends; a takes one smallest chunk (the last load lands
    # in 0.625 s). Step 3: x's tail, its first token; a takes one smallest chunk after it.
    self.assertEqual(plans[True], [
        ([("a", 64, 32), ("s0", 0, 16), ("s0", 16, 4)], ("x", "s0")),
        ([("s1", 0, 16), ("s1", 16, 4), ("a", 96, 16)], ("s1",)),
        ([("x", 64, 2), ("a", 112, 16)], ())])
    # Off: whole steps; the short prompts' first tokens wait a step for a's.
    self.assertEqual(plans[False], [
        ([("a", 64, 64)], ("x",)),
        ([("s0", 0, 16), ("s0", 16, 4), ("s1", 0, 16), ("s1", 16, 4), ("a", 128, 16)],
         ("s0", "s1")),
        ([("x", 64, 2), ("a", 144, 32), ("a", 176, 16), ("a", 192, 8)], ())])


if __name__ == "__main__":
  absltest.main()
