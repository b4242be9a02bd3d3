"""Ragged paged attention: the jnp reference against a dense numpy oracle over gathered KV, the
Pallas TPU and GPU kernels (interpret mode on CPU) against both, over NaN-filled unused pool
memory and shuffled block tables; a hand-computed case; the reference's cost; bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest, parameterized

from kvjax.kernels import paged_attention as pa
from kvjax.kernels.paged_attention import gpu as gpu_lib

INTERPRET = jax.default_backend() == "cpu"
BS = 8  # tokens per pool block
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# Against the float64 oracle: f32 allows accumulation-order differences; bf16 one output rounding
# (2^-8 relative) plus bf16 probabilities in the P.V dot.
TOL = {"float32": dict(rtol=1e-5, atol=1e-5), "bfloat16": dict(rtol=2e-2, atol=2e-2)}
# Small block sizes so interpret mode stays fast; the GPU kernel's are Triton-legal.
BLOCKS = {"reference": dict(query_block=4, kv_tokens_per_step=2 * BS),
          "tpu": dict(query_block=4, kv_tokens_per_step=2 * BS),
          "gpu": dict(query_rows=16, kv_tokens_per_step=2 * BS, num_kv_splits=2)}
IMPLS = ("reference", "tpu", "gpu")

# (q_len, context_len) per sequence. Decodes are q_len 1.
MIXED = [(5, 13), (1, 1), (1, 8), (9, 9), (1, 17), (3, 24)]
EDGES = [(1, 1), (1, BS - 1), (1, BS), (1, BS + 1), (1, 3 * BS + 2), (BS + 1, BS + 1),
         (2, BS), (4, 2 * BS + 3)]
CASES = {"mixed": MIXED, "edges": EDGES, "decode": [(1, 5), (1, 3 * BS), (1, 2 * BS + 1)],
         "prefill": [(BS + 3, 2 * BS + 5)]}
HEADS = {"g1": (2, 2, 16), "g3": (6, 2, 16)}  # (N, K, H)


def make_batch(seqs, heads, dtype, *, seed=0, extra_tokens=3, extra_seqs=2, extra_cols=1,
               num_blocks=48):
  """A ragged batch over a NaN-filled pool with random non-contiguous block tables.

  Returns (args tuple for the kernels, numpy oracle output f64[T, N, H], real-row mask bool[T]).
  Padded tokens (q rows NaN) and padded sequences (garbage tables and lengths) are appended.
  """
  rng = np.random.default_rng(seed)
  n_, k_, h_ = heads
  g_ = n_ // k_
  s_ = len(seqs) + extra_seqs
  q_lens = np.array([q for q, _ in seqs])
  ctx = np.array([c for _, c in seqs])
  total = int(q_lens.sum())
  t_ = total + extra_tokens
  need = -(-ctx // BS)
  m_ = int(need.max()) + extra_cols
  assert need.sum() <= num_blocks
  perm = rng.permutation(num_blocks)
  bt = rng.integers(-5, 10 * num_blocks, size=(s_, m_)).astype(np.int32)  # garbage past the end
  qsl = np.full(s_ + 1, total, np.int32)
  qsl[0] = 0
  qsl[1:len(seqs) + 1] = np.cumsum(q_lens)
  cl = rng.integers(0, 99, size=s_).astype(np.int32)
  cl[:len(seqs)] = ctx
  k_pool = np.full((num_blocks, BS, k_, h_), np.nan, np.float32)
  v_pool = k_pool.copy()
  q = np.full((t_, n_, h_), np.nan, np.float32)
  oracle = np.zeros((t_, n_, h_))
  c = 0
  cast = lambda x: np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))
  for s, (ql, L) in enumerate(seqs):
    bt[s, :need[s]] = perm[c:c + need[s]]
    c += need[s]
    k = cast(rng.normal(size=(L, k_, h_)))
    v = cast(rng.normal(size=(L, k_, h_)))
    for p in range(L):
      k_pool[bt[s, p // BS], p % BS] = k[p]
      v_pool[bt[s, p // BS], p % BS] = v[p]
    qs = cast(rng.normal(size=(ql, n_, h_)))
    q[qsl[s]:qsl[s + 1]] = qs
    # Dense causal attention over the contiguous gathered KV, float64.
    k64, v64 = k.astype(np.float64), v.astype(np.float64)
    for i in range(ql):
      vis = L - ql + i + 1
      for n in range(n_):
        sc = k64[:vis, n // g_] @ qs[i, n] * h_ ** -0.5
        w = np.exp(sc - sc.max())
        oracle[qsl[s] + i, n] = (w / w.sum()) @ v64[:vis, n // g_]
  # The engine's pool layout: heads folded into the last axis, [P, B, K * H].
  fold = lambda x: jnp.asarray(x.reshape(num_blocks, BS, k_ * h_), dtype)
  args = (jnp.asarray(q, dtype), fold(k_pool), fold(v_pool),
          jnp.asarray(bt), jnp.asarray(cl), jnp.asarray(qsl), jnp.int32(len(seqs)))
  return args, oracle, np.arange(t_) < total


def run(impl, args, **kw):
  blocks = dict(BLOCKS[impl], **kw)
  if impl != "reference":
    blocks["interpret"] = INTERPRET
  return np.asarray(pa.paged_attention(*args, implementation=impl, **blocks).astype(jnp.float32))


# The default run's oracle cases, the same on every backend (so the non-reference ones reuse the
# reference's compiled program for their comparison): mixed decodes and prefills in bfloat16 with
# one query head per kv head, and the edge lengths (around and across pool blocks and kv steps)
# in float32 with three (GQA). Every other (case, heads, dtype), decode- and prefill-only batches
# included, is `slow`.
DEFAULT_CASES = (("mixed", "g1", "bfloat16"), ("edges", "g3", "float32"))


def cases(slow=False):
  out = []
  for impl in IMPLS:
    for case in CASES:
      for hname in HEADS:
        for dname in DTYPES:
          if dname == "bfloat16" and case in ("decode", "prefill"):
            continue
          if ((case, hname, dname) not in DEFAULT_CASES) != slow:
            continue
          out.append(dict(testcase_name=f"{impl}_{case}_{hname}_{dname}", impl=impl, case=case,
                          heads=hname, dtype=dname))
  return out


class PagedAttentionTest(parameterized.TestCase):

  @parameterized.named_parameters(*cases())
  def test_matches_dense_oracle(self, impl, case, heads, dtype):
    self._check_matches_dense_oracle(impl, case, heads, dtype)

  @parameterized.named_parameters(*cases(slow=True))
  @pytest.mark.slow
  def test_matches_dense_oracle_slow(self, impl, case, heads, dtype):
    self._check_matches_dense_oracle(impl, case, heads, dtype)

  def _check_matches_dense_oracle(self, impl, case, heads, dtype):
    args, oracle, real = make_batch(CASES[case], HEADS[heads], DTYPES[dtype])
    out = run(impl, args)
    self.assertTrue(np.isfinite(out).all())
    np.testing.assert_allclose(out[real], oracle[real], **TOL[dtype])
    np.testing.assert_array_equal(out[~real], 0.0)  # padded rows hold zeros
    if impl != "reference":
      ref = run("reference", args)
      np.testing.assert_allclose(out, ref, **TOL[dtype])

  @parameterized.parameters(*IMPLS)
  def test_unfolded_pool_gives_the_same_result(self, impl):
    # A pool given as [P, B, K, H] (heads unfolded) reads the same values as the folded one.
    args, _, _ = make_batch(CASES["edges"], HEADS["g3"], jnp.float32)
    k, v = args[1], args[2]
    unfolded = (args[0], k.reshape(k.shape[0], BS, 2, 16), v.reshape(v.shape[0], BS, 2, 16)
                ) + args[3:]
    np.testing.assert_array_equal(run(impl, unfolded), run(impl, args))

  @parameterized.parameters(*IMPLS)
  def test_hand_computed(self, impl):
    # One sequence, context 2, both tokens queried; sm_scale 1, H = 16, one head.
    # Row 0 sees only position 0: output v0. Row 1: scores (0, ln 3) -> weights (1/4, 3/4).
    h = 16
    e = np.eye(h, dtype=np.float32)
    q = np.stack([e[0], e[0]])[:, None, :]
    k_pool = np.full((3, BS, 1, h), np.nan, np.float32)
    v_pool = k_pool.copy()
    k_pool[2, 0, 0], k_pool[2, 1, 0] = 0.0, np.log(3.0) * e[0]
    v_pool[2, 0, 0], v_pool[2, 1, 0] = 4.0 * e[1], 8.0 * e[1]
    args = (jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool),
            jnp.array([[2]], jnp.int32), jnp.array([2], jnp.int32),
            jnp.array([0, 2], jnp.int32), 1)
    out = run(impl, args, sm_scale=1.0)
    want = np.zeros((2, 1, h), np.float32)
    want[0, 0, 1], want[1, 0, 1] = 4.0, 7.0
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)

  @parameterized.parameters(*IMPLS)
  def test_no_sequences_gives_zeros(self, impl):
    args, _, _ = make_batch(EDGES, HEADS["g3"], jnp.float32)
    args = args[:6] + (jnp.int32(0),)
    np.testing.assert_array_equal(run(impl, args), 0.0)

  def test_reference_batched_decodes_match_oracle(self):
    # Three decode items a loop iteration: one decode's steps cut across iterations.
    self._check_reference_batched_decodes_match_oracle(3)

  @parameterized.parameters(1, 16)
  @pytest.mark.slow
  def test_reference_batched_decodes_match_oracle_slow(self, items_per_iter):
    self._check_reference_batched_decodes_match_oracle(items_per_iter)

  def _check_reference_batched_decodes_match_oracle(self, items_per_iter):
    # Twelve decodes of 1 .. 5 kv steps each beside two prefill chunks: the split-KV work list
    # cuts one decode's steps across loop iterations and mixes decodes in one gather.
    seqs = [(1, L) for L in (1, 7, 8, 9, 15, 16, 17, 23, 31, 33, 40, 12)] + [(5, 13), (9, 20)]
    args, oracle, real = make_batch(seqs, HEADS["g3"], jnp.float32, num_blocks=64)
    out, n = pa.paged_attention_reference(*args, query_block=4, kv_tokens_per_step=2 * BS,
                                          decode_items_per_iter=items_per_iter,
                                          return_num_kv_steps=True)
    np.testing.assert_allclose(np.asarray(out)[real], oracle[real], **TOL["float32"])
    np.testing.assert_array_equal(np.asarray(out)[~real], 0.0)
    decode_items = sum(-(-L // (2 * BS)) for q, L in seqs if q == 1)
    # Tiles of (5, 13): 4 + 1 rows seeing 12, 13 positions; of (9, 20): 4 + 4 + 1 rows seeing
    # 15, 19, 20 positions; 16 kv tokens per step.
    prefill_steps = 1 + 1 + 1 + 2 + 2
    self.assertEqual(int(n), decode_items + prefill_steps)

  @pytest.mark.slow  # 9 s of compiles; the default suite's budget
  def test_reference_cost_follows_real_length(self):
    # Count kv loop iterations: each (sequence, query tile) runs cdiv(visible kv, step) of them,
    # whatever the pool size, the table width or the longest sequence in the batch.
    step = 2 * BS

    def steps(seqs, **kw):
      args, _, _ = make_batch(seqs, HEADS["g1"], jnp.float32, **kw)
      _, n = pa.paged_attention_reference(*args, query_block=4, kv_tokens_per_step=step,
                                          return_num_kv_steps=True)
      return int(n)

    def expected(seqs, tq=4):
      total = 0
      for ql, L in seqs:
        rows = [1] if ql == 1 else [min(tq, ql - j) for j in range(0, ql, tq)]
        start = 0
        for r in rows:
          total += -(-(L - ql + start + r) // step)
          start += r
      return total

    short = [(1, 5), (1, 9), (3, 20)]
    self.assertEqual(steps(short), expected(short))
    long_ = short + [(1, 40 * BS)]
    self.assertEqual(steps(long_, num_blocks=64), expected(long_))
    # The short sequences cost the same with a long one beside them, a bigger pool, wider tables.
    self.assertEqual(steps(long_, num_blocks=64) - steps(short), -(-40 * BS // step))
    self.assertEqual(steps(short, num_blocks=200, extra_cols=30), expected(short))
    prefill = [(10, 30)]  # causal: tiles of 4, 4, 2 rows see 24, 28, 30 positions
    self.assertEqual(steps(prefill), 2 + 2 + 2)

  def test_reference_trip_count_is_dynamic(self):
    # One compiled program: the loop bound comes from context_lens at run time.
    args, _, _ = make_batch([(1, 5)], HEADS["g1"], jnp.float32, extra_cols=8)
    jaxpr = jax.make_jaxpr(lambda *a: pa.paged_attention_reference(*a))(*args)
    self.assertIn("while", str(jaxpr))
    counts = []
    bt = args[3].at[0].set(jnp.arange(args[3].shape[1], dtype=jnp.int32))  # valid ids
    for L in (5, 40, 70):
      a = args[:3] + (bt, args[4].at[0].set(L)) + args[5:]
      counts.append(int(pa.paged_attention_reference(*a, kv_tokens_per_step=BS,
                                                     return_num_kv_steps=True)[1]))
    self.assertEqual(counts, [1, 5, 9])

  def test_dispatch_defaults_to_reference_on_cpu(self):
    self.assertEqual(pa.default_implementation("cpu"), "reference")
    self.assertEqual(pa.default_implementation("gpu"), "gpu")
    with self.assertRaisesRegex(ValueError, "implementation"):
      pa.paged_attention(*make_batch(MIXED, HEADS["g1"], jnp.float32)[0], implementation="x")

  @parameterized.parameters("float32", "bfloat16")
  def test_gpu_kernel_lowers_to_triton(self, dtype):
    # LLaMA-3.1-8B attention shapes (N 32, K 8, H 128), block 16: the Triton lowering (run on
    # CPU for a CUDA target) accepts every op and size.
    d = DTYPES[dtype]
    q = jnp.zeros((8, 32, 128), d)
    pool = jnp.zeros((64, 16, 8 * 128), d)  # the engine's folded pool [P, B, K * H]
    bt = jnp.zeros((4, 16), jnp.int32)
    cl = jnp.full((4,), 100, jnp.int32)
    qsl = jnp.array([0, 5, 6, 7, 8], jnp.int32)
    rows, n = gpu_lib.gpu_block_sizes(32, 8, 128, 16)
    text = gpu_lib._gpu_jit.trace(
        q, pool, pool, bt, cl, qsl, jnp.int32(4), sm_scale=128 ** -0.5, query_rows=rows,
        blocks_per_step=n, num_splits=4, num_warps=4, num_stages=2, interpret=False,
        num_kv_heads=8).lower(lowering_platforms=("cuda",)).as_text()
    self.assertIn("__gpu$xla.gpu.triton", text)
    self.assertIn("ragged_paged_attention_gpu", text)

  def test_bad_input_raises(self):
    args, _, _ = make_batch(MIXED, HEADS["g3"], jnp.float32)
    q, kp, vp, bt, cl, qsl, ns = args
    ref = pa.paged_attention_reference
    with self.assertRaisesRegex(ValueError, "rank 3"):
      ref(q[0], kp, vp, bt, cl, qsl, ns)
    with self.assertRaisesRegex(ValueError, "differ"):
      ref(q, kp, vp[:-1], bt, cl, qsl, ns)
    with self.assertRaisesRegex(ValueError, "do not group"):
      ref(q[:, :5], kp, vp, bt, cl, qsl, ns)
    with self.assertRaisesRegex(ValueError, "int32"):
      ref(q, kp, vp, bt.astype(jnp.int16), cl, qsl, ns)
    with self.assertRaisesRegex(ValueError, "query_start_loc"):
      ref(q, kp, vp, bt, cl, qsl[:-1], ns)
    with self.assertRaisesRegex(ValueError, "num_seqs"):
      ref(q, kp, vp, bt, cl, qsl, 99)
    with self.assertRaisesRegex(ValueError, "must rise"):
      ref(q, kp, vp, bt, cl, qsl.at[2].set(0), ns)
    with self.assertRaisesRegex(ValueError, "context_lens=1 < its query length 5"):
      ref(q, kp, vp, bt, cl.at[0].set(1), qsl, ns)
    with self.assertRaisesRegex(ValueError, "needs .* blocks"):
      ref(q, kp, vp, bt, cl.at[0].set(99 * BS), qsl.at[1:].add(0), ns)
    with self.assertRaisesRegex(ValueError, "block ids"):
      ref(q, kp, vp, bt.at[0, 0].set(kp.shape[0]), cl, qsl, ns)
    with self.assertRaisesRegex(ValueError, "query_rows"):
      pa.paged_attention_gpu(*args, query_rows=12, interpret=True)
    with self.assertRaisesRegex(ValueError, "head dim"):
      gpu_lib.gpu_block_sizes(4, 2, 24, 16)
    with self.assertRaisesRegex(ValueError, "kv_heads_per_block"):
      pa.paged_attention_tpu(*args, kv_heads_per_block=3, interpret=True)
    if INTERPRET:
      with self.assertRaisesRegex(ValueError, "interpret=True"):
        pa.paged_attention_gpu(*args)


if __name__ == "__main__":
  absltest.main()
