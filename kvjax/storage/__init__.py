"""kvjax storage: chunk keys, tensorstore specs, the verified chunk store, tiers, link emulation
and eviction (numpy and tensorstore only, no JAX). See DESIGN.md sections 3-5.
"""

from kvjax.storage.chunk_store import ByteLimiter, ChunkStore, StoreStats
from kvjax.storage.eviction import EntryInfo, EvictionPolicy, FIFOPolicy, LRUPolicy
from kvjax.storage.keys import (KeyNamespace, chunk_hashes, hash_chunk,
                                prefix_chunk_hashes_for_prompt)
from kvjax.storage.link import LinkLimiter, gbps, load_trace, mbps
from kvjax.storage.specs import chunk_array_spec, kvstore_spec
from kvjax.storage.tiers import (HostMemoryTier, StoreConfig, TierConfig, TieredStore,
                                 build_tiers, url_kind)
from kvjax.storage.types import (RECORD_FORMAT_VERSION, ChunkHit, ChunkMiss, ChunkRecord,
                                 Encoding, KVLayout, MissReason)

__all__ = [
    "RECORD_FORMAT_VERSION", "ByteLimiter", "ChunkHit", "ChunkMiss", "ChunkRecord", "ChunkStore",
    "Encoding", "EntryInfo", "EvictionPolicy", "FIFOPolicy", "HostMemoryTier", "KVLayout",
    "KeyNamespace", "LRUPolicy", "LinkLimiter", "MissReason", "StoreConfig", "StoreStats",
    "TierConfig", "TieredStore", "build_tiers", "chunk_array_spec", "chunk_hashes", "gbps",
    "hash_chunk", "kvstore_spec", "load_trace", "mbps", "prefix_chunk_hashes_for_prompt",
    "url_kind",
]
