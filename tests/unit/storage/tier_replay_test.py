"""One tier engine: a trace of puts, gets, hints and prefetches replayed through the placement
planner alone (`kvjax.storage.tiering.placement.TierHierarchy`) and through a real `TieredStore` over
memory tiers (a `HostMemoryTier` over two `memory://` chunk stores) gives the same moves, in the
same order, and the tiers hold exactly what the planner says after every event.

The trace: 12 conversations, each a prefix chain of chunks, saved turn by turn, read back from
their first chunk, with a look-ahead window of the next conversations and prefetches of their
chunks; capacities bind in the host and the disk tier (the remote tier is unbounded).
"""

import asyncio
import collections
import random

import numpy as np
from absl.testing import absltest, parameterized

from kvjax.storage.backends.chunk_store import ChunkStore
from kvjax.storage.tiering.eviction import make_policy
from kvjax.storage.tiering.host_tier import HostMemoryTier
from kvjax.storage.tiering.placement import Demote, Drop, Insert, Promote, TierHierarchy, TierSpec
from kvjax.storage.tiering.tiers import TieredStore
from kvjax.storage.format.types import ChunkHit, KVLayout
from kvjax.testing.engines import memory_store_url

NS = "ns-root"
LAYOUT = KVLayout(num_layers=1, chunk_size=2, num_kv_heads=1, head_dim=2, dtype="float32")
C = LAYOUT.chunk_size
NB = LAYOUT.nbytes  # 32 bytes a chunk
HOST_CHUNKS, DISK_CHUNKS = 6, 10


def trace(seed: int = 0, events: int = 300) -> list[tuple]:
  """("put", key, parent) / ("get", keys) / ("hint", [[keys]]) / ("prefetch", key) events."""
  rng = random.Random(seed)
  convs = {c: 0 for c in range(12)}  # conversation -> chunks saved so far
  keys = lambda c, n: [f"c{c}-{i}" for i in range(n)]
  out: list[tuple] = []
  while len(out) < events:
    c = rng.randrange(12)
    r = rng.random()
    if r < 0.45:  # a turn ends: its next chunk is saved
      n = convs[c]
      out.append(("put", f"c{c}-{n}", f"c{c}-{n - 1}" if n else None))
      convs[c] = n + 1
    elif r < 0.75 and convs[c]:  # a turn starts: its history is read from the first chunk
      out.append(("get", keys(c, convs[c])))
    elif r < 0.9:  # the waiting queue changed: the next 2 conversations' histories
      nxt = [(c + d) % 12 for d in (1, 2)]
      out.append(("hint", [keys(x, convs[x]) for x in nxt]))
    elif convs[c]:
      out.append(("prefetch", f"c{c}-{rng.randrange(convs[c])}"))
  return out


def kv_of(key: str) -> np.ndarray:
  return np.full(LAYOUT.shape, float(sum(map(ord, key))), np.float32)


def toks(key: str) -> tuple[int, ...]:
  return tuple(sum(map(ord, key)) + i for i in range(C))


class TraceReplayTest(parameterized.TestCase):

  # "lru" untiered: the paper's baseline (no window, no prefix order), as the simulator runs it.
  @parameterized.parameters(("lookahead", True, "write_back"), ("lru", False, "write_back"),
                            ("lookahead", True, "write_through"))
  def test_planner_and_real_tiers_make_the_same_moves(self, policy, tiered, placement):
    events = trace()
    names = ["host", "disk", "remote"]
    caps = [HOST_CHUNKS * NB, DISK_CHUNKS * NB, None]

    # The planner alone, driven as the store drives it.
    planner = TierHierarchy([TierSpec(n, c) for n, c in zip(names, caps)],
                            make_policy(policy, tier=tiered), copies=True,
                            drop_orphans=placement == "write_back")
    through = ["disk"] if placement == "write_through" else []
    want, want_held = [], []
    for ev in events:
      if ev[0] == "put":
        want += planner.save(ev[1], NB, ev[2], through=through)
      elif ev[0] == "get":
        for k in ev[1]:
          if planner.where(k) is not None:  # the store asks the planner on a hit
            want += planner.access([k]).moves
      elif ev[0] == "hint":
        planner.lookahead(ev[1], prefetch=False)
      else:
        want += planner.prefetch_one(ev[1])
      want_held.append({n: sorted(planner.tier_keys(n)) for n in names})

    # The real tiers.
    host = HostMemoryTier(HOST_CHUNKS * NB, policy=make_policy(policy, tier=tiered))
    disk = ChunkStore(memory_store_url("replay-disk"), name="disk")
    remote = ChunkStore(memory_store_url("replay-remote"), name="remote")
    store = TieredStore([host, disk, remote], capacities=[None, DISK_CHUNKS * NB, None],
                        placement=placement, record_moves=True)
    hits = collections.Counter()

    async def replay():
      held = []
      for ev in events:
        if ev[0] == "put":
          await store.put(ev[1], ev[2] or NS, toks(ev[1]), NS, kv_of(ev[1]))
        elif ev[0] == "get":
          for k in ev[1]:
            got = await store.get(k, toks(k), NS, LAYOUT)
            if isinstance(got, ChunkHit):
              np.testing.assert_array_equal(got.kv, kv_of(k))  # the bytes moved intact
              hits[got.tier] += 1
        elif ev[0] == "hint":
          store.hint(ev[1])
        else:
          await store.prefetch(ev[1], toks(ev[1]), NS, LAYOUT)
        await store.drain()
        held.append({t.name: sorted(r.chunk_hash for r in await t.records()) for t in
                     store.tiers})
      return held

    got_held = asyncio.run(replay())
    kinds = collections.Counter(type(m).__name__ for m in want)
    # The trace binds: every kind of move happens.
    for kind in (Insert, Promote, Demote, Drop):
      self.assertGreater(kinds[kind.__name__], 0, kind.__name__)
    self.assertGreater(hits["disk"] + hits["remote"], 0)
    self.assertEqual(store.mover.planned, want)  # the same moves, in the same order
    self.assertCountEqual(store.mover.executed, want)  # and every one was carried out
    for i, (g, w) in enumerate(zip(got_held, want_held)):
      self.assertEqual(g, w, f"after event {i}: {events[i]}")


if __name__ == "__main__":
  absltest.main()
