"""A request's device-resident prefix and its blocks, for the scheduler.

Plain functions over the block manager (`kvjax/scheduler/kv_cache_manager.py`) and a request;
the `Scheduler` (`kvjax/scheduler/scheduler.py`) calls them at admission and while it plans,
and records what they return (device hit tokens per request). Without a
manager (plan tests) the scheduler does not call them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from kvjax._typing import RequestId
from kvjax.scheduler.kv_cache_manager import KVCacheManager
from kvjax.scheduler.output import StoredPrefix
from kvjax.scheduler.request import Request


def covers(kvm: KVCacheManager, r: Request, stored: StoredPrefix, root: str | None) -> bool:
  """Whether the device-resident prefix reaches past the last stored hit, so the store has
  nothing the device lacks; the request then takes the device path (whole blocks and a parked
  partial block, token-granular) instead of a Cake merge (whole chunks). A peek: the manager's
  hit-rate counters stay as they are."""
  _, hit_tokens = kvm.get_computed_blocks(r, namespace_root=root, record_stats=False)
  return stored.end <= hit_tokens


def hold(kvm: KVCacheManager, r: Request, chunk_size: int, root: str | None) -> int:
  """A request with a Cake merge: takes its device-resident whole store chunks of `chunk_size`
  tokens now (hit blocks shared, the rest of the prompt's blocks allocated), so the merge treats
  them as resident from the start; returns their tokens (0 when none, or the pool is short: the
  blocks are then allocated at admission)."""
  hits, hit_tokens = kvm.get_computed_blocks(r, namespace_root=root)
  per_chunk = chunk_size // kvm.block_size
  chunks = hit_tokens // chunk_size  # whole chunks (a parked partial block is not one)
  if not chunks:
    return 0
  hits = hits[:chunks * per_chunk]
  tokens = chunks * chunk_size
  if kvm.allocate_slots(r.request_id, r.num_prompt_tokens - tokens, num_computed_tokens=0,
                        new_computed_blocks=hits) is None:
    return 0
  return tokens


def lookup(kvm: KVCacheManager, r: Request, root: str | None, whole: int | None,
           record_stats: bool = True) -> tuple[list, int]:
  """A queued ordinary request's device-resident prefix: (hit blocks, hit tokens), cut to whole
  chunks of `whole` tokens when given (consistent mode). `record_stats=False` peeks (the
  manager's hit-rate counters stay as they are)."""
  hits, hit_tokens = kvm.get_computed_blocks(r, namespace_root=root, record_stats=record_stats)
  if whole and hit_tokens % whole:
    keep = hit_tokens // whole * whole // kvm.block_size
    hits, hit_tokens = hits[:keep], keep * kvm.block_size
  return hits, hit_tokens


def grow(kvm: KVCacheManager, r: Request, n: int, may_preempt: bool,
         running: Mapping[RequestId, Request], preempt: Callable[[Request], None]) -> bool:
  """Blocks for `n` more tokens of `r` at `r.num_computed_tokens`, preempting the newest running
  request (`KVCacheManager.choose_victim` among `running`, by the scheduler's `preempt`) while
  the pool is short (with `may_preempt`). False when the pool stays short or `r` itself was
  preempted (it is then waiting again)."""
  while kvm.allocate_slots(r.request_id, n, num_computed_tokens=r.num_computed_tokens) is None:
    if not may_preempt:
      return False
    victim = running[kvm.choose_victim(list(running))]
    preempt(victim)
    if victim is r:
      return False
  return True


def indexable_tokens(r: Request, consistent_chunk: int | None) -> int:
  """How many of `r`'s leading tokens the device prefix cache may index now: those computed;
  in consistent mode (`consistent_chunk`, the store chunk size) only the prefill's whole store
  chunks, whose KV passed through the codec (`PrefillChunk.roundtrip`), never decode KV."""
  n = min(r.num_computed_tokens, r.num_tokens)
  if consistent_chunk is not None:
    n = min(n, r.num_prefill_tokens // consistent_chunk * consistent_chunk)
  return n
