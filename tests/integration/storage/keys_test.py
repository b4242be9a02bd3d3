"""Tests for kvjax.storage.format.keys."""

import dataclasses
import hashlib
import os
import subprocess
import sys

from absl.testing import absltest
from absl.testing import parameterized

from kvjax.storage.format import keys

NS = keys.KeyNamespace(model_fingerprint="fp", kv_dtype="bfloat16", kv_layout_version=1,
                       chunk_size=4)


class KeyNamespaceTest(parameterized.TestCase):

  def test_root_is_hex_sha256(self):
    root = NS.root_hash()
    self.assertLen(root, 64)
    int(root, 16)

  @parameterized.parameters(
      ("model_fingerprint", "fp2"), ("kv_dtype", "float32"), ("kv_layout_version", 2),
      ("chunk_size", 8), ("cache_salt", "tenant-a"), ("cache_salt", ""),
      ("encoding", "kvtc/1"))
  def test_each_field_changes_root(self, field, value):
    self.assertNotEqual(dataclasses.replace(NS, **{field: value}).root_hash(), NS.root_hash())

  def test_none_salt_differs_from_empty_salt(self):
    self.assertNotEqual(dataclasses.replace(NS, cache_salt=None).root_hash(),
                        dataclasses.replace(NS, cache_salt="").root_hash())

  def test_no_encoding_keeps_the_root_of_the_five_fields(self):
    # Keys of every engine but a consistent one's are what they were before `encoding` existed.
    h = hashlib.sha256()
    h.update(keys._field(keys._T_BYTES, keys._ROOT_DOMAIN))
    for value in ("fp", "bfloat16", 1, 4, None):
      h.update(keys._encode_value(value))
    ns = keys.KeyNamespace("fp", "bfloat16", 1, 4)
    self.assertEqual(ns.root_hash(), h.hexdigest())
    self.assertNotEqual(dataclasses.replace(ns, encoding="int8/0").root_hash(), h.hexdigest())

  def test_fields_do_not_run_together(self):
    a = keys.KeyNamespace("ab", "c", 1, 4)
    b = keys.KeyNamespace("a", "bc", 1, 4)
    self.assertNotEqual(a.root_hash(), b.root_hash())

  def test_rejects_nonpositive_chunk_size(self):
    with self.assertRaises(ValueError):
      keys.KeyNamespace("fp", "float32", 1, 0)


class HashChunkTest(parameterized.TestCase):

  def test_deterministic(self):
    root = NS.root_hash()
    self.assertEqual(keys.hash_chunk(root, [1, 2, 3]), keys.hash_chunk(root, (1, 2, 3)))

  def test_parent_and_tokens_matter(self):
    root = NS.root_hash()
    h = keys.hash_chunk(root, [1, 2, 3, 4])
    self.assertNotEqual(h, keys.hash_chunk(root, [1, 2, 3, 5]))
    self.assertNotEqual(h, keys.hash_chunk(root, [2, 1, 3, 4]))
    self.assertNotEqual(h, keys.hash_chunk(keys.hash_chunk(root, [0]), [1, 2, 3, 4]))

  def test_token_width_is_fixed(self):
    root = NS.root_hash()
    self.assertNotEqual(keys.hash_chunk(root, [256]), keys.hash_chunk(root, [1, 0]))
    self.assertNotEqual(keys.hash_chunk(root, [0]), keys.hash_chunk(root, []))
    self.assertNotEqual(keys.hash_chunk(root, [-1]), keys.hash_chunk(root, [2**63 - 1]))

  @parameterized.named_parameters(
      ("split", ("ab", "c"), ("a", "bc")),
      ("empty_list_vs_empty_string", (), ("",)),
      ("int_vs_str", (1,), ("1",)),
      ("str_vs_bytes", ("x",), (b"x",)),
      ("order", ("a", "b"), ("b", "a")),
      ("tokens_vs_extras", (), (0,)),
  )
  def test_extras_are_typed_and_length_prefixed(self, a, b):
    root = NS.root_hash()
    self.assertNotEqual(keys.hash_chunk(root, [1, 2], a), keys.hash_chunk(root, [1, 2], b))

  def test_rejects_bad_extra(self):
    with self.assertRaises(TypeError):
      keys.hash_chunk(NS.root_hash(), [1], [1.5])
    with self.assertRaises(TypeError):
      keys.hash_chunk(NS.root_hash(), [1], [True])

  def test_rejects_out_of_range_token(self):
    with self.assertRaises(ValueError):
      keys.hash_chunk(NS.root_hash(), [2**63])


class ChunkHashesTest(parameterized.TestCase):

  def test_chaining(self):
    ids = list(range(10))
    hs = keys.chunk_hashes(NS, ids)
    self.assertLen(hs, 2)  # The 2-token tail has no key.
    h0 = keys.hash_chunk(NS.root_hash(), ids[0:4])
    self.assertEqual(hs, [h0, keys.hash_chunk(h0, ids[4:8])])

  def test_prefix_property(self):
    ids = list(range(20))
    self.assertEqual(keys.chunk_hashes(NS, ids)[:3], keys.chunk_hashes(NS, ids[:13]))

  def test_earlier_token_changes_all_later_keys(self):
    a = keys.chunk_hashes(NS, list(range(12)))
    b = keys.chunk_hashes(NS, [99] + list(range(1, 12)))
    self.assertTrue(all(x != y for x, y in zip(a, b)))

  def test_max_tokens(self):
    ids = list(range(20))
    self.assertEqual(keys.chunk_hashes(NS, ids, max_tokens=11), keys.chunk_hashes(NS, ids[:11]))
    self.assertEqual(keys.chunk_hashes(NS, ids, max_tokens=0), [])

  def test_namespace_changes_all_keys(self):
    ids = list(range(8))
    other = keys.chunk_hashes(dataclasses.replace(NS, cache_salt="t"), ids)
    self.assertTrue(all(x != y for x, y in zip(keys.chunk_hashes(NS, ids), other)))

  @parameterized.parameters((3, 0), (4, 0), (5, 1), (8, 1), (9, 2), (0, 0), (1, 0))
  def test_prompt_prefix_rule(self, n, want_chunks):
    c = NS.chunk_size
    prompt = list(range(100, 100 + n))
    hs = keys.prefix_chunk_hashes_for_prompt(NS, prompt)
    self.assertLen(hs, want_chunks)
    if n:
      self.assertEqual(c * len(hs), c * ((n - 1) // c))
    self.assertEqual(hs, keys.chunk_hashes(NS, prompt)[:want_chunks])


class TailKeyTest(absltest.TestCase):
  """Stored tails (a session turn's last partial chunk): their own keys, padded token ids."""

  def test_a_tail_key_is_never_a_chunk_key(self):
    root = NS.root_hash()
    ids = [5, 6, 7]
    t = keys.tail_hash(root, ids)
    self.assertNotEqual(t, keys.hash_chunk(root, ids))
    self.assertNotEqual(t, keys.hash_chunk(root, keys.tail_token_ids(ids, 4)))
    self.assertEqual(t, keys.tail_hash(root, ids))  # deterministic

  def test_parent_tokens_and_length_change_the_key(self):
    root = NS.root_hash()
    h0 = keys.chunk_hashes(NS, range(4))[0]
    base = keys.tail_hash(h0, [1, 2])
    for other in (keys.tail_hash(root, [1, 2]), keys.tail_hash(h0, [1, 3]),
                  keys.tail_hash(h0, [1]), keys.tail_hash(h0, [1, 2, 3]),
                  keys.tail_hash(h0, [1, 2, keys.TAIL_PAD_ID])):
      self.assertNotEqual(base, other)

  def test_padded_token_ids(self):
    self.assertEqual(keys.tail_token_ids([9, 8], 4), (9, 8, -1, -1))
    self.assertEqual(keys.tail_token_ids([9, 8, 7], 4), (9, 8, 7, -1))
    for bad in ([], [1, 2, 3, 4]):
      with self.assertRaisesRegex(ValueError, "a tail holds 1 to 3 tokens"):
        keys.tail_token_ids(bad, 4)
    with self.assertRaisesRegex(ValueError, "at least one token"):
      keys.tail_hash(NS.root_hash(), [])


_SNIPPET = """
from kvjax.storage.format import keys
ns = keys.KeyNamespace("fp", "bfloat16", 1, 4, cache_salt="s")
print(ns.root_hash(), *keys.chunk_hashes(ns, list(range(9))),
      keys.hash_chunk("p", [1], ["x", 2, b"y"]))
"""


class DeterminismTest(absltest.TestCase):

  def test_same_across_processes_and_hash_seeds(self):
    outs = []
    for seed in ("0", "12345"):
      env = dict(os.environ, PYTHONHASHSEED=seed)
      out = subprocess.run([sys.executable, "-c", _SNIPPET], env=env, check=True,
                           capture_output=True, text=True).stdout.split()
      outs.append(out)
    self.assertEqual(outs[0], outs[1])
    ns = keys.KeyNamespace("fp", "bfloat16", 1, 4, cache_salt="s")
    here = [ns.root_hash(), *keys.chunk_hashes(ns, list(range(9))),
            keys.hash_chunk("p", [1], ["x", 2, b"y"])]
    self.assertEqual(outs[0], here)


if __name__ == "__main__":
  absltest.main()
