"""The session simulator on a hand-built 3-conversation trace: exact schedule and hit counts.

Trace (chunks of C = 4 tokens, 1 byte per token, one slot, service = 1 s per reply token, a
fixed 1 s think time; host and disk hold 2 chunks each):

  A: (4 + 4), then (4 + 1)   arrives at 0     A0 runs 0-4, saves A/0 A/1; A1 arrives at 5
  B: (4 + 4), then (4 + 1)   arrives at 0.5   B0 runs 4-8, saves B/0 B/1; B1 arrives at 9
  C: (8 + 4)                 arrives at 1     C0 runs 8-12, saves C/0 C/1 C/2
                                              A1 runs 12-13 (reads A/0 A/1), B1 13-14 (B/0 B/1)

LRU and FIFO: B's saves push A's chunks to disk, C's push them out: A1 and B1 miss everything.
Look-ahead (window 2): A1 is queued when B0 finishes, so B's saves go to disk instead of
displacing A's; C's saves find only window chunks and are rejected; when A1 runs, B's chunks
are prefetched into host: both A1 and B1 hit fully in host.
"""

import dataclasses
import json
import os
import tempfile

from absl.testing import absltest, parameterized

from kvjax.storage.tiering.placement import TierSpec
from kvjax.testing import session_sim as ss

CONVS = [ss.Conversation("A", (ss.Turn(4, 4), ss.Turn(4, 1))),
         ss.Conversation("B", (ss.Turn(4, 4), ss.Turn(4, 1))),
         ss.Conversation("C", (ss.Turn(8, 4),))]
CFG = ss.SimConfig(chunk_tokens=4, kv_bytes_per_token=1, think_time_s=1.0,
                   think_time_dist="fixed", num_slots=1, prefill_s_per_token=0.0,
                   decode_s_per_token=1.0, window=2)
TIERS = [TierSpec("host", 8), TierSpec("disk", 8)]


def schedule():
  return ss.build_schedule(CONVS, CFG, arrivals_s=[0.0, 0.5, 1.0])


class ScheduleTest(absltest.TestCase):

  def test_hand_trace(self):
    s = schedule()
    self.assertEqual(s.events, (
        (0.0, "arrive", 0), (0.0, "dispatch", 0), (0.5, "arrive", 1), (1.0, "arrive", 2),
        (4.0, "finish", 0), (4.0, "dispatch", 1), (5.0, "arrive", 3), (8.0, "finish", 1),
        (8.0, "dispatch", 2), (9.0, "arrive", 4), (12.0, "finish", 2), (12.0, "dispatch", 3),
        (13.0, "finish", 3), (13.0, "dispatch", 4), (14.0, "finish", 4)))
    self.assertEqual([(r.conv, r.turn, r.history_tokens) for r in s.requests],
                     [(0, 0, 0), (1, 0, 0), (2, 0, 0), (0, 1, 8), (1, 1, 8)])
    self.assertEqual(s.requests[3], ss.Request(conv=0, turn=1, history_tokens=8, prompt_tokens=4,
                                               reply_tokens=1, arrival_s=5.0, dispatch_s=12.0,
                                               finish_s=13.0))
    # Waits 0, 3.5, 7, 7, 4; queue-length area 21.5 over 14 s; the slot is never idle. A, B and
    # C are in progress 13 + 13.5 + 11 s; A's 8 finished tokens are live from 4 to 13, B's from
    # 8 to 14, C's never (its only turn is its last).
    self.assertEqual(s.summary(), {
        "duration_s": 14.0, "mean_wait_s": 4.3, "p90_wait_s": 7.0, "waited_fraction": 0.8,
        "mean_queue_len": 21.5 / 14, "max_queue_len": 2, "utilization": 1.0,
        "mean_active_conversations": 37.5 / 14, "mean_live_kv_tokens": (8 * 9 + 8 * 6) / 14,
        "requests": 5})

  def test_poisson_arrivals_are_seeded(self):
    cfg = dataclasses.replace(CFG, think_time_dist="exponential", num_slots=4)
    a, b = ss.build_schedule(CONVS, cfg), ss.build_schedule(CONVS, cfg)
    self.assertEqual(a, b)
    c = ss.build_schedule(CONVS, dataclasses.replace(cfg, seed=1))
    self.assertNotEqual(a.events, c.events)
    firsts = sorted(r.arrival_s for r in a.requests if r.turn == 0)
    self.assertLess(0.0, firsts[0])

  def test_fixed_think_time(self):
    s = ss.build_schedule(CONVS, dataclasses.replace(CFG, num_slots=3), arrivals_s=[0, 0, 0])
    a0, a1 = (r for r in s.requests if r.conv == 0)
    self.assertEqual(a1.arrival_s, a0.finish_s + 1.0)

  def test_errors(self):
    with self.assertRaisesRegex(ValueError, "think_time_dist"):
      ss.SimConfig(think_time_dist="pareto")
    with self.assertRaisesRegex(ValueError, "num_slots"):
      ss.SimConfig(num_slots=0)
    with self.assertRaisesRegex(ValueError, "2 arrival times for 3"):
      ss.build_schedule(CONVS, CFG, arrivals_s=[0, 1])
    with self.assertRaisesRegex(ValueError, "no turns"):
      ss.build_schedule([ss.Conversation("x", ())], CFG, arrivals_s=[0])


class HitsTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("lookahead", "lookahead", 2, 2, 16, {"host": 16, "disk": 0}, 4, 2),
      ("lookahead_no_window", "lookahead", 0, 0, 0, {"host": 0, "disk": 0}, 0, 0),
      ("lru", "lru", 2, 0, 0, {"host": 0, "disk": 0}, 0, 0),
      ("fifo", "fifo", 2, 0, 0, {"host": 0, "disk": 0}, 0, 0),
      ("none", "none", 2, 0, 0, {"host": 0, "disk": 0}, 13, 0),
  )
  def test_hand_trace(self, policy, window, full, hit, by_tier, rejected, prefetched):
    res = ss.simulate(CONVS, schedule(), policy, TIERS, dataclasses.replace(CFG, window=window))
    self.assertEqual((res.turns, res.turns_with_history, res.history_tokens, res.chunk_tokens),
                     (5, 2, 16, 16))
    self.assertEqual((res.turns_full_hit, res.hit_tokens, res.hit_tokens_any), (full, hit, hit))
    self.assertEqual(res.hit_tokens_by_tier, by_tier)
    self.assertEqual(res.placement["rejected_saves"], rejected)
    self.assertEqual(res.placement["prefetches_issued"], prefetched)
    self.assertEqual(res.window, window)
    d = res.to_dict()
    self.assertEqual((d["token_hit_rate"], d["turn_hit_rate"]), (hit / 16, full / 2))

  def test_link_budget_zero_keeps_hits_on_disk(self):
    # No prefetch: B's chunks are still on disk when B1 runs; its access promotes them.
    cfg = dataclasses.replace(CFG, prefetch_bytes_per_s=0.0)
    res = ss.simulate(CONVS, schedule(), "lookahead", TIERS, cfg)
    self.assertEqual((res.turns_full_hit, res.hit_tokens), (2, 16))
    self.assertEqual(res.hit_tokens_by_tier, {"host": 8, "disk": 8})
    self.assertEqual((res.placement["prefetches_issued"], res.placement["promotions"]), (0, 2))

  def test_unbounded_store_hits_every_full_chunk(self):
    res = ss.simulate(CONVS, schedule(), "lru", [TierSpec("remote", None)], CFG)
    self.assertEqual((res.turns_full_hit, res.hit_tokens), (2, 16))

  def test_partial_chunks_are_history_but_not_cacheable(self):
    convs = [ss.Conversation("p", (ss.Turn(3, 3), ss.Turn(1, 1)))]  # history 6: 1 chunk + 2
    s = ss.build_schedule(convs, CFG, arrivals_s=[0])
    res = ss.simulate(convs, s, "lru", TIERS, CFG)
    self.assertEqual((res.history_tokens, res.chunk_tokens, res.hit_tokens), (6, 4, 4))

  def test_footprint(self):
    self.assertEqual(ss.footprint_bytes(CONVS, 10), (8 + 5 + 8 + 5 + 12) * 10)
    self.assertEqual(ss.SMOLLM2_BF16_KV_BYTES_PER_TOKEN, 23040)


class ShareGPTTest(absltest.TestCase):

  def test_load(self):
    data = [
        {"id": "x", "conversations": [{"from": "human", "value": "a b"},
                                      {"from": "gpt", "value": "c d e"},
                                      {"from": "human", "value": "f"}]},  # trailing: dropped
        {"id": "y", "conversations": [{"from": "human", "value": "only"}]},  # no round
        {"id": "z", "conversations": [{"from": "human", "value": "g"},
                                      {"from": "gpt", "value": "h"},
                                      {"from": "human", "value": "i j k"},
                                      {"from": "gpt", "value": "l m"}]},
    ]
    path = os.path.join(tempfile.mkdtemp(), "t.json")
    with open(path, "w") as f:
      json.dump(data, f)
    count = lambda role, text: len(text.split()) + (10 if role == "user" else 20)  # noqa: E731
    convs = ss.load_sharegpt(path, count, system_tokens=5)
    self.assertEqual(convs, [
        ss.Conversation("x", (ss.Turn(5 + 12, 23),)),
        ss.Conversation("z", (ss.Turn(5 + 11, 21), ss.Turn(13, 22)))])
    self.assertLen(ss.load_sharegpt(path, count, limit=1), 1)
    data[0]["conversations"][1]["from"] = "human"
    with open(path, "w") as f:
      json.dump(data, f)
    with self.assertRaisesRegex(ValueError, "does not alternate"):
      ss.load_sharegpt(path, count)

  def test_smollm2_counts_equal_the_chat_template(self):
    try:
      count, system = ss.smollm2_token_counter()
    except FileNotFoundError as e:
      raise absltest.SkipTest(str(e))
    from kvjax.testing import tokenizers  # noqa: PLC0415
    tok = tokenizers.smollm2_tokenizer()
    msgs = [{"role": "user", "content": "What is 12 + 30?\n\n  Think."},
            {"role": "assistant", "content": "It is 42.<|im_end|> (literal text)"},
            {"role": "user", "content": "naïve café 🤗"},
            {"role": "assistant", "content": "ok"}]
    self.assertEqual(system + sum(count(m["role"], m["content"]) for m in msgs),
                     len(tok.encode_chat(msgs, add_generation_prompt=False)))


if __name__ == "__main__":
  absltest.main()
