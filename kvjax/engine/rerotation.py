"""Session re-rotation staging: a truncated session prompt's kept KV, read from the store and
written back re-rotated under a private namespace (CachedAttention, arXiv 2403.19708, section
3.4; `docs/design/truncation.md`, "Re-rotation").

Store I/O only, through the store client (`KVStoreClient`: `flush`, `lookup`,
`read_raw_chunks`, `put_raw_chunks`); it never touches the `Engine`, so a front end's worker
thread (the server plans a turn off its event loop) calls it while the engine thread steps. The
session turn flow (`kvjax.sessions.run_turn`) takes it as its `stage`, bound to the client:
`functools.partial(stage_rerotated, llm.kv_store)`.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from kvjax.block_hash import loadable_units
from kvjax.connector import KVStoreClient


def stage_rerotated(kv: KVStoreClient | None, source_ids: Sequence[int],
                    source_salt: str | None, target_ids: Sequence[int], spans: Sequence[Any],
                    target_salt: str, *, boundary_chunks: int = 0) -> int:
  """Stores the KV of a truncated session prompt's kept tokens, re-rotated, under a private
  namespace (CachedAttention, arXiv 2403.19708, section 3.4; `docs/design/truncation.md`,
  "Re-rotation").

  `target_ids` is `source_ids` with tokens dropped: each kept span (`KeptSpan`: `src_start`,
  `dst_start`, `length`) maps `source_ids[src:src + n]` to `target_ids[dst:dst + n]`. The
  source's stored chunks (under `source_salt`; raw encodings only) are read synchronously
  after the queued saves are written; each target position's K (before RoPE) and V are
  gathered token by token from them, so spans need not be chunk- or block-aligned, and the
  target's full chunks up to the first position whose source KV is not stored are written as
  new chunks chained from `target_salt`'s root (new parent chains; RoPE is applied at the new
  positions when they are inserted, like any chunk). The KV is approximate (computed with the
  dropped tokens in context), so `target_salt` must be a namespace no ordinary request uses
  (`kvjax.sessions.REROTATED_SALT_PREFIX`); the session turn under it then loads these chunks
  through a load-only merge (its request options, `kvjax.sessions.TurnPlan.request_options`)
  and computes the rest. Blocks the caller (store reads and writes).

  `boundary_chunks` b: the target's first b chunks (the system prompt and the seam, the kept
  tokens right after the dropped ones, whose KV deviates most from a recompute) are not
  staged; they stay holes that the request computes exactly (`docs/design/truncation.md`,
  "What the gap is made of": measured by `scripts/bench_truncation.py`).

  Args:
    kv: the store client (None: no store, nothing is staged).

  Returns:
    Target tokens staged (a multiple of the chunk size, < len(target_ids)): chunks
    `[b, k)` where k is the first target chunk that could not be staged; 0 without a store
    or when k <= b.

  Raises:
    ValueError: spans that do not lie within the ids, or a negative `boundary_chunks`.
  """
  if isinstance(boundary_chunks, bool) or not isinstance(boundary_chunks, int) or (
      boundary_chunks < 0):
    raise ValueError(f"boundary_chunks={boundary_chunks!r} must be an int >= 0")
  if kv is None:
    return 0
  c = kv.chunk_size
  n_src, n_dst = len(source_ids), len(target_ids)
  src_of = np.full(n_dst, -1, np.int64)
  for sp in spans:
    if not (0 <= sp.src_start and sp.src_start + sp.length <= n_src and 0 <= sp.dst_start
            and sp.dst_start + sp.length <= n_dst):
      raise ValueError(f"span {sp} outside {n_src} source / {n_dst} target tokens")
    if list(source_ids[sp.src_start:sp.src_start + sp.length]) != list(
        target_ids[sp.dst_start:sp.dst_start + sp.length]):
      raise ValueError(f"span {sp}: the kept tokens differ between source and target")
    src_of[sp.dst_start:sp.dst_start + sp.length] = np.arange(sp.src_start,
                                                               sp.src_start + sp.length)
  kv.flush()  # the previous turn's chunks (its reply's too) are readable
  lookup = kv.lookup(list(source_ids), source_salt)
  n_chunks = loadable_units(n_dst, c)  # never the last prompt token, as any hit
  b = min(boundary_chunks, n_chunks)
  needed = sorted({int(s) // c for s in src_of[:n_chunks * c] if s >= 0})
  got = kv.read_raw_chunks(lookup, list(source_ids), needed)
  chunks = []
  for j in range(n_chunks):
    src = src_of[j * c:(j + 1) * c]
    if (src < 0).any() or any(int(s) // c not in got for s in src):
      break
    if j >= b:
      chunks.append(np.stack([got[int(s) // c][:, :, int(s) % c] for s in src], axis=2))
  if chunks:
    kv.put_raw_chunks(target_salt, list(target_ids), chunks, first=b)
  return len(chunks) * c
