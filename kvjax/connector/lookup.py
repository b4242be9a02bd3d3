"""The connector's keys and lookups: namespaces, chained chunk keys, session tails, batched
prefix lookups and the synchronous raw reads and writes of session re-rotation.

`KeyScheme` is the key scheme (plain, frozen: no state); `PrefixLookups` asks the store which
prefix chunks it holds and owns only the count of lookups that failed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import threading
from typing import Callable, Sequence

import numpy as np

from kvjax import codecs
from kvjax._typing import ChunkHash
from kvjax.block_hash import loadable_units
from kvjax.connector.loop import StoreLoop
from kvjax.connector.records import SAVING, PrefixLookup, StoredTail
from kvjax.storage.format import keys
from kvjax.storage.format.types import ChunkHit, ChunkOrigin, ChunkRecord, KVLayout

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class KeyScheme:
  """How one model's chunks are keyed (plain data; every part of the connector reads it).

  Attributes:
    model_fingerprint: seeds every key (`kvjax.models.loading.fingerprint`).
    layout: stored chunk layout `[L, 2, C, K, H]` and dtype.
    kv_layout_version: `kvjax.models.nn.kv_cache.KV_LAYOUT_VERSION`.
    codec: the encoding new chunks are stored with ("raw", "int8", ...).
    key_encoding: `KeyNamespace.encoding` of every key ("codec/level" of a consistent engine's
      one lossy level), or None.
  """

  model_fingerprint: str
  layout: KVLayout
  kv_layout_version: int
  codec: str = codecs.RAW
  key_encoding: str | None = None

  @property
  def chunk_size(self) -> int:
    return self.layout.chunk_size

  @functools.cached_property
  def origin(self) -> ChunkOrigin:
    """What every chunk stored under this scheme records as its origin, and every chunk loaded
    must have recorded (the stored-chunk guard, `ChunkRecord.mismatch`)."""
    return ChunkOrigin(model_fingerprint=self.model_fingerprint,
                       kv_layout_version=self.kv_layout_version)

  def namespace(self, cache_salt: str | None) -> keys.KeyNamespace:
    return keys.KeyNamespace(model_fingerprint=self.model_fingerprint,
                             kv_dtype=self.layout.dtype,
                             kv_layout_version=self.kv_layout_version,
                             chunk_size=self.chunk_size, cache_salt=cache_salt,
                             encoding=self.key_encoding)

  @property
  def stores_tails(self) -> bool:
    """Whether session tails are stored and looked up (`keys.tail_hash`): raw chunks only (a
    lossy tail could make a session turn's answer depend on whether its tail was stored)."""
    return self.codec == codecs.RAW and self.key_encoding is None

  def tail_key(self, namespace: str, hashes: Sequence[ChunkHash], token_ids: Sequence[int],
               end: int) -> tuple[int, ChunkHash, ChunkHash] | None:
    """`(index, parent, key)` of the tail of `token_ids[:end]` (the tokens after its last full
    chunk) under namespace root `namespace`, `hashes` being the chained keys of its first full
    chunks (at least `end // C`); None when `end` is a multiple of C (no tail)."""
    k, m = divmod(end, self.chunk_size)
    if not m:
      return None
    parent = hashes[k - 1] if k else ChunkHash(namespace)
    return k, parent, keys.tail_hash(parent, token_ids[k * self.chunk_size:end])

  def extend_chunk_hashes(self, namespace: str, hashes: Sequence[ChunkHash],
                          token_ids: Sequence[int], num_chunks: int) -> list[ChunkHash]:
    """`hashes` (chained keys of the first chunks of `token_ids` under namespace root
    `namespace`) extended to `num_chunks` keys, chained from them.

    Raises:
      ValueError: `token_ids` shorter than `num_chunks` chunks.
    """
    c = self.chunk_size
    if len(token_ids) < num_chunks * c:
      raise ValueError(f"{num_chunks} chunks of {c} need {num_chunks * c} tokens, got "
                       f"{len(token_ids)}")
    out = list(hashes)
    for j in range(len(out), num_chunks):
      out.append(keys.hash_chunk(out[-1] if out else ChunkHash(namespace),
                                 token_ids[j * c:(j + 1) * c]))
    return out


class PrefixLookups:
  """Batched prefix lookups and the synchronous raw reads and writes, over a `TieredStore`.

  Owns: `failures` (lookups the store failed), under its own lock. Called from the engine
  thread (and the session registry's re-rotation, on the engine thread); blocks on the store
  loop.

  Args:
    store: the tiered store.
    scheme: the key scheme.
    loop: the connector's event loop.
    saving: `Callable[[Sequence[ChunkHash]], set[ChunkHash]]`, the keys among those whose save is
      queued or being written (`Saver.pending_keys`).
  """

  def __init__(self, store, scheme: KeyScheme, loop: StoreLoop,
               saving: Callable[[Sequence[ChunkHash]], set[ChunkHash]]):
    self._store = store
    self._scheme = scheme
    self._loop = loop
    self._saving = saving
    self._lock = threading.Lock()
    self._failures = 0

  @property
  def failures(self) -> int:
    """Lookups the store failed (each degraded to "nothing present")."""
    with self._lock:
      return self._failures

  def lookup(self, prompt_ids: Sequence[int], cache_salt: str | None, *,
             history_tokens: int = 0) -> PrefixLookup:
    """Asks every tier, in one batch, which prefix chunks of the prompt are stored.

    Candidates are the full chunks of `prompt_ids[:-1]` (a hit never covers the last prompt
    token). With `history_tokens` h (a session turn: the prompt's first h tokens are the
    previous turn's prompt and output but its last sampled token, whose KV the previous request
    left, `stores_tails`), the same batch asks for the tail of `prompt_ids[:h]`
    (`keys.tail_hash`); it is kept only when no chunk at or after its index is present (a full
    chunk covers more). With raw chunks, a chunk or tail no tier holds yet whose save is queued
    or being written is present as `SAVING` (a turn sent the moment the last one answered still
    finds its history; its load waits for the write). A store that fails the lookup degrades to
    "nothing present" with a warning.
    """
    s = self._scheme
    ns = s.namespace(cache_salt)
    hashes = keys.chunk_hashes(ns, prompt_ids)
    root = ns.root_hash()
    candidates = hashes[:loadable_units(len(prompt_ids), s.chunk_size)]
    tail = None
    if s.stores_tails and 0 < history_tokens < len(prompt_ids):
      tail = s.tail_key(root, hashes, prompt_ids, history_tokens)
    present: list[str | None] = [None] * len(candidates)
    records: list[ChunkRecord | None] = [None] * len(candidates)
    stored_tail = None
    if candidates or tail is not None:
      try:
        asked = candidates + ([tail[2]] if tail else [])
        # A hit without a record is read as raw (`records`). Asked before the peek: one that
        # lands meanwhile is stored either way.
        saving = self._saving(asked) if s.codec == codecs.RAW else set()
        found = self._loop.run(self._store.peek(asked))
        found = [f if f is not None or h not in saving else (SAVING, None)
                 for h, f in zip(asked, found)]
        present = [f[0] if f is not None else None for f in found[:len(candidates)]]
        records = [f[1] if f is not None else None for f in found[:len(candidates)]]
        if tail is not None and found[-1] is not None and not any(present[tail[0]:]):
          stored_tail = StoredTail(tail[0], history_tokens - tail[0] * s.chunk_size, tail[2],
                                   found[-1][0], found[-1][1])
      except Exception as e:  # noqa: BLE001 - an unreachable store degrades to compute
        with self._lock:
          self._failures += 1
        present = [None] * len(candidates)
        records = [None] * len(candidates)
        _log.warning("KV store lookup failed (%r); computing the prompt instead", e)
    return PrefixLookup(hashes=hashes, namespace=root, present=present, records=records,
                        tail=stored_tail)

  def read_raw_chunks(self, lookup: PrefixLookup, token_ids: Sequence[int],
                      indices: Sequence[int]) -> dict[int, np.ndarray]:
    """Reads prefix chunks synchronously (verified like every load; not through the load
    pipeline, no staging): `{index: [L, 2, C, K, H] K before RoPE and V}` for each of `indices`
    the lookup found stored with a raw encoding and that verified; the others are left out (a
    lossy-only chunk, a miss). Used by session re-rotation
    (`kvjax.engine.rerotation.stage_rerotated`).
    """
    s = self._scheme
    c, origin = s.chunk_size, s.origin
    want = [i for i in indices if i < len(lookup.present) and lookup.present[i] is not None]
    if not want:
      return {}

    async def read_all():
      return await asyncio.gather(*(self._store.get(
          lookup.hashes[i], tuple(token_ids[i * c:(i + 1) * c]), lookup.namespace, s.layout,
          origin=origin,
          choose=lambda encs: next((e for e in encs if e.codec == codecs.RAW), None))
          for i in want), return_exceptions=True)

    out = {}
    for i, got in zip(want, self._loop.run(read_all())):
      if isinstance(got, ChunkHit) and got.kv is not None:
        out[i] = np.asarray(got.kv)
    return out

  def put_raw_chunks(self, cache_salt: str | None, token_ids: Sequence[int],
                     chunks: Sequence[np.ndarray], *, first: int = 0) -> int:
    """Writes `chunks` (`[L, 2, C, K, H]` each, K before RoPE) synchronously as chunks
    `[first, first + len(chunks))` of `token_ids` under `cache_salt`'s namespace (chained keys
    as every chunk: the chunks before `first` need not be stored, keys chain through token
    ids); returns how many the store published or already held.

    Raises:
      ValueError: `first` < 0 or chunks past the end of `token_ids`.
    """
    s = self._scheme
    c, origin = s.chunk_size, s.origin
    if first < 0 or (first + len(chunks)) * c > len(token_ids):
      raise ValueError(f"chunks [{first}, {first + len(chunks)}) of {c} tokens do not fit "
                       f"{len(token_ids)} tokens")
    ns = s.namespace(cache_salt)
    hashes = keys.chunk_hashes(ns, token_ids, max_tokens=(first + len(chunks)) * c)
    root = ns.root_hash()

    async def put_all():
      return await asyncio.gather(*(self._store.put(
          hashes[i], hashes[i - 1] if i else root, tuple(token_ids[i * c:(i + 1) * c]), root,
          np.asarray(chunks[i - first]), origin=origin)
          for i in range(first, first + len(chunks))),
          return_exceptions=True)

    return sum(not isinstance(r, BaseException) for r in self._loop.run(put_all()))
