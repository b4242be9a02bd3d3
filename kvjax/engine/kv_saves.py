"""The save side of executing a plan: computed KV becomes stored chunks.

`KVSaves` is the part of `kvjax.engine.engine.Engine` that hands computed KV to the store
client's saver. Per request it keeps the KV rows (K before RoPE) of each step until their store
chunk is complete; then, per completed chunk the plan names, it passes the chunk through the
stored encoding when the plan asks for a round trip (consistent codecs) and queues a `SaveJob`
(every level encoded in one device call; the saver makes the one device -> host copy). A
finished session turn's tail (its rows after the last full chunk) is saved padded to a chunk
(`save_tail`).

It owns the kept rows and nothing else: which chunks to save is the scheduler's plan, the
request's tokens are the engine's, and the key chain is the store client's.
"""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import numpy as np

from kvjax import codecs
from kvjax._typing import RequestId
from kvjax.connector import KVStoreClient, SaveJob
from kvjax.engine.kv_loads import chunk_blocks
from kvjax.models.runner.runner_api import Runner
from kvjax.scheduler.output import SaveItem


class KVSaves:
  """Keeps each request's computed KV until its store chunks are complete, and saves them.

  Args:
    runner: the model runner (encodes levels, reads device-resident rows back).
    kv_store: the store client (its key chains and saver).
  """

  def __init__(self, runner: Runner, kv_store: KVStoreClient):
    self.runner = runner
    self.kv_store = kv_store
    #: Per request, `(start, k_LTKH, v_LTKH)` pieces of a chunk still being computed.
    self._pieces: dict[RequestId, list[tuple[int, object, object]]] = {}

  def drop(self, rid: RequestId) -> None:
    """Forgets a request's kept rows (it finished, was aborted or preempted)."""
    self._pieces.pop(rid, None)

  def keep(self, rid: RequestId, prompt_token_ids: list[int], output_token_ids: list[int],
           start: int, save_items: Sequence[SaveItem], roundtrip: Sequence[int], k_LTKH, v_LTKH,
           where) -> None:
    """Keeps this step's KV of one request (a prefill chunk's rows, or a decode's one row at
    `start`) until its store chunks are complete; then, per completed chunk: passes it through
    the stored encoding when the plan says `roundtrip` (consistent codecs: encode, decode back
    into the cache), and hands it to the saver when it is in `save_items` (one device array per
    chunk, every level encoded in one device call; the saver makes the one device -> host copy).

    Args:
      rid: the request.
      prompt_token_ids: its prompt (a chunk's tokens are the prompt's, then the output's).
      output_token_ids: its output tokens so far.
      start: the first position of `k_LTKH`.
      save_items: the chunks the plan saves at this step.
      roundtrip: indices of chunks the plan passes through the stored encoding.
      k_LTKH: `[L, T, K, H]` K before RoPE of positions `[start, start + T)`.
      v_LTKH: `[L, T, K, H]` V of the same positions.
      where: the request's block table.

    Raises:
      ValueError: the kept rows do not cover a completed chunk.
    """
    kv, c = self.kv_store, self.kv_store.chunk_size
    if isinstance(k_LTKH, np.ndarray):  # the runner's `host_outputs` (CPU backend): own
      # copies, since a view would keep the whole step's output alive
      k_LTKH, v_LTKH = np.array(k_LTKH), np.array(v_LTKH)
    pieces = self._pieces.setdefault(rid, [])
    pieces.append((start, k_LTKH, v_LTKH))
    saves = {item.index: item for item in save_items}
    if saves:  # the client extends the request's key chain over its output when needed
      kv.extend_request_keys(rid, prompt_token_ids + output_token_ids, max(saves) + 1)
    for index in sorted(set(saves) | set(roundtrip)):
      lo, hi = index * c, (index + 1) * c
      kv_L2CKH = self._kept_rows(pieces, lo, hi, where)
      if kv_L2CKH.shape[2] != c:
        raise ValueError(f"chunk {index}: prefill pieces cover {kv_L2CKH.shape[2]} of {c}")
      payloads = None
      if kv.codec != codecs.RAW:
        payloads = self.runner.encode_levels(kv_L2CKH, kv.codec, kv.codec_levels, lo)
      if index in roundtrip and payloads is not None:
        # The first stored level is the request's fixed encoding (the engine's consistent one).
        blocks = chunk_blocks(where, self.runner.block_size, lo, c)
        self.runner.insert_payload(kv.codec, payloads[0][2], blocks, lo)
      item = saves.get(index)
      if item is not None:
        tokens = (prompt_token_ids[lo:hi] if hi <= len(prompt_token_ids)
                  else (prompt_token_ids + output_token_ids)[lo:hi])
        namespace, key, parent = kv.request_chunk_key(rid, index)
        kv.submit_save(SaveJob(
            namespace=namespace, chunk_hash=key, parent=parent, token_ids=tuple(tokens),
            kv=kv_L2CKH if payloads is None else None, payloads=payloads,
            replace=item.replace, verify_existing=item.verify_existing))
    end = start + k_LTKH.shape[1]
    keep_from = (end // c) * c  # pieces wholly below the last completed chunk end are done
    self._pieces[rid] = [p for p in pieces if p[0] + p[1].shape[1] > keep_from]

  def _kept_rows(self, pieces: list, lo: int, hi: int, where):
    """`[L, 2, hi - lo, K, H]`: a request's KV at positions `[lo, hi)`, K before RoPE, from
    the rows it kept (`pieces`, host arrays on the CPU backend, else device arrays, and so is
    the result); a head those do not cover is device-resident (a prefix hit this request did
    not compute) and is read back from its blocks, K un-rotated
    (`PagedModelRunner.read_pre_rope`; `lo` a multiple of the block size)."""
    xp = np if isinstance(pieces[-1][1], np.ndarray) else jnp
    ks, vs = [], []
    first = min(min((p[0] for p in pieces if p[0] + p[1].shape[1] > lo), default=hi), hi)
    if lo < first:
      b = self.runner.block_size
      k, v = self.runner.read_pre_rope(where[lo // b:-(-first // b)], lo, first - lo)
      ks.append(k)
      vs.append(v)
    for start, k, v in pieces:
      a, b = max(start, lo), min(start + k.shape[1], hi)
      if a < b:
        ks.append(k[:, a - start:b - start])
        vs.append(v[:, a - start:b - start])
    return xp.stack([xp.concatenate(ks, axis=1), xp.concatenate(vs, axis=1)], axis=1)

  def save_tail(self, rid: RequestId, seq: Sequence[int], where) -> None:
    """Stores a finished session turn's tail: its KV after the last full chunk of its prompt
    and output (`seq`) but the last sampled token (which has no KV), padded to a chunk of C rows
    under its tail key (`KVStoreClient.request_tail_job`), so the next turn loads every historical
    token even once the device has evicted its blocks. Raw, like every chunk of a store that
    keeps tails (`KVStoreClient.stores_tails`); queued to the saver like any save (dropped and
    counted when its queue is full). `where` is the request's block table.

    Raises:
      ValueError: the kept rows do not cover the tail.
    """
    kv, c = self.kv_store, self.kv_store.chunk_size
    seq = list(seq)
    end = len(seq) - 1
    k, m = divmod(end, c)
    pieces = self._pieces.get(rid)
    if not m or not pieces:
      return  # no tail (its last chunk is full, saved as a chunk), or nothing kept
    rows = self._kept_rows(pieces, k * c, end, where)
    if rows.shape[2] != m:
      raise ValueError(f"tail of {rid}: kept rows cover {rows.shape[2]} of {m}")
    xp = np if isinstance(rows, np.ndarray) else jnp
    padded = xp.pad(rows, ((0, 0), (0, 0), (0, c - m), (0, 0), (0, 0)))
    kv.submit_save(kv.request_tail_job(rid, seq, end, padded))
