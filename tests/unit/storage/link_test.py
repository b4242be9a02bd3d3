"""Exact waiting times of the link limiter under a fake clock (no real sleeps)."""

import asyncio
import math

from absl.testing import absltest, parameterized

from kvjax.storage.backends.link import LinkLimiter, gbps, load_trace, mbps, validate_trace


class FakeClock:
  """Virtual time: `sleep` yields once to the loop, then moves the clock to its deadline."""

  def __init__(self, now=100.0):
    self.now = now
    self.sleeps = []

  def __call__(self):
    return self.now

  async def sleep(self, dt):
    self.sleeps.append(dt)
    deadline = self.now + dt
    await asyncio.sleep(0)
    self.now = max(self.now, deadline)

  def blocking_sleep(self, dt):
    self.sleeps.append(dt)
    self.now += dt


def limiter(clock, *args, **kwargs):
  return LinkLimiter(*args, clock=clock, sleep=clock.sleep, blocking_sleep=clock.blocking_sleep,
                     **kwargs)


class UnitsTest(absltest.TestCase):

  def test_gbps_and_mbps(self):
    self.assertEqual(gbps(100), 12.5e9)
    self.assertEqual(gbps(7), 875e6)
    self.assertEqual(gbps(56), 7e9)
    self.assertEqual(mbps(8), 1e6)


class ConstantRateTest(parameterized.TestCase):

  @parameterized.parameters(
      (1000.0, 500, 0.5),
      (4096.0, 8192, 2.0),           # a few KB/s
      (gbps(100), 12_500_000, 1e-3),  # 100 Gbps
      (gbps(7), 875_000_000, 1.0),
  )
  def test_single_acquire_waits_n_over_rate(self, rate, nbytes, want_s):
    clock = FakeClock()
    lim = limiter(clock, rate)
    asyncio.run(lim.acquire(nbytes))
    self.assertLen(clock.sleeps, 1)
    self.assertAlmostEqual(clock.sleeps[0], want_s, places=12)
    self.assertAlmostEqual(clock.now, 100.0 + want_s, places=9)
    self.assertEqual(lim.bytes_granted, nbytes)

  def test_back_to_back_requests_queue_and_idle_time_is_not_banked(self):
    clock = FakeClock()
    lim = limiter(clock, 1000.0)

    async def run():
      await lim.acquire(1000)     # 100 -> 101
      clock.now = 105.0           # idle 4 s: no burst allowance by default
      await lim.acquire(250)      # 105 -> 105.25
      await lim.acquire(0)        # free
    asyncio.run(run())
    self.assertEqual(clock.sleeps, [1.0, 0.25])
    self.assertEqual(clock.now, 105.25)
    self.assertEqual(lim.bytes_granted, 1250)

  def test_burst_is_spent_first_then_refills_while_idle(self):
    clock = FakeClock()
    lim = limiter(clock, 1000.0, burst_bytes=500)

    async def run():
      await lim.acquire(400)      # from the full bucket: no wait, 100 left
      await lim.acquire(600)      # 100 from the bucket, 500 paced: 0.5 s
      clock.now = 100.5 + 0.3     # idle 0.3 s: 300 bytes refill
      await lim.acquire(400)      # 300 from the bucket, 100 paced: 0.1 s
      clock.now += 10.0           # refill caps at 500
      await lim.acquire(1500)     # 500 from the bucket, 1000 paced: 1 s
    asyncio.run(run())
    self.assertLen(clock.sleeps, 3)
    for got, want in zip(clock.sleeps, [0.5, 0.1, 1.0]):
      self.assertAlmostEqual(got, want, places=12)

  def test_blocking_acquire_paces_like_async(self):
    clock = FakeClock()
    lim = limiter(clock, 2000.0)
    lim.acquire_blocking(1000)
    lim.acquire_blocking(3000)
    self.assertEqual(clock.sleeps, [0.5, 1.5])
    self.assertEqual(clock.now, 102.0)
    self.assertEqual(lim.bytes_granted, 4000)

  def test_reserved_pieces_go_back_to_back_whatever_the_caller_does_between(self):
    # A copy engine's queue: pieces booked together keep the pipe busy, so the time the caller
    # spends between them (putting a piece on the device) is not added to the link's.
    clock = FakeClock()
    lim = limiter(clock, 2000.0)
    d1, d2 = lim.reserve(1000), lim.reserve(3000)
    self.assertEqual((d1, d2), (100.5, 102.0))
    clock.now += 0.2
    lim.wait_reserved(d1, 1000)
    self.assertEqual(clock.now, 100.5)
    clock.now += 0.4                    # the caller's work after the first piece
    lim.wait_reserved(d2, 3000)
    self.assertEqual(clock.now, 102.0)  # acquire_blocking one by one would end at 102.4
    for got, want in zip(clock.sleeps, [0.3, 1.1]):
      self.assertAlmostEqual(got, want, places=12)
    self.assertEqual(lim.bytes_granted, 4000)
    clock.now = 103.0
    lim.wait_reserved(lim.reserve(1000), 1000)  # idle since 102: from now, no backlog
    self.assertEqual(clock.now, 103.5)
    with self.assertRaises(ValueError):
      lim.reserve(-1)

  def test_negative_bytes_raise(self):
    lim = limiter(FakeClock(), 1000.0)
    with self.assertRaisesRegex(ValueError, "nbytes"):
      asyncio.run(lim.acquire(-1))


class UnlimitedTest(parameterized.TestCase):

  @parameterized.parameters(None, math.inf)
  def test_never_waits(self, rate):
    clock = FakeClock()
    lim = limiter(clock, rate)
    self.assertTrue(lim.unlimited)
    asyncio.run(lim.acquire(10**15))
    lim.acquire_blocking(10**15)
    self.assertEqual(clock.sleeps, [])
    self.assertEqual(lim.bytes_granted, 2 * 10**15)
    self.assertEqual(lim.current_rate(), math.inf)

  @parameterized.parameters(0, -5.0, math.nan)
  def test_bad_constant_rate_raises(self, rate):
    with self.assertRaisesRegex(ValueError, "positive"):
      LinkLimiter(rate)

  def test_rate_and_trace_together_raise(self):
    with self.assertRaisesRegex(ValueError, "not both"):
      LinkLimiter(1000.0, trace=[(0, 1000.0)])


class TraceTest(absltest.TestCase):

  def test_current_rate_follows_steps_relative_to_start(self):
    clock = FakeClock(now=50.0)
    lim = limiter(clock, trace=[(0, 1000.0), (2, 4000.0), (5, 500.0)])
    self.assertEqual(lim.current_rate(), 1000.0)
    self.assertEqual(lim.current_rate(51.999), 1000.0)
    self.assertEqual(lim.current_rate(52.0), 4000.0)
    self.assertEqual(lim.current_rate(56.0), 500.0)
    self.assertEqual(lim.current_rate(1e6), 500.0)  # the last step holds

  def test_transfer_spanning_rate_changes(self):
    clock = FakeClock(now=0.0)
    lim = limiter(clock, trace=[(0, 1000.0), (2, 4000.0), (5, 500.0)])

    async def run():
      clock.now = 1.0
      # 1000 bytes in [1, 2) at 1000/s, then 12000 in [2, 5) at 4000/s, then 500 at 500/s.
      await lim.acquire(13_500)
    asyncio.run(run())
    self.assertEqual(clock.sleeps, [5.0])
    self.assertEqual(clock.now, 6.0)
    self.assertEqual(lim.transfer_time(1000, start_s=1.5), 0.625)  # 500 at 1000/s + 500 at 4000/s

  def test_link_down_step_waits_it_out(self):
    clock = FakeClock(now=0.0)
    lim = limiter(clock, trace=[(0, 100.0), (1, 0.0), (3, 100.0)])
    asyncio.run(lim.acquire(150))  # 100 in [0, 1), nothing in [1, 3), 50 in [3, 3.5)
    self.assertEqual(clock.sleeps, [3.5])

  def test_infinite_step_is_instant(self):
    clock = FakeClock(now=0.0)
    lim = limiter(clock, trace=[(0, 100.0), (1, math.inf), (2, 100.0)])
    self.assertEqual(lim.transfer_time(10**9, start_s=0.5), 0.5)

  def test_invalid_traces(self):
    for trace, pattern in [
        ([], "at least one"),
        ([(1, 100.0)], "start at t=0"),
        ([(0, 100.0), (0, 200.0)], "not after"),
        ([(0, 100.0), (2, 200.0), (1, 300.0)], "not after"),
        ([(0, -1.0)], ">= 0"),
        ([(0, 100.0), (1, 0.0)], "last step"),
        ([(0, 100.0), (math.inf, 5.0)], "not finite"),
    ]:
      with self.subTest(trace=trace), self.assertRaisesRegex(ValueError, pattern):
        validate_trace(trace)


class ConcurrencyTest(absltest.TestCase):

  def test_concurrent_acquirers_finish_in_fifo_order(self):
    clock = FakeClock(now=0.0)
    lim = limiter(clock, 1000.0)
    done = []

    async def reader(name, nbytes):
      await lim.acquire(nbytes)
      done.append((name, clock.now))

    async def run():
      await asyncio.gather(reader("a", 3000), reader("b", 500), reader("c", 1000))
    asyncio.run(run())
    # Each waits for everything granted before it: the small "b" does not overtake "a".
    self.assertEqual(done, [("a", 3.0), ("b", 3.5), ("c", 4.5)])
    self.assertEqual(clock.sleeps, [3.0, 3.5, 4.5])
    self.assertEqual(lim.bytes_granted, 4500)


class LoadTraceTest(absltest.TestCase):

  def write(self, text):
    path = self.create_tempfile(content=text).full_path
    return path

  def test_parses_comments_commas_and_whitespace(self):
    path = self.write("# t_s, bytes_per_s\n"
                      "\n"
                      "0, 3.125e9   # 25 Gbps\n"
                      "2.5\t875000000\n"
                      "  4 1e3\n")
    self.assertEqual(load_trace(path), ((0.0, 3.125e9), (2.5, 875e6), (4.0, 1000.0)))

  def test_bad_lines_name_their_line_number(self):
    for text, pattern in [
        ("0 100\n1 fast\n", r":2: bad trace line '1 fast'"),
        ("# header\n0 100 7\n", r":2: .*want 2 fields"),
        ("0\n", r":1: .*want 2 fields"),
    ]:
      with self.subTest(text=text), self.assertRaisesRegex(ValueError, pattern):
        load_trace(self.write(text))

  def test_invalid_trace_in_file(self):
    with self.assertRaisesRegex(ValueError, "start at t=0"):
      load_trace(self.write("1 100\n"))

  def test_limiter_from_file(self):
    clock = FakeClock(now=0.0)
    lim = limiter(clock, trace=load_trace(self.write("0 1000\n1 2000\n")))
    asyncio.run(lim.acquire(3000))  # 1000 in [0, 1), 2000 in [1, 2)
    self.assertEqual(clock.sleeps, [2.0])


class ResetTest(absltest.TestCase):

  def test_reset_changes_rate_and_forgets_the_backlog(self):
    clock = FakeClock()
    lim = limiter(clock, 1000.0)
    lim.acquire_blocking(1000)          # 100 -> 101
    lim.reserve(5000)                   # booked 101 -> 106, never waited on (a cancelled load)
    lim.reset(4000.0)
    self.assertEqual(lim.current_rate(), 4000.0)
    lim.acquire_blocking(2000)          # the pipe is free now: 0.5 s at the new rate
    self.assertEqual(clock.sleeps, [1.0, 0.5])
    self.assertEqual(lim.bytes_granted, 3000)

  def test_reset_to_a_trace_starts_it_now(self):
    clock = FakeClock()
    lim = limiter(clock, 1000.0)
    clock.now = 150.0
    lim.reset(trace=[(0, 1000.0), (1, 2000.0)])
    self.assertEqual(lim.current_rate(150.5), 1000.0)
    self.assertEqual(lim.current_rate(151.0), 2000.0)
    asyncio.run(lim.acquire(3000))      # 1000 in [150, 151), 2000 in [151, 152)
    self.assertEqual(clock.sleeps, [2.0])

  def test_reset_to_unlimited_and_bad_input(self):
    clock = FakeClock()
    lim = limiter(clock, 1000.0)
    lim.reset()
    self.assertTrue(lim.unlimited)
    lim.acquire_blocking(10**9)
    self.assertEqual(clock.sleeps, [])
    with self.assertRaisesRegex(ValueError, "positive"):
      lim.reset(0.0)
    with self.assertRaisesRegex(ValueError, "not both"):
      lim.reset(1.0, trace=[(0, 1.0)])
    self.assertTrue(lim.unlimited)      # a rejected reset changes nothing


if __name__ == "__main__":
  absltest.main()
