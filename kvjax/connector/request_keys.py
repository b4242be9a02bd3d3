"""The connector's per-request state: each open request's prefix lookup and chained chunk keys.

The client owns them, keyed by request id, from admission (`open_request`) to the request's end
(`close_request`); the engine names requests by id and gets plain data back (a `PrefixLookup`,
key strings, `LookaheadRequest`s), never the chain itself. A request's chain starts as its
prompt's full-chunk keys and grows, chained from them, as its output fills chunks to save.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Sequence

from kvjax import codecs
from kvjax._typing import ChunkHash
from kvjax.connector.records import LookaheadRequest, PrefixLookup, SaveJob
from kvjax.storage import keys
from kvjax.storage.chunk_store import choose_codec


@dataclasses.dataclass
class RequestKeys:
  """One open request's keys (the client's own record).

  Attributes:
    lookup: its prompt's `PrefixLookup` (admission's batched lookup).
    prompt_ids: its prompt's tokens.
    hashes: chained keys of its first chunks: the prompt's, then its output's as saves need
      them.
  """

  lookup: PrefixLookup
  prompt_ids: tuple[int, ...]
  hashes: list[ChunkHash]


class RequestKeysMixin:
  """Per-request lookups and key chains of `KVStoreClient` (`kvjax/connector/client.py` owns
  the state)."""

  def _init_requests(self) -> None:
    self._requests: dict[Any, RequestKeys] = {}
    self._requests_lock = threading.Lock()

  def _request(self, request_id: Any) -> RequestKeys:
    with self._requests_lock:
      try:
        return self._requests[request_id]
      except KeyError:
        raise KeyError(f"request {request_id!r} is not open in the KV store client") from None

  def open_request(self, request_id: Any, prompt_ids: Sequence[int], cache_salt: str | None, *,
                   history_tokens: int = 0) -> PrefixLookup:
    """Looks the prompt up (`lookup`, one batch) and keeps its lookup and key chain for the
    request until `close_request`; returns the lookup (plain data). A request id still open is
    replaced."""
    lookup = self.lookup(prompt_ids, cache_salt, history_tokens=history_tokens)
    keys_ = RequestKeys(lookup, tuple(prompt_ids), list(lookup.hashes))
    with self._requests_lock:
      self._requests[request_id] = keys_
    return lookup

  def is_open(self, request_id: Any) -> bool:
    """Whether `open_request` keeps state for the request."""
    with self._requests_lock:
      return request_id in self._requests

  def close_request(self, request_id: Any) -> int:
    """Forgets the request's lookup and keys and drops its loads (`cancel_loads`); returns how
    many loads were dropped. Idempotent."""
    with self._requests_lock:
      self._requests.pop(request_id, None)
    return self.cancel_loads(request_id)

  def start_request_load(self, request_id: Any, index: int, *,
                         encoding: codecs.EncodingId | None = None, nbytes: int = 0,
                         max_in_flight: int = 2) -> None:
    """`start_load` of chunk `index` of an open request's prompt, with its own lookup.

    `encoding` is the level policy's pick (the scheduler's `LoadItem.encoding`): that encoding
    is read (`kvjax.storage.chunk_store.choose_codec`); None: the loader's own choice. The
    codec choice stays behind the client: the engine hands over the plan's plain id.

    Raises:
      KeyError: the request is not open.
    """
    choose = None if encoding is None else choose_codec(encoding.codec, encoding.level)
    r = self._request(request_id)
    self.start_load(request_id, index, r.lookup, r.prompt_ids, choose=choose, nbytes=nbytes,
                    max_in_flight=max_in_flight)

  def lookahead_requests(self, request_ids: Sequence[Any]) -> list[LookaheadRequest]:
    """The look-ahead window's records (`lookahead_request`) of those of `request_ids` that are
    open, in order."""
    with self._requests_lock:
      open_ = [(rid, self._requests[rid]) for rid in request_ids if rid in self._requests]
    return [self.lookahead_request(rid, r.lookup, r.prompt_ids) for rid, r in open_]

  def extend_request_keys(self, request_id: Any, token_ids: Sequence[int],
                          num_chunks: int) -> None:
    """Extends an open request's key chain to at least `num_chunks` keys, `token_ids` being its
    prompt then output tokens (`extend_chunk_hashes`).

    Raises:
      KeyError: the request is not open; ValueError: `token_ids` shorter than `num_chunks`
        chunks.
    """
    r = self._request(request_id)
    if len(r.hashes) < num_chunks:
      r.hashes = self.extend_chunk_hashes(r.lookup, r.hashes, token_ids, num_chunks)

  def request_chunk_key(self, request_id: Any, index: int) -> tuple[str, ChunkHash, str]:
    """`(namespace root, key, parent key)` of chunk `index` of an open request (the namespace
    root is chunk 0's parent); the chain must reach it (`extend_request_keys`).

    Raises:
      KeyError: the request is not open; IndexError: the chain is shorter.
    """
    r = self._request(request_id)
    ns = r.lookup.namespace
    return ns, r.hashes[index], r.hashes[index - 1] if index else ns

  def request_tail_key(self, request_id: Any, token_ids: Sequence[int], end: int
                       ) -> tuple[str, ChunkHash, ChunkHash] | None:
    """`(namespace root, parent key, key)` of the tail of an open request's `token_ids[:end]`
    (`tail_key`; its chain extended to `end // C` keys first); None when `end` is a multiple
    of C.

    Raises:
      KeyError: the request is not open.
    """
    self.extend_request_keys(request_id, token_ids, end // self.chunk_size)
    r = self._request(request_id)
    tail = self.tail_key(r.lookup.namespace, r.hashes, token_ids, end)
    if tail is None:
      return None
    return r.lookup.namespace, tail[1], tail[2]

  def request_tail_job(self, request_id: Any, token_ids: Sequence[int], end: int,
                       kv: Any) -> SaveJob:
    """The `SaveJob` of the tail of an open request's `token_ids[:end]`: its key
    (`request_tail_key`), its tokens after the last full chunk padded to a chunk
    (`keys.tail_token_ids`) and `kv`, the tail's rows `[L, 2, C, K, H]` padded to C (the caller
    reads them from the device). The tail's key scheme stays behind the client.

    Raises:
      KeyError: the request is not open; ValueError: `end` is a multiple of C (no tail).
    """
    ids = [int(t) for t in token_ids]
    key = self.request_tail_key(request_id, ids, end)
    if key is None:
      raise ValueError(f"no tail: end={end} is a multiple of the chunk size {self.chunk_size}")
    namespace, parent, chunk_hash = key
    c = self.chunk_size
    return SaveJob(namespace=namespace, chunk_hash=chunk_hash, parent=parent,
                   token_ids=keys.tail_token_ids(ids[end // c * c:end], c), kv=kv)
