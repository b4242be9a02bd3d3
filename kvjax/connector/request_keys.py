"""The connector's per-request state: each open request's prefix lookup and chained chunk keys.

`OpenRequests` owns them, keyed by request id, from admission (`open`) to the request's end
(`close`); the engine names requests by id through `KVStoreClient` and gets plain data back (a
`PrefixLookup`, key strings, save jobs), never the chain itself. A request's chain starts as
its prompt's full-chunk keys and grows, chained from them, as its output fills chunks to save.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Sequence

from kvjax._typing import ChunkHash
from kvjax.connector.lookup import KeyScheme
from kvjax.connector.records import PrefixLookup, SaveJob
from kvjax.storage.format import keys


@dataclasses.dataclass(frozen=True)
class RequestKeys:
  """One open request's keys (a snapshot; `OpenRequests.get`).

  Attributes:
    lookup: its prompt's `PrefixLookup` (admission's batched lookup).
    prompt_ids: its prompt's tokens.
    hashes: chained keys of its first chunks: the prompt's, then its output's as saves need
      them.
  """

  lookup: PrefixLookup
  prompt_ids: tuple[int, ...]
  hashes: tuple[ChunkHash, ...]


class OpenRequests:
  """Each open request's lookup and key chain, by request id.

  Owns: the request table, under its own lock. Called from the engine thread (admission,
  saves, loads, the look-ahead window, request ends).

  Args:
    scheme: the key scheme (chunk size, tail keys, chaining).
  """

  def __init__(self, scheme: KeyScheme):
    self._scheme = scheme
    self._requests: dict[Any, RequestKeys] = {}
    self._lock = threading.Lock()

  def open(self, request_id: Any, lookup: PrefixLookup, prompt_ids: Sequence[int]) -> None:
    """Keeps a request's lookup and key chain until `close`; a request id still open is
    replaced."""
    r = RequestKeys(lookup, tuple(prompt_ids), tuple(lookup.hashes))
    with self._lock:
      self._requests[request_id] = r

  def get(self, request_id: Any) -> RequestKeys:
    """The request's keys.

    Raises:
      KeyError: the request is not open.
    """
    with self._lock:
      try:
        return self._requests[request_id]
      except KeyError:
        raise KeyError(f"request {request_id!r} is not open in the KV store client") from None

  def is_open(self, request_id: Any) -> bool:
    with self._lock:
      return request_id in self._requests

  def close(self, request_id: Any) -> None:
    """Forgets the request. Idempotent."""
    with self._lock:
      self._requests.pop(request_id, None)

  def open_of(self, request_ids: Sequence[Any]) -> list[tuple[Any, RequestKeys]]:
    """`(request id, keys)` of those of `request_ids` that are open, in order."""
    with self._lock:
      return [(rid, self._requests[rid]) for rid in request_ids if rid in self._requests]

  def extend(self, request_id: Any, token_ids: Sequence[int], num_chunks: int) -> RequestKeys:
    """Extends an open request's key chain to at least `num_chunks` keys, `token_ids` being its
    prompt then output tokens; returns its keys.

    Raises:
      KeyError: the request is not open; ValueError: `token_ids` shorter than `num_chunks`
        chunks.
    """
    r = self.get(request_id)
    if len(r.hashes) >= num_chunks:
      return r
    hashes = tuple(self._scheme.extend_chunk_hashes(r.lookup.namespace, r.hashes, token_ids,
                                                    num_chunks))
    with self._lock:
      cur = self._requests.get(request_id)
      if cur is not None and len(cur.hashes) < len(hashes):
        self._requests[request_id] = cur = dataclasses.replace(cur, hashes=hashes)
      return cur if cur is not None else dataclasses.replace(r, hashes=hashes)

  def chunk_key(self, request_id: Any, index: int) -> tuple[str, ChunkHash, str]:
    """`(namespace root, key, parent key)` of chunk `index` of an open request (the namespace
    root is chunk 0's parent); the chain must reach it (`extend`).

    Raises:
      KeyError: the request is not open; IndexError: the chain is shorter.
    """
    r = self.get(request_id)
    ns = r.lookup.namespace
    return ns, r.hashes[index], r.hashes[index - 1] if index else ns

  def tail_key(self, request_id: Any, token_ids: Sequence[int], end: int
               ) -> tuple[str, ChunkHash, ChunkHash] | None:
    """`(namespace root, parent key, key)` of the tail of an open request's `token_ids[:end]`
    (`KeyScheme.tail_key`; its chain extended to `end // C` keys first); None when `end` is a
    multiple of C.

    Raises:
      KeyError: the request is not open.
    """
    r = self.extend(request_id, token_ids, end // self._scheme.chunk_size)
    tail = self._scheme.tail_key(r.lookup.namespace, r.hashes, token_ids, end)
    if tail is None:
      return None
    return r.lookup.namespace, tail[1], tail[2]

  def tail_job(self, request_id: Any, token_ids: Sequence[int], end: int, kv: Any) -> SaveJob:
    """The `SaveJob` of the tail of an open request's `token_ids[:end]`: its key (`tail_key`),
    its tokens after the last full chunk padded to a chunk (`keys.tail_token_ids`) and `kv`,
    the tail's rows `[L, 2, C, K, H]` padded to C.

    Raises:
      KeyError: the request is not open; ValueError: `end` is a multiple of C (no tail).
    """
    ids = [int(t) for t in token_ids]
    c = self._scheme.chunk_size
    key = self.tail_key(request_id, ids, end)
    if key is None:
      raise ValueError(f"no tail: end={end} is a multiple of the chunk size {c}")
    namespace, parent, chunk_hash = key
    return SaveJob(namespace=namespace, chunk_hash=chunk_hash, parent=parent,
                   token_ids=keys.tail_token_ids(ids[end // c * c:end], c), kv=kv)
