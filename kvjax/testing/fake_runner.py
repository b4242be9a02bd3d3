"""A `Runner` (`kvjax.models.runner.runner_api`) in numpy: a tiny deterministic attention model over a
real block pool, no jit, no compile, for tests of everything above the model (scheduler, engine,
Cake merge, store faults, sessions, tiers, look-ahead).

It is a model, only a small one: K and V of a token are a function of the token, its position and
(through attention over the pool) the KV its sequence's block table holds at every earlier
position, and the logits are a function of the same. So a chunk loaded into the wrong blocks, a
chunk inserted at the wrong position, a wrong block table, or a stored chunk of another prompt
changes the answer, while a correct load gives the cold run's answer bit for bit:

    x_0(p)     = E[token]                                      [D], D = K * H, float64
    per layer l:
      k_pre(p) = x_l(p) Wk_l,  v(p) = x_l(p) Wv_l, q(p) = x_l(p) Wq_l      (stored as float32)
      pool     <- rot_p(k_pre(p)), v(p)   at block table[p // B], row p % B
      a(p)     = softmax_j<=p(<rot_p(q(p)), pool K(j)> / sqrt(H))  per head, over the pool rows
      x_l+1(p) = x_l(p) + tanh(sum_j a_j pool V(j) Wo_l)
    logits(p)  = x_L(p) Wout                                   f32[V]

`rot_p`, the fake RoPE, is an exact position-dependent signed permutation of the H channels (a
random one per position, seeded): its inverse is exact too, so `read_pre_rope` returns bit for
bit the K the step computed (the real runner's is within float32 rounding). Every value of a
token comes from operations whose order per element does not depend on the other tokens of the
call (products summed over a fixed axis, maxima, prefix sums over positions `[0, p]` in order),
so the result does not depend on how the prompt was split into chunks, steps or layer groups.

Cost: attention is O(n^2) per sequence in numpy; a 400-token prefill took 0.11 s of CPU on the
2-core VM.

Payloads: raw, int8, int4 and cachegen through the numpy reference encoder
(`kvjax.testing.codec_payloads`, the storage layer's codec contract); kvtc is not supported.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from kvjax.models.nn import config as model_configs
from kvjax.models.nn.config import LlamaConfig
from kvjax.models.runner.runner_api import (PagedRunnerConfig, RunnerGeometry, SeqChunk, StepOutput,
                                            layer_groups)
from kvjax.storage.format import entropy
from kvjax.testing import codec_payloads

#: Codecs whose payloads `FakeRunner` encodes and inserts.
FAKE_CODECS = ("raw", "int8", "int4", "cachegen")


class NumpyDeviceSeam:
  """The fake runner's "device" as the KV connector sees it (`kvjax.connector.device.DeviceSeam`):
  host memory, numpy only. Puts and gets copy nothing; entropy-coded arrays are decoded on the
  host (`entropy.decode_rans_codes`).

  Attributes:
    platform: "cpu".
  """

  platform = "cpu"

  def put(self, host_array: np.ndarray) -> np.ndarray:
    """The host array itself, contiguous."""
    return np.ascontiguousarray(host_array)

  def get(self, tree: Any) -> Any:
    """The tree itself: its arrays already live on the host."""
    return tree

  def decode_entropy(self, codes: entropy.RansCodes) -> tuple[np.ndarray, bool]:
    """(int16 codes `[L, 2, C, D]`, True) of one `RansCodes`, decoded on the host.

    Raises:
      ValueError: a stream that does not decode, or codes outside int16
        (`entropy.EntropyError`)."""
    return entropy.decode_rans_codes(codes), True

  def nbytes(self, value: Any) -> int:
    """0: nothing is held on a device."""
    del value
    return 0


def fake_model_config(**overrides: Any) -> LlamaConfig:
  """The fake's architecture: `kvjax.models.nn.config.tiny` (2 layers, 3 KV heads of 8, a byte
  vocabulary of 256, 512 positions); only `vocab_size`, `n_layers`, `n_kv_heads`, `head_dim`
  and `max_seq_len` matter to the fake."""
  return model_configs.tiny(**overrides)


@dataclasses.dataclass
class FakeLayerwiseStep:
  """A `FakeRunner` step in progress (`step_begin`): the `LayerwiseHandle` of the protocol.

  Attributes:
    groups: the layer ranges `(l0, l1)`, in order.
    next_group: the index of the group `step_layers` runs next.
    seqs: the step's sequences.
    x: per sequence, the hidden states [n, D] of its tokens after the layers run so far.
    k_pre, v: per layer run, [T, K, H] K before RoPE and V of the step's tokens.
  """

  groups: tuple[tuple[int, int], ...]
  seqs: tuple[SeqChunk, ...]
  x: list
  offsets: tuple[int, ...]
  k_pre: list = dataclasses.field(default_factory=list)
  v: list = dataclasses.field(default_factory=list)
  next_group: int = 0


def _project(x_nD: np.ndarray, w_DE: np.ndarray) -> np.ndarray:
  """`x @ w` per row, summed over D in order (a matmul's blocking may depend on the row count:
  this does not)."""
  return (x_nD[:, :, None] * w_DE[None]).sum(1)


class FakeRunner:
  """A deterministic numpy `Runner` of `model_config`'s KV shape over a `[L, P, B, K, H]` pool.

  Args:
    config: pool and step sizes (`PagedRunnerConfig`, as the paged runner's).
    model_config: the KV shape and vocabulary (default `fake_model_config()`).
    seed: seeds the weights and the fake RoPE; two runners of one seed give equal outputs.

  Attributes:
    calls: a log of the KV-moving calls, `(name, *args)` tuples in order (tests may inspect
      which blocks a chunk went to); steps log `("step", [(start, n, blocks), ...])`.

  Raises:
    ValueError: `max_seq_len` beyond the model's context.
  """

  def __init__(self, config: PagedRunnerConfig, model_config: LlamaConfig | None = None, *,
               seed: int = 0):
    cfg = self.model_config = model_config or fake_model_config()
    self.config = config
    #: The sizes and argument checks shared with the paged runner.
    self.geometry = geo = RunnerGeometry.of(config, cfg)
    self.max_seq_len, self.block_size, self.buckets = (geo.max_seq_len, geo.block_size,
                                                       geo.buckets)
    self.platform = "cpu"  # numpy: `device_seam()` decodes on the host
    self.dtype = np.float32
    self.calls: list[tuple] = []
    n_l, k_, h_, v_ = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size
    d = k_ * h_
    rng = np.random.default_rng(seed)
    self._embed = rng.standard_normal((v_, d))
    self._wq = rng.standard_normal((n_l, d, d)) / np.sqrt(d)
    self._wk = rng.standard_normal((n_l, d, d)) / np.sqrt(d)
    self._wv = rng.standard_normal((n_l, d, d)) / np.sqrt(d)
    self._wo = rng.standard_normal((n_l, d, d)) / np.sqrt(d)
    self._wout = rng.standard_normal((d, v_)) * 2.0
    # The fake RoPE: position p permutes the H channels by perm[p] and flips signs[p].
    self._perm = np.stack([rng.permutation(h_) for _ in range(cfg.max_seq_len)])
    self._inv_perm = np.argsort(self._perm, axis=1)
    self._sign = rng.choice(np.array([-1.0, 1.0], np.float32), (cfg.max_seq_len, h_))
    self._closed = False
    self.reset()

  # ----------------------------------------------------------------------------- sizes
  @property
  def chunk_sizes(self) -> tuple[int, ...]:
    return self.geometry.chunk_sizes

  @property
  def max_chunk_size(self) -> int:
    return self.geometry.max_chunk_size

  @property
  def num_blocks(self) -> int:
    return self.geometry.num_blocks

  @property
  def kv_dtype(self):
    return np.dtype(self.dtype)

  def bucket_for(self, num_tokens: int) -> int:
    """Smallest step size holding `num_tokens` (as the paged runner's).

    Raises:
      ValueError: `num_tokens` outside [1, max_num_batched_tokens].
    """
    return self.geometry.bucket_for(num_tokens)

  def is_compiled(self, num_tokens: int) -> bool:
    """Always True once `num_tokens` is a valid step size: nothing compiles."""
    self.bucket_for(num_tokens)
    return True

  def kv_cache_nbytes(self) -> int:
    return int(self.k_LPBKH.nbytes + self.v_LPBKH.nbytes)

  def kv_block_nbytes(self) -> int:
    return self.kv_cache_nbytes() // self.num_blocks

  def cache_ok(self) -> bool:
    return not self._closed

  # ----------------------------------------------------------------------------- the model
  def _unrot_rows(self, x_nKH: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """The inverse of `_rot_rows`, exact."""
    idx = np.broadcast_to(self._inv_perm[pos][:, None, :], x_nKH.shape)
    return np.take_along_axis(x_nKH * self._sign[pos][:, None, :], idx, axis=-1)

  def _check_seqs(self, seqs: Sequence[SeqChunk]) -> int:
    n_tokens, _ = self.geometry.check_step(seqs)
    b, vocab = self.block_size, self.model_config.vocab_size
    for i, s in enumerate(seqs):
      n, end = len(s.token_ids), s.start + len(s.token_ids)
      ids = np.asarray(s.block_ids, np.int64)
      if n < 1 or s.start < 0 or end > self.max_seq_len or -(-end // b) > len(ids) or np.any(
          (ids[:-(-end // b)] < 0) | (ids[:-(-end // b)] >= self.num_blocks)):
        raise ValueError(f"sequence {i}: positions [{s.start}, {end}) with {len(ids)} blocks of "
                         f"{b} (max_seq_len {self.max_seq_len})")
      if any(not 0 <= int(t_) < vocab for t_ in s.token_ids):
        raise ValueError(f"sequence {i}: token ids outside [0, {vocab})")
      if s.num_layers is not None and not 1 <= s.num_layers <= self.model_config.n_layers:
        raise ValueError(f"sequence {i}: num_layers={s.num_layers} outside "
                         f"[1, {self.model_config.n_layers}]")
    return n_tokens

  def _layer(self, l: int, seqs: Sequence[SeqChunk], xs: list) -> tuple[list, np.ndarray,
                                                                          np.ndarray]:
    """Layer `l` of a step: writes every token's K and V, then attends (a later sequence of
    the step sees an earlier one's tokens, as the paged runner's). Returns the next hidden
    states and the step's [T, K, H] K before RoPE and V.

    Exactness: every value of a token is computed by operations whose per-element order does
    not depend on how many tokens share the call (products summed over a fixed axis, maxima,
    and prefix sums over positions `[0, p]`), so a token's result is the same whichever chunk,
    step or layer group computes it."""
    cfg, b = self.model_config, self.block_size
    k_, h_ = cfg.n_kv_heads, cfg.head_dim
    ks, vs, qs = [], [], []
    for s, x in zip(seqs, xs):
      n = len(s.token_ids)
      if s.num_layers is not None and l >= s.num_layers:  # stopped: rows unspecified (zeros)
        ks.append(np.zeros((n, k_, h_), np.float32))
        vs.append(np.zeros((n, k_, h_), np.float32))
        qs.append(None)
        continue
      ks.append(_project(x, self._wk[l]).astype(np.float32).reshape(n, k_, h_))
      vs.append(_project(x, self._wv[l]).astype(np.float32).reshape(n, k_, h_))
      qs.append(_project(x, self._wq[l]).reshape(n, k_, h_))
    for s, k, v, q in zip(seqs, ks, vs, qs):
      if q is None:
        continue  # a piece stopped below layer l writes nothing there
      pos = np.arange(s.start, s.start + len(s.token_ids))
      blk = np.asarray(s.block_ids, np.int64)[pos // b]
      self.k_LPBKH[l, blk, pos % b] = self._rot_rows(k, pos)
      self.v_LPBKH[l, blk, pos % b] = v
    out = []
    for s, x, q in zip(seqs, xs, qs):
      if q is None:
        out.append(x)
        continue
      n = len(s.token_ids)
      end = s.start + n
      pos = np.arange(s.start, end)
      ids = np.asarray(s.block_ids[:-(-end // b)], np.int64)
      k_all = self.k_LPBKH[l, ids].reshape(-1, k_, h_)[:end].astype(np.float64)  # [N, K, H]
      v_all = self.v_LPBKH[l, ids].reshape(-1, k_, h_)[:end].astype(np.float64)
      q = self._rot_rows(q, pos)  # [n, K, H]
      scores = (q[:, None] * k_all[None]).sum(-1) / np.sqrt(h_)  # [n, N, K]
      causal = np.arange(end)[None, :] <= pos[:, None]  # [n, N]
      scores = np.where(causal[:, :, None], scores, -np.inf)
      e = np.exp(scores - scores.max(1, keepdims=True))  # 0 past each token's position
      rows = np.arange(n)
      den = np.cumsum(e, axis=1)[rows, pos]  # [n, K]: sums over [0, p] in position order
      num = np.cumsum(e[..., None] * v_all[None], axis=1)[rows, pos]  # [n, K, H]
      ctx = (num / den[..., None]).reshape(n, -1)
      out.append(x + np.tanh(_project(ctx, self._wo[l])))
    return out, np.concatenate(ks), np.concatenate(vs)

  def _rot_rows(self, x_nKH: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """The fake RoPE of each row at its position: a signed permutation of H, exact."""
    idx = np.broadcast_to(self._perm[pos][:, None, :], x_nKH.shape)
    return np.take_along_axis(x_nKH, idx, axis=-1) * self._sign[pos][:, None, :]

  def _logits(self, seqs: Sequence[SeqChunk], xs: list) -> np.ndarray:
    return np.stack([(x[-1] @ self._wout).astype(np.float32) for x in xs])

  def _offsets(self, seqs: Sequence[SeqChunk]) -> tuple[int, ...]:
    out, o = [], 0
    for s in seqs:
      out.append(o)
      o += len(s.token_ids)
    return tuple(out)

  # ----------------------------------------------------------------------------- compute
  def step(self, seqs: Sequence[SeqChunk]) -> StepOutput:
    """Runs every sequence's tokens; writes their K and V into their blocks (`Runner.step`).
    A sequence with `num_layers` k stops after layer k - 1: it writes and attends in layers
    `[0, k)` only (the layer axis of Cake).

    Raises:
      ValueError: no sequences, too many tokens or sequences, a block table that does not
        cover a sequence's positions, or token ids outside the vocabulary.
    """
    st = self.step_begin(seqs, 1)
    self.step_layers(st)
    return self.step_finish(st)

  def step_begin(self, seqs: Sequence[SeqChunk], groups: int) -> FakeLayerwiseStep:
    """Starts `step(seqs)` as `groups` layer-group calls: embeds the tokens.

    Raises:
      ValueError: as `step`, or `groups` outside [1, L].
    """
    self._check_open()
    self._check_seqs(seqs)
    seqs = tuple(SeqChunk(tuple(int(t) for t in s.token_ids), int(s.start),
                          tuple(int(b) for b in s.block_ids), s.num_layers) for s in seqs)
    xs = [self._embed[np.asarray(s.token_ids)] for s in seqs]
    return FakeLayerwiseStep(groups=layer_groups(self.model_config.n_layers, groups),
                             seqs=seqs, x=xs, offsets=self._offsets(seqs))

  def step_layers(self, st: FakeLayerwiseStep) -> tuple[int, int]:
    """Runs the step's next layer group; returns its range.

    Raises:
      ValueError: every group has run already.
    """
    if st.next_group >= len(st.groups):
      raise ValueError(f"all {len(st.groups)} layer groups of this step have run")
    l0, l1 = st.groups[st.next_group]
    for l in range(l0, l1):
      st.x, k, v = self._layer(l, st.seqs, st.x)
      st.k_pre.append(k)
      st.v.append(v)
    st.next_group += 1
    return l0, l1

  def step_finish(self, st: FakeLayerwiseStep) -> StepOutput:
    """The step's `StepOutput` after its last group.

    Raises:
      ValueError: some layer group has not run.
    """
    if st.next_group != len(st.groups):
      raise ValueError(f"{st.next_group} of {len(st.groups)} layer groups have run")
    self.calls.append(("step", [(s.start, len(s.token_ids), s.block_ids) for s in st.seqs]))
    return StepOutput(logits_SV=self._logits(st.seqs, st.x),
                      k_pre_rope_LTKH=np.stack(st.k_pre), v_LTKH=np.stack(st.v),
                      offsets=st.offsets)

  def layer_split_points(self, groups: int) -> tuple[int, ...]:
    """Every k in `[1, L)`: the fake stops a `num_layers` piece after any layer, whatever the
    step's layer groups (`Runner.layer_split_points`).

    Raises:
      ValueError: `groups` outside [1, L].
    """
    n_layers = self.model_config.n_layers
    layer_groups(n_layers, groups)
    return tuple(range(1, n_layers))

  def step_grouped(self, seqs: Sequence[SeqChunk], groups: int) -> StepOutput:
    """`step_begin`, every `step_layers`, `step_finish`."""
    st = self.step_begin(seqs, groups)
    while st.next_group < len(st.groups):
      self.step_layers(st)
    return self.step_finish(st)

  # ----------------------------------------------------------------------------- KV in and out
  def _check_open(self) -> None:
    if self._closed:
      raise RuntimeError("the runner is closed")

  def _write(self, l0: int, kv_G2CKH: np.ndarray, ids: np.ndarray, start: int) -> None:
    """Writes layers `[l0, l0 + G)` of a chunk (K before RoPE) at positions from `start`."""
    g, _, c = kv_G2CKH.shape[:3]
    b = self.block_size
    k = np.asarray(kv_G2CKH[:, 0], np.float32)
    v = np.asarray(kv_G2CKH[:, 1], np.float32)
    i = np.arange(c)
    for j in range(g):
      self.k_LPBKH[l0 + j, ids[i // b], i % b] = self._rot_rows(k[j], start + i)
      self.v_LPBKH[l0 + j, ids[i // b], i % b] = v[j]

  def insert_chunk(self, kv_L2CKH, block_ids: Sequence[int], start: int) -> None:
    """Writes a raw chunk (K before RoPE) into its blocks, K rotated to its positions.

    Raises:
      ValueError: a shape that does not match the model, or blocks that do not fit the chunk.
    """
    self._check_open()
    cfg = self.model_config
    kv_L2CKH = np.asarray(kv_L2CKH)
    want = (cfg.n_layers, 2, kv_L2CKH.shape[2], cfg.n_kv_heads, cfg.head_dim)
    if tuple(kv_L2CKH.shape) != want:
      raise ValueError(f"chunk of shape {tuple(kv_L2CKH.shape)}, model wants {want}")
    ids = self.geometry.check_chunk(kv_L2CKH.shape[2], block_ids, start)
    self.calls.append(("insert_chunk", tuple(ids.tolist()), int(start)))
    self._write(0, kv_L2CKH, ids, int(start))

  def insert_chunk_layers(self, kv_G2CKH, block_ids: Sequence[int], start: int,
                          layer_start: int) -> None:
    """One chunk of `insert_chunks_layers`."""
    self.insert_chunks_layers([kv_G2CKH], [block_ids], [start], layer_start)

  def insert_chunks_layers(self, kvs_G2CKH: Sequence, block_ids: Sequence[Sequence[int]],
                           starts: Sequence[int], layer_start: int) -> None:
    """Writes layers `[layer_start, layer_start + G)` of several raw chunks of one shape.

    Raises:
      ValueError: no chunks, lists of different lengths, chunks of different shapes, a shape
        that does not match the model, or blocks that do not fit a chunk.
    """
    self._check_open()
    all_ids = self.geometry.check_layer_chunks(
        self.model_config, [tuple(np.shape(kv)) for kv in kvs_G2CKH], block_ids, starts,
        layer_start)
    for kv, ids, start in zip(kvs_G2CKH, all_ids, starts):
      self.calls.append(("insert_chunk_layers", tuple(ids.tolist()), int(start),
                         int(layer_start), np.shape(kv)[0]))
      self._write(layer_start, np.asarray(kv), ids, int(start))

  def insert_payload(self, codec: str, arrays, block_ids: Sequence[int], start: int) -> None:
    """Decodes a payload (`codec_payloads.decode`) and inserts it as `insert_chunk` does.

    Raises:
      ValueError: a codec the fake does not support (kvtc), or a payload or blocks that do not
        fit the model.
    """
    if codec not in FAKE_CODECS:
      raise ValueError(f"the fake runner decodes {FAKE_CODECS}, not {codec!r}")
    host = {}
    for name, a in dict(arrays).items():
      if isinstance(a, entropy.RansCodes):
        raise ValueError(f"payload array {name!r} is still entropy-coded")
      host[name] = np.asarray(a)
    kv = codec_payloads.decode(codec, host)
    self._check_open()
    ids = self.geometry.check_chunk(kv.shape[2], block_ids, start)
    cfg = self.model_config
    want = (cfg.n_layers, 2, kv.shape[2], cfg.n_kv_heads, cfg.head_dim)
    if kv.shape != want:
      raise ValueError(f"payload of shape {kv.shape}, model wants {want}")
    self.calls.append(("insert_payload", codec, tuple(ids.tolist()), int(start)))
    self._write(0, kv, ids, int(start))

  def read_pre_rope(self, block_ids: Sequence[int], start: int, n: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """K before RoPE (exactly: the fake RoPE inverts exactly) and V of positions
    `[start, start + n)` held in `block_ids`: ([L, n, K, H], [L, n, K, H]) float32.

    Raises:
      ValueError: `start` not block-aligned, or `n` outside the blocks given.
    """
    self._check_open()
    ids = self.geometry.check_read(block_ids, start, n)
    l_, _, _, k_, h_ = self.k_LPBKH.shape
    k = self.k_LPBKH[:, ids].reshape(l_, -1, k_, h_)[:, :n]
    v = self.v_LPBKH[:, ids].reshape(l_, -1, k_, h_)[:, :n].copy()
    pos = start + np.arange(n)
    k_pre = np.stack([self._unrot_rows(k[l], pos) for l in range(l_)])
    self.calls.append(("read_pre_rope", tuple(ids.tolist()), int(start), int(n)))
    return k_pre.astype(np.float32), v

  def copy_blocks(self, src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
    """Copies whole blocks `src_ids[i]` -> `dst_ids[i]` (K as stored, and V).

    Raises:
      ValueError: see `RunnerGeometry.check_copy`.
    """
    self._check_open()
    src, dst = self.geometry.check_copy(src_ids, dst_ids)
    self.calls.append(("copy_blocks", tuple(src.tolist()), tuple(dst.tolist())))
    self.k_LPBKH[:, dst] = self.k_LPBKH[:, src]
    self.v_LPBKH[:, dst] = self.v_LPBKH[:, src]

  def read_blocks(self, block_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """The K (after the fake RoPE) and V of some blocks: ([L, n * B, K, H], same) (tests)."""
    ids = np.asarray(block_ids, np.int64)
    l_, _, b, k_, h_ = self.k_LPBKH.shape
    return (self.k_LPBKH[:, ids].reshape(l_, -1, k_, h_).copy(),
            self.v_LPBKH[:, ids].reshape(l_, -1, k_, h_).copy())

  def encode_levels(self, kv_L2CKH, codec: str, levels: tuple[int, ...], start: int) -> list:
    """A chunk's payload at each level (`codec_payloads.encode`), with its finite flag.

    Raises:
      ValueError: a codec the fake does not support.
    """
    del start  # the reference codecs do not depend on the position
    if codec not in FAKE_CODECS:
      raise ValueError(f"the fake runner encodes {FAKE_CODECS}, not {codec!r}")
    kv = np.asarray(kv_L2CKH, np.float32)
    finite = bool(np.isfinite(kv).all())
    out = []
    for level in levels:
      arrays = codec_payloads.encode(codec, level, kv) if finite else {}
      out.append((codec, level, arrays, finite))
    return out

  # ----------------------------------------------------------------------------- lifetime
  def warmup(self, buckets: Sequence[int] | None = None) -> None:
    """Nothing to compile; checks the sizes."""
    for t in self.buckets if buckets is None else buckets:
      self.bucket_for(t)

  def warmup_layerwise(self, groups: int) -> None:
    layer_groups(self.model_config.n_layers, groups)

  def warmup_layer_inserts(self, kv_L2CKH, block_ids: Sequence[int], groups: int) -> None:
    del kv_L2CKH, block_ids
    layer_groups(self.model_config.n_layers, groups)

  def block_until_ready(self) -> None:
    pass

  def device_seam(self) -> NumpyDeviceSeam:
    """The KV connector's way to this runner's "device": host memory (`NumpyDeviceSeam`)."""
    return NumpyDeviceSeam()

  def reset(self) -> None:
    """Zeroes the pool."""
    cfg = self.model_config
    shape = (cfg.n_layers, self.config.num_blocks, self.block_size, cfg.n_kv_heads,
             cfg.head_dim)
    self.k_LPBKH = np.zeros(shape, np.float32)
    self.v_LPBKH = np.zeros(shape, np.float32)

  def close(self) -> None:
    """Drops the pool; the runner is unusable afterwards."""
    self._closed = True
