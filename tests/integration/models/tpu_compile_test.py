"""Deviceless TPU compiles (libtpu's XLA TPU compiler and Mosaic on a CPU-only machine): the tiny
model's paged step and codec programs for a v5e, built by an abstract `PagedModelRunner` on TPU
topology devices, the paged-attention kernel with a block table cut into windows, and the rANS
decoder's TPU kernel.
libtpu comes with the `tpu` extra (`pip install -e '.[tpu]'`), not with `test`. Without it these
tests skip, naming the extra; with KVJAX_REQUIRE_LIBTPU=1 (what .ci/run sets after installing the
extra) they fail instead, so a CI run that promised the compiles cannot pass without them.
scripts/compile_check.py runs the same at real model shapes."""

import importlib.util
import os
import unittest

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest
from flax import nnx

from kvjax.kernels import paged_attention as pa
from kvjax.kernels import rans_decode as rd
from kvjax.models.nn import config as model_configs
from kvjax.models.nn.llama import Llama
from kvjax.models.runner.paged_runner import PagedModelRunner
from kvjax.models.runner.runner_api import PagedRunnerConfig
from kvjax.models.runner.sharding import TensorParallel

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
#: Set to 1 where libtpu was installed on purpose (.ci/run): a missing libtpu fails the tests.
REQUIRE_ENV = "KVJAX_REQUIRE_LIBTPU"


def check_libtpu(has_libtpu: bool, environ) -> None:
  """Returns when libtpu is installed; else skips (unittest.SkipTest) or, with
  KVJAX_REQUIRE_LIBTPU=1 in `environ`, fails (AssertionError)."""
  if has_libtpu:
    return
  if environ.get(REQUIRE_ENV, "") == "1":
    raise AssertionError(f"{REQUIRE_ENV}=1 but libtpu is not installed: the TPU compile tests "
                         "were promised (pip install -e '.[tpu]')")
  raise unittest.SkipTest(f"libtpu is not installed (pip install -e '.[tpu]'; {REQUIRE_ENV}=1 "
                          "makes this a failure)")


class LibtpuRequirementTest(absltest.TestCase):

  def test_missing_libtpu_skips_unless_required(self):
    check_libtpu(True, {REQUIRE_ENV: "1"})
    with self.assertRaisesRegex(unittest.SkipTest, r"pip install -e '\.\[tpu\]'"):
      check_libtpu(False, {})
    with self.assertRaisesRegex(unittest.SkipTest, "libtpu is not installed"):
      check_libtpu(False, {REQUIRE_ENV: "0"})
    with self.assertRaisesRegex(AssertionError, f"{REQUIRE_ENV}=1 but libtpu is not installed"):
      check_libtpu(False, {REQUIRE_ENV: "1"})


def v5e_devices():
  # libtpu takes a lockfile per machine unless told otherwise: pytest's two workers (and a
  # compile_check run alongside) would refuse each other.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies  # noqa: PLC0415
  return topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu").devices


def compile_for(devices, fn, args):
  mesh = jax.sharding.Mesh(np.asarray(devices), ("tp",))
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    lowered = fn.lower(*args)
  return lowered.compile()


class TpuCompileTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    check_libtpu(HAS_LIBTPU, os.environ)
    cls.devices = v5e_devices()
    cls.cfg = model_configs.tiny()
    cls.model = nnx.eval_shape(lambda: Llama(cls.cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16,
                                             param_dtype=jnp.bfloat16))
    cls.rc = PagedRunnerConfig(num_blocks=32, block_size=16, max_num_seqs=2,
                               max_num_batched_tokens=64, chunk_sizes=(64,))

  def test_tiny_paged_step_and_codecs_compile_for_v5e(self):
    runner = PagedModelRunner(self.model, self.rc, device=self.devices[0], abstract=True)
    self.assertEqual(runner.platform, "tpu")
    progs = {name: (fn, args) for name, fn, args in runner.aot_programs(
        buckets=(8,), codecs=("int8", "int4"))}
    self.assertEqual(set(progs), {"step[T=8]", "insert_raw[C=64]", "read_pre_rope[C=64]",
                                  "insert_payload[int8,C=64]", "encode[int8,levels=1,C=64]",
                                  "insert_payload[int4,C=64]", "encode[int4,levels=1,C=64]"})
    for name in ("step[T=8]", "insert_payload[int4,C=64]", "encode[int4,levels=1,C=64]"):
      compiled = compile_for(self.devices[:1], *progs[name])
      pool = 2 * self.cfg.n_layers * 32 * 16 * self.cfg.n_kv_heads * self.cfg.head_dim * 2
      if name != "encode[int4,levels=1,C=64]":  # the pool is an argument
        self.assertGreaterEqual(compiled.memory_analysis().argument_size_in_bytes, pool, name)
      self.assertIn("tpu_custom_call", compiled.as_text(), name)  # a Mosaic kernel inside

  def test_pool_is_neither_converted_nor_copied(self):
    # The pool's layout is the one the step's scatter and the kernel read, and inserts write
    # their blocks in place: the step's temporaries do not grow with the pool, an insert and a
    # read-back have none the size of the pool. (Heads folded as [L, P, B, K * H], padded to
    # 128 lanes: the tiny model's 3 x 8 -> 128. With [L, P, B, K, H], XLA converted the pool
    # around every step and insert: temporaries about the pool's size.)
    temps = {}
    for blocks in (128, 512):
      rc = PagedRunnerConfig(num_blocks=blocks, block_size=16, max_num_seqs=2,
                             max_num_batched_tokens=64, chunk_sizes=(64,))
      runner = PagedModelRunner(self.model, rc, device=self.devices[0], abstract=True)
      self.assertEqual(runner.pool.k_LPBF.shape, (self.cfg.n_layers, blocks, 16, 128))
      for name, fn, args in runner.aot_programs(buckets=(64,), codecs=()):
        if name.startswith(("step", "insert_raw", "read_pre_rope")):
          temps[name, blocks] = compile_for(self.devices[:1], fn, args).memory_analysis(
              ).temp_size_in_bytes
    growth = 2 * self.cfg.n_layers * (512 - 128) * 16 * 128 * 2  # the pool's K and V, bytes
    for name in ("step[T=64]", "insert_raw[C=64]", "read_pre_rope[C=64]"):
      self.assertLess(abs(temps[name, 512] - temps[name, 128]), growth / 8, name)
    for name in ("insert_raw[C=64]", "read_pre_rope[C=64]"):
      self.assertLess(temps[name, 512], growth / 8, name)

  def test_tensor_parallel_step_compiles_for_v5e(self):
    tp = TensorParallel.build(self.cfg, 3, self.devices)
    runner = PagedModelRunner(self.model, self.rc, tp, abstract=True)
    (name, fn, args), = runner.aot_programs(buckets=(8,), codecs=())[:1]
    self.assertEqual(name, "step[T=8]")
    self.assertIn("tpu_custom_call", compile_for(runner.devices, fn, args).as_text())

  def test_qwen_switches_tensor_parallel_step_compiles_for_v5e(self):
    # Qwen2's q/k/v biases (sharded by head with their projections) and Qwen3's q/k norms
    # (replicated) in one config, over 3 devices: each shard's step adds its heads' biases.
    cfg = model_configs.tiny(family="qwen3", attention_bias=True, qk_norm=True)
    model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16,
                                         param_dtype=jnp.bfloat16))
    tp = TensorParallel.build(cfg, 3, self.devices)
    self.assertEqual(tp.param_spec("layers.bq"), jax.sharding.PartitionSpec(None, "tp", None))
    self.assertEqual(tp.param_spec("layers.bk"), jax.sharding.PartitionSpec(None, "tp", None))
    self.assertEqual(tp.param_spec("layers.q_norm"), jax.sharding.PartitionSpec())
    runner = PagedModelRunner(model, self.rc, tp, abstract=True)
    (name, fn, args), = runner.aot_programs(buckets=(8,), codecs=())[:1]
    self.assertEqual(name, "step[T=8]")
    self.assertIn("tpu_custom_call", compile_for(runner.devices, fn, args).as_text())

  def _attention_compiles(self, s_, m_, **kw):
    k_, h_ = 8, 128
    sh = jax.sharding.SingleDeviceSharding(self.devices[0])
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sh)
    args = (sds((64, 32, h_), jnp.bfloat16), sds((256, 16, k_, h_), jnp.bfloat16),
            sds((256, 16, k_, h_), jnp.bfloat16), sds((s_, m_), jnp.int32),
            sds((s_,), jnp.int32), sds((s_ + 1,), jnp.int32), sds((), jnp.int32))
    fn = jax.jit(lambda *a: pa.paged_attention(*a, platform="tpu", **kw))
    text = compile_for(self.devices[:1], fn, args).as_text()
    return text.count('custom_call_target="tpu_custom_call"')

  def test_attention_table_in_windows_compiles(self):
    # A [8, 64] table with room for 256 entries per call: two windows, two kernel calls (8 s
    # on the 2-core VM; tests/integration/kernels/paged_attention_windows_test.py checks their values).
    self.assertEqual(self._attention_compiles(8, 64, max_table_entries=256), 2)

  def test_rans_decode_compiles_for_v5e(self):
    # 12 blocks of 32 lanes (two programs of 8 rows), 64 steps, a 256-symbol alphabet at
    # Z = 4096 (a few seconds on the 2-core VM; tests/integration/kernels/rans_decode_test.py checks the
    # kernel's values in interpret mode).
    m, j, b, t, w = 6, 2, 32, 64, 2048
    sh = jax.sharding.SingleDeviceSharding(self.devices[0])
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sh)
    fn = jax.jit(lambda *a: rd.rans_decode(*a, scale_bits=12, num_streams=j * b, num_steps=t,
                                           platform="tpu"))
    compiled = compile_for(self.devices[:1], fn, (
        sds((m, j, w), jnp.uint16), sds((m, j, b), jnp.uint32), sds((m, j, b), jnp.int32),
        sds((m, j), jnp.int32), sds((m, 256), jnp.int32)))
    self.assertEqual(compiled.as_text().count('custom_call_target="tpu_custom_call"'), 1)
    self.assertGreater(compiled.cost_analysis()["flops"], 0)  # the kernel's own estimate

  @pytest.mark.slow
  def test_attention_with_a_long_block_table_compiles(self):
    # LLaMA-3.1-8B's table at 131,072 tokens (41 x 8,192 int32 = 1.3 MiB, over the chip's
    # 1 MiB of SMEM in one call; 18-70 s to compile on the 2-core VM): cut into 3 windows.
    self.assertEqual(self._attention_compiles(41, 8192), 3)

if __name__ == "__main__":
  absltest.main()
