"""Tests for kvjax.storage.format.codecs and kvjax.storage.format.entropy: specs, exact byte round trips,
lossless entropy coding, and that damaged bytes always raise instead of decoding to garbage."""

import zlib

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

from kvjax import codecs as registry
from kvjax.storage.format import codecs
from kvjax.storage.format import entropy
from kvjax.storage.format.types import KVLayout
from kvjax.testing import codec_payloads
from kvjax.testing.storage import bits

SMALL = KVLayout(num_layers=2, chunk_size=32, num_kv_heads=2, head_dim=8, dtype="float32")
ENCODINGS = (("raw", 0), ("int8", 0), ("int4", 0), ("cachegen", 0), ("cachegen", 1),
             ("cachegen", 2), ("cachegen", 3))


def payload_of(codec, level, layout=SMALL, seed=0):
  kv = codec_payloads.random_kv(layout.shape, seed, layout.dtype)
  return codec_payloads.encode(codec, level, kv)


def cachegen_payload(delta_q, layout=SMALL):
  """A valid cachegen payload around given delta symbols (anchors from a fixed pattern)."""
  n_layers, _, c, k, h = layout.shape
  a = c // codecs.cachegen_anchor_stride(c)
  anchor_q = (np.arange(n_layers * 2 * a * k * h) % 255 - 127).astype(np.int8)
  return {"anchor_q": anchor_q.reshape(n_layers, 2, a, k, h),
          "anchor_scale": np.full((n_layers, 2, k, h), 0.5, np.float32),
          "delta_q": np.asarray(delta_q, np.int8),
          "delta_step": np.full((n_layers, 2, k, h), 0.01, np.float32)}


def assert_same(test, got, want):
  test.assertEqual(list(got), list(want))
  for name in want:
    test.assertEqual(got[name].dtype, want[name].dtype, name)
    test.assertEqual(got[name].shape, want[name].shape, name)
    np.testing.assert_array_equal(bits(got[name]), bits(want[name]), err_msg=name)


class RegistryTest(absltest.TestCase):

  def test_registry(self):
    self.assertEqual(sorted(codecs.CODECS), [("cachegen", 1), ("int4", 1), ("int8", 1),
                                             ("kvtc", 5), ("raw", 1)])
    self.assertTrue(codecs.is_decodable("cachegen", 1, 3))
    self.assertFalse(codecs.is_decodable("cachegen", 1, 4))
    self.assertFalse(codecs.is_decodable("cachegen", 2, 0))
    self.assertFalse(codecs.is_decodable("zfp", 1, 0))
    self.assertEqual(codecs.codec_info("int4", 1).arrays, ("q", "scale", "zero"))
    with self.assertRaises(codecs.UnknownCodec):
      codecs.codec_info("int8", 2)
    with self.assertRaises(codecs.UnknownCodec):
      codecs.codec_info("int8", 1, level=1)
    self.assertTrue(issubclass(codecs.UnknownCodec, ValueError))
    self.assertTrue(issubclass(codecs.CorruptPayload, ValueError))

  def test_payload_specs(self):
    f32, f16 = np.dtype(np.float32), np.dtype(np.float16)
    lay = KVLayout(num_layers=3, chunk_size=256, num_kv_heads=2, head_dim=8, dtype="bfloat16")
    self.assertEqual(codecs.payload_spec("raw", 1, 0, lay),
                     {"values": (np.dtype("bfloat16"), (3, 2, 256, 2, 8))})
    self.assertEqual(codecs.payload_spec("int8", 1, 0, lay),
                     {"q": (np.dtype(np.int8), (3, 2, 256, 2, 8)), "scale": (f32, (3, 2, 2, 8))})
    self.assertEqual(codecs.payload_spec("int4", 1, 0, lay),
                     {"q": (np.dtype(np.uint8), (3, 2, 256, 2, 4)),
                      "scale": (f16, (3, 2, 4, 2, 8)), "zero": (f16, (3, 2, 4, 2, 8))})
    self.assertEqual(codecs.payload_spec("cachegen", 1, 2, lay),
                     {"anchor_q": (np.dtype(np.int8), (3, 2, 16, 2, 8)),
                      "anchor_scale": (f32, (3, 2, 2, 8)),
                      "delta_q": (np.dtype(np.int8), (3, 2, 256, 2, 8)),
                      "delta_step": (f32, (3, 2, 2, 8))})
    # Chunk sizes the caps (64, 16) do not divide: G and T are their largest divisors below the
    # caps (the registry's rule, re-exported here).
    self.assertEqual((codecs.int4_group_tokens(24), codecs.cachegen_anchor_stride(24)), (24, 12))
    self.assertEqual((codecs.int4_group_tokens(4), codecs.cachegen_anchor_stride(4)), (4, 4))
    self.assertEqual((codecs.int4_group_tokens(96), codecs.cachegen_anchor_stride(96)), (48, 16))
    self.assertIs(codecs.int4_group_tokens, registry.int4_group_tokens)
    self.assertEqual(codecs.CURRENT_VERSION, dict(registry.CODEC_VERSIONS))
    self.assertEqual({name: info.levels for (name, _), info in codecs.CODECS.items()},
                     dict(registry.CODEC_LEVELS))
    with self.assertRaisesRegex(ValueError, "does not divide"):
      codecs.payload_spec("int4", 1, 0, lay, group_tokens=48)
    with self.assertRaisesRegex(ValueError, "odd"):
      codecs.payload_spec("int4", 1, 0, KVLayout(1, 4, 1, 7, "float32"))
    with self.assertRaises(codecs.UnknownCodec):
      codecs.payload_spec("cachegen", 1, 4, lay)


class RoundTripTest(parameterized.TestCase):

  @parameterized.parameters(*ENCODINGS)
  def test_bytes_round_trip_exactly(self, codec, level):
    p = payload_of(codec, level)
    data = codecs.encode_payload(codec, level, p, SMALL)
    got = codecs.decode_payload(codec, 1, level, data, SMALL)
    assert_same(self, got, p)
    for a in got.values():
      self.assertTrue(a.flags.writeable and a.flags.c_contiguous)
    header = codecs.read_header(data)
    self.assertEqual((header.codec, header.version, header.level), (codec, 1, level))
    self.assertEqual([e.name for e in header.arrays], list(codecs.payload_spec(
        codec, 1, level, SMALL)))

  @parameterized.parameters("float32", "bfloat16", "float16")
  def test_raw_dtypes(self, dtype):
    lay = KVLayout(2, 4, 1, 8, dtype)
    p = payload_of("raw", 0, lay)
    data = codecs.encode_payload("raw", 0, p, lay)
    assert_same(self, codecs.decode_payload("raw", 1, 0, data, lay), p)

  def test_free_group_and_anchor_sizes(self):
    kv = codec_payloads.random_kv(SMALL.shape, 3)
    for p, codec in ((codec_payloads.encode_int4(kv, group_tokens=8), "int4"),
                     (codec_payloads.encode_cachegen(kv, 1, anchor_stride=4), "cachegen")):
      data = codecs.encode_payload(codec, 1 if codec == "cachegen" else 0, p, SMALL)
      assert_same(self, codecs.decode_payload(codec, 1, codecs.read_header(data).level, data,
                                              SMALL), p)

  def test_codings_chosen(self):
    lay = KVLayout(4, 64, 2, 16, "float32")
    kv = codec_payloads.random_kv(lay.shape, 1)
    data = codecs.encode_payload("cachegen", 3, codec_payloads.encode_cachegen(kv, 3), lay)
    coding = {e.name: (e.coding, e.nbytes) for e in codecs.read_header(data).arrays}
    self.assertEqual(coding["delta_q"][0], "pco")
    self.assertLess(coding["delta_q"][1] * 8 / np.prod(lay.shape), 3.0)  # bits per value
    self.assertEqual(codecs.read_header(codecs.encode_payload(
        "raw", 0, {"values": kv}, lay)).arrays[0].coding, "plain")

  def test_reference_encoder_error(self):
    kv = codec_payloads.random_kv((2, 2, 64, 2, 16), 4)
    errs = {c: codec_payloads.relative_error(kv, codec_payloads.decode(c, codec_payloads.encode(
        c, 1, kv))) for c in ("raw", "int8", "int4", "cachegen")}
    self.assertEqual(errs["raw"], 0.0)
    self.assertLess(errs["int8"], 0.01)
    self.assertLess(errs["int4"], 0.08)
    self.assertLess(errs["cachegen"], 0.08)


class EntropyTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("zeros", lambda r: np.zeros((2, 2, 32, 2, 8))),
      ("all_127", lambda r: np.full((2, 2, 32, 2, 8), 127)),
      ("all_minus_127", lambda r: np.full((2, 2, 32, 2, 8), -127)),
      ("plus_minus_127", lambda r: np.where(r.random((2, 2, 32, 2, 8)) < 0.5, -127, 127)),
      ("uniform", lambda r: r.integers(-127, 128, (2, 2, 32, 2, 8))),
      ("one_channel_constant", lambda r: np.where(
          np.arange(8) == 3, 5, np.clip(np.rint(r.normal(0, 4, (2, 2, 32, 2, 8))), -127, 127))),
      ("one_group_constant", lambda r: np.concatenate([
          np.zeros((1, 2, 32, 2, 8)), np.rint(r.normal(0, 2, (1, 2, 32, 2, 8)))])),
      ("laplace", lambda r: np.clip(np.rint(r.laplace(0, 3, (2, 2, 32, 2, 8))), -127, 127)),
  )
  def test_cachegen_symbols_lossless(self, make):
    delta_q = make(np.random.default_rng(0)).astype(np.int8)
    p = cachegen_payload(delta_q)
    data = codecs.encode_payload("cachegen", 1, p, SMALL)
    assert_same(self, codecs.decode_payload("cachegen", 1, 1, data, SMALL), p)

  @parameterized.parameters(1, 2, 4, 32)
  def test_groups_round_trip_full_int8_range(self, groups):
    rng = np.random.default_rng(groups)
    q = rng.integers(-128, 128, (4, 8, 32), dtype=np.int8)
    q[0] = -128  # a constant group at the range's end
    data = entropy.encode_groups(q, groups)
    np.testing.assert_array_equal(entropy.decode_groups(data, q.shape), q)

  def test_groups_bad_input(self):
    with self.assertRaisesRegex(ValueError, "int8"):
      entropy.encode_groups(np.zeros(4, np.int16), 1)
    with self.assertRaisesRegex(ValueError, "divide"):
      entropy.encode_groups(np.zeros(5, np.int8), 2)
    data = entropy.encode_groups(np.arange(64, dtype=np.int8), 2)
    for bad in (data[:3], data[:-1], data + b"\0", b"\0\0\0\0" + data[4:]):
      with self.assertRaises(entropy.EntropyError):
        entropy.decode_groups(bad, (64,))
    with self.assertRaises(entropy.EntropyError):
      entropy.decode_groups(data, (65,))  # another size


class DamageTest(parameterized.TestCase):

  @parameterized.parameters(("int8", 0), ("int4", 0), ("cachegen", 1))
  def test_truncated_raises(self, codec, level):
    data = codecs.encode_payload(codec, level, payload_of(codec, level), SMALL)
    start = codecs.read_header(data).data_offset
    for cut in sorted({0, 1, 4, 5, 9, start - 5, start - 1, start, start + 1,
                       (start + len(data)) // 2, len(data) - 1}):
      with self.subTest(cut=cut), self.assertRaises(codecs.CorruptPayload):
        codecs.decode_payload(codec, 1, level, data[:cut], SMALL)
    with self.assertRaises(codecs.CorruptPayload):
      codecs.decode_payload(codec, 1, level, data + b"\0", SMALL)

  @parameterized.parameters(("int8", 0), ("int4", 0), ("cachegen", 0), ("cachegen", 3))
  def test_every_flipped_byte_raises_or_decodes_exactly(self, codec, level):
    # Never garbage: a damaged byte raises, or (a few pcodec padding bits that no value depends
    # on) the decode is still bit-exact. The store's SHA-256 catches those too.
    lay = KVLayout(1, 16, 1, 4, "float32")
    p = payload_of(codec, level, lay)
    data = codecs.encode_payload(codec, level, p, lay)
    header_end = codecs.read_header(data).data_offset
    raised = 0
    for i in range(len(data)):
      bad = bytearray(data)
      bad[i] ^= 0x41
      with self.subTest(byte=i):
        try:
          got = codecs.decode_payload(codec, 1, level, bytes(bad), lay)
        except codecs.CorruptPayload:
          raised += 1
          continue
        self.assertGreaterEqual(i, header_end)  # the header is fully covered by its CRC
        assert_same(self, got, p)
    self.assertGreater(raised, 0.95 * len(data))

  def test_damaged_array_with_repaired_header_crc_raises(self):
    # A valid header over damaged data: the per-array CRC (or the decoder) must catch it.
    p = payload_of("cachegen", 1)
    data = bytearray(codecs.encode_payload("cachegen", 1, p, SMALL))
    header = codecs.read_header(bytes(data))
    data[-10] ^= 0xFF
    data[header.data_offset - 4:header.data_offset] = zlib.crc32(
        bytes(data[:header.data_offset - 4])).to_bytes(4, "little")
    with self.assertRaises(codecs.CorruptPayload):
      codecs.decode_payload("cachegen", 1, 1, bytes(data), SMALL)

  def test_mismatched_requests(self):
    data = codecs.encode_payload("cachegen", 1, payload_of("cachegen", 1), SMALL)
    for codec, version, level, lay in (
        ("cachegen", 1, 2, SMALL), ("int8", 1, 0, SMALL),
        ("cachegen", 1, 1, KVLayout(3, 32, 2, 8, "float32")),
        ("cachegen", 1, 1, KVLayout(2, 64, 2, 8, "float32"))):
      with self.subTest(codec=codec, level=level, layout=lay), self.assertRaises(
          codecs.CorruptPayload):
        codecs.decode_payload(codec, version, level, data, lay)
    for codec, version, level in (("zfp", 1, 0), ("cachegen", 2, 1), ("cachegen", 1, 9)):
      with self.assertRaises(codecs.UnknownCodec):
        codecs.decode_payload(codec, version, level, data, SMALL)
    with self.assertRaisesRegex(codecs.CorruptPayload, "magic"):
      codecs.decode_payload("int8", 1, 0, b"not a payload at all", SMALL)


class ValidationTest(parameterized.TestCase):

  def test_bad_payloads_raise_value_error(self):
    good = payload_of("int8", 0)
    cases = {
        "missing": {"q": good["q"]},
        "extra": {**good, "zero": good["scale"]},
        "dtype": {**good, "q": good["q"].astype(np.int16)},
        "shape": {**good, "scale": good["scale"][:1]},
        "nan": {**good, "scale": np.full_like(good["scale"], np.nan)},
        "minus_128": {**good, "q": np.full_like(good["q"], -128)},
    }
    for name, arrays in cases.items():
      with self.subTest(name), self.assertRaises(ValueError):
        codecs.encode_payload("int8", 0, arrays, SMALL)
    p4 = payload_of("int4", 0)
    with self.assertRaisesRegex(ValueError, "token groups"):
      codecs.encode_payload("int4", 0, {**p4, "scale": p4["scale"][:, :, :0],
                                        "zero": p4["zero"][:, :, :0]}, SMALL)
    with self.assertRaises(codecs.UnknownCodec):
      codecs.encode_payload("zfp", 0, good, SMALL)
    with self.assertRaises(codecs.UnknownCodec):
      codecs.encode_payload("int8", 1, good, SMALL)
    with self.assertRaises(ValueError):  # raw values of another dtype than the layout's
      codecs.encode_payload("raw", 0, {"values": np.zeros(SMALL.shape, np.float16)}, SMALL)


if __name__ == "__main__":
  absltest.main()
