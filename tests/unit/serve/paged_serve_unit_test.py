"""The paged KV layout through the server (issue 11): device prefix hits in the `kvjax` response
field and `/metrics`, KV pool usage and preemptions from one `Engine.stats()` snapshot, and the
server's layout flags.

On the fake runner (`kvjax.testing.engines.fake_llm`: the server over `LLM` over a numpy model);
the real tiny model's run is tests/integration/serve/paged_serve_test.py."""

import concurrent.futures
import threading

import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from prometheus_client.parser import text_string_to_metric_families

from kvjax import SamplingParams
from kvjax.engine import EngineStats, LoopStats
from kvjax.models.nn import config
from kvjax.models.nn.kv_cache import paged_block_nbytes
from kvjax.scheduler.kv_cache_manager import KVCacheStats
from kvjax.serve import ServerConfig
from kvjax.serve.metrics import ServeMetrics
from kvjax.testing import engines
from kvjax.testing.serve import ServedLLMTestCase

B = 16
NUM_BLOCKS = 8  # 128 tokens: two requests of 100 cannot run together
BLOCK_NBYTES = paged_block_nbytes(config.tiny(), B, jnp.float32)  # the tiny model's


def tokens(seed, n):
  return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]


def paged_llm(**kw):
  return engines.fake_llm(chunk_sizes=(16, 32, 64), block_size=B,
                          kv_cache_memory_bytes=NUM_BLOCKS * BLOCK_NBYTES, max_num_seqs=4, **kw)


class PagedServeUnitTest(ServedLLMTestCase):

  @classmethod
  def make_llm(cls):
    return paged_llm()

  def complete(self, prompt, max_tokens=4, **extra):
    return self.client.completions.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0.0,
        extra_body={"ignore_eos": True, **extra})

  def test_device_hit_in_the_response_and_the_metrics(self):
    prompt = tokens(1, 40)
    before = self.srv.scrape()
    cold = self.complete(prompt, cache_salt="hit")
    warm = self.complete(prompt, cache_salt="hit")
    other = self.complete(prompt, cache_salt="another tenant")
    after = self.srv.scrape()

    def delta(name, **labels):
      key = (name, tuple(sorted(labels.items())))
      return after.get(key, 0.0) - before.get(key, 0.0)

    self.assertEqual(warm.choices[0].text, cold.choices[0].text)
    ext = [r.model_extra["kvjax"] for r in (cold, warm, other)]
    # Two full blocks of the 40 tokens are shared, then the cold run's parked third block (its
    # 40 + 3 positions with KV: [32, 43)) up to the last prompt token, which is computed.
    self.assertEqual([e["tokens_device_cached"] for e in ext], [0, 39, 0])
    self.assertEqual([e["tokens_computed"] for e in ext], [40, 1, 40])
    self.assertEqual([e["loaded_from_tiers"] for e in ext], [{}, {"device": 1}, {}])
    self.assertEqual(warm.usage.prompt_tokens_details.cached_tokens, 39)
    for name in ("vllm:prefix_cache_hits_total", "kvjax_device_prefix_cache_hit_tokens_total"):
      self.assertEqual(delta(name), 39)
    for name in ("vllm:prefix_cache_queries_total",
                 "kvjax_device_prefix_cache_query_tokens_total"):
      self.assertEqual(delta(name), 3 * 40)
    self.assertEqual(delta("kvjax_device_prefix_cache_queries_total"), 3)
    self.assertEqual(delta("kvjax_device_prefix_cache_hits_total"), 1)
    self.assertEqual(delta("kvjax_prompt_tokens_total", source="device"), 39)
    self.assertEqual(delta("kvjax_prompt_tokens_total", source="loaded"), 0)
    self.assertEqual(delta("kvjax_prompt_tokens_total", source="computed"), 81)

  def test_idle_pool_gauges_equal_the_engine_snapshot(self):
    self.complete(tokens(2, 20))
    kv = self.srv.engine_call(lambda e: e.stats().kv_cache)
    got = self.srv.scrape()
    for name in ("kvjax_kv_cache_usage_perc", "vllm:kv_cache_usage_perc"):
      self.assertEqual(got[(name, ())], 0.0)  # idle: every block free or cached at ref 0
    self.assertEqual(got[("kvjax_kv_cache_blocks", (("state", "total"),))], NUM_BLOCKS)
    self.assertEqual(got[("kvjax_kv_cache_blocks", (("state", "free"),))], NUM_BLOCKS)
    self.assertEqual(got[("kvjax_kv_cache_blocks", (("state", "cached"),))],
                     kv.num_cached_blocks)
    self.assertGreater(kv.num_cached_blocks, 0)
    self.assertEqual(got[("kvjax_kv_cache_blocks", (("state", "peak_used"),))],
                     kv.peak_used_blocks)
    self.assertGreater(kv.peak_used_blocks, 0)
    stats = self.srv.engine_call(lambda e: e.stats())
    self.assertEqual(got[("kvjax_kv_cache_bytes", (("state", "reserved"),))],
                     stats.kv_cache_bytes)
    self.assertIn(stats.kv_cache_bytes, (NUM_BLOCKS * BLOCK_NBYTES, (NUM_BLOCKS + 1) * BLOCK_NBYTES))
    self.assertEqual(got[("kvjax_kv_cache_bytes", (("state", "peak_used"),))],
                     kv.peak_used_blocks * BLOCK_NBYTES)
    for name in ("kvjax_num_requests_waiting", "vllm:num_requests_waiting",
                 "kvjax_num_requests_running"):
      self.assertEqual(got[(name, ())], 0)

  def test_a_full_pool_preempts_and_both_answers_equal_running_alone(self):
    a, b = tokens(3, 20), tokens(4, 20)
    alone = [self.complete(p, max_tokens=80, cache_salt="alone").choices[0].text for p in (a, b)]
    engine, loop = self.llm.engine, self.srv.backend.engine
    step, entered, proceed = engine.step, threading.Event(), threading.Event()

    def gated_step():  # holds the first step until b is queued behind a
      entered.set()
      proceed.wait(60)
      return step()

    engine.step = gated_step
    submit, queued, submitted = loop.submit, threading.Event(), []

    def counted_submit(*args, **kw):  # the second call: b handed to the (held) engine thread
      out = submit(*args, **kw)
      submitted.append(1)
      if len(submitted) == 2:
        queued.set()
      return out

    loop.submit = counted_submit
    self.addCleanup(lambda: (proceed.set(), engine.__dict__.pop("step", None),
                             loop.__dict__.pop("submit", None)))
    before = self.srv.scrape()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
      fa = pool.submit(self.complete, a, 80, cache_salt="together")
      self.assertTrue(entered.wait(60))
      fb = pool.submit(self.complete, b, 80, cache_salt="together")
      self.assertTrue(queued.wait(60))  # b submitted to the engine thread (which is held)
      del engine.step
      proceed.set()
      got = [fa.result(120).choices[0].text, fb.result(120).choices[0].text]
    after = self.srv.scrape()
    self.assertEqual(got, alone)
    for name in ("kvjax_num_preemptions_total", "vllm:num_preemptions_total"):
      self.assertGreater(after[(name, ())], before.get((name, ()), 0))
    self.assertEqual(after[("kvjax_kv_cache_usage_perc", ())], 0.0)


class NoPrefixCachingServeUnitTest(ServedLLMTestCase):

  @classmethod
  def make_llm(cls):
    return paged_llm(enable_prefix_caching=False)

  def test_repeated_prompt_is_computed_again(self):
    prompt = tokens(5, 40)
    outs = [self.client.completions.create(model="tiny", prompt=prompt, max_tokens=2,
                                           temperature=0.0) for _ in range(2)]
    self.assertEqual([o.model_extra["kvjax"]["tokens_device_cached"] for o in outs], [0, 0])
    self.assertEqual(self.srv.scrape()[("vllm:prefix_cache_hits_total", ())], 0)


def _kv(**kw):
  base = dict(num_blocks=100, num_free_blocks=75, num_cached_blocks=30, usage=0.25, queries=7,
              query_tokens=700, hits=3, hit_tokens=96, evictions=5, preemptions=2)
  return KVCacheStats(**{**base, **kw})


class MetricsFromOneSnapshotTest(absltest.TestCase):

  def test_every_engine_figure_comes_from_the_snapshot(self):
    calls = []

    def stats():
      calls.append(1)
      return EngineStats(num_waiting=9, num_running=64, loop=LoopStats(), loader=None,
                         saver=None, lookup_failures=0, link_bandwidth_bytes_per_s=0.0,
                         kv_cache_ok=True, kv_cache=_kv())

    metrics = ServeMetrics(engine_stats=stats)
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in
           text_string_to_metric_families(metrics.render().decode()) for s in fam.samples}
    metrics.close()
    self.assertEqual(len(calls), 1)
    want = {"kvjax_kv_cache_usage_perc": 0.25, "vllm:kv_cache_usage_perc": 0.25,
            "kvjax_num_requests_waiting": 9, "vllm:num_requests_waiting": 9,
            "kvjax_num_requests_running": 64, "vllm:prefix_cache_queries_total": 700,
            "vllm:prefix_cache_hits_total": 96, "kvjax_device_prefix_cache_queries_total": 7,
            "kvjax_device_prefix_cache_hits_total": 3, "kvjax_kv_cache_evictions_total": 5,
            "kvjax_num_preemptions_total": 2, "vllm:num_preemptions_total": 2}
    self.assertEqual({k: got[(k, ())] for k in want}, want)
    self.assertEqual(got[("kvjax_kv_cache_blocks", (("state", "cached"),))], 30)


class ServerConfigTest(absltest.TestCase):

  def test_layout_options_reach_the_llm(self):
    opts = ServerConfig.from_flat(model="tiny", kv_store=None, block_size=32,
                        kv_cache_memory_bytes=1 << 20, enable_prefix_caching=False).llm_options()
    self.assertEqual({k: opts[k] for k in ("block_size", "kv_cache_memory_bytes",
                                           "enable_prefix_caching", "max_num_seqs")},
                     {"block_size": 32, "kv_cache_memory_bytes": 1 << 20,
                      "enable_prefix_caching": False, "max_num_seqs": 64})
    self.assertNotIn("kv_cache_layout", opts)
    self.assertEqual(ServerConfig.from_flat(model="tiny",
                                  max_num_seqs=8).llm_options()["max_num_seqs"], 8)
    default = ServerConfig.from_flat(model="tiny").llm_options()
    self.assertEqual((default["max_num_seqs"], default["enable_prefix_caching"]), (64, True))
    for codec in ("kvtc", "int8"):  # lossy, with the default store: the same pool options
      opts = ServerConfig.from_flat(model="tiny", kv_codec=codec).llm_options()
      self.assertEqual((opts["max_num_seqs"], opts["block_size"], opts["enable_prefix_caching"]),
                       (64, 16, True))

  def test_bad_layout_options(self):
    with self.assertRaises(TypeError):  # the option is gone: one KV layout
      ServerConfig.from_flat(kv_cache_layout="paged")  # pylint: disable=unexpected-keyword-arg
    with self.assertRaisesRegex(ValueError, "block_size=0 must be a positive int"):
      ServerConfig.from_flat(block_size=0)


if __name__ == "__main__":
  absltest.main()
