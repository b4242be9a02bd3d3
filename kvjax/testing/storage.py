"""Shared fixtures for chunk-store tests on every backend: tiny layouts, keys, assertions."""

from __future__ import annotations

import asyncio

import ml_dtypes
import numpy as np

from kvjax.storage.format import keys
from kvjax.storage.format.types import ChunkMiss, EncodedPayload, KVLayout
from kvjax.testing import codec_payloads

C = 4
NS = keys.KeyNamespace("fp", "float32", 1, C)
TOKENS = list(range(100, 100 + 3 * C))
HASHES = keys.chunk_hashes(NS, TOKENS)
ROOT = NS.root_hash()


def layout(dtype="float32", num_layers=3) -> KVLayout:
  """A tiny `[L, 2, C, 2, 8]` layout."""
  return KVLayout(num_layers=num_layers, chunk_size=C, num_kv_heads=2, head_dim=8, dtype=dtype)


def values(kv_layout: KVLayout, seed=0) -> np.ndarray:
  """Random normal values of the layout's shape and dtype."""
  x = np.random.default_rng(seed).standard_normal(kv_layout.shape, dtype=np.float32)
  return x.astype(ml_dtypes.bfloat16 if kv_layout.dtype == "bfloat16" else kv_layout.dtype)


#: Every non-raw encoding, (codec, level).
CODEC_LEVELS = (("int8", 0), ("int4", 0), ("cachegen", 0), ("cachegen", 1), ("cachegen", 2),
                ("cachegen", 3))


def payloads(kv: np.ndarray, which=CODEC_LEVELS) -> list[EncodedPayload]:
  """Valid payloads of `kv` for each (codec, level) in `which` (reference numpy encoder)."""
  return [EncodedPayload(c, lv, codec_payloads.encode(c, lv, kv)) for c, lv in which]


def bits(x: np.ndarray) -> np.ndarray:
  """The raw bytes of an array (exact comparisons, NaN-safe)."""
  return np.ascontiguousarray(x).reshape(-1).view(np.uint8)


def run(coro):
  return asyncio.run(coro)


class StoreAssertions:
  """Mixin for `absltest.TestCase`s over a `ChunkStore`."""

  def make_store(self, backend="memory", **kwargs):
    """A `ChunkStore` on `backend` ("memory", "file" or "ocdbt", the last two in a temporary
    folder; its path and URL kept as `self.tmp` and `self.url`), closed at the test's end;
    `kwargs` go to the store."""
    from kvjax.storage.backends import chunk_store  # noqa: PLC0415 (the mixin's only user)
    self.tmp = self.create_tempdir().full_path
    url = {"memory": "memory://t", "file": f"file://{self.tmp}/store",
           "ocdbt": f"ocdbt+file://{self.tmp}/store"}[backend]
    store = chunk_store.ChunkStore(url, **kwargs)
    self.addCleanup(store.close)
    self.url = url
    return store

  async def rewrite_raw(self, store, chunk_hash, edit):
    """Replaces the bytes of a chunk's raw object with `edit(bytes)` (damage for tests)."""
    root = await store.kvstore()
    key = await self.shard_key(store, chunk_hash)
    await root.write(key, edit((await root.read(key)).value))

  async def put0(self, store, kv_layout=None, seed=0):
    kv = values(kv_layout or layout(), seed)
    self.assertTrue(await store.put(HASHES[0], ROOT, TOKENS[:C], ROOT, kv))
    return kv

  async def keys_under(self, store, prefix=""):
    root = await store.kvstore()
    return sorted(k.decode() for k in await root.list() if k.decode().startswith(prefix))

  async def shard_key(self, store, chunk_hash):
    """The key holding a chunk's raw values: one object `data/<hash>/raw-0-<checksum>` (record
    format 2), or the shard `.../c/0/0/0/0/0` of a format 1 zarr3 array."""
    raw = [k for k in await self.keys_under(store, f"data/{chunk_hash}/raw-")
           if k.count("/") == 2 or k.endswith("/c/0/0/0/0/0")]
    self.assertLen(raw, 1)
    return raw[0]

  def assert_miss(self, store, result, reason):
    self.assertIsInstance(result, ChunkMiss)
    self.assertEqual(result.reason, reason, result.detail)
    self.assertEqual(store.stats.snapshot()["misses_by_reason"], {reason.value: 1})
