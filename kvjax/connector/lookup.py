"""The connector's keys and lookups: namespaces, chained chunk keys, session tails, batched
prefix lookups and the synchronous raw reads and writes of session re-rotation."""

from __future__ import annotations

import asyncio
import logging
from typing import Sequence

import numpy as np

from kvjax import codecs
from kvjax._typing import ChunkHash
from kvjax.block_hash import loadable_units
from kvjax.connector.records import SAVING, PrefixLookup, StoredTail
from kvjax.storage import keys
from kvjax.storage.types import ChunkHit, ChunkRecord

_log = logging.getLogger(__name__)


class LookupMixin:
  """Keys and lookups of `KVStoreClient` (`kvjax/connector/client.py` owns the state)."""

  def namespace(self, cache_salt: str | None) -> keys.KeyNamespace:
    return keys.KeyNamespace(model_fingerprint=self._fingerprint, kv_dtype=self.layout.dtype,
                             kv_layout_version=self._layout_version,
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
    ns = self.namespace(cache_salt)
    hashes = keys.chunk_hashes(ns, prompt_ids)
    root = ns.root_hash()
    candidates = hashes[:loadable_units(len(prompt_ids), self.chunk_size)]
    tail = None
    if self.stores_tails and 0 < history_tokens < len(prompt_ids):
      tail = self.tail_key(root, hashes, prompt_ids, history_tokens)
    present: list[str | None] = [None] * len(candidates)
    records: list[ChunkRecord | None] = [None] * len(candidates)
    stored_tail = None
    if candidates or tail is not None:
      try:
        asked = candidates + ([tail[2]] if tail else [])
        saving = set()
        if self.codec == codecs.RAW:  # a hit without a record is read as raw (`records`)
          with self._lock:  # before the peek: one that lands meanwhile is stored either way
            saving = {h for h in asked if h in self._saving}
        found = self._run(self.store.peek(asked))
        found = [f if f is not None or h not in saving else (SAVING, None)
                 for h, f in zip(asked, found)]
        present = [f[0] if f is not None else None for f in found[:len(candidates)]]
        records = [f[1] if f is not None else None for f in found[:len(candidates)]]
        if tail is not None and found[-1] is not None and not any(present[tail[0]:]):
          stored_tail = StoredTail(tail[0], history_tokens - tail[0] * self.chunk_size, tail[2],
                                   found[-1][0], found[-1][1])
      except Exception as e:  # noqa: BLE001 - an unreachable store degrades to compute
        self.lookup_failures += 1
        present = [None] * len(candidates)
        records = [None] * len(candidates)
        _log.warning("KV store lookup failed (%r); computing the prompt instead", e)
    return PrefixLookup(hashes=hashes, namespace=root, present=present, records=records,
                        tail=stored_tail)

  def extend_chunk_hashes(self, lookup: PrefixLookup, hashes: Sequence[ChunkHash],
                          token_ids: Sequence[int], num_chunks: int) -> list[ChunkHash]:
    """`hashes` (chained keys of the first chunks of `token_ids`, under `lookup`'s namespace)
    extended to `num_chunks` keys: the keys of a sequence that grew past its prompt (output
    tokens), chained from the prompt's.

    Raises:
      ValueError: `token_ids` shorter than `num_chunks` chunks.
    """
    c = self.chunk_size
    if len(token_ids) < num_chunks * c:
      raise ValueError(f"{num_chunks} chunks of {c} need {num_chunks * c} tokens, got "
                       f"{len(token_ids)}")
    out = list(hashes)
    for j in range(len(out), num_chunks):
      out.append(keys.hash_chunk(out[-1] if out else ChunkHash(lookup.namespace),
                                 token_ids[j * c:(j + 1) * c]))
    return out

  def read_raw_chunks(self, lookup: PrefixLookup, token_ids: Sequence[int],
                      indices: Sequence[int]) -> dict[int, np.ndarray]:
    """Reads prefix chunks synchronously (verified like every load; not through the load
    pipeline, no staging): `{index: [L, 2, C, K, H] K before RoPE and V}` for each of `indices`
    the lookup found stored with a raw encoding and that verified; the others are left out (a
    lossy-only chunk, a miss). Used by session re-rotation
    (`kvjax.engine.rerotation.stage_rerotated`).
    """
    c = self.chunk_size
    want = [i for i in indices if i < len(lookup.present) and lookup.present[i] is not None]
    if not want:
      return {}

    async def read_all():
      return await asyncio.gather(*(self.store.get(
          lookup.hashes[i], tuple(token_ids[i * c:(i + 1) * c]), lookup.namespace, self.layout,
          origin=self.origin,
          choose=lambda encs: next((e for e in encs if e.codec == codecs.RAW), None))
          for i in want), return_exceptions=True)

    out = {}
    for i, got in zip(want, self._run(read_all())):
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
    c = self.chunk_size
    if first < 0 or (first + len(chunks)) * c > len(token_ids):
      raise ValueError(f"chunks [{first}, {first + len(chunks)}) of {c} tokens do not fit "
                       f"{len(token_ids)} tokens")
    ns = self.namespace(cache_salt)
    hashes = keys.chunk_hashes(ns, token_ids, max_tokens=(first + len(chunks)) * c)
    root = ns.root_hash()

    async def put_all():
      return await asyncio.gather(*(self.store.put(
          hashes[i], hashes[i - 1] if i else root, tuple(token_ids[i * c:(i + 1) * c]), root,
          np.asarray(chunks[i - first]), origin=self.origin)
          for i in range(first, first + len(chunks))),
          return_exceptions=True)

    return sum(not isinstance(r, BaseException) for r in self._run(put_all()))

