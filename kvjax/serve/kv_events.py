"""KV cache events in vLLM's schema on a ZMQ publisher, for llm-d's precise prefix-cache indexer.

The scheduler's `KVCacheManager` records every change of the device prefix-cache index as plain
data (`kvjax.engine.KVCacheEvents`: a block stored, a block evicted, all
cleared), keyed by kvjax's own chained hashes (`kvjax.block_hash`, seeded by the store's model
namespace). The engine thread drains them after every step; this module re-keys them the way
vLLM keys its blocks and publishes them as vLLM does (`vllm/distributed/kv_events.py`,
`ZmqEventPublisher`), so a router that indexes vLLM pods indexes kvjax replicas unchanged:

  block hash   h_i = H((h_{i-1}, tuple(tokens[iB:(i+1)B]), None))    vLLM `hash_block_tokens`
               h_{-1} = NONE_HASH = H(seed)                           vLLM `init_none_hash`
  H            "sha256_cbor": sha256(cbor2.dumps(x, canonical=True))  (default: what llm-d's
               "sha256":      sha256(pickle.dumps(x, protocol=5))     indexer recomputes)
  on the wire  the low 64 bits, int.from_bytes(h, "big") & (2**64 - 1) (vLLM's default,
               VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1), or the 32 raw bytes

with `seed` the string vLLM reads from PYTHONHASHSEED and B the pool's block size (`--block_size`,
vLLM's `--block-size`); llm-d's `tokenProcessorConfig` must use the same block size, seed and
hash ("sha256_cbor"). Messages are vLLM's: three frames (topic, 8-byte big-endian sequence
number, payload), the payload a msgpack array `[ts, events, data_parallel_rank]` with each event
a tagged array (msgspec `array_like=True, tag=True`):

  ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
   lora_name]
  ["BlockRemoved", block_hashes, medium]
  ["AllBlocksCleared"]

Consecutive stored blocks of one sequence are one `BlockStored` (vLLM's grouping), `medium` is
"GPU" (the device tier; llm-d's default). A sequence under a `cache_salt` (another namespace
root) is not published: vLLM would put the salt into the first block's extra keys, which an
indexer that does not know it cannot reproduce, and a tenant's prefix is not advertised. With a
replay endpoint (a ROUTER socket, as vLLM's), a subscriber that sends a start sequence number
(8 bytes big-endian) gets every buffered `(seq, payload)` from there on, then `(-1, b"")`.

pyzmq, msgpack and (for "sha256_cbor") cbor2 are imported only when a publisher is built, so the
engine and the server run without them when events are off.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import pickle
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any, Callable

from kvjax.engine import (AllBlocksClearedEvent, BlockRemovedEvent, BlockStoredEvent,
                          KVCacheEvents)

_log = logging.getLogger(__name__)

#: vLLM's `prefix_caching_hash_algo` values this module computes.
HASH_ALGOS = ("sha256_cbor", "sha256")
#: vLLM's `MEDIUM_GPU`: the device tier.
MEDIUM_GPU = "GPU"
#: vLLM's end-of-replay sequence number.
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def default_hash_seed() -> str:
  """vLLM's NONE_HASH seed: $PYTHONHASHSEED when set; else "0" (vLLM would draw random bytes,
  which no indexer can match, so kvjax picks a fixed default)."""
  return os.environ.get("PYTHONHASHSEED", "0")


def _hash_fn(algo: str) -> Callable[[Any], bytes]:
  if algo == "sha256_cbor":
    import cbor2  # noqa: PLC0415 - only with events on

    return lambda x: hashlib.sha256(cbor2.dumps(x, canonical=True)).digest()
  if algo == "sha256":
    return lambda x: hashlib.sha256(pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL)).digest()
  raise ValueError(f"kv_events_hash_algo={algo!r}; use one of {HASH_ALGOS}")


class VllmBlockHasher:
  """vLLM's block hashes (`vllm/v1/core/kv_cache_utils.py` `hash_block_tokens`, text-only
  requests: no LoRA, multimodal, salt or prompt-embedding extra keys).

  Args:
    algo: "sha256_cbor" or "sha256" (vLLM's `--prefix-caching-hash-algo`).
    seed: the PYTHONHASHSEED string vLLM seeds NONE_HASH with.

  Raises:
    ValueError: an unknown algorithm.
  """

  def __init__(self, algo: str = "sha256_cbor", seed: str | None = None):
    self.algo = algo
    self._h = _hash_fn(algo)
    self.seed = default_hash_seed() if seed is None else str(seed)
    self.none_hash: bytes = self._h(self.seed)

  def hash_block(self, parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """32-byte hash of one full block given its parent's (None: the first block)."""
    return self._h((self.none_hash if parent is None else parent,
                    tuple(int(t) for t in token_ids), None))

  def hash_prompt(self, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Hashes of the full blocks of `token_ids` (a partial tail has none)."""
    out, parent = [], None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
      parent = self.hash_block(parent, token_ids[start:start + block_size])
      out.append(parent)
    return out


def external_hash(h: bytes, int_hashes: bool = True) -> int | bytes:
  """A hash as it goes on the wire: the low 64 bits as an int (vLLM's default), or the bytes."""
  return int.from_bytes(h, "big") & ((1 << 64) - 1) if int_hashes else h


class VllmEventTranslator:
  """kvjax index events -> vLLM event arrays; keeps kvjax hash -> vLLM hash of indexed blocks.

  Not thread-safe: the publisher thread owns it.

  Args:
    hasher: the vLLM hash to key blocks by.
    int_hashes: publish the low 64 bits as ints (True, vLLM's default) or the 32 bytes.
    medium: the `medium` field ("GPU").
    max_memo: kvjax -> vLLM hashes remembered (parents of blocks indexed later).
  """

  def __init__(self, hasher: VllmBlockHasher, *, int_hashes: bool = True,
               medium: str = MEDIUM_GPU, max_memo: int = 1 << 18):
    self.hasher = hasher
    self.int_hashes = int_hashes
    self.medium = medium
    self.max_memo = max_memo
    # kvjax block hash -> vLLM block hash, least recently used first: parents of later blocks
    # (kept past their eviction, since a child may be indexed after its parent left).
    self._memo: collections.OrderedDict[str, bytes] = collections.OrderedDict()
    self._published: set[str] = set()  # kvjax hashes published as stored, not yet removed

  @property
  def num_tracked(self) -> int:
    """Indexed blocks published as stored and not yet removed."""
    return len(self._published)

  def _remember(self, kvjax_hash: str, h: bytes) -> None:
    self._memo[kvjax_hash] = h
    self._memo.move_to_end(kvjax_hash)
    while len(self._memo) > self.max_memo:
      self._memo.popitem(last=False)

  def translate(self, batch: KVCacheEvents) -> list[list]:
    """The vLLM event arrays of one drained batch, in order (possibly empty)."""
    out: list[list] = []
    run: list = []  # [parent vLLM hash or None, [hashes], [tokens]] of consecutive stored blocks
    last_kvjax: str | None = None

    def flush():
      if run:
        parent, hashes, tokens = run
        out.append(["BlockStored", [self._ext(h) for h in hashes],
                    None if parent is None else self._ext(parent), tokens, batch.block_size,
                    None, self.medium, None])
        run.clear()

    for ev in batch.events:
      if isinstance(ev, BlockStoredEvent):
        if ev.parent_hash == batch.namespace_root:
          parent = None
        elif ev.parent_hash in self._memo:
          parent = self._memo[ev.parent_hash]
        else:
          continue  # a salted sequence (or a parent forgotten long ago): not published
        h = self._memo.get(ev.block_hash) or self.hasher.hash_block(parent, ev.token_ids)
        self._remember(ev.block_hash, h)
        self._published.add(ev.block_hash)
        if run and last_kvjax == ev.parent_hash:
          run[1].append(h)
          run[2].extend(ev.token_ids)
        else:
          flush()
          run.extend([parent, [h], list(ev.token_ids)])
        last_kvjax = ev.block_hash
        continue
      flush()
      last_kvjax = None
      if isinstance(ev, BlockRemovedEvent):
        h = self._memo.get(ev.block_hash)
        if ev.block_hash in self._published and h is not None:
          out.append(["BlockRemoved", [self._ext(h)], self.medium])
        self._published.discard(ev.block_hash)
      elif isinstance(ev, AllBlocksClearedEvent):
        self._published.clear()
        out.append(["AllBlocksCleared"])
    flush()
    return out

  def _ext(self, h: bytes) -> int | bytes:
    return external_hash(h, self.int_hashes)


class ZmqKVEventPublisher:
  """Publishes drained `KVCacheEvents` as vLLM `KVEventBatch`es on a ZMQ publisher socket.

  `publish` (engine thread) only queues; a daemon thread re-keys (`VllmEventTranslator`),
  encodes (msgpack) and sends, and answers replay requests. The socket is an XPUB (a PUB that
  also sees subscriptions, wire-compatible with any SUB), so `wait_for_subscriber` can tell when
  an indexer has subscribed.

  Args:
    endpoint: e.g. "tcp://*:5557" (bound: vLLM binds when the address has "*", "::", or is
      ipc:// or inproc://; otherwise it connects).
    topic: the first frame of every message; llm-d's indexer reads "kv@<pod>@<model>".
    replay_endpoint: a ROUTER address for replays (bound), or None.
    hasher: vLLM's block hash (default: sha256_cbor, `default_hash_seed()`).
    int_hashes: hashes on the wire as 64-bit ints (vLLM's default) or 32 bytes.
    buffer_steps: batches kept for replay.
    data_parallel_rank: the `data_parallel_rank` field (0: one engine per replica).
    clock: seconds since the epoch for `ts`.

  Raises:
    ImportError: pyzmq or msgpack (or cbor2 for sha256_cbor) is not installed.
    zmq.ZMQError: the endpoint cannot be bound or connected.
  """

  def __init__(self, endpoint: str, *, topic: str = "", replay_endpoint: str | None = None,
               hasher: VllmBlockHasher | None = None, int_hashes: bool = True,
               buffer_steps: int = 10_000, data_parallel_rank: int = 0,
               clock: Callable[[], float] = time.time):
    import msgpack  # noqa: PLC0415 - only with events on
    import zmq  # noqa: PLC0415

    self._zmq, self._packb = zmq, msgpack.packb
    self.translator = VllmEventTranslator(hasher or VllmBlockHasher(), int_hashes=int_hashes)
    self.endpoint, self.topic = endpoint, topic
    self._topic = topic.encode("utf-8")
    self._dp_rank = data_parallel_rank
    self._clock = clock
    self._ctx = zmq.Context.instance()
    self._pub = self._ctx.socket(zmq.XPUB)
    self._pub.setsockopt(zmq.LINGER, 0)
    self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # see every subscription, not only the first
    self._replay = None
    try:
      if any(m in endpoint for m in ("*", "::")) or endpoint.startswith(("ipc://", "inproc://")):
        self._pub.bind(endpoint)
      else:
        self._pub.connect(endpoint)
      if replay_endpoint is not None:
        self._replay = self._ctx.socket(zmq.ROUTER)
        self._replay.setsockopt(zmq.LINGER, 0)
        self._replay.bind(replay_endpoint)
    except Exception:
      self._close_sockets()
      raise
    # Read now: after the thread starts, only it touches the sockets (they are not thread-safe).
    self._bound = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
    self._bound_replay = (None if self._replay is None
                          else self._replay.getsockopt_string(zmq.LAST_ENDPOINT))
    self._queue: queue.SimpleQueue = queue.SimpleQueue()
    self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
    self._seq = 0
    self._subscribed = threading.Event()
    self._idle = threading.Condition()
    self._pending = 0
    self.num_published = 0  # batches sent
    self._running = True
    self._thread = threading.Thread(target=self._run, name="kvjax-kv-events", daemon=True)
    self._thread.start()

  def bound_endpoint(self) -> str:
    """The publisher socket's endpoint, with the port a wildcard ("tcp://127.0.0.1:*") got."""
    return self._bound

  def bound_replay_endpoint(self) -> str | None:
    """The replay socket's endpoint (wildcard port resolved), or None without replays."""
    return self._bound_replay

  def publish(self, batch: KVCacheEvents) -> None:
    """Queues one drained batch (any thread); empty batches are dropped."""
    if batch.events and self._running:
      with self._idle:
        self._pending += 1
      self._queue.put(batch)

  def wait_for_subscriber(self, timeout_s: float) -> bool:
    """Waits until some SUB socket has subscribed; False after `timeout_s` seconds."""
    return self._subscribed.wait(timeout_s)

  def wait_idle(self, timeout_s: float) -> bool:
    """Waits until every queued batch is sent; False after `timeout_s` seconds."""
    with self._idle:
      return self._idle.wait_for(lambda: self._pending == 0, timeout_s)

  def close(self, timeout_s: float = 5.0) -> None:
    """Sends what is queued (up to `timeout_s`), stops the thread, closes the sockets."""
    if not self._running:
      return
    self._running = False
    self._queue.put(None)
    self._thread.join(timeout_s)
    self._close_sockets()

  def _close_sockets(self) -> None:
    for sock in (self._pub, self._replay):
      if sock is not None:
        sock.close(linger=0)

  # -- publisher thread --------------------------------------------------------------------------
  def _run(self) -> None:
    zmq = self._zmq
    poller = zmq.Poller()
    poller.register(self._pub, zmq.POLLIN)
    if self._replay is not None:
      poller.register(self._replay, zmq.POLLIN)
    while True:
      try:
        for sock, _ in poller.poll(0):
          if sock is self._pub:
            self._read_subscriptions()
          else:
            self._serve_replay()
        try:
          batch = self._queue.get(timeout=0.05)
        except queue.Empty:
          continue
        if batch is None:
          return
        try:
          self._send(batch)
        finally:
          with self._idle:
            self._pending -= 1
            self._idle.notify_all()
      except Exception:  # noqa: BLE001 - events are best effort; serving goes on
        _log.exception("KV event publisher iteration failed")

  def _read_subscriptions(self) -> None:
    while True:
      try:
        frame = self._pub.recv(self._zmq.NOBLOCK)
      except self._zmq.Again:
        return
      if frame[:1] == b"\x01":
        self._subscribed.set()

  def _send(self, batch: KVCacheEvents) -> None:
    events = self.translator.translate(batch)
    if not events:
      return
    payload = self._packb([self._clock(), events, self._dp_rank], use_bin_type=True)
    seq = self._seq
    self._seq += 1
    self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
    self._buffer.append((seq, payload))
    self.num_published += 1

  def _serve_replay(self) -> None:
    frames = self._replay.recv_multipart()
    if len(frames) != 3:
      _log.warning("ignoring a replay request of %d frames (want identity, '', start seq)",
                   len(frames))
      return
    client, _, start = frames
    first = int.from_bytes(start, "big")
    for seq, payload in self._buffer:
      if seq >= first:
        self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
    self._replay.send_multipart((client, b"", END_SEQ, b""))
