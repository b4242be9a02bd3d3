"""rANS byte format: hand-computed encodings, numpy round trips on adversarial distributions,
every kind of damage, and compression against the empirical entropy, pcodec and zstd."""

import struct

import numpy as np
import zstandard
from absl.testing import absltest, parameterized

from kvjax.storage.format import entropy, rans

HEAD = struct.Struct("<4sBBBBIIIIIQ")
HEAD2 = struct.Struct("<4sBBBBIIIIIIQ")


def laplace_symbols(seed, shape, scale, centre=128):
  """Quantized Laplacian symbols (like quantized KV deltas), centred in uint8."""
  rng = np.random.default_rng(seed)
  q = np.rint(rng.laplace(0.0, scale, size=shape)) + centre
  return np.clip(q, 0, 255).astype(np.uint8)


def masked(symbols_MTS, lengths_MS):
  mask = np.arange(symbols_MTS.shape[1])[None, :, None] < lengths_MS[:, None, :]
  return np.where(mask, symbols_MTS, 0)


def resign(data: bytes) -> bytes:
  """Recomputes the checksum of (deliberately forged) bytes, so the structural checks run."""
  size, total = (HEAD.size, rans._HEAD_BYTES) if data[4] == 1 else (HEAD2.size,
                                                                    rans._HEAD2_BYTES)
  head = data[:size]
  return head + rans._digest(head, data[total:]) + data[total:]


def cases():
  rng = np.random.default_rng(7)
  skew = np.where(rng.random((2, 37, 45)) < 0.998, 3, rng.integers(0, 256, (2, 37, 45)))
  ragged = rng.integers(0, 38, (2, 45))
  ragged[0, :9] = 0      # empty streams
  ragged[1, 3] = 37
  return [
      ("laplace", laplace_symbols(0, (3, 33, 50), 2.0), None, {}),
      ("one_symbol", np.full((2, 20, 9), 200, np.uint8), None, {}),
      ("uniform_256", rng.integers(0, 256, (2, 64, 40)).astype(np.uint8), None, {}),
      ("skewed", skew.astype(np.uint8), None, {}),
      ("ragged_lanes_7", laplace_symbols(1, (2, 37, 45), 1.0), ragged, dict(lanes=7)),
      ("all_empty", laplace_symbols(2, (2, 5, 4), 1.0), np.zeros((2, 4), int), {}),
      ("one_model_empty", laplace_symbols(3, (2, 6, 4), 1.0), np.array([[0] * 4, [6] * 4]), {}),
      ("no_steps", np.zeros((2, 0, 5), np.uint8), None, {}),
      ("no_streams", np.zeros((2, 5, 0), np.uint8), None, {}),
      ("lanes_1", laplace_symbols(4, (1, 30, 3), 3.0), None, dict(lanes=1)),
      ("lanes_over_S", laplace_symbols(5, (1, 30, 3), 3.0), None, dict(lanes=128)),
      ("scale_bits_8", laplace_symbols(6, (2, 30, 33), 0.7), None, dict(scale_bits=8)),
      ("scale_bits_15", laplace_symbols(7, (2, 30, 33), 6.0), None, dict(scale_bits=15)),
      ("alphabet_16bit", rng.integers(0, 3000, (2, 25, 40)).astype(np.uint16), None,
       dict(scale_bits=15)),
      ("alphabet_2", rng.integers(0, 2, (2, 25, 40)).astype(np.uint8), None, dict(alphabet=2)),
  ]


class HandComputedTest(absltest.TestCase):

  def test_two_symbols_half_half(self):
    # Model 0: symbols 0 and 1, 2048 each of Z = 4096. Stream 0 holds [1], stream 1 [0]:
    # x = (65536 // 2048) << 12 + 65536 % 2048 + c = 131072 + c, c = 2048 for symbol 1.
    data = rans.encode(np.array([[[1, 0]]], np.uint8), scale_bits=12, lanes=32, version=1)
    head = HEAD.unpack_from(data)
    self.assertEqual(head, (b"KVRA", 1, 12, 0, 0, 1, 2, 1, 32, 256, len(data)))
    body = data[rans._HEAD_BYTES:]
    self.assertEqual(struct.unpack_from("<IIBBHH", body), (0, 2, 255, 255, 2048, 2048))
    self.assertEqual(struct.unpack_from("<III", body, 14), (133120, 131072, 0))
    self.assertLen(data, rans._HEAD_BYTES + 14 + 12)
    symbols, lengths = rans.decode(data)
    np.testing.assert_array_equal(symbols, [[[1, 0]]])
    np.testing.assert_array_equal(lengths, [[1, 1]])

  def test_two_symbols_half_half_version_2(self):
    # Version 2: a header with K, then u32 nbytes and the side data (here raw: too small for
    # zstd to pay): the same table as version 1, the two states as four byte planes, the
    # block's word count; no words.
    data = rans.encode(np.array([[[1, 0]]], np.uint8), scale_bits=12, lanes=32)
    self.assertEqual(HEAD2.unpack_from(data), (b"KVRA", 2, 12, 0, 0, 1, 2, 1, 32, 256, 1,
                                                len(data)))
    body = data[rans._HEAD2_BYTES:]
    self.assertEqual(struct.unpack_from("<IIIBBHH", body), (26, 0, 2, 255, 255, 2048, 2048))
    # 133120 = 0x00020800, 131072 = 0x00020000: planes [00 00] [08 00] [02 02] [00 00].
    self.assertEqual(body[18:26], bytes([0, 0, 8, 0, 2, 2, 0, 0]))
    self.assertEqual(struct.unpack_from("<I", body, 26), (0,))
    self.assertLen(body, 30)
    # lane_steps=1: streams of 2 symbols are 2 lanes each: stream 0 [1, 1] is lanes 0 (its
    # first symbol) and 1, stream 1 [0, 0] lanes 2 and 3, each lane in state 131072 + c.
    data = rans.encode(np.array([[[1, 0], [1, 0]]], np.uint8), lane_steps=1)
    self.assertEqual(HEAD2.unpack_from(data), (b"KVRA", 2, 12, 2, 0, 1, 2, 2, 32, 256, 2,
                                                len(data)))          # flags 2: zstd side data
    arrays = rans.parse(data)
    self.assertEqual((arrays.num_streams, arrays.num_steps, arrays.segments), (2, 2, 2))
    np.testing.assert_array_equal(arrays.states[0, 0, :5],
                                  [133120, 133120, 131072, 131072, 65536])
    np.testing.assert_array_equal(arrays.lengths[0, 0, :5], [1, 1, 1, 1, 0])
    np.testing.assert_array_equal(rans.decode_arrays(arrays), [[[1, 0], [1, 0]]])

  def test_side_data_is_one_zstd_frame_when_it_pays(self):
    symbols = laplace_symbols(3, (8, 64, 16), 20.0)
    v1, v2 = rans.encode(symbols, version=1), rans.encode(symbols)
    self.assertEqual(v2[6], 2)                              # flags: zstd side data
    (packed,) = struct.unpack_from("<I", v2, rans._HEAD2_BYTES)
    side = zstandard.ZstdDecompressor().decompress(
        v2[rans._HEAD2_BYTES + 4:rans._HEAD2_BYTES + 4 + packed])
    arrays = rans.parse(v1)
    words = 2 * int(arrays.num_words.sum())
    # The same tables, states (as planes) and word counts as version 1, and the same words.
    self.assertLen(side, len(v1) - rans._HEAD_BYTES - words)
    self.assertEqual(v2[-words:], v1[-words:])
    self.assertLess(len(v2), len(v1) - len(side) // 3)
    np.testing.assert_array_equal(rans.decode(v2)[0], symbols)

  def test_one_symbol_costs_no_words(self):
    data = rans.encode(np.full((1, 1000, 3), 9, np.uint8))
    arrays = rans.parse(data)
    np.testing.assert_array_equal(arrays.num_words, [[0]])
    np.testing.assert_array_equal(arrays.states[0, 0, :3], [65536] * 3)
    self.assertEqual(arrays.freqs[0, 9], 4096)
    self.assertEqual(arrays.freqs.sum(), 4096)

  def test_renormalisation_order_within_a_block(self):
    # All 256 symbols once at scale 8: every frequency is 1, so encoding is x = x << 8 | s and
    # the state holds 2 symbols above 2**16. Encoding t = 63 .. 0 emits a word every second
    # symbol; the decoder reads, at every even step t, one word per lane in lane order: the
    # next two symbols s[t+2] << 8 | s[t+1] (at t = 62 only s[63] is left).
    symbols = np.random.default_rng(0).permutation(256).reshape(1, 64, 4).astype(np.uint8)
    arrays = rans.parse(rans.encode(symbols, scale_bits=8, lanes=4, version=1))
    s = symbols[0].astype(np.int64)                                    # [T, lanes]
    np.testing.assert_array_equal(arrays.states[0, 0], 65536 + s[0])
    want = [s[t + 2] * 256 + s[t + 1] if t < 62 else s[63] for t in range(0, 64, 2)]
    np.testing.assert_array_equal(arrays.num_words, [[128]])
    np.testing.assert_array_equal(arrays.words[0, 0, :128], np.concatenate(want))
    np.testing.assert_array_equal(arrays.words[0, 0, 128:], 0)
    np.testing.assert_array_equal(rans.decode_arrays(arrays), symbols)


class QuantizeFrequenciesTest(parameterized.TestCase):

  @parameterized.parameters(8, 12, 15)
  def test_sums_to_scale_and_is_locally_optimal(self, scale_bits):
    rng = np.random.default_rng(scale_bits)
    counts = np.bincount(np.clip(np.rint(rng.laplace(0, 3, 20000)) + 128, 0, 255).astype(int),
                         minlength=256)
    counts[rng.integers(0, 256, 5)] += 1  # a few rare outliers
    freqs = rans.quantize_frequencies(counts, scale_bits)
    self.assertEqual(int(freqs.sum()), 1 << scale_bits)
    np.testing.assert_array_equal(freqs > 0, counts > 0)
    # No single unit moved from symbol i to symbol j lowers the coded size sum(-c log2 f).
    nz = np.flatnonzero(counts)
    c, f = counts[nz].astype(float), freqs[nz].astype(float)
    take = np.where(f > 1, c * np.log2(f / np.maximum(f - 1, 1)), np.inf)   # cost of f_i - 1
    give = c * np.log2((f + 1) / f)                                         # gain of f_j + 1
    gain = give[None, :] - take[:, None]
    np.fill_diagonal(gain, -np.inf)
    self.assertLessEqual(gain.max(), 1e-9)
    # Cross entropy minus entropy, bits per symbol.
    p, q = c / c.sum(), f / f.sum()
    loss = float((p * np.log2(p / q)).sum())
    self.assertLess(loss, {8: 0.2, 12: 0.005, 15: 0.001}[scale_bits])

  def test_errors(self):
    with self.assertRaisesRegex(ValueError, "no symbols"):
      rans.quantize_frequencies(np.zeros(4), 12)
    with self.assertRaisesRegex(ValueError, "distinct symbols"):
      rans.quantize_frequencies(np.ones(300), 8)
    with self.assertRaisesRegex(ValueError, "scale_bits"):
      rans.quantize_frequencies(np.ones(3), 16)


def versions_x(rest):
  """Each case as version 1, version 2 with a lane per stream, and version 2 in segments."""
  out = []
  for name, symbols, lengths, kwargs in rest:
    out += [(name + "_v1", symbols, lengths, dict(kwargs, version=1)),
            (name + "_v2", symbols, lengths, kwargs),
            (name + "_v2_lane_steps_7", symbols, lengths, dict(kwargs, lane_steps=7))]
  return out


class RoundTripTest(parameterized.TestCase):

  @parameterized.named_parameters(*versions_x(cases()))
  def test_numpy_round_trip(self, symbols, lengths, kwargs):
    data = rans.encode(symbols, lengths, **kwargs)
    self.assertEqual(data[4], kwargs.get("version", 2))
    decoded, got_lengths = rans.decode(data)
    want_lengths = (np.full(symbols.shape[::2], symbols.shape[1]) if lengths is None
                    else lengths)
    np.testing.assert_array_equal(got_lengths, want_lengths)
    np.testing.assert_array_equal(decoded, masked(symbols, want_lengths))
    self.assertEqual(decoded.dtype, np.uint8 if symbols.max(initial=0) < 256 else np.uint16)
    # Deterministic bytes, and parse's fixed shapes.
    self.assertEqual(rans.encode(symbols, lengths, **kwargs), data)
    arrays = rans.parse(data)
    m_, t_, s_ = symbols.shape
    k_ = max(1, -(-t_ // kwargs.get("lane_steps", max(t_, 1))))
    b_ = kwargs.get("lanes", rans.DEFAULT_LANES)
    j_ = -(-s_ * k_ // b_)
    self.assertEqual(arrays.states.shape, (m_, j_, b_))
    self.assertEqual(arrays.words.shape[:2], (m_, j_))
    self.assertEqual((arrays.num_streams, arrays.num_steps, arrays.segments), (s_, t_, k_))
    self.assertLessEqual(int(arrays.lengths.max(initial=0)), rans.steps_per_lane(t_, k_))
    self.assertEqual(arrays.words.dtype, np.uint16)
    self.assertEqual(arrays.states.dtype, np.uint32)

  def test_words_per_block(self):
    symbols = laplace_symbols(0, (2, 40, 16), 3.0)
    data = rans.encode(symbols)
    longest = int(rans.parse(data).num_words.max())
    self.assertEqual(rans.parse(data).words.shape[2], max(64, 1 << (longest - 1).bit_length()))
    arrays = rans.parse(data, words_per_block=longest + 5)
    self.assertEqual(arrays.words.shape[2], longest + 5)
    np.testing.assert_array_equal(rans.decode_arrays(arrays), symbols)
    with self.assertRaisesRegex(ValueError, "words_per_block"):
      rans.parse(data, words_per_block=longest - 1)

  def test_encoder_rejects_bad_input(self):
    sym = np.zeros((1, 4, 4), np.uint8)
    for kwargs, pattern in [
        (dict(symbols_MTS=sym[0]), r"\[M, T, S\]"),
        (dict(symbols_MTS=sym.astype(np.float32)), "integer"),
        (dict(symbols_MTS=sym, lengths_MS=np.zeros((1, 3), int)), "lengths"),
        (dict(symbols_MTS=sym, lengths_MS=np.full((1, 4), 5)), "lengths must lie"),
        (dict(symbols_MTS=sym + 7, alphabet=4), r"\[0, 4\)"),
        (dict(symbols_MTS=sym - np.int8(1).astype(np.int16)), r"\[0, 256\)"),
        (dict(symbols_MTS=sym, lanes=0), "lanes"),
        (dict(symbols_MTS=sym, scale_bits=7), "scale_bits"),
        (dict(symbols_MTS=sym, alphabet=70000), "alphabet"),
        (dict(symbols_MTS=np.arange(300).reshape(1, 300, 1), scale_bits=8), "distinct"),
        (dict(symbols_MTS=sym, lane_steps=0), "lane_steps"),
        (dict(symbols_MTS=sym, version=3), "version"),
        (dict(symbols_MTS=sym, lane_steps=2, version=1), "version 1"),
    ]:
      with self.subTest(pattern):
        with self.assertRaisesRegex(ValueError, pattern):
          rans.encode(**kwargs)


class CorruptionTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    lengths = np.full((2, 10), 30)
    lengths[0, 0] = 0
    self.data = rans.encode(laplace_symbols(9, (2, 30, 10), 2.0), lengths, lanes=4, version=1)

  def test_every_truncation_and_extension(self):
    for n in range(len(self.data)):
      with self.assertRaisesRegex(rans.RansError, "truncated|header says"):
        rans.parse(self.data[:n])
    with self.assertRaisesRegex(rans.RansError, "header says"):
      rans.parse(self.data + b"\0")

  def test_every_flipped_byte(self):
    for i in range(len(self.data)):
      bad = bytearray(self.data)
      bad[i] ^= 0x10
      with self.assertRaises(rans.RansError):
        rans.parse(bytes(bad))

  def test_bad_magic_and_version(self):
    with self.assertRaisesRegex(rans.RansError, "magic"):
      rans.parse(b"KVRB" + self.data[4:])
    with self.assertRaisesRegex(rans.RansError, "version 3"):
      rans.parse(self.data[:4] + b"\3" + self.data[5:])
    with self.assertRaisesRegex(rans.RansError, "checksum|header says"):
      rans.parse(self.data[:4] + b"\2" + self.data[5:])

  def forge(self, offset, fmt, value):
    bad = bytearray(self.data)
    struct.pack_into(fmt, bad, offset, value)
    return resign(bytes(bad))

  def test_forged_structure(self):
    body = rans._HEAD_BYTES
    _, count0 = struct.unpack_from("<II", self.data, body)
    n_big0 = self.data[body + 8:body + 8 + count0].count(255)
    self.assertGreater(n_big0, 0)
    table1 = body + 8 + count0 + 2 * n_big0
    count1 = struct.unpack_from("<II", self.data, table1)[1]
    n_big1 = self.data[table1 + 8:table1 + 8 + count1].count(255)
    lengths_at = table1 + 8 + count1 + 2 * n_big1
    states_at = lengths_at + 4 * 20
    counts_at = states_at + 4 * 19
    for name, forged, pattern in [
        ("scale_bits", self.forge(5, "<B", 16), "scale_bits 16"),
        ("flags", self.forge(6, "<B", 6), "flags"),
        ("alphabet", self.forge(24, "<I", 0), "A=0"),
        ("lanes", self.forge(20, "<I", 0), "B=0"),
        ("huge", self.forge(16, "<I", 1 << 31), "M=2"),
        ("table_sum", self.forge(body + 8, "<B", 1), "sum to"),
        ("table_escape", self.forge(body + 8 + count0 + 2 * n_big0 - 2, "<H", 3), "escaped"),
        ("table_range", self.forge(body, "<I", 250), "leave the alphabet"),
        ("length", self.forge(lengths_at + 4, "<I", 31), "exceed T"),
        ("state", self.forge(states_at, "<I", 5), "below 2\\*\\*16"),
        ("word_count", self.forge(counts_at, "<I", 10 ** 6), "more words"),
        ("word_total", self.forge(counts_at, "<I", 1), "sections end|truncated"),
    ]:
      with self.subTest(name):
        with self.assertRaisesRegex(rans.RansError, pattern):
          rans.parse(forged)

  def test_forged_stream_of_a_model_without_table(self):
    lengths = np.array([[3, 3], [0, 0]])
    data = bytearray(rans.encode(laplace_symbols(1, (2, 3, 2), 1.0), lengths, version=1))
    words = int(rans.parse(bytes(data)).num_words.sum())
    lengths_at = len(data) - 2 * words - 4 * 2 - 4 * 2 - 4 * 4  # words, counts, states, lengths
    self.assertEqual(struct.unpack_from("<4I", data, lengths_at), (3, 3, 0, 0))
    struct.pack_into("<I", data, lengths_at + 8, 3)
    with self.assertRaisesRegex(rans.RansError, "without a table"):
      rans.parse(resign(bytes(data)))

  def test_forged_words_fail_the_end_state_check(self):
    arrays = rans.parse(self.data)
    words = arrays.words.copy()
    words[0, 0, 0] ^= 1
    with self.assertRaisesRegex(rans.RansError, "do not end where they began|reads past"):
      rans.decode_arrays(arrays._replace(words=words))
    fewer = arrays.num_words.copy()
    fewer[0, 0] -= 1
    with self.assertRaisesRegex(rans.RansError, "reads past|do not end"):
      rans.decode_arrays(arrays._replace(num_words=fewer))


class CorruptionVersion2Test(absltest.TestCase):

  def setUp(self):
    super().setUp()
    lengths = np.full((2, 10), 30)
    lengths[0, 0] = 0
    lengths[1, 4] = 11
    # Wide spreads: the tables are a zstd frame.
    self.data = rans.encode(laplace_symbols(9, (2, 30, 10), 30.0), lengths, lanes=4,
                            lane_steps=8)
    self.assertEqual(self.data[6], 3)     # explicit lengths, zstd side data

  def test_every_truncation_and_flipped_byte(self):
    for n in range(len(self.data)):
      with self.assertRaisesRegex(rans.RansError, "truncated|header says"):
        rans.parse(self.data[:n])
    for i in range(len(self.data)):
      bad = bytearray(self.data)
      bad[i] ^= 0x10
      with self.assertRaises(rans.RansError):
        rans.parse(bytes(bad))

  def forge(self, offset, fmt, value):
    bad = bytearray(self.data)
    struct.pack_into(fmt, bad, offset, value)
    return resign(bytes(bad))

  def test_forged_structure(self):
    body = rans._HEAD2_BYTES
    (packed,) = struct.unpack_from("<I", self.data, body)
    for name, forged, pattern in [
        ("segments_0", self.forge(28, "<I", 0), "K=0"),
        ("segments_over_T", self.forge(28, "<I", 31), "K=31"),
        ("segments_other", self.forge(28, "<I", 3), "side data ends|truncated|more words"),
        ("flags", self.forge(6, "<B", 7), "flags"),
        ("raw_side_data", self.forge(6, "<B", 1), "sum to|alphabet|escaped|truncated|exceed"),
        ("frame_size", self.forge(body, "<I", packed - 1), "decompress|truncated|header says"),
        ("frame_byte", self.forge(body + 4 + packed // 2, "<B",
                                  self.data[body + 4 + packed // 2] ^ 0xFF),
         "decompress|tables|sum to|alphabet|escaped|side data|exceed|below|more words|"
         "do not end|reads past"),
    ]:
      with self.subTest(name):
        with self.assertRaisesRegex(rans.RansError, pattern):
          rans.decode(forged)

  def test_forged_side_data(self):
    # Raw side data (flag bit 1 clear) forged inside a valid frame: each check still fires.
    arrays = rans.parse(self.data)
    (packed,) = struct.unpack_from("<I", self.data, rans._HEAD2_BYTES)
    start = rans._HEAD2_BYTES + 4
    side = bytearray(zstandard.ZstdDecompressor().decompress(self.data[start:start + packed]))
    words = self.data[start + packed:]
    lengths_at = len(side) - 4 * int(arrays.num_words.size) - 4 * int(
        (arrays.lengths > 0).sum()) - 4 * 20

    def rebuilt(side_bytes):
      head = bytearray(self.data[:rans._HEAD2_BYTES])
      head[6] = 1
      body = struct.pack("<I", len(side_bytes)) + bytes(side_bytes) + words
      struct.pack_into("<Q", head, 32, rans._HEAD2_BYTES + len(body))
      return resign(bytes(head) + body)

    np.testing.assert_array_equal(rans.decode(rebuilt(side))[0], rans.decode(self.data)[0])
    for name, offset, fmt, value, pattern in [
        ("length", lengths_at + 4, "<I", 31, "exceed T"),
        ("state_plane", len(side) - 4 * int(arrays.num_words.size) - 1, "<B", 0,
         "below 2\\*\\*16|do not end|reads past"),
        ("word_count", len(side) - 4, "<I", 10 ** 6, "more words"),
    ]:
      with self.subTest(name):
        bad = bytearray(side)
        struct.pack_into(fmt, bad, offset, value)
        with self.assertRaisesRegex(rans.RansError, pattern):
          rans.decode(rebuilt(bad))

  def test_version_1_flag_bit_1_is_unknown(self):
    data = rans.encode(laplace_symbols(9, (2, 30, 10), 2.0), version=1)
    bad = bytearray(data)
    bad[6] = 2
    with self.assertRaisesRegex(rans.RansError, "flags"):
      rans.parse(resign(bytes(bad)))

  def test_forged_words_fail_the_end_state_check(self):
    arrays = rans.parse(self.data)
    words = arrays.words.copy()
    words[1, 0, 0] ^= 1
    with self.assertRaisesRegex(rans.RansError, "do not end where they began|reads past"):
      rans.decode_arrays(arrays._replace(words=words))


class CompressionTest(parameterized.TestCase):

  @parameterized.named_parameters(
      # (spread of the quantized Laplacian, steps T, streams S per model, most bytes over the
      # bound); 16 models. Coarse symbols (1.9 bits) pay most for the per-stream state.
      ("coarse_256_steps", 0.6, 256, 128, 1.065),
      ("middle_256_steps", 2.0, 256, 128, 1.04),
      ("fine_256_steps", 8.0, 256, 128, 1.04),
      ("middle_2048_steps", 2.0, 2048, 16, 1.015),
  )
  def test_near_entropy_and_against_pcodec_and_zstd(self, scale, steps, streams, most):
    symbols = laplace_symbols(int(scale * 10), (16, steps, streams), scale)
    data = rans.encode(symbols, version=1)
    self.assertLessEqual(len(rans.encode(symbols)), len(data) + 4)  # version 2, same lanes
    bound = rans.empirical_entropy_bits(symbols) / 8
    arrays = rans.parse(data)
    tables = sum(8 + int(np.ptp(np.flatnonzero(f)) + 1) + 2 * int((f >= 255).sum())
                 for f in arrays.freqs)
    # Each stream's 32-bit final state holds about 8 bits of its symbols: about 3 bytes per
    # stream, plus the frequency tables, header and a 12-bit quantization loss, over the bound.
    per_stream = (len(data) - rans._HEAD_BYTES - tables - bound) / (16 * streams)
    self.assertBetween(per_stream, 2.0, 4.0)
    self.assertLess(len(data), bound * most)
    pco = len(entropy.encode_groups((symbols.astype(np.int16) - 128).astype(np.int8), 16))
    zstd = len(zstandard.ZstdCompressor(level=19).compress(symbols.tobytes()))
    # One state per stream is the price of decoding 16 x S lanes at once: short streams cost a
    # few % more than one-model-per-group pcodec (tANS) and zstd -19; long ones beat both.
    if steps == 256:
      self.assertLess(len(data), 1.06 * min(pco, zstd))
    else:
      self.assertLess(len(data), min(pco, zstd))


if __name__ == "__main__":
  absltest.main()
